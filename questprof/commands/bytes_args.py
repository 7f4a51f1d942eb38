"""BytesArgs: the arguments of `questprof bytes` as one typed, frozen object, each with its
default (the command line's defaults are these)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BytesArgs:
    """The arguments of `questprof bytes` (where it writes travels beside them)."""

    check_formula: bool = True  # judge measured bytes against the model: exit 1 beyond tolerance
    scenario: str = "llama3-8b"  # a name under scenarios/, a .toml path or a config.json
    lengths: str = "16k,64k"  # range syntax, as the sweep's (so for the next three)
    batch: str = "1"
    page_size: str = "16"
    budget: str = "1024,4096"
    mode: str | None = None  # selection modes, comma-separated; None: the scenario's
    kv_dtype: str | None = None  # None: the scenario's (so for the next three)
    summary_dtype: str | None = None
    kv_scale: str | None = None
    tp: int | None = None
    kv_tier: str | None = None  # hbm or host; None: the scenario's grid (so for the next two)
    summary_tier: str | None = None
    hbm_pages: int | None = None
    source: str = "cupti"  # cupti, ncu, nvml or all (measure.dram.SOURCES)
    tolerance: float = 0.05  # allowed relative difference: results.BYTES_TOLERANCE
    protocol: str = "rotate"  # CUPTI's cold-cache protocol: rotate or flush (measure.dram)
