"""The native hit path (shmcache/node/native.c): batched lookups and existence checks, this
process's pin bookkeeping, and the hand-back to the locked Python path."""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from shmcache import (
    ArgumentTypeError,
    CacheClosed,
    CacheConfig,
    CapacityError,
    EmbeddingCache,
    InvalidKey,
)
from shmcache.errors import LockTimeout
from shmcache.kernel import _mapping, copy_into
from shmcache.kernel.cowmap import CowMapper
from shmcache.node.audit import audit
from shmcache.node.crashpoints import CrashPoint
from shmcache.node.index import NodeIndex
from shmcache.node.layout import needle_of
from shmcache.node.slots import SealedEntry
from shmcache.testing import sample_cache_config
from tests import workers
from tests.helpers import kill, settle, spawn, wait_for
from tests.workers import expected_value, key_of


def node_of(cache: EmbeddingCache) -> NodeIndex:
    return cache._node


def test_get_many_answers_in_key_order_and_pins_like_get(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        names = [f"k{i}" for i in range(10)]
        for name in names[::2]:
            cache.put(key_of(name), expected_value(name))
        before = cache.stats()
        values = cache.get_many([key_of(name) for name in [*names, "k0"]], request_id="r")
        assert [value is not None for value in values] == [i % 2 == 0 for i in range(10)] + [True]
        for name, value in zip([*names, "k0"], values, strict=True):
            if value is not None:
                assert torch.equal(value, expected_value(name))
        stats = cache.stats()
        assert (stats["hits_node"] - before["hits_node"], stats["misses"] - before["misses"]) == (6, 5)
        assert cache.cleanup_request("r") == 6  # one request reference per hit, as `get` takes
        del values, value
        settle()
        assert cache.stats()["references"] == 0
        assert audit(node_of(cache)) == []


def test_get_many_with_a_live_view_is_a_repeat_hit(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        cache.put(key_of("a"), expected_value("a"))
        held = cache.get(key_of("a"))
        assert held is not None
        again = cache.get_many([key_of("a"), key_of("b")])
        assert again[0] is not None and again[0].data_ptr() == held.data_ptr() and again[1] is None
        assert cache.stats()["hits_process"] == 1


def test_get_many_refuses_a_bad_key_before_pinning_anything(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        cache.put(key_of("a"), expected_value("a"))
        with pytest.raises(InvalidKey):
            cache.get_many([key_of("a"), "not a key"])  # type: ignore[list-item]
        assert node_of(cache).pins.held() == {}
        assert cache.stats()["hits_node"] == 0


def test_get_many_out_of_pin_records_gives_every_pin_back(config: CacheConfig) -> None:
    small = sample_cache_config(config.namespace, max_pins_per_process=16)
    with EmbeddingCache(small) as cache:
        names = [f"k{i}" for i in range(20)]
        for name in names:
            cache.put(key_of(name), expected_value(name, 16))
        with pytest.raises(CapacityError, match="max_pins_per_process"):
            cache.get_many([key_of(name) for name in names], request_id="r")
        assert node_of(cache).pins.held() == {}
        assert cache.stats()["references"] == 0 and cache.cleanup_request("r") == 0
        assert (
            len([v for v in cache.get_many([key_of(name) for name in names[:7]], "r") if v is not None]) == 7
        )


def test_contains_is_lock_free_and_agrees_with_get(config: CacheConfig) -> None:
    with EmbeddingCache(sample_cache_config(config.namespace, ttl_s=0.5)) as cache:
        cache.put(key_of("a"), expected_value("a"))
        assert cache.contains(key_of("a")) and not cache.contains(key_of("b"))
        assert cache.contains_many([key_of("b"), key_of("a"), key_of("a")]) == [False, True, True]
        assert cache.stats()["references"] == 0 and cache.stats()["hits_node"] == 0  # no pin, no count
        time.sleep(0.8)
        assert cache.contains_many([key_of("a")]) == [False]  # expired: a miss for everyone
        assert cache.get(key_of("a")) is None


def test_a_stripe_whose_holder_died_inside_is_repaired_by_the_next_lookup(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        victim = spawn(workers.crash_at, config, CrashPoint.IN_STRIPE_SECTION.value)
        victim.join(60)
        assert victim.exitcode == -9
        before = cache.stats()
        assert cache.get(key_of("a")) is None  # the native lookup hands the stripe to the repair
        after = cache.stats()
        assert after["repairs"] == before["repairs"] + 1
        assert after["misses"] == before["misses"] + 1  # counted once, on the locked path
        assert torch.equal(
            cache.get_or_compute(key_of("a"), lambda: expected_value("a")), expected_value("a")
        )
        cache.gc()
        assert audit(node_of(cache)) == []


def test_pin_bookkeeping_matches_a_model_under_random_churn(config: CacheConfig) -> None:
    """Adds and removes in random order, with collisions in the native hash table and every pin
    record in use at times; the shared pin records must say what a plain dict says."""
    pins_per_process = 16
    with EmbeddingCache(
        sample_cache_config(config.namespace, max_pins_per_process=pins_per_process)
    ) as cache:
        pins = node_of(cache).pins
        rng = random.Random(7)
        model: dict[tuple[int, int], int] = {}
        for _ in range(5000):
            entry = (rng.randrange(40), rng.randrange(1, 4))
            if rng.random() < 0.5:
                n = rng.randrange(1, 3)
                if entry not in model and len(model) == pins_per_process:
                    with pytest.raises(CapacityError):
                        pins.add(*entry, n)
                    continue
                pins.add(*entry, n)
                model[entry] = model.get(entry, 0) + n
            else:
                n = rng.randrange(1, 4)
                assert pins.remove(*entry, n) == min(n, model.get(entry, 0))
                if entry in model:
                    model[entry] -= min(n, model[entry])
                    if not model[entry]:
                        del model[entry]
            assert pins.held() == model
            assert pins.spare == pins_per_process - len(model)
        row = node_of(cache).client
        shared = {(int(p["slot"]), int(p["gen"])): int(p["count"]) for p in pins.array[row] if p["count"]}
        assert shared == model
        for entry, n in list(model.items()):
            pins.remove(*entry, n)


def test_a_lookup_that_waited_through_a_detach_raises_cache_closed(config: CacheConfig) -> None:
    """A thread's lookup waits for a stripe while another thread closes the cache: once it gets
    the stripe, it must not pin through a client record it no longer has."""
    with EmbeddingCache(config) as keeper:  # keeps the namespace alive and holds the stripe
        keeper.put(key_of("a"), expected_value("a"))
        cache = EmbeddingCache(config)
        outcome: list[object] = []

        def look() -> None:
            try:
                outcome.append(cache.get(key_of("a")))
            except CacheClosed as exc:
                outcome.append(exc)

        section = keeper._node.sections.stripe(keeper._node.stripe_of(needle_of(key_of("a"))))
        with section:
            waiter = threading.Thread(target=look)
            waiter.start()
            time.sleep(0.3)  # the lookup waits for the stripe, the GIL released
            cache.close()
        waiter.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], CacheClosed), outcome
        assert audit(node_of(keeper)) == []


def test_a_views_mapping_reports_its_death_once_after_the_last_derived_array(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "arena", os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, 1 << 16)
    mapper = CowMapper(fd)
    calls: list[str] = []
    view = mapper.watched_view(5000, 1000, calls.append, "released")
    other, third = mapper.watched_views([(0, 10), (20, 10)], calls.append, ["other", "third"])
    plain, *_ = mapper.view_many([(40, 10)])
    assert mapper.watched() == 3 and mapper.is_watched(view) and mapper.is_watched(third)
    assert not mapper.is_watched(plain) and not mapper.disarm(plain)
    with pytest.raises(TypeError):
        mapper.watched_views([(0, 10), (20, 10)], calls.append, ["one arg for two views"])
    with pytest.raises(TypeError):
        mapper.disarm(np.zeros(4, dtype=np.uint8))  # not a view
    assert mapper.disarm(other) and not mapper.is_watched(other) and not mapper.disarm(other)
    assert mapper.watched() == 2
    derived = view[10:20]
    del view, other, plain
    gc.collect()
    assert calls == []  # a derived array still reads the mapping; `other` was disarmed
    del derived
    assert calls == ["released"]
    del third
    assert calls == ["released", "third"] and mapper.watched() == 2
    mapper.close()


def test_the_pool_keeps_at_most_64_dead_views_mappings_and_256_mib(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "arena", os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, 300 << 20)  # sparse: nothing is written
    mapper = CowMapper(fd)
    views = [mapper.view(i << 16, 4096) for i in range(70)]
    del views
    gc.collect()
    assert mapper.idle() == 64  # the oldest six were unmapped
    large = mapper.view(0, 260 << 20)
    del large
    gc.collect()
    assert mapper.idle() == 64  # too large to keep: unmapped
    mapper.close()
    assert mapper.idle() == 0
    with pytest.raises(CacheClosed):
        mapper.view(0, 4096)
    with pytest.raises(RuntimeError, match="once"):
        _mapping.Pool(3).__init__(4)  # type: ignore[misc]


def test_idle_mappings_are_unmapped_when_a_view_needs_their_room(tmp_path: Path) -> None:
    path = tmp_path / "arena"
    with open(path, "wb") as f:
        f.truncate(300 << 20)  # sparse
    child = spawn(workers.map_past_idle_mappings, str(path))
    child.join(60)
    assert child.exitcode == 0


@pytest.mark.parametrize("size", [0, 1, 63, 4096, (2 << 20) - 1, 2 << 20, (2 << 20) + 77])
def test_copy_into_writes_every_byte_at_any_alignment_and_nothing_past_them(size: int) -> None:
    """Small copies are memcpy, from 2 MiB on non-temporal stores after an unaligned head."""
    source = np.random.default_rng(size).integers(0, 256, size + 16, dtype=np.uint8)
    for shift in (0, 1, 15):
        destination = np.full(size + 64, 0xAA, dtype=np.uint8)
        copy_into(memoryview(destination)[shift:], memoryview(source)[16 - shift : 16 - shift + size])
        assert np.array_equal(destination[shift : shift + size], source[16 - shift : 16 - shift + size])
        assert (destination[:shift] == 0xAA).all() and (destination[shift + size :] == 0xAA).all()


def test_copy_into_refuses_what_does_not_fit_or_cannot_be_written() -> None:
    destination = np.zeros(8, dtype=np.uint8)
    with pytest.raises(ValueError, match="9 bytes do not fit in 8"):
        copy_into(destination, b"x" * 9)
    assert not destination.any()
    with pytest.raises(BufferError):
        copy_into(b"readonly", b"x")
    with pytest.raises(TypeError, match="2 arguments"):
        copy_into(destination)  # type: ignore[call-arg]


@pytest.mark.parametrize("enabled", [True, False])
def test_batch_calls_refuse_what_is_not_a_list_of_keys(config: CacheConfig, enabled: bool) -> None:
    with EmbeddingCache(config if enabled else CacheConfig(namespace=config.namespace)) as cache:
        for call in (cache.get_many, cache.contains_many, cache.try_reserve_many):
            for bad in (5, None, key_of("a")):  # a single key is the likely mistake
                with pytest.raises(ArgumentTypeError, match="list or tuple"):
                    call(bad)  # type: ignore[operator]
        assert cache.get_many((key_of("a"),)) == [None]  # a tuple is fine
        if enabled:
            assert node_of(cache).pins.held() == {}


def test_a_damaged_access_stamp_sorts_last_among_eviction_candidates(config: CacheConfig) -> None:
    """The access stamp is outside the record's crc: a NaN there (a damaged segment) must neither
    break the eviction order's sort nor put that entry first."""
    with EmbeddingCache(config) as cache:
        for name in ("old", "damaged", "new"):
            cache.put(key_of(name), expected_value(name))
            time.sleep(0.01)
        node = node_of(cache)
        slots = {name: node.lookups.lookup(needle_of(key_of(name)), 0) for name in ("old", "damaged", "new")}
        assert all(hit is not None for hit in slots.values())
        node.native.touch(slots["damaged"].slot, float("nan"))  # type: ignore[union-attr]
        expected = [slots[name].slot for name in ("old", "new", "damaged")]  # type: ignore[union-attr]
        for limit in (1, 2, 3, 100):  # the selection of the best few and the sort agree
            assert node.native.evictable(time.monotonic(), limit) == ([], expected[:limit], limit >= 3)


def test_the_first_look_at_eviction_candidates_selects_what_the_full_sort_orders(config: CacheConfig) -> None:
    """`evictable(now, limit)` with a small limit selects the best few (insertion into the best so
    far) instead of sorting every candidate: the same slots in the same order, ties by slot."""
    rng = random.Random(5)
    with EmbeddingCache(config) as cache:
        node = node_of(cache)
        for i in range(40):
            cache.put(key_of(f"e{i}"), expected_value(f"e{i}"))
        slots = [node.lookups.lookup(needle_of(key_of(f"e{i}")), 0) for i in range(40)]
        node.release([(hit.slot, hit.gen) for hit in slots if hit is not None])
        for _ in range(20):
            for hit in slots:  # stamps with ties, in random order, about half of them damaged (NaN)
                assert hit is not None
                node.native.touch(hit.slot, rng.choice([float(rng.randrange(8)), float("nan")]))
            reserved, everything, complete = node.native.evictable(time.monotonic(), 1000)
            assert reserved == [] and len(everything) == 40 and complete
            for limit in (1, 2, 7, 8, 39, 40, 64):
                assert node.native.evictable(time.monotonic(), limit) == ([], everything[:limit], limit >= 40)
        with pytest.raises(ValueError, match="at least 1"):
            node.native.evictable(time.monotonic(), 0)


def test_a_held_stripe_lock_times_out_naming_its_holder(config: CacheConfig) -> None:
    """Another thread holds the key's stripe section: a get waits (the GIL released: the holder
    thread runs meanwhile) and gives up after lock_timeout_s with LockTimeout naming the holder's
    pid; once the section is left, the get works."""
    with EmbeddingCache(dataclasses.replace(config, lock_timeout_s=0.3)) as cache:
        cache.put(key_of("a"), expected_value("a"))
        node = node_of(cache)
        inside, leave = threading.Event(), threading.Event()

        def hold() -> None:
            with node.sections.stripe(node.stripe_of(key_of("a").record)):
                inside.set()
                leave.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        assert inside.wait(10)
        started = time.monotonic()
        with pytest.raises(LockTimeout, match=f"holder pid {os.getpid()}"):
            cache.get(key_of("a"))
        assert 0.3 <= time.monotonic() - started < 10
        leave.set()
        holder.join(10)
        assert torch.equal(cache.get(key_of("a")), expected_value("a"))
        assert cache.stats()["repairs"] == 0


def test_a_get_waiting_on_a_killed_holders_lock_gets_it_at_once(config: CacheConfig, tmp_path: Path) -> None:
    """A process SIGKILLed inside a stripe section while a get waits for that section: the kernel
    hands the lock over (robust mutex, owner died), the get repairs the stripe and answers,
    long before the lock timeout."""
    with EmbeddingCache(dataclasses.replace(config, lock_timeout_s=60.0)) as cache:
        cache.put(key_of("a"), expected_value("a"))
        ready = tmp_path / "ready"
        victim = spawn(workers.hold_stripe_section, config, "a", str(ready))
        try:
            wait_for(ready.exists, what="the victim inside the stripe section")
            answers: list[object] = []
            getter = threading.Thread(target=lambda: answers.append(cache.get(key_of("a"))))
            getter.start()
            time.sleep(0.3)
            assert getter.is_alive() and not answers  # waiting for the lock
            killed = time.monotonic()
        finally:
            kill(victim)
        getter.join(30)
        assert time.monotonic() - killed < 5 and not getter.is_alive()
        assert isinstance(answers[0], torch.Tensor) and torch.equal(answers[0], expected_value("a"))
        assert cache.stats()["repairs"] == 1
        cache.gc()  # reaps the victim's client record
        assert audit(node_of(cache)) == []


def test_a_native_hit_is_a_sealed_entry_like_one_made_in_python(config: CacheConfig) -> None:
    """The native lookup makes its answer as an instance of `SealedEntry` (a NamedTuple): equal
    to, and hashing like, the same record made in Python; an Index refuses a type of another shape."""
    with EmbeddingCache(config) as cache:
        cache.put(key_of("a"), expected_value("a"))
        node = node_of(cache)
        hit = node.lookups.lookup(needle_of(key_of("a")), 0)
        assert type(hit) is SealedEntry
        made = SealedEntry(hit.slot, hit.gen, hit.offset, hit.size, True, hit.attachment)
        assert hit == made and hash(hit) == hash(made) and {hit, made} == {made}
        assert hit.pinned and hit.size > 0

        class Pair(NamedTuple):
            slot: int
            gen: int

        with pytest.raises(TypeError, match="6 fields"):
            node.layout.native(cache._segments.index, None, 1.0, Pair)
