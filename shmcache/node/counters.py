"""Node-wide counters: each client adds to its own record; totals are the sum over live records
plus the retired totals of clients that left.

Folding a leaving (or dead) client's counters into the retired totals is journaled, so a process
killed midway neither loses nor doubles them: the journal holds the totals as they were before
the fold and the row being folded; the next node-section holder restores and redoes it.

Readers take no lock: a retire makes the retire sequence odd while it folds (native.c, point
8), and a sum is kept only if the sequence was even and unchanged around it. A retire that stays
odd for `RETIRE_WAIT_S` (its process stopped, or killed inside) is read through its journal:
the totals before the fold plus the folded record, exact unless the record was already zeroed.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Final

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
RETIRE_WAIT_S: Final = 0.05  # a reader waits this long for a retire in progress, then reads the journal


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

    def totals(self, claimed: Callable[[], np.ndarray]) -> dict[str, int]:
        """Node-wide totals: the records of the `claimed()` rows plus the retired totals, each
        client counted once even while a retire folds one in (the module docstring)."""
        give_up = time.monotonic() + RETIRE_WAIT_S
        while True:
            before = self._native.retire_seq(False)
            if before % 2 == 0:
                sums = self.retired + self.all[claimed()].sum(axis=0, dtype=np.uint64)
                if self._native.retire_seq(True) == before:
                    break
            if time.monotonic() > give_up:
                sums = self._through_journal(claimed())
                break
            time.sleep(0.0005)
        return {counter.label: int(sums[counter]) for counter in Counter}

    def _through_journal(self, claimed: np.ndarray) -> np.ndarray:
        """The totals while a retire stays unfinished: before the fold, plus the record it folds."""
        row = _I32.unpack_from(self._idx, H_JOURNAL_ROW)[0]
        before, rows = self._journal, claimed.copy()
        if 0 <= row < self._layout.clients:
            rows[row] = True
        else:  # not journaled yet, or folded and cleared
            before = self.retired
        sums: np.ndarray = before + self.all[rows].sum(axis=0, dtype=np.uint64)
        return sums

    def retire(self, row: int, clear: Callable[[int], None]) -> None:
        """Fold `row`'s counters into the retired totals, then `clear(row)` its record (journaled,
        inside the retire sequence; the caller holds the node section)."""
        self._native.retire_begin()
        self._journal[:] = self.retired
        self._idx[H_JOURNAL_ROW : H_JOURNAL_ROW + 4] = _I32.pack(row)
        self.retired[:] = self.retired + self.all[row]
        crashpoints.reached(CrashPoint.RETIRING_CLIENT)
        clear(row)
        self._idx[H_JOURNAL_ROW : H_JOURNAL_ROW + 4] = _I32.pack(-1)
        self._native.retire_end()

    def replay(self, clear: Callable[[int], None], dead: Callable[[int], bool]) -> bool:
        """Finish a retire its process died in (the caller holds the node section). A journal row
        that names no record, or a live client's, is damage, not a retire: it is dropped (the
        totals are left as they are) and False returned."""
        row = _I32.unpack_from(self._idx, H_JOURNAL_ROW)[0]
        if row == -1:
            self._native.retire_end()  # a retire killed after its journal row was cleared
            return True
        if not 0 <= row < self._layout.clients or not dead(row):
            self._idx[H_JOURNAL_ROW : H_JOURNAL_ROW + 4] = _I32.pack(-1)
            self._native.retire_end()
            return False
        self.retired[:] = self._journal
        self.retire(row, clear)
        return True
