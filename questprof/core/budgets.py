"""Per-layer token budgets: a table a user can take (`budgets.toml`) and the sweep can time.

`questprof fidelity` writes one beside its rows (report/budgets.py builds it: per layer the
smallest budget whose 10th-percentile mass recall over the layer's heads reaches the floor);
`questprof sweep --budgets-file budgets.toml` times the Quest step with each layer's budget.
The file:

    model = "SmolLM2-135M"                    # what the table was measured on (context)
    page_size = 16
    mode = "per-head"
    min_recall = 0.9                          # the floor every sparse layer reaches
    uniform_budget = 512                      # the one budget for all layers that reaches it
    [layers]                                  # every layer 0 .. n-1: tokens, or "dense"
    0 = "dense"
    2 = 64

A layer is "dense" when Quest keeps it dense (the first layers) or no budget measured reaches
the floor there. Budgets are whole pages; a missing layer, a budget that is not whole pages or
a table of another model's layer count is one line (ConfigError).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from questprof.core.config import ConfigError
from questprof.core.stages import MODES

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DENSE = "dense"


@dataclass(frozen=True)
class BudgetTable:
    """budgets[l]: layer l's token budget, None where the layer is dense."""

    budgets: tuple[int | None, ...]
    page_size: int
    mode: str = "per-head"
    model: str = ""
    min_recall: float | None = None
    uniform_budget: int | None = None
    info: dict = field(default_factory=dict, compare=False)  # source, length, ... (context)

    @property
    def layers(self) -> int:
        return len(self.budgets)

    @property
    def largest(self) -> int | None:
        """The largest sparse budget (None when every layer is dense)."""
        sparse = [b for b in self.budgets if b is not None]
        return max(sparse) if sparse else None

    def k_pages(self) -> tuple[int | None, ...]:
        """Pages kept per layer (None: dense)."""
        return tuple(None if b is None else b // self.page_size for b in self.budgets)

    def text(self) -> str:
        """'dense,dense,64,128,...': the budgets in one field of a row."""
        return ",".join(DENSE if b is None else str(b) for b in self.budgets)


def _value(x) -> str:
    if isinstance(x, str):
        return '"' + x.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(x, bool):
        return "true" if x else "false"
    return repr(x)


def to_toml(table: BudgetTable) -> str:
    """The table as budgets.toml text (round-trips through read_table)."""
    head = {"model": table.model, "page_size": table.page_size, "mode": table.mode,
            "min_recall": table.min_recall, "uniform_budget": table.uniform_budget,
            **table.info}
    lines = ["# questprof per-layer budgets: per layer the smallest budget (tokens) whose 10th-",
             "# percentile mass recall over the layer's heads reaches min_recall; \"dense\": kept",
             "# dense. Time it: questprof sweep --budgets-file budgets.toml"]
    lines += [f"{k} = {_value(v)}" for k, v in head.items() if v is not None]
    lines += ["", "[layers]"]
    lines += [f"{i} = {_value(DENSE if b is None else b)}" for i, b in enumerate(table.budgets)]
    return "\n".join(lines) + "\n"


def write_table(table: BudgetTable, path) -> Path:
    path = Path(path)
    path.write_text(to_toml(table), encoding="utf-8")
    return path


def _layers(data: dict, where: str, page_size: int,
            layers: int | None = None) -> tuple[int | None, ...]:
    raw = data.get("layers")
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{where}: no [layers] table (layer = tokens or \"dense\")")
    try:
        got = {int(k): v for k, v in raw.items()}
    except ValueError:
        raise ConfigError(f"{where}: [layers] keys must be layer numbers 0, 1, ...") from None
    if min(got) < 0:
        raise ConfigError(f"{where}: layer {min(got)} in [layers]: layers are numbered from 0")
    if layers is not None and max(got) >= layers:
        raise ConfigError(f"{where}: layer {max(got)} in [layers], past the model's {layers} "
                          f"layers (0..{layers - 1})")
    missing = [i for i in range(max(got) + 1) if i not in got]
    if missing:
        raise ConfigError(f"{where}: layer {missing[0]} missing from [layers] (every layer "
                          f"0..{max(got)} needs a budget)")
    out = []
    for i in range(len(got)):
        v = got[i]
        if v == DENSE:
            out.append(None)
        elif isinstance(v, int) and not isinstance(v, bool) and v > 0 and v % page_size == 0:
            out.append(v)
        else:
            raise ConfigError(f"{where}: layer {i} budget {v!r} is not whole pages of "
                              f"{page_size} tokens (or \"dense\")")
    return tuple(out)


def read_table(path, layers: int | None = None) -> BudgetTable:
    """The BudgetTable of a budgets.toml; ConfigError (one line) when it is missing or bad, or
    when `layers` is given and the table has another number of layers."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"budget table {path} " + ("is a directory: name its budgets.toml"
                                                      if path.is_dir() else "not found"))
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"budget table {path}: not TOML ({exc})") from None
    size = data.get("page_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"budget table {path}: page_size must be a whole number of tokens")
    mode = data.get("mode", "per-head")
    if mode not in MODES:
        raise ConfigError(f"budget table {path}: mode {mode!r}, expected one of "
                          f"{', '.join(MODES)}")
    budgets = _layers(data, f"budget table {path}", size, layers)
    if layers is not None and len(budgets) != layers:
        raise ConfigError(f"budget table {path} has {len(budgets)} layers; the model has "
                          f"{layers}")
    known = {"model", "page_size", "mode", "min_recall", "uniform_budget", "layers"}
    return BudgetTable(budgets, size, mode, str(data.get("model", "")), data.get("min_recall"),
                       data.get("uniform_budget"),
                       {k: v for k, v in data.items() if k not in known})
