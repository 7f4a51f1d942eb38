"""A captured KV cache: each layer's decode queries and its post-RoPE keys and values.

Decode step t (0-based, `steps` of them) attends to the first `length - steps + 1 + t` tokens:
keys only grow during decode, so the cache after the last step holds every step's keys.
Shapes: queries [layers, steps, Hq, d]; keys, values [layers, Hkv, length, d]; float32.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from questprof.core.config import ConfigError

FORMAT = "questprof-kv-capture/1"


@dataclass
class Capture:
    """One prompt's decode queries and final cache, with where they came from."""

    queries: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    scaling: float
    model: str
    source: str
    info: dict = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return int(self.keys.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.keys.shape[1])

    @property
    def length(self) -> int:
        """Tokens in the cache at the last decode step."""
        return int(self.keys.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.keys.shape[3])

    @property
    def q_heads(self) -> int:
        return int(self.queries.shape[2])

    @property
    def steps(self) -> int:
        return int(self.queries.shape[1])

    def step_length(self, step: int) -> int:
        """Tokens that the query of decode step `step` attends to."""
        return self.length - self.steps + 1 + step

    def check(self, origin: str = "capture") -> "Capture":
        """Raise ConfigError when the shapes do not fit together or a value is NaN or inf."""
        q, k, v = self.queries.shape, self.keys.shape, self.values.shape
        if len(q) != 4 or len(k) != 4 or k != v:
            raise ConfigError(f"{origin} shapes do not fit: queries {q}, keys {k}, values {v}")
        if q[0] != k[0] or q[3] != k[3] or q[2] % k[1] or q[1] > k[2]:
            raise ConfigError(f"{origin} shapes do not fit: queries {q} (layers, steps, q_heads, "
                              f"d) against keys {k} (layers, kv_heads, length, d)")
        _check_finite(self, origin)
        return self


def _check_finite(cap: Capture, origin: str) -> None:
    """ConfigError naming the first tensor with NaN or inf: softmax weights, Quest's page bounds
    and every metric are undefined there (a traceback in the report, before this check)."""
    bad = []
    for layer in range(cap.layers):
        for name, x in zip(layer_names(layer), (cap.queries, cap.keys, cap.values)):
            count = x[layer].size - int(np.count_nonzero(np.isfinite(x[layer])))
            if count:
                bad.append((name, count, x[layer].size))
    raise_nonfinite(bad, origin)


def raise_nonfinite(bad: list[tuple[str, int, int]], origin: str) -> None:
    """ConfigError naming the first of `bad` (tensor name, non-finite values, size), if any."""
    if bad:
        name, count, size = bad[0]
        more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
        raise ConfigError(f"{origin} {name} holds {count} non-finite values (NaN/inf) of "
                          f"{size}{more}: an fp16 overflow in the model? Attention is undefined "
                          f"there; capture in fp32 or bf16, or leave those steps out")


def layer_names(layer: int) -> tuple[str, str, str]:
    return f"layers.{layer}.query", f"layers.{layer}.key", f"layers.{layer}.value"


def save_capture(path, cap: Capture) -> Path:
    """Write `cap` as safetensors (the layout in docs/FIDELITY.md); returns the path."""
    from safetensors.numpy import save_file
    tensors = {}
    for layer in range(cap.layers):
        names = layer_names(layer)
        for name, x in zip(names, (cap.queries[layer], cap.keys[layer], cap.values[layer])):
            tensors[name] = np.ascontiguousarray(x, dtype=np.float32)
    meta = {"format": FORMAT, "model": cap.model, "source": cap.source,
            "layers": str(cap.layers), "q_heads": str(cap.q_heads), "kv_heads": str(cap.kv_heads),
            "head_dim": str(cap.head_dim), "scaling": repr(float(cap.scaling)),
            "info": json.dumps(cap.info, default=str)}
    save_file(tensors, str(path), metadata=meta)
    return Path(path)


def _meta_int(meta: dict, name: str, path) -> int:
    try:
        return int(meta[name])
    except (KeyError, ValueError):
        raise ConfigError(f"{path}: metadata field {name!r} is missing or not an integer") from None


def load_capture(path) -> Capture:
    """Read a capture written by `save_capture` (or by hand in that layout)."""
    from safetensors import safe_open
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"cache file {path} not found")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta, names = f.metadata() or {}, set(f.keys())
            layers = _meta_int(meta, "layers", path)
            wanted = [n for layer in range(layers) for n in layer_names(layer)]
            missing = [n for n in wanted if n not in names]
            if missing:
                raise ConfigError(f"{path}: {len(missing)} tensor(s) missing, first {missing[0]!r} "
                                  f"(each layer needs query, key and value)")
            arrays = [f.get_tensor(n).astype(np.float32) for n in wanted]
    except ConfigError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise ConfigError(f"{path}: not a readable safetensors file ({exc})") from None
    return _assemble(arrays, meta, path)


def _assemble(arrays, meta: dict, path) -> Capture:
    """Stack per-layer arrays into a checked Capture."""
    try:
        q, k, v = (np.stack(arrays[i::3]) for i in range(3))
    except ValueError as exc:
        raise ConfigError(f"{path}: layers differ in shape ({exc})") from None
    if q.ndim == 3:  # one decode step stored as [Hq, d]
        q = q[:, None]
    d = _meta_int(meta, "head_dim", path)
    try:
        scaling = float(meta.get("scaling", d ** -0.5))
        info = json.loads(meta.get("info", "{}"))
    except (ValueError, TypeError) as exc:  # json's JSONDecodeError is a ValueError
        raise ConfigError(f"{path}: unreadable metadata ({exc})") from None
    if not (math.isfinite(scaling) and scaling > 0):  # NaN reached every metric as null
        raise ConfigError(f"{path}: metadata scaling {meta.get('scaling')!r} is not a positive "
                          "number")
    return Capture(q, k, v, scaling, meta.get("model", path.stem), meta.get("source", "cache"),
                   info).check(f"{path}: capture")
