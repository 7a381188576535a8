"""Pins: this process's references on entries, kept in its own client record.

A pin is (slot, gen, count) in one of the client's P pin records. A slot's refcount is the sum of
the counts of live clients' pins on its (slot, gen), kept in step inside the slot's stripe section;
a dead client's pins stop counting the moment its liveness semaphore drops (`recount` skips it).
Two kinds of reference share the mechanism: request references (released by cleanup_request)
and view pins (released when the last view of a mapping is garbage collected).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from shmcache.errors import CapacityError
from shmcache.node.layout import CLIENT_HEAD_SIZE, PIN, PIN_DTYPE, IndexBuffer, Layout

__all__ = ["PinTable"]


@dataclass
class _Pin:
    index: int  # which of the client's pin records holds it
    count: int


class PinTable:
    """Every client's pin records, and this process's own (`bind` names its row)."""

    def __init__(self, idx: memoryview, layout: Layout, buf: IndexBuffer) -> None:
        self._idx, self._layout = idx, layout
        self.array = np.ndarray(
            (layout.clients, layout.pins),
            PIN_DTYPE,
            buffer=buf,
            offset=layout.clients_off + CLIENT_HEAD_SIZE,
            strides=(layout.client_size, PIN.size),
        )
        self._row = -1
        self._mine: dict[tuple[int, int], _Pin] = {}
        self._free: list[int] = []
        self._lock = threading.Lock()

    def bind(self, row: int) -> None:
        """Use client record `row` (zeroed) for this process's pins."""
        with self._lock:
            self._row = row
            self._mine.clear()
            self._free = list(range(self._layout.pins - 1, -1, -1))

    @property
    def spare(self) -> int:
        """How many more entries this process can pin."""
        return len(self._free)

    def add(self, slot: int, gen: int, count: int) -> None:
        """Add `count` pins on (slot, gen); `CapacityError` when every pin record is in use.
        The caller holds the slot's stripe section and adds `count` to its refcount."""
        with self._lock:
            pin = self._mine.get((slot, gen))
            if pin is None:
                if not self._free:
                    raise CapacityError(
                        f"this process holds pins on {self._layout.pins} entries (max_pins_per_process): "
                        "release requests with cleanup_request() or drop returned views"
                    )
                pin = self._mine[(slot, gen)] = _Pin(self._free.pop(), 0)
            pin.count += count
            self._write(pin, slot, gen)

    def remove(self, slot: int, gen: int, count: int) -> int:
        """Remove up to `count` pins on (slot, gen); returns how many were held (the caller holds
        the stripe section and subtracts that from the refcount)."""
        with self._lock:
            pin = self._mine.get((slot, gen))
            if pin is None:
                return 0
            taken = min(count, pin.count)
            pin.count -= taken
            self._write(pin, slot, gen)
            if pin.count == 0:
                del self._mine[(slot, gen)]
                self._free.append(pin.index)
            return taken

    def _write(self, pin: _Pin, slot: int, gen: int) -> None:
        off = self._layout.pin_off(self._row, pin.index)
        self._idx[off : off + PIN.size] = PIN.pack(slot, pin.count, gen)

    def held(self) -> dict[tuple[int, int], int]:
        """This process's pins: (slot, gen) -> count."""
        with self._lock:
            return {entry: pin.count for entry, pin in self._mine.items()}

    def recount(self, slot: int, gen: int, live: np.ndarray) -> int:
        """The refcount (slot, gen) should have: the pins of the clients marked in `live`."""
        pins = self.array
        match = (pins["slot"] == slot) & (pins["gen"] == gen) & live[:, None]
        return int(pins["count"][match].sum())

    def pinned_by(self, row: int) -> list[tuple[int, int]]:
        """The entries client `row` holds pins on, in slot order."""
        return sorted({(int(p["slot"]), int(p["gen"])) for p in self.array[row] if p["count"]})
