"""A process near its `max_pins_per_process` limit: the pins of views it dropped a moment ago
(still queued for the release thread) are released before anything is refused, and a request
reference that cannot be taken is an error, never silently skipped."""

from __future__ import annotations

import logging

import pytest
import torch

from shmcache import CacheConfig, EmbeddingCache
from shmcache.errors import PinLimitReached
from shmcache.integrations.encoder import CachedEncoder
from shmcache.node.audit import audit
from shmcache.process import releases
from shmcache.testing import sample_cache_config
from tests.encoders import batch, build
from tests.test_native import node_of
from tests.workers import expected_value, key_of

PINS = 16  # the smallest limit


def _fill_with_dead_views(cache: EmbeddingCache) -> None:
    """Take every pin record with views, then drop them: their pins wait in the release queue."""
    names = [f"dead{i}" for i in range(PINS)]
    for name in names:
        cache.put(key_of(name), expected_value(name, 16))
    views = [cache.get(key_of(name)) for name in names]
    assert cache.stats()["references"] >= PINS  # with the pins of values dropped before
    del views


def test_dead_views_pins_are_released_before_a_request_is_refused(
    config: CacheConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a compute with a request id returned its value without the request's reference
    (`cleanup_request` found 0), and a `get` raised `CapacityError`, while every pin record was
    held by views already dropped."""
    monkeypatch.setattr(releases, "_BATCH_S", 5.0)  # the release thread stays out of it
    small = sample_cache_config(config.namespace, max_pins_per_process=PINS)
    with EmbeddingCache(small) as cache:
        _fill_with_dead_views(cache)
        value = cache.get_or_compute(key_of("new"), lambda: expected_value("new", 16), request_id="h")
        assert cache.cleanup_request("h") == 1
        del value

        _fill_with_dead_views(cache)
        cache.put(key_of("put"), expected_value("put", 16), request_id="p")
        assert cache.cleanup_request("p") == 1

        _fill_with_dead_views(cache)
        assert cache.get(key_of("new"), request_id="g") is not None
        assert cache.cleanup_request("g") == 1

        _fill_with_dead_views(cache)
        got = cache.get_many([key_of("new"), key_of("put")], request_id="m")
        assert all(v is not None for v in got)
        assert cache.cleanup_request("m") == 2
        del got


def test_a_request_past_the_pin_limit_is_refused_and_the_value_stays_cached(config: CacheConfig) -> None:
    """Every pin record held by a live request: a compute for another request stores its value
    for everyone but raises `PinLimitReached` (before: it returned the value and its request held
    nothing), as a `put` and a `get` for it do; without a request id the caller gets its own
    value, as before. `PinLimitReached` is a `CapacityError`."""
    small = sample_cache_config(config.namespace, max_pins_per_process=PINS)
    with EmbeddingCache(small) as cache:
        names = [f"held{i}" for i in range(PINS)]
        for name in names:
            cache.put(key_of(name), expected_value(name, 16), request_id="held")
        with pytest.raises(PinLimitReached, match="max_pins_per_process") as refused:
            cache.get_or_compute(key_of("late"), lambda: expected_value("late", 16), request_id="late")
        assert torch.equal(refused.value.value, expected_value("late", 16))  # what it computed
        with pytest.raises(PinLimitReached, match="max_pins_per_process"):
            cache.put(key_of("later"), expected_value("later", 16), request_id="late")
        with pytest.raises(PinLimitReached, match="max_pins_per_process"):
            cache.get(key_of("late"), request_id="late")
        assert cache.contains(key_of("late")) and cache.contains(key_of("later"))
        assert cache.cleanup_request("late") == 0
        own = cache.get_or_compute(key_of("own"), lambda: expected_value("own", 16))
        assert bool((own == expected_value("own", 16)).all()) and cache.contains(key_of("own"))
        assert cache.stats()["references"] == PINS
        assert cache.cleanup_request("held") == PINS
        assert cache.get(key_of("late"), request_id="late") is not None
        assert cache.cleanup_request("late") == 1
        # a refusal leaves its stripe section cleanly: no repair follows (one did, once the limit's
        # error became a subclass of CapacityError)
        assert cache.stats()["repairs"] == 0 and audit(node_of(cache)) == []


def test_the_encoder_hook_returns_what_a_request_cannot_hold_and_warns(
    config: CacheConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """A serving engine's forward is not failed by the pin limit: the outputs go out without the
    request's reference, and a warning says why (before: silently; and a batch of hits raised)."""
    small = sample_cache_config(config.namespace, max_pins_per_process=PINS)
    with EmbeddingCache(small) as cache:
        for i in range(PINS):
            cache.put(key_of(f"held{i}"), expected_value(f"held{i}", 16), request_id="held")
        encoder = build("whisper")
        hook = CachedEncoder(
            cache, encoder, items=encoder.items, preprocessing=encoder.preprocessing(), modality="audio"
        )
        args, kwargs = batch("whisper", [1, 2])
        want = encoder(*args, **kwargs)
        with caplog.at_level(logging.WARNING, logger="shmcache"), cache.request("r"):
            got = hook(*args, **kwargs)  # computed and stored, the commits cannot hold them
            again = hook(*args, **kwargs)  # hits its lookup cannot pin: run without the cache
        assert torch.equal(got, want) and torch.equal(again, want) and cache.cleanup_request("r") == 0
        assert "without their request's reference" in caplog.text
        assert cache.cleanup_request("held") == PINS
