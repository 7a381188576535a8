"""Critical sections with held markers, and the repairs that run when a holder died inside one.

A section is a process-shared robust mutex in the index (the kernel hands it to the next locker
when its holder dies: native.c, rule 1) plus a `held` marker: set to the holder's pid right after
the mutex is taken, cleared right before it is given back after a clean exit. Finding the marker
set on entry means the previous holder died inside (or left by an exception): the entrant runs the
section's repair first, which is idempotent and rebuilds only derived state, so it may itself be
interrupted and run again.

- A stripe section guards the slot, key, failure and attachment records of one stripe's slots.
  Its repair (repair.py) re-checks every record of the stripe.
- The node section guards client records, the counter journal and arena allocation. Its repair
  (repair.py) replays the counter journal and reaps dead clients.

Lock order: the node section, then at most one stripe section at a time.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from shmcache.errors import CapacityError
from shmcache.node import _native, crashpoints
from shmcache.node.crashpoints import CrashPoint
from shmcache.node.layout import H_NODE_HELD, NODE_LOCK, Layout

__all__ = ["Section", "Sections"]

_U32: Final = struct.Struct("<I")


class Section:
    """One held-marker critical section (a context manager; not reentrant)."""

    __slots__ = ("_held_off", "_lock", "_owner", "_point", "_repair", "_what")

    def __init__(
        self, owner: Sections, lock: int, held_off: int, repair: Callable[[], None], point: CrashPoint
    ) -> None:
        self._owner, self._lock, self._held_off, self._repair = owner, lock, held_off, repair
        self._point = point
        self._what = "the node lock" if point is CrashPoint.IN_NODE_SECTION else "a stripe lock"

    def __enter__(self) -> None:
        owner = self._owner
        if owner.enter(self._lock, self._held_off, self._what):
            try:
                self._repair()
            except BaseException:
                owner.leave(self._lock, self._held_off, clean=False)
                raise
        crashpoints.reached(self._point)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # CapacityError (PinLimitReached too) is only raised before a section writes anything:
        # that exit is clean too
        clean = exc_type is None or (isinstance(exc_type, type) and issubclass(exc_type, CapacityError))
        self._owner.leave(self._lock, self._held_off, clean=clean)


class Sections:
    """The stripe and node sections of one namespace. The repairs are given by the index; entering
    and leaving is the native handle's (native.c: the same steps its hot transactions take)."""

    def __init__(
        self,
        idx: memoryview,
        layout: Layout,
        native: _native.Index,
        *,
        repair_stripe: Callable[[int], None],
        repair_node: Callable[[], None],
    ) -> None:
        self._idx, self._layout, self._native = idx, layout, native
        self._repair_stripe, self._repair_node = repair_stripe, repair_node

    def stripe(self, stripe: int) -> Section:
        """Hold one stripe; repairs it first if its last holder died inside."""
        return Section(
            self,
            self._layout.stripe_lock(stripe),
            self._layout.stripe_off(stripe),
            lambda: self._repair_stripe(stripe),
            CrashPoint.IN_STRIPE_SECTION,
        )

    def node(self) -> Section:
        """Hold the node lock (client records, counter journal, allocation)."""
        return Section(self, NODE_LOCK, H_NODE_HELD, self._repair_node, CrashPoint.IN_NODE_SECTION)

    def stripe_needs_repair(self, stripe: int) -> bool:
        """True if a holder died inside the stripe's section (read without the lock)."""
        held: int = _U32.unpack_from(self._idx, self._layout.stripe_off(stripe))[0]
        return held != 0

    def count_repair(self, stripe: int) -> None:
        """Count one repair of `stripe` in its own record (shown by shmcache-inspect)."""
        off = self._layout.stripe_off(stripe) + 4
        self._idx[off : off + 4] = _U32.pack(_U32.unpack_from(self._idx, off)[0] + 1)

    def enter(self, lock: int, held_off: int, what: str) -> bool:
        """Take lock `lock` (`LockTimeout` after the lock timeout) and set its held marker;
        True if the last holder died inside."""
        return self._native.enter(lock, held_off, what)

    def leave(self, lock: int, held_off: int, *, clean: bool) -> None:
        """Clear the held marker (only after a clean exit: else the next holder repairs) and release."""
        self._native.leave(lock, held_off, clean)
