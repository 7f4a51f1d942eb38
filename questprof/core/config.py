"""Range syntax, the model shape and the point of a grid (Config), and input validation.

Scenario files (TOML: a model shape and a sweep grid) and their expansion into Configs live in
core/scenarios.py.

Every problem with user input raises ConfigError with one line that names the bad text,
field or file; the CLI turns it into exit status 2 without a traceback.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import asdict, dataclass

from questprof.core import model
from questprof.core.fp8 import E4M3
from questprof.core.layout import KV_SCALES, check_cache_dtypes
from questprof.core.stages import MODES
from questprof.core.tier import TIERS

# The page sizes and head dims the kernels are built for (kernels/constants.cuh's QP_PAGE_SIZES and
# QP_HEAD_DIMS; tests/test_variants.py keeps them equal). Any group q_heads / kv_heads runs: groups
# up to 16 on tiles, larger ones (multi-query) in chunks of at most 16 q heads.
PAGE_SIZES = (8, 16, 32, 64, 128)
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
MAX_HBM_PAGES = 2048  # slots of the GPU's page cache step (PC_MAX_SLOTS), on every backend alike
DTYPES = ("fp16", "bf16", "fp32")
KV_DTYPES = (*DTYPES, E4M3)  # of the cache; "fp8" is read as fp8_e4m3
DTYPE_ALIASES = {"fp8": E4M3, "float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
TIER_DEFAULTS = {"kv_tier": "hbm", "summary_tier": "hbm", "hbm_pages": 0}
MAX_VALUES = 10_000  # a range longer than this is a typo (say "1..1m+1"), not a sweep

_NUMBER = re.compile(r"^(\d+)([km]?)$", re.IGNORECASE)
_RANGE = re.compile(r"^([^.]+)\.\.([^*+]+)(?:([*+])(.+))?$")
_UNIT = {"": 1, "k": 1024, "m": 1024**2}


class ConfigError(ValueError):
    """A problem with user input, told in one line."""


def _number(text: str, item: str, what: str) -> int:
    """'4k' -> 4096, '1M' -> 1048576, '100000' -> 100000."""
    match = _NUMBER.match(text.strip())
    if not match:
        raise ConfigError(f"bad {what} {item!r}: {text.strip()!r} is not a number like 4096, 4k or 1m")
    return int(match.group(1)) * _UNIT[match.group(2).lower()]


def _item(item: str, what: str) -> list[int]:
    """One comma-separated item: a number or a range 'a..b', 'a..b*f', 'a..b+n'."""
    match = _RANGE.match(item)
    if not match:
        return [_number(item, item, what)]
    start, stop = _number(match.group(1), item, what), _number(match.group(2), item, what)
    op, step = match.group(3) or "*", _number(match.group(4) or "2", item, what)
    if start > stop:
        raise ConfigError(f"bad {what} {item!r}: descending range ({start} > {stop})")
    if start < 1:
        raise ConfigError(f"bad {what} {item!r}: values must be at least 1")
    if (op == "*" and step < 2) or (op == "+" and step < 1):
        raise ConfigError(f"bad {what} {item!r}: step {op}{step} never advances")
    count = (math.log(stop / start, step) if op == "*" else (stop - start) / step) + 1
    if count > MAX_VALUES:
        raise ConfigError(f"bad {what} {item!r}: more than {MAX_VALUES} values")
    values, value = [], start
    while value <= stop:
        values.append(value)
        value = value * step if op == "*" else value + step
    return values


def parse_sizes(text: str, what: str = "lengths") -> list[int]:
    """Sorted unique sizes from range syntax: '2k..128k' (doubling), '2k..32k*4', '1k..8k+1k',
    '4k,16k,100000' (items may be ranges). k = 1024, m = 1024**2, case-insensitive."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"empty {what}: expected a list or range such as 2k..128k")
    values: set[int] = set()
    for item in text.split(","):
        if not item.strip():
            raise ConfigError(f"bad {what} {text!r}: empty item between commas")
        values.update(_item(item.strip(), what))
    if min(values) < 1:
        raise ConfigError(f"bad {what} {text!r}: values must be at least 1")
    if max(values) > MAX_SIZE:  # 10^23 reached pyarrow's int64 and NumPy's shapes as a traceback
        raise ConfigError(f"bad {what} {text!r}: values must be at most {MAX_SIZE:,}")
    return sorted(values)


