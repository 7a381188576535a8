"""The arena allocator: first fit over the slot table, evicting least recently used entries.

It keeps no state of its own: the extents of non-EMPTY slots are the allocation. Allocation runs
under the node section, so one allocator runs at a time; it reads the slot table in one pass
without stripe locks (others may free extents meanwhile, never take free space: taking space
needs the node section). Records are written in one copy (slots.py), so the look never sees a
live record as free; half-freed records only make it more careful. The two looks at the table,
the first-fit gap and the eviction order, are native (native.c, rule 7), and so is freeing a
candidate under its stripe lock (`evict`, which checks it again); deciding what to evict is here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from shmcache.errors import CapacityError, ReservationLost
from shmcache.node import _native
from shmcache.node.sections import Sections
from shmcache.node.slots import SlotTable

__all__ = ["ALIGN", "Allocator", "aligned"]

ALIGN: Final = 64
FIRST_LOOK: Final = 8  # eviction candidates ordered by the first look (native.c: a selection, not a sort)


def aligned(nbytes: int) -> int:
    """The extent that holds `nbytes`: extents start and end on `ALIGN` bytes."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class Allocator:
    """Finds arena room for reservations, evicting unreferenced entries as needed."""

    def __init__(
        self, slots: SlotTable, sections: Sections, capacity: int, owner_alive: Callable[[int], bool]
    ) -> None:
        self._slots, self._sections, self._native = slots, sections, slots.native
        self.capacity = capacity
        self._owner_alive = owner_alive

    def find(self, need: int, reap: Callable[[], bool]) -> int:
        """An offset of `need` free bytes (the caller holds the node section), evicting LRU
        entries, and reaping dead clients once, as needed; `CapacityError` if none can be made."""
        offset = self.gap(need)
        reaped = False
        while offset is None:
            if not self._evict_one():
                if reaped or not reap():
                    raise CapacityError(
                        f"no room for {need} bytes: the arena ({self.capacity} bytes) is held "
                        "by referenced or in-flight entries"
                    )
                reaped = True
            offset = self.gap(need)
        return offset

    def set_extent(self, slot: int, gen: int, offset: int | None, size: int) -> None:
        """Our reservation's extent set (`offset` None: cut to `size`, which frees the rest: the
        stripe section suffices) in one native call, the locked path running the same step when
        the stripe needs its repair; `ReservationLost` if it was taken over (or its record is
        damaged: quarantined)."""
        done = self._native.extent(slot, gen, offset, size)
        if isinstance(done, _native.Slow):
            with self._sections.stripe(slot // self._slots.layout.ways):
                done = self._native.extent_in(slot, gen, offset, size)
                if isinstance(done, _native.Slow):
                    self._slots.on_damaged(slot)
        if done is not True:
            raise ReservationLost(f"reservation (slot {slot}, gen {gen}) was taken over")

    def gap(self, need: int) -> int | None:
        """The lowest free offset of `need` bytes right now, evicting nothing (None if none)."""
        return self._slots.native.gap(need, self.capacity)

    def _candidates(self, limit: int) -> tuple[list[int], bool]:
        """Slots worth evicting, best first: dead reservations, then the best `limit` unreferenced
        sealed entries, expired before the least recently used; and whether those are all."""
        reserved, sealed, complete = self._slots.native.evictable(time.monotonic(), limit)
        return [*(slot for slot in reserved if not self._owner_alive(slot)), *sealed], complete

    def _evict_one(self) -> bool:
        """Evict the best candidate that is still evictable under its stripe lock; False if none.
        The first look orders the best few (an entry pinned since the look is skipped); only if
        every one of them was taken meanwhile does a second look order them all."""
        for limit in (FIRST_LOOK, self._slots.layout.slots):
            candidates, complete = self._candidates(limit)
            if any(self._evict(slot) for slot in candidates):
                return True
            if complete:
                return False
        return False

    def _evict(self, slot: int) -> bool:
        """Free `slot` if it is still an unreferenced sealed entry or a dead owner's reservation
        (one native call; the locked path runs the same step when the stripe needs its repair,
        and a damaged record is quarantined: its memory may be free now)."""
        evicted = self._native.evict(slot, time.monotonic())
        if isinstance(evicted, _native.Slow):
            with self._sections.stripe(slot // self._slots.layout.ways):
                evicted = self._native.evict_in(slot, time.monotonic())
                if isinstance(evicted, _native.Slow):
                    self._slots.on_damaged(slot)
                    return True
        return evicted
