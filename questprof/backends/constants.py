"""Launch constants read from kernels/constants.cuh, the one place they are defined.

The launcher (backends/cupy.py) sizes grids, shared memory and splits from the same numbers the
kernels are compiled with; nothing here imports CuPy, so CI checks the parse without a GPU.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from types import MappingProxyType

from questprof import KERNELS_DIR

HEADER = KERNELS_DIR / "constants.cuh"
_SCALAR = re.compile(r"constexpr\s+int\s+(\w+)\s*=\s*(-?\d+)\s*;")
_ARRAY = re.compile(r"constexpr\s+int\s+(\w+)\s*\[\s*\]\s*=\s*\{([^}]*)\}\s*;")
_ANY = re.compile(r"^\s*constexpr\s+int\s+(\w+)")


def parse(text: str) -> dict[str, int | tuple[int, ...]]:
    """NAME -> int or tuple of ints for every `constexpr int` line; ValueError on another form."""
    out: dict[str, int | tuple[int, ...]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("//", 1)[0]
        if not _ANY.match(code):
            continue
        scalar, array = _SCALAR.search(code), _ARRAY.search(code)
        if scalar:
            out[scalar.group(1)] = int(scalar.group(2))
        elif array:
            items = [x.strip() for x in array.group(2).split(",") if x.strip()]
            if not all(re.fullmatch(r"-?\d+", x) for x in items):
                raise ValueError(f"constants.cuh:{number}: array items must be integer literals")
            out[array.group(1)] = tuple(int(x) for x in items)
        else:
            raise ValueError(f"constants.cuh:{number}: not `constexpr int NAME = <integer>;` "
                             f"or `constexpr int NAME[] = {{...}};`: {line.strip()!r}")
    return out


@functools.cache
def load(path: Path = HEADER) -> MappingProxyType:
    """The constants of kernels/constants.cuh (read once)."""
    return MappingProxyType(parse(path.read_text(encoding="utf-8")))


def per_group(name: str, g: int) -> int:
    """Entry of array `name` for G = g (arrays are indexed like QP_GROUPS)."""
    consts = load()
    groups = consts["QP_GROUPS"]
    if g not in groups:
        raise ValueError(f"{g} q heads per CTA is not built: expected one of {groups}")
    return consts[name][groups.index(g)]
