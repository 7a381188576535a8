"""Pins: this process's references on entries, kept in its own client record.

A pin is (slot, gen, count) in one of the client's P pin records. A slot's refcount is the sum of
the counts of live clients' pins on its (slot, gen), kept in step inside the slot's stripe section;
a dead client's pins stop counting the moment its liveness semaphore drops (`recount` skips it).
Two kinds of reference share the mechanism: request references (released by cleanup_request)
and view pins (released when the last view of a mapping is garbage collected).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from shmcache.errors import CapacityError
from shmcache.node import _native
from shmcache.node.layout import CLIENT_HEAD_SIZE, PIN, PIN_DTYPE, Layout

__all__ = ["PinTable", "after_reclaim"]

T = TypeVar("T")


def after_reclaim(step: Callable[[], T], reclaim: Callable[[], bool]) -> T:
    """`step()`; if it raises `CapacityError` (a full arena, or every pin record taken), release
    this process's dead views' pins (`reclaim`, True if any were; the caller holds no section: it
    takes stripe sections) and run it once more."""
    try:
        return step()
    except CapacityError:
        if not reclaim():
            raise
    return step()


class PinTable:
    """Every client's pin records, and this process's own: which of its records holds which
    entry's pins is the native handle's bookkeeping (native.c), bound to the client row at attach."""

    def __init__(self, idx: memoryview, layout: Layout, native: _native.Index) -> None:
        self._native = native
        self.array = np.ndarray(
            (layout.clients, layout.pins),
            PIN_DTYPE,
            buffer=idx,
            offset=layout.clients_off + CLIENT_HEAD_SIZE,
            strides=(layout.client_size, PIN.size),
        )

    @property
    def spare(self) -> int:
        """How many more entries this process can pin."""
        return self._native.pins_spare()

    def add(self, slot: int, gen: int, count: int) -> None:
        """Add `count` pins on (slot, gen); `CapacityError` when every pin record is in use.
        The caller holds the slot's stripe section and adds `count` to its refcount."""
        self._native.pin_add(slot, gen, count)

    def remove(self, slot: int, gen: int, count: int) -> int:
        """Remove up to `count` pins on (slot, gen); returns how many were held (the caller holds
        the stripe section and subtracts that from the refcount)."""
        return self._native.pin_remove(slot, gen, count)

    def held(self) -> dict[tuple[int, int], int]:
        """This process's pins: (slot, gen) -> count."""
        return self._native.pins_held()

    def recount(self, slot: int, gen: int, live: np.ndarray) -> int:
        """The refcount (slot, gen) should have: the pins of the clients marked in `live`."""
        pins = self.array
        match = (pins["slot"] == slot) & (pins["gen"] == gen) & live[:, None]
        return int(pins["count"][match].sum())

    def pinned_by(self, row: int) -> list[tuple[int, int]]:
        """The entries client `row` holds pins on, in slot order."""
        return sorted({(int(p["slot"]), int(p["gen"])) for p in self.array[row] if p["count"]})
