"""The arena's first-fit allocator over a racy snapshot of extents, what that snapshot sees, and
what a full stripe gives up for a new key."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest

from shmcache import CacheConfig, EmbeddingCache
from shmcache.errors import ReservationLost
from shmcache.node._native import first_fit
from shmcache.node.layout import needle_of
from shmcache.process import releases
from shmcache.testing import sample_cache_config
from tests import workers
from tests.helpers import kill, spawn, wait_for
from tests.workers import expected_value, key_of


def fit(extents: list[tuple[int, int]], need: int, capacity: int = 1000) -> int | None:
    return first_fit(extents, need, capacity)


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


def _pressed(namespace: str, ttl_s: float | None) -> CacheConfig:
    """Room for three 1.2 MiB entries in the arena, and slots to spare: a fourth evicts one."""
    return sample_cache_config(
        namespace, capacity_bytes=4 << 20, max_entries=64, ways=8, return_mode="clone", ttl_s=ttl_s
    )


_ENTRY = np.ones(1200 * 1024, dtype=np.uint8)


def _first_fit_oracle(extents: list[tuple[int, int]], need: int, capacity: int) -> int | None:
    """The allocation rule read literally: extents by start, each gap from the furthest end so far."""
    start = 0
    for begin, end in sorted(extents):
        if begin >= start and begin - start >= need:
            return start
        start = max(start, end)
    return start if capacity - start >= need else None


@pytest.mark.parametrize("capacity", [1000, 128 << 20, 1 << 40, (1 << 64) - 1])
def test_first_fit_agrees_with_the_rule_for_any_extents(capacity: int) -> None:
    """The native sort (radix, from the lowest bit any start has) orders every kind of offset: a
    shuffled tiling of the arena with gaps of random sizes, plus phantoms, asked for one of the
    gaps' sizes (a mis-sorted pair hands out the wrong gap)."""
    rng = random.Random(capacity)
    for _ in range(200):
        unit = rng.choice([1, 64, 4096, max(1, capacity >> 12)])  # the last reaches the top bits
        extents, gaps, at, count = [], [0], 0, rng.randrange(1, 400)
        while len(extents) < count:
            gap, size = rng.choice([0, 0, rng.randrange(1, 64)]) * unit, rng.randrange(1, 64) * unit
            if at + gap + size > capacity:
                break
            gaps.append(gap)
            extents.append((at + gap, at + gap + size))
            at += gap + size
        extents += [(begin, begin) for begin, _ in rng.sample(extents, len(extents) // 8)]  # phantoms
        rng.shuffle(extents)
        need = max(1, rng.choice(gaps))
        assert fit(extents, need, capacity) == _first_fit_oracle(extents, need, capacity)


def test_arena_pressure_evicts_the_least_recently_used_entry(namespace: str) -> None:
    with EmbeddingCache(_pressed(namespace, None)) as cache:
        for name in "abc":
            cache.put(key_of(name), _ENTRY)
            time.sleep(0.01)
        assert cache.get(key_of("a")) is not None  # b is now the one unused the longest
        cache.put(key_of("d"), _ENTRY)
        assert cache.get(key_of("b")) is None
        assert all(cache.get(key_of(name)) is not None for name in "acd")
        stats = cache.stats()
        assert (stats["entries"], stats["evictions_lru"], stats["evictions_ttl"]) == (3, 1, 0)


def test_arena_pressure_evicts_an_expired_entry_as_a_ttl_eviction(namespace: str) -> None:
    with EmbeddingCache(_pressed(namespace, 0.5)) as cache:
        cache.put(key_of("old"), _ENTRY)
        time.sleep(0.6)  # expired: the first candidate, whatever the others' ages
        for name in "bcd":
            cache.put(key_of(name), _ENTRY)
        assert all(cache.get(key_of(name)) is not None for name in "bcd")
        stats = cache.stats()
        assert (stats["entries"], stats["evictions_lru"], stats["evictions_ttl"]) == (3, 0, 1)


_SMALL = np.ones(1, dtype=np.uint8)


def test_a_full_stripe_evicts_the_expired_first_and_quarantines_a_damaged_record(
    namespace: str,
) -> None:
    config = sample_cache_config(
        namespace, capacity_bytes=8 << 20, max_entries=4, ways=4, return_mode="clone", ttl_s=1.0
    )  # one stripe of four ways: a fifth key evicts
    with EmbeddingCache(config) as cache:
        cache.put(key_of("a"), _SMALL)
        time.sleep(1.05)  # a expired (the others are not, unless this machine stalls for a second)
        for name in "bcd":
            cache.put(key_of(name), _SMALL)
            time.sleep(0.002)
        cache.put(key_of("e"), _SMALL)
        assert cache.get(key_of("a")) is None
        stats = cache.stats()
        assert (stats["evictions_ttl"], stats["evictions_lru"], stats["corrupt_records"]) == (1, 0, 0)
        b = cache._node.lookups.lookup(needle_of(key_of("b")), 0)
        assert b is not None
        cache._node.slots.array["offset"][b.slot] += 64  # a stray write into b's record: its crc fails
        cache.put(key_of("f"), _SMALL)  # the claim quarantines b and takes its freed slot: no eviction
        stats = cache.stats()
        assert (stats["evictions_ttl"], stats["evictions_lru"], stats["corrupt_records"]) == (1, 0, 1)
        assert [cache.get(key_of(n)) is not None for n in "bcdef"] == [False, True, True, True, True]


def test_eviction_looks_again_at_every_candidate_when_the_best_few_were_pinned_since_the_look(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first look orders the best 8 candidates only. Each of them is pinned (for real, by this
    process) between that lock-free look and its stripe lock, so none can be evicted: the second
    look, over every candidate, evicts the ninth least recently used instead of failing the put."""
    config = sample_cache_config(
        namespace, capacity_bytes=1 << 20, max_entries=256, ways=8, return_mode="clone"
    )  # room for twelve 80 KiB entries: a thirteenth evicts one
    value = np.ones(80 << 10, dtype=np.uint8)
    with EmbeddingCache(config) as cache:
        node = cache._node
        for i in range(12):
            cache.put(key_of(f"e{i}"), value)
            time.sleep(0.002)  # distinct access stamps: e0 is the least recently used
        names = {}
        for i in range(12):
            hit = node.lookups.lookup(needle_of(key_of(f"e{i}")), 0)
            assert hit is not None
            names[hit.slot] = f"e{i}"
        pinned = []
        evict = node.allocator._evict

        def pinned_since_the_look(slot: int) -> bool:
            if len(pinned) < 8:
                pinned.append(node.lookups.lookup(needle_of(key_of(names[slot])), 1))
            return evict(slot)

        monkeypatch.setattr(node.allocator, "_evict", pinned_since_the_look)
        cache.put(key_of("new"), value)
        assert sorted(hit.slot for hit in pinned if hit is not None) == sorted(
            slot for slot, name in names.items() if name in {f"e{i}" for i in range(8)}
        )
        present = [name for name in (f"e{i}" for i in range(12)) if cache.contains(key_of(name))]
        assert present == [f"e{i}" for i in range(12) if i != 8] and cache.contains(key_of("new"))
        assert cache.stats()["evictions_lru"] == 1
        node.release([(hit.slot, hit.gen) for hit in pinned if hit is not None])


def test_a_shrunk_reservation_gives_its_tail_to_the_next_allocation(namespace: str) -> None:
    """`NodeIndex.shrink` (a pull whose object was smaller than the extent guessed for it): the
    reservation keeps the head of its extent and the tail is free for the next allocation at once;
    it never grows an extent, and a reservation that is not ours any more is refused."""
    with EmbeddingCache(sample_cache_config(namespace, capacity_bytes=1 << 20)) as cache:
        node = cache._node
        with cache.reserve(key_of("a")) as a, cache.reserve(key_of("b")) as b:
            assert a.owned and b.owned
            assert node.allocate(a.slot, a.gen, 600 << 10) == 0
            node.shrink(a.slot, a.gen, 100_000)  # to 100_032: extents end on 64 bytes
            node.shrink(a.slot, a.gen, 900 << 10)  # no-op: a shrink never grows
            assert node.allocate(b.slot, b.gen, 800 << 10) == 100_032  # did not fit after 600 KiB
            with pytest.raises(ReservationLost):
                node.shrink(a.slot, a.gen + 1, 0)
            node.shrink(a.slot, a.gen, 0)  # all of it back: b's next extent starts at 0
            assert node.allocate(b.slot, b.gen, 64) == 0


def test_views_dropped_just_before_a_compute_never_keep_it_from_evicting(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead view's pin is released by the release thread after a pause (a few milliseconds; a
    second here, so no release happens by the pause's end). An allocation that finds the arena
    full releases it first, so a process that drops each value before computing the next stores
    them all (the arena holds three)."""
    monkeypatch.setattr(releases, "_BATCH_S", 1.0)
    config = sample_cache_config(
        namespace, capacity_bytes=4 << 20, max_entries=64, ways=8, return_mode="view"
    )
    with EmbeddingCache(config) as cache:
        for i in range(8):
            value = cache.get_or_compute(key_of(f"v{i}"), lambda: _ENTRY)
            del value  # dead: its pin is queued for the release thread
        stats = cache.stats()
        assert (stats["puts"], stats["uncacheable"], stats["evictions_lru"]) == (8, 0, 5)
        assert [cache.contains(key_of(f"v{i}")) for i in range(8)] == [False] * 5 + [True] * 3


def test_views_dropped_just_before_a_compute_never_keep_its_stripe_full(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for slots: every way of the only stripe is referenced by a view that died a moment
    ago; the claim releases those pins and evicts instead of computing uncached."""
    monkeypatch.setattr(releases, "_BATCH_S", 1.0)
    config = sample_cache_config(namespace, capacity_bytes=8 << 20, max_entries=4, ways=4, return_mode="view")
    with EmbeddingCache(config) as cache:
        for i in range(6):
            value = cache.get_or_compute(key_of(f"s{i}"), lambda: _SMALL)
            del value
        stats = cache.stats()
        assert (stats["puts"], stats["uncacheable"], stats["evictions_lru"]) == (6, 0, 2)
