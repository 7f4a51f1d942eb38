"""A dry run of the launchers over a CPU stand-in for CuPy: every kernel a launch names is built and
gets its parameters (CI, no GPU; the objects come from tests/kernel_objects.py)."""

from __future__ import annotations

import itertools
import re
import subprocess

from questprof.backends import variants
from questprof.core.fp8 import E4M3


def _pointer(array) -> str:
    """The C parameter type a device array is passed as: a const pointer to its storage."""
    return {2: "unsigned short const*"}.get(getattr(array.dtype, "itemsize", 0),
                                             type(array).__name__)


def _signatures(parts) -> dict[str, list[str]]:
    """Template instance (as the launcher names it, without spaces) -> its parameter types, of
    every kernel in a source's objects."""
    found = {}
    for result, obj, _ in parts:
        assert result.returncode == 0, result.stderr
        symbols = [s for s in subprocess.run(["nm", str(obj)], capture_output=True, text=True,
                                             check=True).stdout.split()
                   if s.startswith("_Z") and "_kernelI" in s and "device_stub" not in s]
        names = subprocess.run(["c++filt"], input="\n".join(symbols), capture_output=True,
                               text=True, check=True).stdout.splitlines()
        for name in names:
            m = re.fullmatch(r"void (\w+<.*>)\((.*)\)", name)
            if m:
                found[m.group(1).replace(" ", "")] = [t.strip() for t in m.group(2).split(",")]
    return found


# (q heads, KV heads, head dim, page size, queries, cache, summaries, layout) of the launcher
# dry run
DRY_RUN = [(8, 2, 128, 16, "fp16", None, None, "HND"), (9, 3, 64, 8, "bf16", None, None, "HND"),
           (71, 1, 128, 128, "fp16", None, None, "HND"),
           (32, 32, 96, 16, "bf16", None, None, "HND"), (16, 8, 256, 8, "bf16", None, None, "HND"),
           (32, 8, 128, 16, "bf16", E4M3, E4M3, "HND"),
           (32, 8, 128, 16, "fp16", E4M3, "fp16", "HND"),
           (6, 2, 80, 8, "bf16", E4M3, "fp16", "HND"),
           (8, 2, 128, 16, "fp16", None, None, "NHD"), (9, 3, 64, 8, "bf16", None, None, "NHD")]


TUNES = ("", "stages=6,tk_threads=256")  # the defaults; deep rings, a smaller top-K CTA


