"""Waiting on another process's reservation: one slice of the wait, and what its end means."""

from __future__ import annotations

import os
import time
from typing import Final

from shmcache.errors import ComputeFailed, ComputeTimeout, SemaphoreTimeout
from shmcache.keys.key import EmbeddingCacheKey
from shmcache.node.index import NodeIndex
from shmcache.node.layout import Counter
from shmcache.node.slots import FailureKind

__all__ = ["failed_uncacheable", "wait_slice"]

WAIT_SLICE_S: Final = 1.0  # a waiter re-checks which key its slot holds at least this often


def wait_slice(node: NodeIndex, key: EmbeddingCacheKey, slot: int, deadline: float, timeout_s: float) -> bool:
    """Wait one slice on slot's reservation; False if the slice ran out before the deadline
    (the caller looks again: the slot may hold another key by now), `ComputeTimeout` (after
    `timeout_s` in all) past it."""
    try:
        node.wait(slot, max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
    except SemaphoreTimeout:
        if time.monotonic() < deadline:
            return False
        node.count(Counter.TIMEOUTS)
        owner = node.reservations.owner_pid(slot)
        by = f"pid {owner}" if owner != os.getpid() else "this process (a reservation of it not ended?)"
        raise ComputeTimeout(f"{key!r}: waited {timeout_s}s for the compute of {by}") from None
    return True


def failed_uncacheable(node: NodeIndex, key: EmbeddingCacheKey, slot: int, gen: int) -> bool:
    """After the reservation (slot, gen) we waited on ended: True if its value could not be
    stored (we compute it ourselves, uncached), `ComputeFailed` if its compute failed, False
    otherwise (look again)."""
    failure = node.failure(slot, gen)
    if failure is None:
        return False
    kind, message = failure
    if kind is FailureKind.UNCACHEABLE:
        return True
    raise ComputeFailed(f"{key!r}: the process computing it failed: {message}")
