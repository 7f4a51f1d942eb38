"""Backends run the Quest stages behind one protocol: `numpy` (the float64 reference, anywhere),
`numpy-fp32` (its float32 path, what a sweep times on a CPU), `cupy` (kernels/)."""

from __future__ import annotations

from questprof.backends.base import Backend, BackendUnavailable


def gpu_unavailable_reason() -> str | None:
    """Why the CuPy backend cannot run here, or None when it can."""
    try:
        import cupy
    except Exception as exc:  # deliberately any: a broken install fails its own way, and the
        # reason is what the GPU tests skip with and the CLI falls back to NumPy with
        return f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device is visible"
    except RuntimeError as exc:  # CUDARuntimeError: no device, or no driver or one too old
        return f"no usable CUDA device ({exc})"
    return None


def get_backend(name: str = "auto") -> Backend:
    """Backend by name: 'cupy', 'numpy', or 'auto' (CuPy when a GPU is usable, else NumPy)."""
    if name not in ("auto", "cupy", "numpy"):
        raise BackendUnavailable(f"unknown backend {name!r}: expected auto, cupy or numpy")
    reason = gpu_unavailable_reason() if name != "numpy" else "NumPy asked for"
    if name == "cupy" and reason:
        raise BackendUnavailable(f"the cupy backend cannot run: {reason}")
    if reason:
        from questprof.backends.numpy import NumpyBackend
        backend = NumpyBackend()
        backend.fallback_reason = reason if name == "auto" else None
        return backend
    from questprof.backends.cupy import CupyBackend
    return CupyBackend()


def timing_backend(backend: Backend) -> Backend:
    """The backend a sweep times: the NumPy backend's float32 path (backends/numpy_fp32.py, FP8
    caches included) in place of its float64 reference, whose CPU times nobody acts on; any
    other backend itself."""
    from questprof.backends.numpy import NumpyBackend
    if type(backend) is not NumpyBackend:  # the GPU, the fp32 path, a test's double
        return backend
    from questprof.backends.numpy_fp32 import NumpyFp32Backend
    timed = NumpyFp32Backend()
    timed.fallback_reason = backend.fallback_reason
    return timed


__all__ = ["Backend", "BackendUnavailable", "get_backend", "gpu_unavailable_reason",
           "timing_backend"]
