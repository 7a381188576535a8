"""Ready-made pool workers that stop at a crash point, for `ProcessPool.crash` to SIGKILL there.

Each runs in a spawned worker with an open cache, reaches its point, reports it with `checkpoint`
and blocks until killed: `computing` (inside get_or_compute's compute, holding the reservation),
`reserved` (after `reserve`, before committing) and `holding-view` (holding a view and a request
reference on a cached entry).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from shmcache.keys.key import EmbeddingCacheKey
from shmcache.process.cache import EmbeddingCache
from shmcache.testing.pool import checkpoint

__all__ = ["CRASH_AT", "POINTS", "crash_after_reserve", "crash_holding_view", "crash_while_computing"]


def crash_while_computing(cache: EmbeddingCache, key: EmbeddingCacheKey) -> None:
    """Reserve `key` through get_or_compute and stop inside the compute."""
    cache.get_or_compute(key, lambda: checkpoint("computing", pause=True))


def crash_after_reserve(cache: EmbeddingCache, key: EmbeddingCacheKey) -> None:
    """Take `key`'s reservation with `reserve` and stop before committing."""
    reservation = cache.reserve(key)
    assert reservation.owned, "the key was already cached"
    checkpoint("reserved", pause=True)


def crash_holding_view(cache: EmbeddingCache, key: EmbeddingCacheKey) -> None:
    """Get `key` (cached already) with a request reference and stop while holding the view."""
    view = cache.get(key, request_id="crash-holding-view")
    assert view is not None, "the key is not cached"
    checkpoint("holding-view", pause=True)


CRASH_AT: Final[dict[str, Callable[[EmbeddingCache, EmbeddingCacheKey], None]]] = {
    "computing": crash_while_computing,
    "reserved": crash_after_reserve,
    "holding-view": crash_holding_view,
}
POINTS: Final = tuple(CRASH_AT)  # the crash points `ProcessPool.crash` knows
