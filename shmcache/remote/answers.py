"""Mooncake's answers: what each return code of a call means, and for the memory a `get_into`
was given, whether a transfer may still write there (see ../shared/MOONCAKE.md for the codes).

When a failed transfer stops writing (read in Mooncake's store client, transfer_task.cpp): it
answers TRANSFER_FAIL only once every slice of the transfer ended (completed or failed), unless
its own wait (`MOONCAKE_WAIT_S`, timed on the wall clock) ran out first, or, over RDMA, a submit
failed after some reads were posted. So on TCP a TRANSFER_FAIL that came back well before that
wait leaves nothing writing (`CallStart.failure_settled`; a publisher that died answers so at
once). Any other failure, an answer we stopped waiting for, or a transport other than TCP, may
leave slices in flight.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "BUFFER_TOO_SMALL",
    "MASTER_GONE",
    "MOONCAKE_WAIT_S",
    "NOT_AVAILABLE",
    "OBJECT_NOT_FOUND",
    "RAISED",
    "REPLICA_IS_NOT_READY",
    "SETTLED_WITHIN_S",
    "TIMED_OUT",
    "TRANSFER_FAIL",
    "CallStart",
    "Fetched",
    "Transfer",
    "batch_clean",
    "get_into_outcome",
    "nothing_in_flight",
    "taints",
    "transferred",
]

# the object's put is still running: answered by the master's lookup, before any transfer
# (Mooncake's real_client.cpp: get_size, get_into, batch_get_into)
REPLICA_IS_NOT_READY = -703
# Mooncake codes that mean "not available" (a miss), never data: see ../shared/MOONCAKE.md
NOT_AVAILABLE = {-200, REPLICA_IS_NOT_READY, -704, -706, -707, -800, -900, -901}
MASTER_GONE = {-900, -901}  # RPC_FAIL, RPC timeout: an outage begins
OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600
TRANSFER_FAIL = -800  # also what Mooncake answers when it gave up waiting (60 s) on slices in flight
TIMED_OUT: Any = object()  # `_call`'s answer when Mooncake did not answer within remote_timeout_s
RAISED: Any = object()  # `_call`'s answer when the call raised: what it did to its memory is unknown
MOONCAKE_WAIT_S = 60.0  # Mooncake's wait for a transfer's slices before it gives up on them
SETTLED_WITHIN_S = MOONCAKE_WAIT_S - 5.0  # a TRANSFER_FAIL answered sooner came before that wait
# ran out (with room for its millisecond clock)


class Transfer(enum.Enum):
    """How a `get_into` left the memory it was given."""

    DONE = "done"  # the object's bytes are there
    QUIET = "quiet"  # no object arrived, and nothing writes there: a miss, the master gone, an ended failure
    LARGER = "larger"  # the object is larger than the memory given: nothing was transferred
    TAINTED = "tainted"  # failed or timed out: it may still be written, so it is never reused


class Fetched(NamedTuple):
    """A `get_into`'s outcome and, when DONE, the object's size (checked: at most the room given)."""

    outcome: Transfer
    nbytes: int = 0


def transferred(rc: Any) -> bool:
    """Whether a `get_into` answer means the whole object arrived: its size (at most the room
    given; nothing is written past it). Nothing writes into that memory any more."""
    return isinstance(rc, int) and rc >= 0


@dataclass(frozen=True)
class CallStart:
    """When a transfer call started, on both clocks: Mooncake times its wait on the wall clock,
    which may jump forward while our monotonic clock does not."""

    monotonic: float
    wall: float

    @classmethod
    def now(cls) -> CallStart:
        return cls(time.monotonic(), time.time())

    def failure_settled(self, tcp: bool) -> bool:
        """Whether a TRANSFER_FAIL answered now means every slice of that transfer ended: on TCP,
        answered before Mooncake's own wait could have run out on either clock."""
        elapsed = max(time.monotonic() - self.monotonic, time.time() - self.wall)
        return tcp and elapsed < SETTLED_WITHIN_S


def get_into_outcome(rc: Any, room: int, *, failure_settled: bool = False) -> Fetched:
    """How a `get_into` given `room` bytes left them when it answered `rc` (or TIMED_OUT);
    `failure_settled`: a TRANSFER_FAIL answer came after every slice ended (`CallStart`)."""
    if transferred(rc):
        # more than the room given (never seen): the memory past it is not ours to trust
        return Fetched(Transfer.DONE, rc) if rc <= room else Fetched(Transfer.TAINTED)
    if rc == BUFFER_TOO_SMALL:
        return Fetched(Transfer.LARGER)
    return Fetched(Transfer.TAINTED if taints(rc, failure_settled=failure_settled) else Transfer.QUIET)


def nothing_in_flight(rc: Any) -> bool:
    """Whether a `get_into` that outlived its wait left nothing writing into its memory when it
    answered `rc`: the whole object arrived, or no transfer ran (a miss, a refusal, the master
    gone). A failed transfer may leave slices in flight (when it answered is not known here)."""
    return transferred(rc) or not taints(rc)


def batch_clean(rcs: Any, *, failure_settled: bool = False) -> bool:
    """Whether a `batch_get_into` answer leaves no transfer writing into its buffer."""
    return isinstance(rcs, list) and not any(taints(rc, failure_settled=failure_settled) for rc in rcs)


def taints(rc: Any, *, failure_settled: bool = False) -> bool:
    """Whether a failed `get_into` answer may leave a transfer writing into its memory: a call we
    stopped waiting for or that raised, a failed transfer (unless `failure_settled`: see the
    module docstring), or an unexpected code. BUFFER_TOO_SMALL is answered before any transfer
    starts (checked: the memory given stays as it was)."""
    if rc is TIMED_OUT or rc is RAISED:
        return True
    if rc == TRANSFER_FAIL:
        return not failure_settled
    return isinstance(rc, int) and rc < 0 and rc not in NOT_AVAILABLE and rc != BUFFER_TOO_SMALL
