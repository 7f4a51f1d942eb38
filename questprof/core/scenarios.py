"""Scenarios: TOML files of a model shape and a sweep grid (or a Hugging Face config.json, which
gets a default grid), command-line changes to the shape (ShapeOptions: the KV cache's dtypes and
tensor parallelism), and their expansion into Configs.

Every problem with a scenario file raises ConfigError with one line naming the file and field.
"""

from __future__ import annotations

import itertools
import operator
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from questprof import SCENARIOS_DIR
from questprof.core.config import (DTYPE_ALIASES, DTYPES, Config, ConfigError, ModelShape,
                                   TIER_DEFAULTS, check_modes, parse_sizes, validate_budget,
                                   validate_page_size, validate_seed)
from questprof.core.fp8 import E4M3
from questprof.core.hf_config import config_path, shape_fields
from questprof.core.sharding import tensor_parallel

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli has the same API
    import tomli as tomllib

BENCH_KEY = "case"  # a TOML file with [[case]] tables is a bench file (questprof bench --cases)


@dataclass(frozen=True)
class Grid:
    """A sweep grid: every combination of these values (tokens, requests, tokens, tokens)."""

    lengths: tuple[int, ...]
    batches: tuple[int, ...]
    page_sizes: tuple[int, ...]
    budgets: tuple[int, ...]
    modes: tuple[str, ...] = ("per-head",)
    seed: int = 0
    kv_tier: str = "hbm"  # where the K and V pages live (core/tier.py), so the next two
    summary_tier: str = "hbm"
    hbm_pages: int = 0


@dataclass(frozen=True)
class Scenario:
    """A named model shape and sweep grid, loaded from `path`."""

    name: str
    model: ModelShape
    grid: Grid
    path: Path
    description: str = ""
    note: str = ""  # what a run should say first (where a config.json's shape and grid came from)
    source: str = ""  # where the shape was published (a model's config.json, its fields)


@dataclass(frozen=True)
class ShapeOptions:
    """Changes to a scenario's model from the command line (None: the scenario's own):
    kv_dtype fp16 / bf16 (queries too: a plain cache holds their dtype) or fp8 / fp8_e4m3;
    summary_dtype fp16 or fp8 (over an FP8 cache); kv_scale tensor or head; tp GPUs."""

    kv_dtype: str | None = None
    summary_dtype: str | None = None
    kv_scale: str | None = None
    tp: int | None = None

    @classmethod
    def from_args(cls, args: dict) -> "ShapeOptions":
        return cls(args.get("kv_dtype"), args.get("summary_dtype"), args.get("kv_scale"),
                   args.get("tp"))

    def given(self) -> list[str]:
        """The fields given on the command line, in order."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def flags(self, names) -> str:
        """'--kv-dtype int8 --tp 0': the flags of `names` as the command line gave them."""
        return " ".join(f"--{n.replace('_', '-')} {getattr(self, n)}" for n in names)

    @property
    def plain_dtype(self) -> str | None:
        """The dtype --kv-dtype gives queries and cache alike (None for FP8 or not given)."""
        kv = DTYPE_ALIASES.get(self.kv_dtype, self.kv_dtype)
        return kv if kv in DTYPES else None


# The grid of a config.json, which holds none (said before a run: Scenario.note)
HF_GRID = Grid(lengths=tuple(8192 << i for i in range(5)), batches=(1, 8), page_sizes=(16,),
               budgets=(1024, 2048, 4096))
# HF_GRID in words, by the sweep argument that replaces each part
HF_GRID_WORDS = {"lengths": "lengths 8k..128k", "batch": "batch 1,8", "page_size": "page size 16",
                 "budget": "budgets 1024,2048,4096", "mode": "per-head"}


def _sizes(value, field_name: str, where: str) -> tuple[int, ...]:
    """A TOML value (range string, integer or list of either) as sizes."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    elif isinstance(value, list) and all(isinstance(v, (int, str)) and not isinstance(v, bool)
                                         for v in value):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise ConfigError(f"{where}: field {field_name!r} must be a range string, an integer "
                          f"or a list, got {value!r}")
    try:
        return tuple(parse_sizes(value, field_name))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


_MODEL_FIELDS = {"name": str, "layers": int, "q_heads": int, "kv_heads": int, "head_dim": int,
                 "dtype": str, "dense_layers": int, "intermediate": int, "vocab": int,
                 "kv_dtype": str, "summary_dtype": str, "kv_scale": str, "tp": int}
_MODEL_OPTIONAL = {"dense_layers", "intermediate", "vocab", "kv_dtype", "summary_dtype",
                   "kv_scale", "tp"}
_GRID_FIELDS = {"lengths": "sizes", "batch": "sizes", "page_sizes": "sizes", "budgets": "sizes",
                "modes": list, "seed": int, "kv_tier": str, "summary_tier": str,
                "hbm_pages": int}
_GRID_OPTIONAL = {"modes", "seed", *TIER_DEFAULTS}