def test_launchers_ask_for_built_kernels_with_their_parameters(objects, monkeypatch):
    """A dry run of backends/cupy.py over a CPU stand-in for CuPy (tests/cupy_stub.py): every
    kernel a launch names is among the built instances and gets its params struct first (by the
    C name of backends/params.py's dtype, whose layout tests/test_params.py holds to nvcc's) and
    then the pointers it takes beside it (the estimate's q: kernels/estimate.cu says why), at
    every group, head dim, cache and mode of DRY_RUN."""
    import numpy as np

    import cupy_stub
    from conftest import full_plan
    from questprof.backends import params
    from questprof.core.layout import random_paged_kv, random_queries
    from questprof.core.selectors import KernelForm

    sigs = {}
    for source in ("attention.cu", "estimate.cu", "summary.cu", "topk.cu"):
        sigs.update(_signatures(objects(source)))
    names = ("questprof.backends.cupy", "questprof.backends.pdl",
             "questprof.backends.cupy_selectors")
    with cupy_stub.installed(monkeypatch, names) as (stub, (ops, _, forms)):
        rng = np.random.default_rng(7)
        for (qh, kvh, d, s, dtype, cache, summ, layout), tune in itertools.product(DRY_RUN,
                                                                                   TUNES):
            if layout == "NHD" and "stages" in tune:
                continue  # deeper rings are not built for token-major pages (refused)
            monkeypatch.setenv("QP_TUNE", tune)
            kv = random_paged_kv(rng, [1, s - 1, s + 1, 37 * s + 3], s, kvh, d, dtype,
                                 spare_pages=3, kv_dtype=cache, summary_dtype=summ)
            kv = kv.token_major() if layout == "NHD" else kv
            q = random_queries(rng, 4, qh, d, dtype)
            ops.summary(kv, full_plan(kv))
            for mode in ("per-head", "shared-max", "shared-mean"):
                sel, count = ops.topk(ops.estimate(q, kv, mode), kv, 5)
                sel[...], count[...] = 0, 1
                ops.attention(q, kv, sel, count)
            ops.attention(q, kv)
            for form in (KernelForm(fp8=True), KernelForm(boxes=2), KernelForm(boxes=4),
                         KernelForm(rule="topp", param=0.5), KernelForm(rule="gap", param=1)):
                if layout == "NHD" and (form.fp8 or form.boxes > 1):
                    continue  # head-major pages only (refused: test_layout.py)
                if cache is None and variants.boxes_built(d, form.boxes) and s % form.boxes == 0:
                    fs = forms.summaries(kv, form, full_plan(kv))
                    for mode in ("per-head", "shared-max"):
                        forms.quest(q, kv, fs, 5, mode)
    assert len(stub.LAUNCHES) > 120, len(stub.LAUNCHES)
    assert any(",6,false>" in e.replace(" ", "") for e, *_ in stub.LAUNCHES)  # a deep ring ran
    for expression, grid, block, args, shared_mem in stub.LAUNCHES:
        key = expression.replace(" ", "")
        assert key in sigs, f"{expression} is not built"
        names = {dtype: name for name, dtype in params.STRUCTS.items()}
        passed = [names.get(getattr(a, "dtype", None)) or _pointer(a) for a in args]
        assert passed == sigs[key], f"{expression}: {passed} passed, {sigs[key]} wanted"
        assert args[0].shape == (1,)
        assert min(grid) >= 1 and shared_mem <= 227 * 1024


# The launchers' checks: launch_args.py's (a selection's with its rows' plan, a rule's with its
# shared memory) and core.stages.check_mode.
CHECKS = ("check_", "cache_tags", "form_tags", "topk_rule", "attention_rows")


def test_each_check_runs_once_per_call(monkeypatch):
    """A launcher's checks (backends/launch_args.py, the mode's) run once per call, the Quest
    step's and a selector form's included, where top-K's budget was checked twice before."""
    import collections
    import sys

    import numpy as np

    import cupy_stub
    from conftest import full_plan
    from questprof.core.layout import random_paged_kv, random_queries
    from questprof.core.selectors import KernelForm

    names = ("questprof.backends.cupy", "questprof.backends.pdl",
             "questprof.backends.cupy_selectors")
    with cupy_stub.installed(monkeypatch, names) as (_, (ops, _, forms)):
        rng = np.random.default_rng(3)
        kv = random_paged_kv(rng, [5, 40, 70], 16, 2, 128, "fp16", spare_pages=2)
        q = random_queries(rng, 3, 8, 128, "fp16")
        ops.summary(kv, full_plan(kv))
        form = KernelForm(rule="topp", param=0.9)
        fs = forms.summaries(kv, form, full_plan(kv))
        scores = ops.estimate(q, kv)
        calls = {
            "quest": lambda: ops.quest(q, kv, 3, "shared-max", sinks=1, window=1),
            "topk": lambda: ops.topk(scores, kv, 3),
            "attention": lambda: ops.attention(q, kv),
            "form quest": lambda: forms.quest(q, kv, fs, 3),
            "form topk": lambda: forms.topk(scores, kv, 3, form),
        }
        for label, call in calls.items():
            seen = collections.Counter()

            def trace(frame, event, arg, seen=seen):
                code = frame.f_code
                if event == "call" and code.co_name.startswith(CHECKS):
                    seen[code.co_name] += 1

            sys.setprofile(trace)
            try:
                call()
            finally:
                sys.setprofile(None)
            assert seen and max(seen.values()) == 1, (label, dict(seen))
