"""Repairs: what runs when a process died inside a section, and reaping the dead.

All of it rebuilds derived state only, from what cannot be torn (the kernel's semaphores and the
live clients' pin records), so it is idempotent and may itself be interrupted and run again:

- `quarantine`: a slot record that fails its crc becomes unreachable; its memory is kept only
  while live pins may use it (STALE, freed at its last release), else the slot is freed.
- `stripe`: every record of the stripe re-checked: damaged ones quarantined, reservations of dead
  owners freed, reference counts recounted from live clients' pins, unreferenced STALE freed.
- `node`: the counter journal replayed, dead clients reaped.
- `reap_dead`: for each dead client, the refcounts of what it pinned recounted (ignoring it), then
  its record retired. A reaper killed between the two leaves the record for the next reaper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shmcache.node import crashpoints
from shmcache.node.crashpoints import CrashPoint
from shmcache.node.layout import Counter
from shmcache.node.slots import SlotState

# How long a repair waits for a process that died holding the node lock to be gone in the kernel
# (its lock is handed on first): a journal row naming a client still alive after this is damage.
DEATH_GRACE_S = 2.0

if TYPE_CHECKING:
    from shmcache.node.index import NodeIndex

__all__ = ["Repairs"]


class Repairs:
    """The repairs of one index (see the module docstring)."""

    def __init__(self, index: NodeIndex, capacity: int) -> None:
        self._index, self._capacity = index, capacity

    def quarantine(self, slot: int) -> None:
        """Make a record that fails its crc unreachable (the caller holds its stripe section)."""
        index = self._index
        record, _valid = index.slots.raw(slot)
        index.counters.count(Counter.CORRUPT_RECORDS)
        refs = index.pins.recount(slot, record.gen, index.clients.live())
        sane = record.offset >= 0 and record.offset + record.size <= self._capacity
        if refs and sane and record.state != SlotState.EMPTY:
            index.slots.quarantine(slot, record._replace(state=SlotState.STALE, refs=refs))
        else:
            index.slots.quarantine(slot, record.freed())

    def stripe(self, stripe: int) -> None:
        """Rebuild `stripe`'s derived state (the caller holds its section)."""
        index = self._index
        live = index.clients.live()
        ways = index.layout.ways
        for slot in range(stripe * ways, (stripe + 1) * ways):
            record, valid = index.slots.raw(slot)
            if not valid:
                self.quarantine(slot)
            elif record.state == SlotState.RESERVED and not index.reservations.owner_alive(slot):
                index.slots.write(slot, record.state, record.freed())
            elif record.state != SlotState.EMPTY:
                refs = index.pins.recount(slot, record.gen, live)
                index.slots.write(slot, record.state, record.with_refs(refs))
        index.sections.count_repair(stripe)
        index.counters.count(Counter.REPAIRS)

    def node(self) -> None:
        """Finish a retire and reap the dead (the caller holds the node section)."""
        index = self._index
        if not index.counters.replay(
            index.clients.clear, lambda row: index.clients.gone_within(row, DEATH_GRACE_S)
        ):
            index.counters.count(Counter.CORRUPT_RECORDS)  # a damaged journal row, dropped
        self.reap_dead()
        index.counters.count(Counter.REPAIRS)

    def reap_dead(self) -> bool:
        """Reap every dead client (the caller holds the node section); True if there was one."""
        index = self._index
        dead = index.clients.dead()
        for row in dead:
            for slot, gen in index.pins.pinned_by(row):
                with index.sections.stripe(slot // index.layout.ways):
                    record = index.slots.read(slot)
                    if record is None or record.gen != gen or record.state == SlotState.EMPTY:
                        continue
                    refs = index.pins.recount(slot, gen, index.clients.live())
                    index.slots.write(slot, record.state, record.with_refs(refs))
            crashpoints.reached(CrashPoint.REAPING_CLIENT)
            index.counters.retire(row, index.clients.clear)
            index.counters.count(Counter.REAPED_CLIENTS)
        return bool(dead)

    def reap(self) -> int:
        """Reap dead clients, free reservations whose owner died, repair every stripe whose last
        holder died inside; returns how many clients were reaped."""
        index = self._index
        with index.sections.node():
            before = int(index.clients.claimed().sum())
            self.reap_dead()
            reserved = np.nonzero(index.slots.array["state"] == SlotState.RESERVED)[0]
            for slot in (int(s) for s in reserved):
                with index.sections.stripe(slot // index.layout.ways):
                    index.reservations.free_dead_in(slot)
            for stripe in range(index.layout.stripes):
                if index.sections.stripe_needs_repair(stripe):
                    with index.sections.stripe(stripe):
                        pass  # entering the section repairs it
            return before - int(index.clients.claimed().sum())