def _table(data: dict, name: str, fields, optional, where: str) -> dict:
    """data[name] checked for unknown and missing fields."""
    table = data.get(name)
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: missing table [{name}]")
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown field {name}.{unknown[0]} "
                          f"(expected some of {', '.join(fields)})")
    missing = [f for f in fields if f not in table and f not in optional]
    if missing:
        raise ConfigError(f"{where}: missing field {name}.{missing[0]}")
    return table


def _typed(table: dict, fields: dict, prefix: str, where: str) -> dict:
    """Scalar fields of `table` checked against their Python types (bool is not an int)."""
    out = {}
    for key, kind in fields.items():
        if key not in table or kind == "sizes":
            continue
        value = table[key]
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if kind is list:
            ok = ok and all(isinstance(v, str) for v in value)
        if not ok:
            expected = "a list of strings" if kind is list else f"a {kind.__name__}"
            raise ConfigError(f"{where}: field {prefix}.{key} must be {expected}, got {value!r}")
        out[key] = value
    return out


def _split_shape(fields: dict, options: ShapeOptions) -> ModelShape:
    """One GPU's ModelShape from a model's fields (heads of the whole model, `tp` among them)
    and the command line's changes."""
    fields = dict(fields)
    tp = fields.pop("tp", 1)
    tp = tp if options.tp is None else options.tp
    kv = DTYPE_ALIASES.get(options.kv_dtype, options.kv_dtype)
    if kv in DTYPES:  # a plain cache holds the queries' dtype: both change
        fields.update(dtype=kv, kv_dtype="")
    elif kv is not None:
        fields["kv_dtype"] = kv
    if kv is not None and kv != E4M3:  # the file's summaries and scales were its FP8 cache's
        fields = {k: v for k, v in fields.items() if k not in ("summary_dtype", "kv_scale")}
    for name in ("summary_dtype", "kv_scale"):
        if getattr(options, name) is not None:
            fields[name] = getattr(options, name)
    return tensor_parallel(ModelShape(**fields), tp)


def model_shape(fields: dict, options: ShapeOptions, where: str) -> ModelShape:
    """_split_shape, checked in two steps so that one ConfigError line blames its source: the
    model's own fields first (naming `where`, the file), then the command line's changes
    (naming the flag that fails alone, else every flag given)."""
    try:
        shape = _split_shape(fields, ShapeOptions())
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None
    given = options.given()
    if not given:
        return shape
    try:
        return _split_shape(fields, options)
    except ConfigError as exc:
        alone = [n for n in given if not _fits(fields, ShapeOptions(**{n: getattr(options, n)}))]
        flags, said = options.flags(alone[:1] or given), str(exc)
        if said.startswith(flags[2:]):  # "tp 3: ..." said of --tp 3: "--tp 3: ..."
            raise ConfigError(f"--{said}") from None
        raise ConfigError(f"{flags}: {said}") from None


def _fits(fields: dict, options: ShapeOptions) -> bool:
    try:
        _split_shape(fields, options)
    except ConfigError:
        return False
    return True


def _parse_scenario(data: dict, path: Path, options: ShapeOptions) -> Scenario:
    where = str(path)
    if BENCH_KEY in data:
        raise ConfigError(f"{where} is a bench file of cases, not a sweep scenario: run it with "
                          f"questprof bench --cases {path}")
    unknown = sorted(set(data) - {"model", "grid", "description", "source"})
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]} (expected [model], [grid], "
                          f"description, source)")
    m = _table(data, "model", _MODEL_FIELDS, _MODEL_OPTIONAL, where)
    g = _table(data, "grid", _GRID_FIELDS, _GRID_OPTIONAL, where)
    shape = model_shape(_typed(m, _MODEL_FIELDS, "model", where), options, where)
    try:
        scalars = _typed(g, _GRID_FIELDS, "grid", where)
        grid = Grid(lengths=_sizes(g["lengths"], "grid.lengths", where),
                    batches=_sizes(g["batch"], "grid.batch", where),
                    page_sizes=_sizes(g["page_sizes"], "grid.page_sizes", where),
                    budgets=_sizes(g["budgets"], "grid.budgets", where),
                    modes=check_modes(scalars.get("modes", ["per-head"])),
                    seed=validate_seed(scalars.get("seed", 0), "grid.seed"),
                    **{k: scalars.get(k, v) for k, v in TIER_DEFAULTS.items()})
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None
    for text in ("description", "source"):
        if not isinstance(data.get(text, ""), str):
            raise ConfigError(f"{where}: field {text} must be a string")
    return Scenario(path.stem, shape, grid, path, data.get("description", ""),
                    source=data.get("source", ""))


def _is_bench_file(path: Path) -> bool:
    """A TOML file of bench cases (scenarios/bench.toml, shapes.toml), not a sweep scenario."""
    try:
        return BENCH_KEY in tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return False


def list_scenarios() -> list[str]:
    """Names of the scenarios shipped in SCENARIOS_DIR (bench files left out)."""
    return sorted(p.stem for p in Path(SCENARIOS_DIR).glob("*.toml") if not _is_bench_file(p))


