"""tools/config_route.py: how far bench's selector config travels to the kernel launches, as a
reader follows it (issue 31: files entered, returns to a file already left). CPU only.

    python3 tools/config_route.py                    # this tree
    python3 tools/config_route.py 664813a -v         # a commit (git archive), with the routes

Runs `commands/bench_selectors.selector_rows` for one selector on a small case over the CPU
stand-in for CuPy (tests/cupy_stub.py), then each stage's launch alone, and follows the calls:
each function is read once, at its first call, from its caller's file. A stay is a run of reading
in one file; a return is a stay in a file the route had left before. Files: questprof/ less
core/layout.py and core/config.py (the value objects, PagedKV and Config, that every layer reads).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = ("core/layout.py", "core/config.py")


class Route:
    """The files a reader passes through, each function read once."""

    def __init__(self, start: str):
        self.files, self.seen = [start], set()

    @staticmethod
    def counted(code) -> bool:
        return ("/questprof/" in code.co_filename and not code.co_name.startswith(("<", "__"))
                and not code.co_filename.endswith(SKIP))

    def trace(self, frame, event, arg):
        code = frame.f_code
        if event == "call" and self.counted(code) and code not in self.seen:
            self.seen.add(code)
            caller = frame.f_back
            while caller is not None and not self.counted(caller.f_code):
                caller = caller.f_back
            for c in ([caller.f_code] if caller is not None else []) + [code]:
                name = c.co_filename.split("/questprof/", 1)[1]
                if self.files[-1] != name:
                    self.files.append(name)

    def summary(self) -> str:
        left, returns = set(), 0
        for i, name in enumerate(self.files):
            returns += name in left
            if i:
                left.add(self.files[i - 1])
        return (f"{len(self.files)} stays in {len(set(self.files))} files, {returns} returns to "
                "a file left")


def _follow(label: str, call, verbose: bool) -> None:
    route = Route("commands/bench_selectors.py")
    sys.settrace(route.trace)
    try:
        call()
    finally:
        sys.settrace(None)
    print(f"{label}: {route.summary()}")
    if verbose:
        print("   " + " -> ".join(route.files))


def run_here(tree: Path, selector: str, verbose: bool) -> None:
    """Every route over the questprof/ of `tree` (imported from there)."""
    sys.path[:0] = [str(tree), str(tree / "tests")]
    import cupy_stub
    import numpy as np

    sys.modules["cupy"] = cupy_stub.make()
    from questprof.backends.cupy import CupyBackend
    from questprof.commands import bench_selectors as bs
    from questprof.core.config import Config, ModelShape
    from questprof.core.layout import random_paged_kv, random_queries

    rng = np.random.default_rng(0)
    model = ModelShape(name="m", layers=2, q_heads=8, kv_heads=2, head_dim=128, dtype="fp16")
    cfg = Config(model, 600, 2, 16, 256, "per-head")
    kv = random_paged_kv(rng, [600, 600], 16, 2, 128, "fp16", spare_pages=2)
    work = types.SimpleNamespace(backend=CupyBackend(pdl=False), kvs=[kv, kv], layers=2,
                                 q=random_queries(rng, 2, 8, 128, "fp16"))
    bs._cupti_reason = lambda: "no GPU"

    def time(launch):
        launch(0)
        return types.SimpleNamespace(summary=lambda: {"median_ms": 1.0})

    _follow("selector_rows, whole",
            lambda: bs.selector_rows(cfg, [selector], work, time, lambda *a, **k: None), verbose)
    launches, _ = bs._launchers(cfg, work, bs.selectors.parse(selector).kernel_form)
    for stage in ("estimate", "topk", "attention", "quest"):
        _follow(f"{stage} launch", lambda: launches[stage](0), verbose)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/config_route.py", description=__doc__.split("\n")[0])
    ap.add_argument("commit", nargs="?", help="a commit to measure instead of this tree")
    ap.add_argument("--selector", default="quest-topp:0.9", help="a selector with a kernel form")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each route's files")
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # the child run over an archived commit
    args = ap.parse_args(argv)
    if args.commit is None or args.tree:
        run_here(Path(args.tree) if args.tree else ROOT, args.selector, args.verbose)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.commit],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        cmd = [sys.executable, __file__, args.commit, "--tree", tmp, "--selector", args.selector]
        return subprocess.run(cmd + (["-v"] if args.verbose else [])).returncode


if __name__ == "__main__":
    sys.exit(main())
