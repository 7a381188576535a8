"""The connector's scheduler side without an engine: a real node cache and vLLM's own records of a
request's items (tests/test_vllm_engines.py runs whole engines)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

from shmcache import CacheConfig, EmbeddingCache
from shmcache.integrations.vllm.scheduler import SchedulerSide
from shmcache.integrations.vllm.settings import KeyMaker
from shmcache.testing import sample_preprocessing
from tests.workers import expected_value


@dataclass
class _Request:
    """The two fields of vLLM's `Request` the scheduler side reads."""

    request_id: str
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)


def _request(request_id: str, *identifiers: str) -> _Request:
    features = [
        MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset=10 * i, length=4))
        for i, identifier in enumerate(identifiers)
    ]
    return _Request(request_id, features)


def test_a_request_with_the_same_image_twice_reserves_it_once_and_is_not_deferred(
    config: CacheConfig,
) -> None:
    with EmbeddingCache(config) as cache:
        side = SchedulerSide(cache, KeyMaker(sample_preprocessing(), config))
        request = _request("r1", "img", "img", "other")
        assert side.ensure(request, 0)  # before the fix: deferred at every step (its own reservation)
        assert side.ensure(request, 0)
        assert cache.stats()["reserved"] == 2  # "img" and "other", once each
        side.finished(request)
        assert cache.stats()["reserved"] == 0


def test_a_request_waiting_for_another_process_holds_nothing(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache, EmbeddingCache(config) as other:
        side = SchedulerSide(cache, KeyMaker(sample_preprocessing(), config))
        keys = KeyMaker(sample_preprocessing(), config)
        busy = other.try_reserve(keys("busy", "image"))  # another engine computes "busy"
        assert busy is not None and busy.owned
        request = _request("r1", "free", "busy")
        assert not side.ensure(request, 0)  # deferred: "free", reserved in the same call, given back
        assert cache.stats()["reserved"] == 1  # only the other engine's
        busy.commit(expected_value("busy"))
        assert side.ensure(request, 0)  # "busy" is sealed now; "free" is reserved here
        assert cache.stats()["reserved"] == 1
        side.close()
        assert cache.stats()["reserved"] == 0
