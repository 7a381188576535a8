"""A compute that calls back into the cache for its own key fails at once with
`ComputeReentered`, instead of waiting on itself until compute_timeout_s; other threads of the
same process still wait for it, and a compute may ask for other keys."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest
import torch

from shmcache import (
    CacheConfig,
    ComputeReentered,
    EmbeddingCache,
    EmbeddingCacheKey,
    EncoderPreprocessingConfig,
)

TIMEOUT_S = 20.0  # a wait on itself would end in ComputeTimeout after this, and fail the test


def key(pconfig: EncoderPreprocessingConfig, name: str) -> EmbeddingCacheKey:
    return EmbeddingCacheKey.from_raw_bytes(name.encode(), pconfig, modality="image")


@pytest.fixture
def cache(config: CacheConfig) -> Iterator[EmbeddingCache]:
    with EmbeddingCache(dataclasses.replace(config, compute_timeout_s=TIMEOUT_S)) as opened:
        yield opened


def test_a_compute_asking_for_its_own_key_fails_and_frees_it(
    cache: EmbeddingCache, pconfig: EncoderPreprocessingConfig
) -> None:
    k = key(pconfig, "self")
    with pytest.raises(ComputeReentered, match="its own compute"):
        cache.get_or_compute(k, lambda: cache.get_or_compute(k, lambda: torch.ones(2)))
    stats = cache.stats()
    assert stats["reserved"] == 0 and stats["entries"] == 0 and stats["compute_failures"] == 1
    assert torch.equal(cache.get_or_compute(k, lambda: torch.ones(2)), torch.ones(2))  # free again
    with cache.reserve(key(pconfig, "reserved")) as res, res.computing():
        with pytest.raises(ComputeReentered):
            cache.reserve(key(pconfig, "reserved"))
        res.commit(torch.zeros(1))
    assert issubclass(ComputeReentered, RecursionError)


def test_a_compute_may_ask_for_other_keys(cache: EmbeddingCache, pconfig: EncoderPreprocessingConfig) -> None:
    inner, outer = key(pconfig, "inner"), key(pconfig, "outer")

    def compute_outer() -> torch.Tensor:
        return cache.get_or_compute(inner, lambda: torch.ones(3)) * 2

    assert torch.equal(cache.get_or_compute(outer, compute_outer), torch.full((3,), 2.0))
    assert cache.stats()["entries"] == 2


def test_another_thread_still_waits_for_the_compute(
    cache: EmbeddingCache, pconfig: EncoderPreprocessingConfig
) -> None:
    k = key(pconfig, "shared")
    computing, release = threading.Event(), threading.Event()
    results: list[object] = []

    def slow() -> torch.Tensor:
        computing.set()
        assert release.wait(TIMEOUT_S)
        return torch.arange(4)

    def waiter() -> None:
        try:
            results.append(cache.get_or_compute(k, lambda: torch.zeros(4)))
        except BaseException as exc:  # reported below
            results.append(exc)

    owner = threading.Thread(target=lambda: cache.get_or_compute(k, slow))
    owner.start()
    assert computing.wait(TIMEOUT_S)
    other = threading.Thread(target=waiter)
    other.start()
    other.join(0.5)
    assert other.is_alive()  # waiting for the owner's compute, not failed
    release.set()
    owner.join(TIMEOUT_S)
    other.join(TIMEOUT_S)
    assert len(results) == 1 and torch.equal(results[0], torch.arange(4))  # type: ignore[arg-type]
    assert cache.stats()["computes"] == 1
