"""The page selectors questprof compares, one registry entry and one name each.

A name is a family and, for some, a parameter after a colon: `quest-boxes:4`, `bnb:64`.
The table FAMILIES holds each family once (what its parameter is, which summaries it reads,
whether it carries state across decode steps); `parse` turns a name into a `Selector`, whose
`select` runs the NumPy float64 reference (questprof.core.selection) and whose `rho` is the
byte model's (questprof.core.model.selector_rho). A family's `kernel` row says which form of
the CUDA kernels runs it (KernelForm: boxes per page, FP8 summaries, a top-K rule with a count
per row): quest, quest-fp8, quest-boxes:c and the dynamic budgets quest-gap / quest-topp;
the others are reference-only for now. `form_work` is the byte model of a form's stages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from questprof.core import model, selection
from questprof.core.config import ConfigError
from questprof.core.layout import DTYPE_BYTES
from questprof.core.stages import QUEST_STAGES


def _int(text: str, low: int = 1) -> int:
    value = int(text)
    if value < low:
        raise ValueError
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError
    return value


def _nonneg(text: str) -> float:
    value = float(text)
    if not value >= 0.0:
        raise ValueError
    return value


def _choice(*names: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in names:
            raise ValueError
        return text
    return parse


@dataclass(frozen=True)
class KernelForm:
    """How the CUDA kernels run a selector: `boxes` min/max boxes per page, `fp8` summaries
    (E4M3, rounded outward, a scale per KV head) over a 16-bit cache, and a top-K `rule`: ''
    (K pages), 'gap' or 'topp' (K at most, a count per row) with its `param` (t or p)."""

    boxes: int = 1
    fp8: bool = False
    rule: str = ""
    param: float = 0.0


@dataclass(frozen=True)
class Family:
    """One selector family: `param` parses the text after the colon (None: takes none),
    `wants` says what it must be, `letter` names it, `boxes` the summary copies read per page (0: no summaries),
    `fp8` whether those are FP8, `stateful` whether it keeps state across decode steps,
    `budgeted` whether the budget changes what it selects, `kernel` its KernelForm from the
    parameter (None: no kernel, the reference only)."""

    name: str
    run: Callable
    help: str
    param: Callable[[str], object] | None = None
    wants: str = ""
    letter: str = ""
    boxes: Callable[[object], float] = lambda p: 1.0
    fp8: bool = False
    stateful: bool = False
    budgeted: bool = True  # False: selects the same pages whatever the budget (bnb)
    kernel: Callable[[object], KernelForm] | None = None


QUEST = "quest"  # plain Quest: the family that the backends' own stages run
FAMILIES = {f.name: f for f in (
    Family(QUEST, lambda v, k, p, s: selection.topk_bound(v, k),
           "Quest: K pages of largest min/max bound U_p, tail page in",
           kernel=lambda p: KernelForm()),
    Family("quest+sink+window", lambda v, k, p, s: selection.sink_window(v, k),
           f"Quest with {selection.SINK_PAGES} sink page and the last {selection.WINDOW_PAGES} "
           "pages reserved, counted in the budget"),
    Family("streaming", lambda v, k, p, s: selection.streaming(v, k),
           "StreamingLLM: the sink page and the most recent pages only", boxes=lambda p: 0.0),
    Family("h2o", lambda v, k, p, s: selection.h2o(v, k, s),
           "H2O: pages of most attention accumulated so far; evicted pages are gone",
           boxes=lambda p: 0.0, stateful=True),
    Family("tova", lambda v, k, p, s: selection.tova(v, k, s),
           "TOVA: once full, evict the pages of least attention under the current query",
           boxes=lambda p: 0.0, stateful=True),
    Family("oracle", lambda v, k, p, s: selection.oracle(v, k),
           "the K pages of most true mass (unattainable: needs every key)", boxes=lambda p: 0.0),
    Family("order", lambda v, k, p, s: selection.order(v, k, p),
           "ablation: K pages in a fixed order, first pages first or seeded random",
           _choice("position", "random"), "position or random", "position|random", boxes=lambda p: 0.0),
    Family("quest-fp8", lambda v, k, p, s: selection.topk_bound(v, k, fp8=True),
           "Quest over FP8 summaries rounded outward (half the summary bytes)", fp8=True,
           kernel=lambda p: KernelForm(fp8=True)),
    Family("quest-boxes", lambda v, k, p, s: selection.topk_bound(v, k, boxes=p),
           "Quest with c sub-boxes per page, the page's bound their largest (c x summaries)",
           _int, "a whole number of boxes c >= 1 dividing the page size", "c",
           boxes=float, kernel=lambda p: KernelForm(boxes=p)),
    Family("quest-gap", lambda v, k, p, s: selection.gap(v, k, p),
           "dynamic budget: stop at a bound gap > t (logits), at most the budget",
           _nonneg, "a gap t >= 0 in logits", "t",
           kernel=lambda p: KernelForm(rule="gap", param=p)),
    Family("quest-topp", lambda v, k, p, s: selection.top_p(v, k, p),
           "dynamic budget: stop when the bounds' softmax mass reaches p, at most the budget",
           _fraction, "a mass p in (0, 1]", "p",
           kernel=lambda p: KernelForm(rule="topp", param=p)),
    Family("bnb", lambda v, k, p, s: selection.branch_and_bound(v, p),
           "branch and bound: exact top-R tokens, pages read as needed (budget ignored)",
           _int, "a whole number of tokens R >= 1", "R", budgeted=False),
)}
# every name a full comparison runs (`--selector all`): each family once, the parameters
EXAMPLES = ("quest", "quest+sink+window", "streaming", "h2o", "tova", "oracle", "order:position",
            "order:random", "quest-fp8", "quest-boxes:2", "quest-boxes:4", "quest-gap:1",
            "quest-topp:0.9", "bnb:10", "bnb:64")


def name_list(kernel: bool = False) -> str:
    """Every family as a name is written, its parameter's letter after a colon ('quest-boxes:c'),
    comma-separated; kernel: only the families the CUDA kernels run (a `kernel` entry)."""
    return ", ".join(f.name + (f":{f.letter}" if f.param else "") for f in FAMILIES.values()
                     if f.kernel is not None or not kernel)


@dataclass(frozen=True)
class Selector:
    """A parsed selector name: its family and parameter."""

    name: str
    family: Family
    param: object = None

    @property
    def stateful(self) -> bool:
        return self.family.stateful

    def start(self) -> dict | None:
        """Fresh state for a decode sequence (None for a stateless selector)."""
        return {} if self.stateful else None

    @property
    def kernel_form(self) -> KernelForm | None:
        """The KernelForm the CUDA kernels run this selector in (None: reference only)."""
        return None if self.family.kernel is None else self.family.kernel(self.param)

    def select(self, view: selection.View, k_pages: int, state: dict | None = None):
        """The Selection of one query (`view`) with a budget of k_pages pages."""
        if self.family.name == "quest-boxes" and view.page_size % self.param:
            raise ConfigError(f"selector {self.name}: {self.param} boxes do not divide the page "
                              f"size {view.page_size}")
        return self.family.run(view, max(k_pages, 1), self.param, state)

    def rho(self, page_size: int, pages_read: float, pages: int, kv_dtype: str = "fp16") -> float:
        """Bytes per query against dense: summaries (boxes, FP8) and the pages read."""
        m = DTYPE_BYTES[kv_dtype]
        ms = 1 if self.family.fp8 else m
        return model.selector_rho(page_size, pages_read, pages, self.family.boxes(self.param),
                                  ms, m)


def parse(name: str) -> Selector:
    """The Selector of `name` ('quest', 'quest-boxes:4'); ConfigError in one line when unknown."""
    text = name.strip()
    base, colon, arg = text.partition(":")
    family = FAMILIES.get(base)
    if family is None:
        raise ConfigError(f"unknown selector {text!r}: expected one of {name_list()}")
    if family.param is None:
        if colon:
            raise ConfigError(f"selector {base!r} takes no parameter (got {text!r})")
        return Selector(text, family)
    if not colon:
        raise ConfigError(f"selector {base!r} needs a parameter: {base}:{family.letter}, {family.wants}")
    try:
        value = family.param(arg)
    except ValueError:
        raise ConfigError(f"selector {text!r}: the parameter must be {family.wants}") from None
    return Selector(text, family, value)


def parse_list(text: str) -> tuple[Selector, ...]:
    """Selectors of 'a,b,...' ('all': EXAMPLES), each once, in the order given."""
    names = EXAMPLES if text.strip() == "all" else [n for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError("--selector: expected one or more names such as quest,streaming")
    chosen = [parse(n) for n in names]
    return tuple({s.name: s for s in chosen}.values())


def check_page_sizes(selectors, page_sizes) -> None:
    """ConfigError when a boxes selector's c does not divide every page size."""
    for sel in selectors:
        for size in page_sizes:
            if sel.family.name == "quest-boxes" and size % sel.param:
                raise ConfigError(f"selector {sel.name}: {sel.param} boxes do not divide the "
                                  f"page size {size}")


