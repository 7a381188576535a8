"""Node-wide counters: each client adds to its own record; totals are the sum over live records
plus the retired totals of clients that left.

Folding a leaving (or dead) client's counters into the retired totals is journaled, so a process
killed midway neither loses nor doubles them: the journal holds the totals as they were before
the fold and the row being folded; the next node-section holder restores and redoes it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from shmcache.node import _native, crashpoints
from shmcache.node.crashpoints import CrashPoint
from shmcache.node.layout import (
    C_COUNTERS,
    H_JOURNAL,
    H_JOURNAL_ROW,
    H_RETIRED,
    N_COUNTERS,
    Counter,
    Layout,
)

__all__ = ["Counters"]

_I32 = struct.Struct("<i")


class Counters:
    """The counter records of one mapped index; `bind` selects this process's record."""

    def __init__(self, idx: memoryview, layout: Layout, native: _native.Index) -> None:
        self._idx, self._native = idx, native
        self.all = np.ndarray(
            (layout.clients, N_COUNTERS),
            "<u8",
            buffer=idx,
            offset=layout.clients_off + C_COUNTERS,
            strides=(layout.client_size, 8),
        )
        self.retired = np.ndarray((N_COUNTERS,), "<u8", buffer=idx, offset=H_RETIRED)
        self._journal = np.ndarray((N_COUNTERS,), "<u8", buffer=idx, offset=H_JOURNAL)
        self._layout = layout

    def count(self, counter: Counter, n: int = 1) -> None:
        """Add `n` to this process's `counter` (the native handle's bound client record; nothing
        while detached)."""
        self._native.count(counter, n)

    def totals(self, claimed: np.ndarray) -> dict[str, int]:
        """Node-wide totals: the records of the `claimed` rows plus the retired totals."""
        sums = self.retired + self.all[claimed].sum(axis=0, dtype=np.uint64)
        return {counter.label: int(sums[counter]) for counter in Counter}

    def retire(self, row: int, clear: Callable[[int], None]) -> None:
        """Fold `row`'s counters into the retired totals, then `clear(row)` its record (journaled;
        the caller holds the node section)."""
        self._journal[:] = self.retired
        self._idx[H_JOURNAL_ROW : H_JOURNAL_ROW + 4] = _I32.pack(row)
        self.retired[:] = self.retired + self.all[row]
        crashpoints.reached(CrashPoint.RETIRING_CLIENT)
        clear(row)
        self._idx[H_JOURNAL_ROW : H_JOURNAL_ROW + 4] = _I32.pack(-1)

    def replay(self, clear: Callable[[int], None], dead: Callable[[int], bool]) -> bool:
        """Finish a retire its process died in (the caller holds the node section). A journal row
        that names no record, or a live client's, is damage, not a retire: it is dropped (the
        totals are left as they are) and False returned."""
        row = _I32.unpack_from(self._idx, H_JOURNAL_ROW)[0]
        if row == -1:
            return True
        if not 0 <= row < self._layout.clients or not dead(row):
            self._idx[H_JOURNAL_ROW : H_JOURNAL_ROW + 4] = _I32.pack(-1)
            return False
        self.retired[:] = self._journal
        self.retire(row, clear)
        return True
