"""EmbeddingCache in one process: API semantics, zero copy, references, TTL, eviction, integrity."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from shmcache import (
    CacheConfig,
    CapacityError,
    ComputeFailed,
    ComputeTimeout,
    EmbeddingCache,
    EmbeddingCacheKey,
    EncoderPreprocessingConfig,
    HiddenStatePrefix,
    InvalidKey,
    LayoutMismatch,
    ReservationLost,
)
from tests.helpers import (
    arena_page,
    file_offset,
    kernel_objects,
    physical_page,
    sealed_slot,
    settle,
)


def key(pconfig: EncoderPreprocessingConfig, name: str) -> EmbeddingCacheKey:
    return EmbeddingCacheKey.from_raw_bytes(name.encode(), pconfig, modality="image")


def test_disabled_cache_is_a_pass_through(namespace: str, pconfig: EncoderPreprocessingConfig) -> None:
    before = kernel_objects()
    calls = []
    with EmbeddingCache(CacheConfig(namespace=namespace)) as cache:
        for _ in range(3):
            assert (
                cache.get_or_compute(key(pconfig, "a"), lambda: calls.append(1) or torch.ones(2)).sum() == 2
            )
        assert cache.get(key(pconfig, "a")) is None
        cache.put(key(pconfig, "a"), torch.ones(2))
        assert cache.stats() == {} and cache.cleanup_request("r") == 0
    assert len(calls) == 3
    assert kernel_objects() == before  # nothing was created


def test_get_put_get_or_compute(config: CacheConfig, pconfig: EncoderPreprocessingConfig) -> None:
    with EmbeddingCache(config) as cache:
        k = key(pconfig, "img")
        assert cache.get(k) is None
        value = torch.randn(16, 32).to(torch.bfloat16)
        got = cache.get_or_compute(k, lambda: value)
        assert torch.equal(got, value)
        assert torch.equal(cache.get_or_compute(k, lambda: pytest.fail("recomputed")), value)
        cache.put(k, torch.zeros(3))  # first writer wins
        assert torch.equal(cache.get(k), value)
        stats = cache.stats()
        assert stats["computes"] == 1 and stats["entries"] == 1 and stats["puts"] == 1
        assert stats["hits_node"] + stats["hits_process"] == 2


def test_a_put_is_not_counted_as_a_lookup(config: CacheConfig, pconfig: EncoderPreprocessingConfig) -> None:
    with EmbeddingCache(config) as cache:
        cache.put(key(pconfig, "new"), torch.ones(2))  # a new key: stored, not a miss
        cache.put(key(pconfig, "new"), torch.zeros(2))  # an existing key: kept, not a hit
        assert cache.get(key(pconfig, "absent")) is None  # a lookup: one miss
        stats = cache.stats()
        assert (stats["puts"], stats["misses"], stats["hits_node"] + stats["hits_process"]) == (1, 1, 0)


def test_every_value_type_through_the_cache(config: CacheConfig, pconfig: EncoderPreprocessingConfig) -> None:
    values = {
        "tensor": torch.randn(4, 5).t(),
        "ndarray": np.arange(10, dtype=np.int16),
        "tokens": [5, 6, 7],
        "prefix": HiddenStatePrefix([1, 2], torch.randn(2, 8), {"voice": "v1"}),
        "dict": {"a": torch.randn(3), "b": torch.randint(0, 9, (2, 2))},
    }
    with EmbeddingCache(config) as cache:
        for name, value in values.items():
            cache.put(key(pconfig, name), value)
        for name, value in values.items():
            got = cache.get(key(pconfig, name))
            if name == "tensor":
                assert torch.equal(got, value)
            elif name == "ndarray":
                np.testing.assert_array_equal(got, value)
                assert not got.flags.writeable
            elif name == "tokens":
                assert got == value
            elif name == "prefix":
                assert got.token_ids == value.token_ids and torch.equal(
                    got.hidden_states, value.hidden_states
                )
            else:
                assert all(torch.equal(got[n], value[n]) for n in value)


def test_hits_are_zero_copy_views_of_the_shared_arena(
    config: CacheConfig, pconfig: EncoderPreprocessingConfig
) -> None:
    """A view's pages are the arena's own physical pages (its copy-on-write mapping copies
    nothing until written), and a repeat hit aliases the first view."""
    with EmbeddingCache(config) as cache:
        cache.put(key(pconfig, "big"), torch.randn(1024, 256))
        first = cache.get(key(pconfig, "big"))
        second = cache.get(key(pconfig, "big"))
        assert first.data_ptr() == second.data_ptr()
        path = f"/dev/shm/shmcache.{os.geteuid()}.{config.namespace}.arena"
        shared = np.frombuffer(cache._segments.arena, dtype=np.uint8)
        float(first.sum())  # read every page (a read maps the file's page; a write would copy it)
        for address in (first.data_ptr(), first[-1].data_ptr()):
            assert physical_page(address) == arena_page(shared, file_offset(address, path)) != 0
        del first, second, shared


def test_clone_mode_returns_private_copies(config: CacheConfig, pconfig: EncoderPreprocessingConfig) -> None:
    import dataclasses

    with EmbeddingCache(dataclasses.replace(config, return_mode="clone")) as cache:
        cache.put(key(pconfig, "x"), torch.ones(4))
        got = cache.get(key(pconfig, "x"))
        got += 1
        assert torch.equal(cache.get(key(pconfig, "x")), torch.ones(4))
        assert cache.stats()["references"] == 0


def test_request_refs_survive_ttl_and_pressure_until_cleanup(
    namespace: str, pconfig: EncoderPreprocessingConfig
) -> None:
    config = CacheConfig(
        enable_embedding_cache=True,
        namespace=namespace,
        capacity_bytes=1 << 20,
        max_entries=16,
        ways=16,
        ttl_s=0.2,
        return_mode="clone",
    )
    with EmbeddingCache(config) as cache:
        kept = key(pconfig, "voice-ref")
        cache.get_or_compute(kept, lambda: torch.full((64 * 1024,), 7, dtype=torch.uint8), request_id="tts-1")
        time.sleep(0.3)  # past the TTL
        for i in range(40):  # pressure: 40 x 64 KiB through a 1 MiB arena
            cache.put(key(pconfig, f"filler-{i}"), torch.zeros(64 * 1024, dtype=torch.uint8))
        stats = cache.stats()
        assert stats["evictions_lru"] > 0 and stats["references"] == 1
        # expired: a miss for new lookups, but its memory stays for the request that holds it
        assert cache.get(kept) is None
        assert cache.stats()["stale"] == 1
        assert cache.cleanup_request("tts-1") == 1
        stats = cache.stats()
        assert stats["stale"] == 0 and stats["references"] == 0 and stats["evictions_ttl"] >= 1


def test_referenced_entry_is_not_evicted_by_lru(namespace: str, pconfig: EncoderPreprocessingConfig) -> None:
    config = CacheConfig(
        enable_embedding_cache=True,
        namespace=namespace,
        capacity_bytes=1 << 20,
        max_entries=16,
        ways=16,
        return_mode="clone",
    )
    with EmbeddingCache(config) as cache:
        pinned = key(pconfig, "pinned")
        original = torch.randint(0, 255, (200 * 1024,), dtype=torch.uint8)
        cache.put(pinned, original, request_id="req")
        for i in range(30):
            cache.put(key(pconfig, f"f{i}"), torch.zeros(100 * 1024, dtype=torch.uint8))
        assert torch.equal(cache.get(pinned), original)
        cache.cleanup_request("req")
        for i in range(30, 60):
            cache.put(key(pconfig, f"f{i}"), torch.zeros(100 * 1024, dtype=torch.uint8))
        assert cache.get(pinned) is None  # evictable once released, and evicted


def test_lru_order_by_entries(namespace: str, pconfig: EncoderPreprocessingConfig) -> None:
    config = CacheConfig(
        enable_embedding_cache=True,
        namespace=namespace,
        capacity_bytes=8 << 20,
        max_entries=4,
        ways=4,
        return_mode="clone",
    )
    with EmbeddingCache(config) as cache:
        for name in "abcd":
            cache.put(key(pconfig, name), torch.ones(1))
            time.sleep(0.002)
        cache.get(key(pconfig, "a"))  # a becomes most recent; b is now least recent
        cache.put(key(pconfig, "e"), torch.ones(1))
        assert cache.get(key(pconfig, "b")) is None
        assert all(cache.get(key(pconfig, n)) is not None for n in "acde")
        assert cache.stats()["evictions_lru"] == 1


def test_capacity_errors(namespace: str, pconfig: EncoderPreprocessingConfig) -> None:
    config = CacheConfig(
        enable_embedding_cache=True, namespace=namespace, capacity_bytes=1 << 20, max_entries=16, ways=16
    )
    with EmbeddingCache(config) as cache:
        huge = torch.zeros(2 << 20, dtype=torch.uint8)
        with pytest.raises(CapacityError, match="exceeds capacity"):
            cache.put(key(pconfig, "huge"), huge)
        got = cache.get_or_compute(key(pconfig, "huge"), lambda: huge)
        assert got is huge  # returned, not cached
        assert cache.get(key(pconfig, "huge")) is None
        assert cache.stats()["uncacheable"] == 2
        # every byte referenced: a put that needs room fails clearly, nothing is evicted from under a reader
        held = [
            cache.get_or_compute(key(pconfig, f"h{i}"), lambda: torch.zeros(300 * 1024, dtype=torch.uint8))
            for i in range(3)
        ]
        with pytest.raises(CapacityError, match="referenced"):
            cache.put(key(pconfig, "one-more"), torch.zeros(300 * 1024, dtype=torch.uint8))
        del held


def test_shm_too_small_is_a_clear_error(namespace: str) -> None:
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(CapacityError, match="--shm-size"):
        EmbeddingCache(
            CacheConfig(enable_embedding_cache=True, namespace=namespace, capacity_bytes=free + (1 << 30))
        )


def test_layout_mismatch_while_attached(config: CacheConfig) -> None:
    import dataclasses

    with EmbeddingCache(config):
        with pytest.raises(LayoutMismatch, match="capacity_bytes"):
            EmbeddingCache(dataclasses.replace(config, capacity_bytes=config.capacity_bytes * 2))
        with pytest.raises(
            LayoutMismatch, match="hash_algorithm: namespace has 'xxh3_128', config has 'sha256'"
        ):
            EmbeddingCache(dataclasses.replace(config, hash_algorithm="sha256"))
    with EmbeddingCache(dataclasses.replace(config, capacity_bytes=config.capacity_bytes * 2)) as again:
        assert again.stats()["capacity_bytes"] == config.capacity_bytes * 2  # nobody attached: recreated


def test_key_of_another_algorithm_is_rejected(
    config: CacheConfig, pconfig: EncoderPreprocessingConfig
) -> None:
    with EmbeddingCache(config) as cache:
        foreign = EmbeddingCacheKey.from_raw_bytes(b"x", pconfig, modality="image", algorithm="sha256")
        with pytest.raises(InvalidKey, match="sha256"):
            cache.get(foreign)
        with pytest.raises(InvalidKey):
            cache.get("not a key")  # type: ignore[arg-type]
        assert cache.key_from_raw_bytes(b"x", pconfig, modality="image").algorithm == "xxh3_128"


def test_corrupt_slot_record_is_quarantined_not_served(
    config: CacheConfig, pconfig: EncoderPreprocessingConfig
) -> None:
    with EmbeddingCache(config) as cache:
        k = key(pconfig, "victim")
        cache.put(k, torch.ones(8))
        settle()
        node = cache._node
        slot = sealed_slot(cache)
        node.slots.array["offset"][slot] += 64  # a stray write into the index
        assert cache.get(k) is None
        assert cache.stats()["corrupt_records"] == 1
        assert torch.equal(cache.get_or_compute(k, lambda: torch.full((8,), 2.0)), torch.full((8,), 2.0))


def test_corrupt_entry_bytes_are_a_miss(config: CacheConfig, pconfig: EncoderPreprocessingConfig) -> None:
    with EmbeddingCache(config) as cache:
        k = key(pconfig, "victim")
        cache.put(k, torch.ones(8))
        settle()
        node = cache._node
        slot = sealed_slot(cache)
        offset = int(node.slots.array["offset"][slot])
        cache._segments.arena[offset + 20 : offset + 24] = b"\xff\xff\xff\xff"  # entry header: digest region
        cache._views.forget()
        assert cache.get(k) is None
        assert cache.stats()["corrupt_records"] >= 1


def test_reservation_api(config: CacheConfig, pconfig: EncoderPreprocessingConfig) -> None:
    with EmbeddingCache(config) as cache:
        k = key(pconfig, "r")
        with cache.reserve(k, request_id="req") as res:
            assert res.owned and res.value is None
            got = res.commit(torch.arange(4))
        assert torch.equal(got, torch.arange(4))
        with pytest.raises(ReservationLost):
            res.commit(torch.arange(4))
        with cache.reserve(k) as hit:
            assert not hit.owned and torch.equal(hit.value, torch.arange(4))
        other = key(pconfig, "abandoned")
        with pytest.raises(RuntimeError), cache.reserve(other):
            raise RuntimeError("encoder OOM")
        with cache.reserve(other) as again:  # the key is free again
            assert again.owned
            again.abandon()
        assert cache.cleanup_request("req") == 1


def test_compute_failure_frees_the_key(config: CacheConfig, pconfig: EncoderPreprocessingConfig) -> None:
    with EmbeddingCache(config) as cache:
        k = key(pconfig, "f")

        def boom() -> torch.Tensor:
            raise ValueError("bad image")

        with pytest.raises(ValueError, match="bad image"):
            cache.get_or_compute(k, boom)
        assert torch.equal(cache.get_or_compute(k, lambda: torch.ones(1)), torch.ones(1))
        assert cache.stats()["compute_failures"] == 1
        with pytest.raises(TypeError):
            cache.get_or_compute(key(pconfig, "g"), lambda: "not a tensor")
        assert cache.get_or_compute(key(pconfig, "g"), lambda: [1]) == [1]
    assert issubclass(ComputeFailed, RuntimeError)


def test_a_wait_on_a_reservation_of_this_process_says_so(
    config: CacheConfig, pconfig: EncoderPreprocessingConfig
) -> None:
    """A reservation this thread holds and reserves again (a compute that asks for its own key)
    can only time out: the error names this process, not a pid to go and look for."""
    import dataclasses

    with (
        EmbeddingCache(dataclasses.replace(config, compute_timeout_s=0.3)) as cache,
        cache.reserve(key(pconfig, "mine")) as res,
    ):
        with pytest.raises(ComputeTimeout, match="this process"):
            cache.reserve(key(pconfig, "mine"))
        res.abandon("done")


def test_repeat_hits_are_counted_once_each_with_or_without_a_request(
    config: CacheConfig, pconfig: EncoderPreprocessingConfig
) -> None:
    """A repeat hit counts itself in its native check, unless a request's reference may still
    fail it (then after that reference); a put's look at a live view counts nothing."""
    with EmbeddingCache(config) as cache:
        k = key(pconfig, "counted")
        cache.put(k, torch.ones(4))
        held = cache.get(k)  # a node hit: the view is alive from here on
        assert cache.get(k) is not None and cache.get(k, request_id="r") is not None
        cache.put(k, torch.ones(4))  # first writer wins: not a lookup
        stats = cache.stats()
        assert (stats["hits_node"], stats["hits_process"], stats["misses"]) == (1, 2, 0)
        assert cache.cleanup_request("r") == 1
        del held
