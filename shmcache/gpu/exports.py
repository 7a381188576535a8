"""`Exports`: the device buffers this process exported, kept until their entry leaves the index."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["EntryState", "Exports"]

EntryState = Callable[[int, int], tuple[bool, int]]  # (slot, gen) -> (still indexed, references)


@dataclass
class _Export:
    buffer: torch.Tensor
    pending: bool = True  # exported, not sealed yet: its entry is still a reservation
    withdrawn: bool = False


class Exports:
    """The device buffers this process exported, by (slot, gen), until their entry leaves the index.

    An export is pending from `add` until `published` (after the seal): sweeps and withdrawals
    leave it alone, as its entry is not in the index yet."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._exports: OrderedDict[tuple[int, int], _Export] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer kept, withdrawn and pending ones included."""
        with self._lock:
            return sum(export.buffer.nbytes for export in self._exports.values())

    def add(self, slot: int, gen: int, buffer: torch.Tensor) -> None:
        """Keep `buffer`, exported for reservation (slot, gen): pending until `published`."""
        with self._lock:
            self._exports[(slot, gen)] = _Export(buffer)

    def published(self, slot: int, gen: int) -> None:
        """The entry of (slot, gen) was sealed with our record."""
        with self._lock:
            export = self._exports.get((slot, gen))
            if export is not None:
                export.pending = False

    def discard(self, slot: int, gen: int) -> None:
        """Forget the export of (slot, gen) at once (its entry was never sealed with our record)."""
        with self._lock:
            self._exports.pop((slot, gen), None)

    def buffer(self, slot: int, gen: int) -> torch.Tensor | None:
        """Our buffer for (slot, gen), unless it was withdrawn."""
        with self._lock:
            export = self._exports.get((slot, gen))
            if export is None or export.withdrawn:
                return None
            self._exports.move_to_end((slot, gen))
            return export.buffer

    def sweep(self, state: EntryState) -> int:
        """Free buffers whose entry left the index, or that were withdrawn and are unreferenced.
        `state(slot, gen)` -> (entry still indexed, references). Returns how many were freed."""
        with self._lock:
            items = [(found, export) for found, export in self._exports.items() if not export.pending]
        freed = 0
        for (slot, gen), export in items:
            indexed, references = state(slot, gen)
            if not indexed or (export.withdrawn and references == 0):
                with self._lock:
                    self._exports.pop((slot, gen), None)
                freed += 1
        return freed

    def to_withdraw(self, need: int, state: EntryState) -> list[tuple[int, int]]:
        """Least recently used published exports to withdraw so that `need` more bytes fit the
        limit; `state` as for `sweep`. Only unreferenced exports are chosen (withdrawing one a
        reader holds frees nothing now), and none at all if that cannot make room."""
        if need > self.limit_bytes:
            return []
        with self._lock:
            items = list(self._exports.items())
        excess = sum(export.buffer.nbytes for _found, export in items) + need - self.limit_bytes
        chosen: list[tuple[int, int]] = []
        for found, export in items:
            if excess <= 0:
                break
            if export.withdrawn or export.pending or state(*found)[1] > 0:
                continue
            chosen.append(found)
            excess -= export.buffer.nbytes
        return chosen if excess <= 0 else []

    def mark_withdrawn(self, slot: int, gen: int) -> None:
        """Its record was withdrawn (a pending export has none yet: it is left as is)."""
        with self._lock:
            export = self._exports.get((slot, gen))
            if export is not None and not export.pending:
                export.withdrawn = True

    def drain(self) -> list[torch.Tensor]:
        """Forget every export; returns their buffers."""
        with self._lock:
            buffers = [export.buffer for export in self._exports.values()]
            self._exports.clear()
            return buffers

    def exported(self) -> list[tuple[int, int]]:
        """(slot, gen) of every export kept, least recently used first."""
        with self._lock:
            return list(self._exports)