def form_work(cfg, form: KernelForm, pages_read: float | None = None) -> dict:
    """StageWork of estimate, topk, attention and quest of a kernel form on cfg (per layer):
    the estimate reads `boxes` boxes of summaries per page and KV head (FP8: one byte an element
    and the float32 scales [Hkv]; boxes: last_page_len [B]); a dynamic rule's top-K writes a count
    per row; attention reads `pages_read` pages per (request, KV head), the mean measured (None:
    core.model's K, or its GQA union bound)."""
    m, work = cfg.model, model.stage_work(cfg)
    nnz = cfg.batch * model.pages(cfg.length, cfg.page_size)
    elem = 1 if form.fp8 else DTYPE_BYTES[model.summary_dtype(m)]
    extra = (m.kv_heads if form.fp8 else 0) * model.FLOAT_BYTES
    extra += (cfg.batch if form.boxes > 1 else 0) * model.INDEX_BYTES
    est = work["estimate"]
    out = {"estimate": replace(est, read=nnz * m.kv_heads * 2 * m.head_dim * elem * form.boxes,
                               unmodelled_read=est.unmodelled_read + extra)}
    top = work["topk"]
    rows = model.score_heads(cfg) * cfg.batch
    out["topk"] = replace(top, write=top.write + (rows - cfg.batch if form.rule else 0) *
                          model.INDEX_BYTES)
    att = work["attention"]
    if pages_read is not None:
        tokens = ((pages_read - 1) * cfg.page_size
                  + model.last_page_len(cfg.length, cfg.page_size))
        att = replace(att, read=cfg.batch * m.kv_heads * 2 * model.vector_bytes(m) * tokens,
                      flops=cfg.batch * m.q_heads * tokens * 4 * m.head_dim, bound=False)
    out["attention"] = att
    out["quest"] = model.total((out[s] for s in QUEST_STAGES), "quest")
    return out
