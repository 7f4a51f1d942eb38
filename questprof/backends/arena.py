"""Host memory that successive pools share, one at a time: a CPU sweep builds the pools of one
configuration group after another, largest first (commands/sweep.run_order), and on the 2-core
machine fresh memory cost a page fault per page, 1.3-8.8 ns per float32 value written into it
(2026-12-01; numpy.empty + fill), more than computing the value."""

from __future__ import annotations

import weakref

import numpy as np


class Arena:
    """One buffer lent to one owner at a time (held until the owner is garbage): take() while
    it is lent gives fresh memory instead, so two live owners never share bytes."""

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None
        self._owner = None  # weakref to the owner, or a callable that says it is pending

    def _busy(self) -> bool:
        return self._owner is not None and self._owner() is not None

    def spare(self) -> int:
        """Bytes held and not lent: the next take() reuses them, or frees them first."""
        return 0 if self._busy() or self.buf is None else self.buf.nbytes

    def take(self, nbytes: int, owner=None) -> np.ndarray:
        """nbytes of memory (uint8) for `owner`, or for the owner that own() names later."""
        if self._busy():
            return np.empty(nbytes, np.uint8)
        if self.buf is None or self.buf.nbytes < nbytes:
            self.buf = None  # freed before the larger one is allocated
            self.buf = np.empty(nbytes, np.uint8)
        self._owner = weakref.ref(owner) if owner is not None else (lambda: True)
        return self.buf[:nbytes]

    def own(self, owner, memory: np.ndarray) -> None:
        """`owner` holds `memory` (what take() gave without an owner) from now on."""
        if self.buf is not None and memory.base is self.buf:
            self._owner = weakref.ref(owner)
