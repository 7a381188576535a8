"""The crash-point table, as data: where a process may die, what it leaves, what repairs it.

Every row names a hook in the code (`reached(point)` here, `reached(POINT_...)` in native.c for the
points the native transactions pass: in-stripe-section, slot-record-torn, holding-pins), so a test
can SIGKILL a real process at exactly that point (`arm(point)` in that process, which arms both;
`arm(point, stop=True)` makes it SIGSTOP itself at a Python point instead, for a test to look at
what it holds there) and the table and the tests cannot drift apart:
tests/test_crash_points.py runs one crash test per row. A process that is not armed pays one
comparison per hook.
"""

from __future__ import annotations

import enum
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from shmcache.node import _native
from shmcache.node.layout import Counter

__all__ = ["CRASH_POINTS", "NATIVE_POINTS", "CrashPoint", "CrashRow", "Survivor", "arm", "reached"]


class CrashPoint(enum.Enum):
    """A named place in the protocol where a test may kill the process."""

    CREATING_SEMAPHORES = "creating-semaphores"
    CREATING_NAMESPACE = "creating-namespace"
    IN_NODE_SECTION = "in-node-section"
    RETIRING_CLIENT = "retiring-client"
    REAPING_CLIENT = "reaping-client"
    IN_STRIPE_SECTION = "in-stripe-section"
    SLOT_RECORD_TORN = "slot-record-torn"
    RESERVED = "reserved"
    UNSEALED_PAYLOAD = "unsealed-payload"
    HOLDING_PINS = "holding-pins"


class Survivor(enum.Enum):
    """Who finds what a dead process left."""

    ATTACHED = "a process that stays attached (repairs in place)"
    ARRIVES_AFTER = "the next process to attach, the dead one having been the only one (wipes)"


BOTH: Final = (Survivor.ATTACHED, Survivor.ARRIVES_AFTER)


@dataclass(frozen=True)
class CrashRow:
    """One row of the crash-point table. `evidence` is the node counter an attached survivor sees
    move when it repairs (None: nothing to count); `drops_an_entry` when the repair may drop the
    entry whose record the dead process was writing (it is recomputed: a miss, never wrong data)."""

    point: CrashPoint
    killed_while: str
    left_behind: str
    repaired_by: str
    survivors: tuple[Survivor, ...] = BOTH
    evidence: Counter | None = None
    drops_an_entry: bool = False


CRASH_POINTS: tuple[CrashRow, ...] = (
    CrashRow(
        CrashPoint.CREATING_SEMAPHORES,
        "creating a namespace (semaphore set made, not yet signed nor named by id in the header)",
        "a semaphore set that only the key in the unfinished header names",
        "the next attacher finds the header unfinished, finds the set by that key and removes it "
        "with the namespace, under the bootstrap lock",
        survivors=(Survivor.ARRIVES_AFTER,),
    ),
    CrashRow(
        CrashPoint.CREATING_NAMESPACE,
        "creating a namespace (header written, arena not yet reserved)",
        "objects of a namespace that never became ready",
        "the next attacher finds it not ready and wipes it, under the bootstrap lock",
        survivors=(Survivor.ARRIVES_AFTER,),
    ),
    CrashRow(
        CrashPoint.IN_NODE_SECTION,
        "holding the node lock",
        "the lock handed on by the kernel (robust mutex, owner died), its held marker set",
        "the next holder replays the counter journal and reaps dead clients",
        evidence=Counter.REPAIRS,
    ),
    CrashRow(
        CrashPoint.RETIRING_CLIENT,
        "retiring a client record (folding its counters into the retired totals)",
        "totals folded partly or not at all, the journal row set, the node held marker set, the "
        "retire sequence odd (readers read through the journal meanwhile)",
        "the next node-lock holder restores the totals from the journal, redoes the retire and "
        "ends the retire sequence",
        evidence=Counter.REPAIRS,
    ),
    CrashRow(
        CrashPoint.REAPING_CLIENT,
        "reaping a dead client (after recounting its pins, before retiring its record)",
        "the dead record still claimed, the node held marker set",
        "the next reaper redoes it: recounts ignore dead rows, so the first half is idempotent",
        survivors=(Survivor.ATTACHED,),
        evidence=Counter.REAPED_CLIENTS,
    ),
    CrashRow(
        CrashPoint.IN_STRIPE_SECTION,
        "holding a stripe lock",
        "the lock released by the kernel, its held marker set",
        "the next holder of the stripe repairs it: crcs checked, dead reservations freed, "
        "reference counts recounted from live clients' pins",
        evidence=Counter.REPAIRS,
    ),
    CrashRow(
        CrashPoint.SLOT_RECORD_TORN,
        "writing a slot record (half of it written)",
        "a record that fails its crc, the stripe's held marker set",
        "the stripe repair quarantines it: STALE while live pins use its memory, else EMPTY; "
        "it is never served",
        evidence=Counter.CORRUPT_RECORDS,
        drops_an_entry=True,
    ),
    CrashRow(
        CrashPoint.RESERVED,
        "computing a key (RESERVED)",
        "a reservation whose semaphore the kernel released",
        "waiters wake (wait-for-zero); the first takes over with gen + 1",
        evidence=Counter.TAKEOVERS,
    ),
    CrashRow(
        CrashPoint.UNSEALED_PAYLOAD,
        "after writing a payload, before the seal",
        "an allocated, unsealed extent that nobody reads",
        "the takeover or the allocator frees the dead reservation's extent",
        evidence=Counter.TAKEOVERS,
    ),
    CrashRow(
        CrashPoint.HOLDING_PINS,
        "holding pins and views (or as the last process attached)",
        "pins in a dead client's record; if it was the last process, the whole namespace",
        "pins of dead clients never count; the record is reaped at the next attach, eviction "
        "or gc; the next first attacher wipes a namespace whose clients all died",
        evidence=Counter.REAPED_CLIENTS,
    ),
)

NATIVE_POINTS: Final = frozenset(
    {CrashPoint.IN_STRIPE_SECTION, CrashPoint.SLOT_RECORD_TORN, CrashPoint.HOLDING_PINS}
)  # reached inside native.c's transactions
_armed: CrashPoint | None = None
_stops = False


def arm(point: CrashPoint | None, *, stop: bool = False) -> None:
    """Make this process SIGKILL itself when it next reaches `point` (None disarms). With `stop`
    (a point reached in Python only), SIGSTOP itself there instead, once: a test looks at what
    it holds at that point (the bootstrap lock, say), then continues it with SIGCONT."""
    global _armed, _stops
    if stop and point in NATIVE_POINTS:
        raise ValueError(f"{point} is reached in native code, which can only be killed there")
    _armed, _stops = point, stop
    _native.arm(None if point is None or stop else point.value)  # the points native.c reaches


def reached(point: CrashPoint, tear: Callable[[], None] | None = None) -> None:
    """A crash hook: if this process is armed for `point`, run `tear` (the half-done write the
    point stands for), then SIGKILL this process (armed to stop: SIGSTOP it, and disarm)."""
    global _armed
    if _armed is point:
        if tear is not None:
            tear()
        if _stops:
            _armed = None
        os.kill(os.getpid(), signal.SIGSTOP if _stops else signal.SIGKILL)