def _scenario_path(name_or_path) -> Path:
    """A .toml file, or the config.json of a Hugging Face model (the file or its folder)."""
    text = str(name_or_path)
    if (isinstance(name_or_path, Path) or text.endswith((".toml", ".json")) or "/" in text
            or "\\" in text):
        path = Path(text)
        if config_path(path) is not None:
            return config_path(path)
        if path.is_dir():
            raise ConfigError(f"{text} is a folder without a config.json")
        if not path.is_file():
            raise ConfigError(f"scenario file {text} not found")
        return path
    path = Path(SCENARIOS_DIR) / f"{text}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown scenario {text!r}: available are {', '.join(list_scenarios())} "
                          f"(or give a path to a .toml file)")
    return path


def load_scenario(name_or_path, options: ShapeOptions | None = None) -> Scenario:
    """A scenario by name (SCENARIOS_DIR/<name>.toml), by path to a .toml file, or from a
    Hugging Face config.json (the file or its model folder; HF_GRID), changed by `options`."""
    options = options or ShapeOptions()
    path = _scenario_path(name_or_path)
    if path.suffix == ".json":
        fields, note = shape_fields(path, options.plain_dtype)
        shape = model_shape(fields, options, str(path))
        return Scenario(shape.name, shape, HF_GRID, path, note, note, str(path))
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return _parse_scenario(data, path, options)


def grid_note(scenario: Scenario, args: dict) -> str:
    """What a config.json's run takes from HF_GRID, which it holds no grid of: the parts that
    `args` (sweep arguments, None: not given) leave to it; '' for a scenario file or when every
    part is given."""
    used = [words for name, words in HF_GRID_WORDS.items() if args.get(name) is None]
    if scenario.path.suffix != ".json" or not used:
        return ""
    return f"a config.json holds no grid: using {', '.join(used)}"


def _override(value, default, what: str) -> tuple[int, ...]:
    """An expand() override: None = the scenario's, a range string, or a list of ints."""
    if value is None:
        return tuple(default)
    try:  # operator.index takes numpy integers, refuses floats and strings
        values = parse_sizes(value, what) if isinstance(value, str) else sorted(
            {operator.index(v) for v in value})
    except TypeError:
        raise ConfigError(f"bad {what} {list(value)!r}: expected whole numbers") from None
    if not values:
        raise ConfigError(f"empty {what}: expected at least one value")
    if min(values) < 1:
        raise ConfigError(f"bad {what} {values}: values must be at least 1")
    return tuple(values)


def expand(scenario: Scenario, lengths=None, batches=None, page_sizes=None, budgets=None,
           modes=None, tiers: dict | None = None) -> list[Config]:
    """Every point of the scenario's grid, with overrides (None = the scenario's values;
    tiers: kv_tier, summary_tier, hbm_pages, each None for the grid's).

    Order: batch, page size, budget, mode, then length fastest (one crossover curve at a time).
    Modes collapse to 'per-head' for MHA, where all modes select the same pages.
    Budgets >= length are kept: they are the dense points (Config.is_dense_budget).
    """
    grid = scenario.grid
    lengths = _override(lengths, grid.lengths, "lengths")
    batches = _override(batches, grid.batches, "batch")
    sizes = tuple(validate_page_size(s) for s in _override(page_sizes, grid.page_sizes,
                                                            "page sizes"))
    budgets = _override(budgets, grid.budgets, "budgets")
    for s, b in itertools.product(sizes, budgets):
        validate_budget(b, s)
    modes = check_modes(grid.modes if modes is None else list(modes))
    if scenario.model.group == 1:
        modes = ("per-head",)
    points = itertools.product(batches, sizes, budgets, modes, lengths)
    tier = {k: getattr(grid, k) if (tiers or {}).get(k) is None else tiers[k]
            for k in TIER_DEFAULTS}
    return [Config(scenario.model, n, b, s, k, m, grid.seed, **tier)
            for b, s, k, m, n in points]


def configs_from_args(args: dict):
    """(scenario, configurations) for a command's arguments: scenario, lengths, batch,
    page_size, budget, mode (range syntax strings or None), layers / repeats / warmup checks."""
    for name in ("layers", "repeats", "warmup"):
        least = 0 if name == "warmup" else 1
        if args.get(name) is not None and args[name] < least:
            raise ConfigError(f"--{name} {args[name]} must be at least {least}")
    scenario = load_scenario(args["scenario"], ShapeOptions.from_args(args))
    given = args.get("mode")  # "" is a mode list with none in it, refused by check_modes
    modes = [m.strip() for m in given.split(",")] if given is not None else None
    configs = expand(scenario, lengths=args.get("lengths"), batches=args.get("batch"),
                     page_sizes=args.get("page_size"), budgets=args.get("budget"), modes=modes,
                     tiers={k: args.get(k) for k in TIER_DEFAULTS})
    return scenario, configs