MAX_SIZE = 2**31 - 1  # a length, batch, page size or budget: far past any memory, within int32
MAX_SEED = 2**63 - 1  # NumPy takes seeds >= 0; rows store them as int64


def validate_seed(seed: int, what: str = "seed") -> int:
    """The seed if NumPy and the rows can hold it (0 <= seed < 2^63)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"{what} {seed!r}: a seed is a whole number from 0 to 2^63 - 1")
    return seed


def validate_page_size(page_size: int) -> int:
    """The page size if the kernels support it (a power of two among PAGE_SIZES)."""
    if page_size not in PAGE_SIZES or isinstance(page_size, bool):
        allowed = ", ".join(map(str, PAGE_SIZES))
        raise ConfigError(f"page size {page_size} is not supported: "
                          f"expected a power of two among {allowed}")
    return page_size


def validate_budget(budget: int, page_size: int) -> int:
    """The token budget if it is at least one page and a whole number of pages."""
    if budget < 1:
        raise ConfigError(f"budget {budget} tokens is below one {page_size}-token page")
    if budget % page_size:
        raise ConfigError(f"budget {budget} tokens is not a whole number of {page_size}-token pages")
    return budget


def _check_ints(obj, names) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{name} must be an integer, got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    """Attention shape of a decoder (and its weights, for the end-to-end byte model).

    intermediate: MLP width, 0 = 8/3 * hidden rounded up to 256 (LLaMA's rule: 11008 at 4096);
    vocab: LM-head rows read per decode step, 0 = not counted.
    dense_layers: first layers kept dense under Quest (the paper keeps 2).
    dtype: queries, outputs and weights; kv_dtype: the KV cache, dtype (the default, "") or
    fp8_e4m3; summary_dtype: kv_dtype (the default) or fp16 over an FP8 cache; kv_scale: an FP8
    cache's scale granularity, tensor (the default) or head ("" for other caches).
    tp: the tensor-parallel degree this shape is one GPU's share of: q_heads and kv_heads are
    per GPU (core.sharding.tensor_parallel makes them from the model's).
    """

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    dense_layers: int = 2
    intermediate: int = 0
    vocab: int = 0
    kv_dtype: str = ""
    summary_dtype: str = ""
    kv_scale: str = ""
    tp: int = 1

    def __post_init__(self) -> None:
        _check_ints(self, ("layers", "q_heads", "kv_heads", "head_dim", "dense_layers",
                           "intermediate", "vocab", "tp"))
        if min(self.layers, self.q_heads, self.kv_heads) < 1:
            raise ConfigError(f"model {self.name}: layers and heads must be at least 1")
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"model {self.name}: q_heads {self.q_heads} is not a multiple "
                              f"of kv_heads {self.kv_heads}")
        if self.head_dim not in HEAD_DIMS:
            near = min(HEAD_DIMS, key=lambda d: (abs(d - self.head_dim), d))
            raise ConfigError(f"model {self.name}: head_dim {self.head_dim} is not supported: "
                              f"the kernels take {', '.join(map(str, HEAD_DIMS))} "
                              f"(nearest: {near})")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model {self.name}: dtype {self.dtype!r} is not supported: "
                              f"expected one of {', '.join(DTYPES)}")
        if not 0 <= self.dense_layers <= self.layers:
            raise ConfigError(f"model {self.name}: dense_layers {self.dense_layers} "
                              f"is outside 0..{self.layers}")
        if self.intermediate < 0 or self.vocab < 0:
            raise ConfigError(f"model {self.name}: intermediate and vocab must be >= 0")
        self._check_cache()

    def _check_cache(self) -> None:
        """Check the cache's dtypes (fp8 = fp8_e4m3) and keep them in one form: "" where they
        follow dtype (a plain cache, its summaries, its absent scale), named for an FP8 cache
        (summaries fp8_e4m3 and scale tensor unless given). dataclasses.replace of dtype then
        moves a plain cache along. model.kv_dtype / model.summary_dtype read them."""
        kv = DTYPE_ALIASES.get(self.kv_dtype, self.kv_dtype) or self.dtype
        summ = DTYPE_ALIASES.get(self.summary_dtype, self.summary_dtype) or kv
        scale = self.kv_scale or ("tensor" if kv == E4M3 else "")
        for name, value in (("kv_dtype", kv), ("summary_dtype", summ)):
            if value not in KV_DTYPES:
                raise ConfigError(f"model {self.name}: {name} {value!r} is not supported: "
                                  f"expected one of fp16, bf16, fp32, fp8 ({E4M3})")
        try:
            check_cache_dtypes(self.dtype, kv, summ)
        except ValueError as exc:
            raise ConfigError(f"model {self.name}: {exc}") from None
        if kv == E4M3 and scale not in KV_SCALES or kv != E4M3 and scale:
            raise ConfigError(f"model {self.name}: kv_scale {scale!r}: an FP8 cache takes "
                              f"{' or '.join(KV_SCALES)}, other caches none")
        if self.tp < 1:
            raise ConfigError(f"model {self.name}: tp {self.tp} must be at least 1")
        plain = "" if kv != E4M3 else None
        for name, value in (("kv_dtype", kv), ("summary_dtype", summ), ("kv_scale", scale)):
            object.__setattr__(self, name, value if plain is None else plain)

    @property
    def is_fp8(self) -> bool:
        """The KV cache holds FP8 (e4m3) codes."""
        return self.kv_dtype == E4M3

    @property
    def group(self) -> int:
        """Query heads per KV head (1 = MHA)."""
        return self.q_heads // self.kv_heads

    def text(self) -> str:
        """The shape in words, one GPU's under tensor parallelism: '32 layers, 16 q / 4 KV
        heads of 128 dims per GPU of tensor parallelism 2, bf16'."""
        heads = (f"{self.q_heads} q / {self.kv_heads} KV head{'s' * (self.kv_heads > 1)} of "
                 f"{self.head_dim} dims")
        if self.tp > 1:
            heads += f" per GPU of tensor parallelism {self.tp}"
        cache = self.dtype
        if self.is_fp8:
            cache = (f"{self.dtype} queries over an {self.kv_dtype} cache ({self.summary_dtype} "
                     f"summaries, scales per {self.kv_scale})")
        return f"{self.layers} layers, {heads}, {cache}"


def check_modes(modes) -> tuple[str, ...]:
    """The modes without repeats, in order; ConfigError naming the first unknown one."""
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"unknown selection mode {bad[0] if bad else '(none)'!r}: "
                          f"expected some of {', '.join(MODES)}")
    return tuple(dict.fromkeys(modes))


def check_tiers(kv_tier: str, summary_tier: str, hbm_pages: int, k_pages: int) -> None:
    """ConfigError, one line, for tiers that make no sense together (core/tier.py)."""
    for flag, value in (("--kv-tier", kv_tier), ("--summary-tier", summary_tier)):
        if value not in TIERS:
            raise ConfigError(f"{flag} {value!r}: expected one of {', '.join(TIERS)}")
    if summary_tier == "host" and kv_tier == "hbm":
        raise ConfigError("--summary-tier host with --kv-tier hbm: summaries on the host would "
                          "cross the link to choose pages already in HBM (use --kv-tier host)")
    if hbm_pages and kv_tier == "hbm":
        raise ConfigError(f"--hbm-pages {hbm_pages}: an HBM page cache serves a cache in host "
                          f"memory (add --kv-tier host, or leave --hbm-pages out)")
    if hbm_pages < 0 or 0 < hbm_pages < k_pages:
        raise ConfigError(f"--hbm-pages {hbm_pages}: a page cache holds at least one step's "
                          f"{k_pages} chosen pages (0: no page cache, every chosen page crosses)")
    if hbm_pages > MAX_HBM_PAGES:
        raise ConfigError(f"--hbm-pages {hbm_pages}: the page cache holds at most "
                          f"{MAX_HBM_PAGES} pages per (request, KV head)")


@dataclass(frozen=True)
class Config:
    """One point of a grid: every request of the batch holds `length` tokens."""

    model: ModelShape
    length: int
    batch: int
    page_size: int
    budget: int
    mode: str = "per-head"
    seed: int = 0
    kv_tier: str = "hbm"  # where K and V pages live: hbm or host (core/tier.py)
    summary_tier: str = "hbm"  # where the page summaries live (host only with kv_tier host)
    hbm_pages: int = 0  # C pages per (request, KV head) cached in HBM; 0: no page cache

    def __post_init__(self) -> None:
        _check_ints(self, ("length", "batch", "page_size", "budget", "seed", "hbm_pages"))
        if self.length < 1 or self.batch < 1:
            raise ConfigError(f"length {self.length} and batch {self.batch} must be at least 1")
        validate_page_size(self.page_size)
        validate_budget(self.budget, self.page_size)
        check_modes([self.mode])
        check_tiers(self.kv_tier, self.summary_tier, self.hbm_pages,
                    model.k_pages(self.budget, self.page_size, self.pages))

    @property
    def pages(self) -> int:
        """Pages per request, ceil(length / page_size)."""
        return model.pages(self.length, self.page_size)

    @property
    def k_pages(self) -> int:
        """Budget in pages, budget // page_size (not capped: the top-K selection width)."""
        return model.k_pages(self.budget, self.page_size)

    @property
    def is_dense_budget(self) -> bool:
        """The budget covers every token: Quest degenerates to dense attention."""
        return self.budget >= self.length

    def key(self) -> str:
        """A string naming this point uniquely (model shape included), for resuming sweeps and
        comparing runs; the cache and tp fields only where they are not the plain defaults, so
        the keys of runs made before they existed still match."""
        cache = ("kv_dtype", "summary_dtype", "kv_scale")
        fields = self._fields()
        if not self.model.is_fp8:
            fields = {k: v for k, v in fields.items() if k not in cache}
        if fields.get("tp") == 1:
            del fields["tp"]
        for name, plain in TIER_DEFAULTS.items():  # keys of HBM-resident runs stay as they were
            if fields.get(name) == plain:
                del fields[name]
        return "|".join(f"{k}={v}" for k, v in fields.items())

    def _fields(self) -> dict:
        shape = asdict(self.model)
        shape.update(kv_dtype=model.kv_dtype(self.model),
                     summary_dtype=model.summary_dtype(self.model))
        point = {k: getattr(self, k) for k in ("length", "batch", "page_size", "budget",
                                                 "mode", "seed", *TIER_DEFAULTS)}
        return {"model": shape.pop("name"), **shape, **point}

    def as_dict(self) -> dict:
        """Flat dict for result rows: model fields (name as 'model'), the point's fields,
        then the derived pages and k_pages (budget // page_size, uncapped)."""
        return {**self._fields(), "pages": self.pages, "k_pages": self.k_pages}


def config_from_dict(data: dict):
    """A Config rebuilt from Config.as_dict() (for the ncu child process)."""
    shape = {f.name: data["model" if f.name == "name" else f.name]
             for f in dataclasses.fields(ModelShape) if (f.name == "name" or f.name in data)}
    point = {f.name: data[f.name] for f in dataclasses.fields(Config)
             if f.name != "model" and f.name in data}
    return Config(ModelShape(**shape), **point)
