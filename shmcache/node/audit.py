"""The invariants of a consistent index, checked stripe by stripe under their locks.

Used by the crash-point tests and the stress tool after `reap()`: a namespace whose processes died
anywhere must satisfy all of them once the dead were reaped and their sections repaired.
"""

from __future__ import annotations

import numpy as np

from shmcache.node.index import NodeIndex
from shmcache.node.slots import SlotState

__all__ = ["audit"]


def audit(index: NodeIndex) -> list[str]:
    """Every violated invariant, as a sentence (empty: consistent). Call after `index.reap()`."""
    problems: list[str] = []
    live = index.clients.live()
    extents: list[tuple[int, int, int]] = []
    ways = index.layout.ways
    for stripe in range(index.layout.stripes):
        if index.sections.stripe_needs_repair(stripe):
            problems.append(f"stripe {stripe}: held marker set after reap")
        with index.sections.stripe(stripe):
            for slot in range(stripe * ways, (stripe + 1) * ways):
                problems.extend(_check_slot(index, slot, live, extents))
    extents.sort()
    reach, reacher = 0, -1  # the furthest end so far, and whose
    for start, end, slot in extents:
        if start < reach:
            problems.append(f"slot {slot} at {start} overlaps slot {reacher}'s extent (to {reach})")
        if end > reach:
            reach, reacher = end, slot
    dead = index.clients.dead()
    if dead:
        problems.append(f"dead client records not reaped: {dead}")
    return problems


def _check_slot(
    index: NodeIndex, slot: int, live: np.ndarray, extents: list[tuple[int, int, int]]
) -> list[str]:
    record, valid = index.slots.raw(slot)
    if not valid:
        return [f"slot {slot}: record fails its crc"]
    problems: list[str] = []
    if record.state == SlotState.EMPTY:
        return problems
    if record.state == SlotState.RESERVED and not index.reservations.owner_alive(slot):
        problems.append(f"slot {slot}: reserved by a dead owner")
    refs = index.pins.recount(slot, record.gen, live)
    if refs != record.refs:
        problems.append(f"slot {slot}: refcount {record.refs}, live pins {refs}")
    if record.state == SlotState.STALE and record.refs == 0:
        problems.append(f"slot {slot}: stale and unreferenced")
    if record.size:
        if record.offset + record.size > index.capacity:
            problems.append(f"slot {slot}: extent past the arena")
        extents.append((record.offset, record.offset + record.size, slot))
    return problems
