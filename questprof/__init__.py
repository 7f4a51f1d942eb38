"""questprof: measure what query-aware sparse attention (Quest) is worth on a GPU."""

from pathlib import Path

__version__ = "0.1.0"

ROOT = Path(__file__).resolve().parent.parent
KERNELS_DIR = ROOT / "kernels"
SCENARIOS_DIR = ROOT / "scenarios"
