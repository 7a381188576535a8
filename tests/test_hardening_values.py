"""Every value type `put` accepts round-trips through a real cache, across processes: 0-d arrays
keep shape () (and never share a key with their 1-d twins), and `HiddenStatePrefix` comes back
with numpy or torch hidden states as it was stored, never as a miss counted corrupt."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
import pytest
import torch

from shmcache import CacheConfig, EmbeddingCache, EmbeddingCacheKey, HiddenStatePrefix
from shmcache.process import mappings
from shmcache.testing import sample_preprocessing
from tests.helpers import spawn


def _key(tensor: Any) -> EmbeddingCacheKey:
    return EmbeddingCacheKey.from_decoded_tensor(tensor, sample_preprocessing(), modality="image")


def _raw(name: str) -> EmbeddingCacheKey:
    return EmbeddingCacheKey.from_raw_bytes(name.encode(), sample_preprocessing(), modality="audio")


def _values() -> dict[str, Any]:
    """name -> value: 0-d and 1-d arrays of both libraries, and hidden-state prefixes."""
    return {
        "np-0d": np.array(3.0),
        "np-1d": np.array([3.0]),
        "torch-0d": torch.tensor(3.0),
        "torch-1d": torch.tensor([3.0]),
        "np-0d-int": np.array(7, dtype=np.int16),
        "hsp-numpy": HiddenStatePrefix(
            [1, 2, 3], np.arange(12, dtype=np.float32).reshape(3, 4), {"layer": 7}
        ),
        "hsp-torch": HiddenStatePrefix(
            [4, 5], torch.arange(8, dtype=torch.bfloat16).reshape(2, 4), {"x": "y"}
        ),
        "hsp-numpy-0d": HiddenStatePrefix([], np.array(1.5), {}),
    }


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, HiddenStatePrefix):
        return (
            isinstance(got, HiddenStatePrefix)
            and got.token_ids == want.token_ids
            and got.metadata == want.metadata
            and _same(got.hidden_states, want.hidden_states)
        )
    if isinstance(want, np.ndarray):
        return (
            isinstance(got, np.ndarray)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and (got == want).all()
        )
    return (
        isinstance(got, torch.Tensor)
        and got.dtype == want.dtype
        and got.shape == want.shape
        and torch.equal(got, want)
    )


def reader(config: CacheConfig, results: Any) -> None:
    """Another process: get every value twice (the second time is a repeat hit) and report."""
    with EmbeddingCache(config) as cache:
        report = {}
        for name, want in _values().items():
            first, second = cache.get(_raw(name)), cache.get(_raw(name))
            report[name] = (_same(first, want), _same(second, want))
        report["corrupt"] = cache.stats()["corrupt_records"]
        results.put(report)


def test_zero_d_arrays_and_hidden_states_round_trip_across_processes(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        for name, value in _values().items():
            cache.put(_raw(name), value)
        for name, want in _values().items():
            for _ in range(2):  # a first hit, then a repeat hit (an alias of the first)
                got = cache.get(_raw(name))
                assert _same(got, want), (name, got)
        results = mp.get_context("spawn").Queue()
        proc = spawn(reader, config, results)
        report = results.get(timeout=120)
        proc.join(30)
        assert report.pop("corrupt") == 0
        assert report == {name: (True, True) for name in _values()}
        assert cache.stats()["corrupt_records"] == 0


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_zero_d_array_has_its_own_key_and_entry(config: CacheConfig, lib: str) -> None:
    make = np.array if lib == "numpy" else torch.tensor
    scalar, vector = make(3.0), make([3.0])
    assert _key(scalar) != _key(vector)
    with EmbeddingCache(config) as cache:
        cache.put(_key(scalar), scalar)
        assert cache.get(_key(vector)) is None  # the false hit of the issue
        cache.put(_key(vector), vector)
        assert tuple(cache.get(_key(scalar)).shape) == ()
        assert tuple(cache.get(_key(vector)).shape) == (1,)


def test_a_key_stored_again_is_read_as_its_new_value_after_its_view_died(config: CacheConfig) -> None:
    """A process keeps the head it parsed for the entry it last delivered of a key, and reuses it
    only for that very entry (slot, generation): the key stored anew (another shape and dtype)
    is read as stored, through `get` and `get_many`."""
    short = CacheConfig(**{**config.__dict__, "ttl_s": 0.2})
    key = _raw("restored")
    with EmbeddingCache(short) as cache:
        cache.put(key, torch.arange(16, dtype=torch.float32).reshape(4, 4))
        first = cache.get(key)
        assert first is not None and first.shape == (4, 4)
        del first  # the view dies: the process keeps only what it parsed
        cache.flush_releases()
        time.sleep(0.3)  # idle for longer than the TTL: the entry expired
        assert cache.get(key) is None
        new = np.arange(8, dtype=np.int16).reshape(2, 4)
        cache.put(key, new)
        assert _same(cache.get(key), new)
        [again] = cache.get_many([key])
        assert _same(again, new)
        assert cache.stats()["corrupt_records"] == 0


def test_a_process_remembers_a_bounded_number_of_dead_views_and_every_live_one(
    config: CacheConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a process keeps of a delivered entry after its views died (for a cheap re-delivery)
    is bounded: a process that meets ever new keys does not grow; a live view is never forgotten
    (its key stays a repeat hit)."""
    monkeypatch.setattr(mappings, "REMEMBERED", 8)
    with EmbeddingCache(config) as cache:
        keys = [_raw(f"many-{i}") for i in range(60)]
        for key in keys:
            cache.put(key, np.arange(4, dtype=np.float32))
        held = cache.get(keys[0])
        for key in keys[1:]:
            assert cache.get(key) is not None  # dropped at once
            assert len(cache._views._local) <= 16
        process_hits = cache.stats()["hits_process"]
        assert _same(cache.get(keys[0]), np.arange(4, dtype=np.float32))
        assert cache.stats()["hits_process"] == process_hits + 1
        del held
