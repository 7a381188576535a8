"""The arena's first-fit allocator over a racy snapshot of extents, and what that snapshot sees."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from shmcache import CacheConfig, EmbeddingCache
from shmcache.node.allocator import first_fit
from shmcache.node.layout import needle_of
from tests import workers
from tests.helpers import kill, spawn, wait_for
from tests.workers import expected_value, key_of


def fit(extents: list[tuple[int, int]], need: int, capacity: int = 1000) -> int | None:
    starts = np.array([s for s, _ in extents], dtype=np.int64)
    ends = np.array([e for _, e in extents], dtype=np.int64)
    return first_fit(starts, ends, need, capacity)


def test_first_fit_basics() -> None:
    assert fit([], 1000) == 0
    assert fit([], 1001) is None
    assert fit([(0, 100), (300, 400)], 150) == 100
    assert fit([(0, 100), (300, 400)], 250) == 400
    assert fit([(0, 100), (300, 400)], 601) is None


def test_half_freed_records_never_hide_a_live_extent() -> None:
    # a record read while being freed can look like [0, 0) or [start, start): the gap after it must
    # still start after every live extent that begins before it (this was a real overlap bug)
    assert fit([(0, 200), (0, 0), (300, 400)], 100) == 200
    assert fit([(0, 0), (0, 200), (300, 400)], 100) == 200
    assert fit([(0, 500), (100, 100), (600, 700)], 50) == 500
    # a phantom [0, old size) only makes the allocator more conservative
    assert fit([(0, 900), (0, 100)], 100) == 900


def test_random_snapshots_never_overlap_live_extents() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        capacity = 10_000
        cuts = np.sort(rng.choice(capacity, size=8, replace=False))
        live = [(int(a), int(b)) for a, b in zip(cuts[::2], cuts[1::2], strict=True)]
        phantoms = [(int(x), int(x)) for x in rng.integers(0, capacity, 3)] + [(0, 0)]
        extents = live + phantoms
        rng.shuffle(extents)
        need = int(rng.integers(1, 3000))
        offset = fit(extents, need, capacity)
        if offset is not None:
            assert offset + need <= capacity
            assert all(offset + need <= a or offset >= b for a, b in live), (extents, need, offset)


def test_the_allocator_never_sees_an_entry_whose_record_is_rewritten_as_free(
    config: CacheConfig, tmp_path: Path
) -> None:
    """References rewrite a hot entry's slot record all the time, and the allocator reads the slot
    table without stripe locks: it must never find that entry's memory free (struct's pack_into
    zeroes a record before it writes it, which handed live memory out twice)."""
    with EmbeddingCache(config) as cache:
        cache.put(key_of("hot"), expected_value("hot"))
        node = cache._node
        info = node.lookups.lookup(needle_of(key_of("hot")), 0)
        assert info is not None and info.offset == 0  # the first entry: the gap before it is none
        ready, stop = tmp_path / "ready", tmp_path / "stop"
        churner = spawn(workers.churn_refs, config, "hot", str(ready), str(stop))
        try:
            wait_for(ready.exists, what="the churner's start")
            looks = 0
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                offset = node.allocator.gap(64)
                assert offset is not None and offset >= info.size, f"live extent handed out at {offset}"
                looks += 1
            assert looks > 1000
        finally:
            stop.touch()
            churner.join(30)
            kill(churner)
