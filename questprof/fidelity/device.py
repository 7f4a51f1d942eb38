"""torch helpers of the fidelity path on the model's device: rounding to the cache's storage,
and backend arrays (NumPy, CuPy) as torch tensors without a host copy.

A real model's captures stay where the model ran (an H200's 20 prompts of 8K tokens hold
7.5 GB of fp32 keys and values: copying them to the host and checking them there took most
of the capture's 20.9 s on 2026-12-01); the selection of a GPU backend crosses to torch
through DLPack, on the same (default) stream.
"""

from __future__ import annotations

import numpy as np
import torch

from questprof.core.config import ConfigError

# torch dtype each cache storage rounds through (fp32: as captured)
_ROUND = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def stored(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Values as the cache stores them (rounded to `dtype`, nearest even), as float32: what
    host_index.stored computes with NumPy."""
    if dtype not in _ROUND:
        raise ConfigError(f"fidelity on the model's device: cache dtype {dtype!r} is not one of "
                          f"{', '.join(_ROUND)}")
    return x.to(_ROUND[dtype]).float()


def storage(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """x in `dtype` storage form on its device (fp16, fp32; bf16 as its 16 bits, int16)."""
    if dtype == "bf16":
        return x.to(torch.bfloat16).view(torch.int16)
    if dtype not in _ROUND:
        raise ConfigError(f"cache dtype {dtype!r} cannot be stored from torch")
    return x.to(_ROUND[dtype])


def as_tensor(x, device) -> torch.Tensor:
    """A backend's array (NumPy on the host, CuPy on the GPU) as a torch tensor on `device`:
    CuPy's through DLPack (no copy), NumPy's copied once."""
    if is_tensor(x):
        return x.to(device)
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x)).to(device)
    try:
        return torch.from_dlpack(x).to(device)
    except (TypeError, BufferError):  # a CuPy without the stream-aware protocol: its CUDA
        return torch.as_tensor(x, device=device)  # array interface (same default stream)
