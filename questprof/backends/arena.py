"""Host memory that successive pools share, one at a time: a CPU sweep builds the pools of one
configuration group after another, largest first (commands/sweep.run_order), and on the 2-core
machine fresh memory cost a page fault per page, 1.3-8.8 ns per float32 value written into it
(2026-12-01; numpy.empty + fill), more than computing the value."""

from __future__ import annotations

import sys

import numpy as np


class Arena:
    """One buffer, lent again only when no array made from it lives (each view keeps a reference
    to it, NumPy's `base`): take() while one does gives fresh memory instead, so two live pools
    never share bytes."""

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None
        self._refs = 0  # references to buf with no view of it alive

    def _busy(self) -> bool:
        return self.buf is not None and sys.getrefcount(self.buf) > self._refs

    def spare(self) -> int:
        """Bytes held and not lent: the next take() reuses them, or frees them first."""
        return 0 if self.buf is None or self._busy() else self.buf.nbytes

    def take(self, nbytes: int) -> np.ndarray:
        """nbytes of memory (uint8): the buffer's, when nothing made from it lives."""
        if self._busy():
            return np.empty(nbytes, np.uint8)
        if self.buf is None or self.buf.nbytes < nbytes:
            self.buf = None  # freed before the larger one is allocated
            self.buf = np.empty(nbytes, np.uint8)
            self._refs = sys.getrefcount(self.buf)
        return self.buf[:nbytes]
