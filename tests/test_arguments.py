"""Every public call of `EmbeddingCache` checks its arguments first: one typed error (a
`ShmCacheError` that is also the matching builtin), and no pin, reservation or entry changed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from shmcache import (
    ArgumentTypeError,
    CacheConfig,
    EmbeddingCache,
    EmbeddingCacheKey,
    EncoderPreprocessingConfig,
    InvalidKey,
    KeyTypeError,
    RequestIdTypeError,
    UnsupportedValue,
)
from tests.test_cache_local import key


def test_an_unhashable_request_id_is_a_typed_error_and_takes_no_pin(
    config: CacheConfig, pconfig: EncoderPreprocessingConfig
) -> None:
    with EmbeddingCache(config) as cache:
        k = key(pconfig, "held")
        cache.put(k, torch.ones(8))
        for call in (
            lambda: cache.get(k, request_id=["r"]),
            lambda: cache.put(k, torch.ones(8), request_id={"r": 1}),
            lambda: cache.get_or_compute(k, lambda: torch.ones(8), request_id=["r"]),
            lambda: cache.cleanup_request(["r"]),
        ):
            with pytest.raises(RequestIdTypeError):
                call()
        cache.flush_releases()
        assert cache.stats()["references"] == 0


def test_bad_arguments_are_typed_errors_and_change_nothing(
    config: CacheConfig, pconfig: EncoderPreprocessingConfig
) -> None:
    with EmbeddingCache(config) as cache:
        stored, fresh = key(pconfig, "stored"), key(pconfig, "fresh")
        cache.put(stored, torch.ones(8))
        with pytest.raises(UnsupportedValue):
            cache.put(stored, "a string")  # refused though the key is stored already
        with pytest.raises(ArgumentTypeError, match="compute_fn must be callable"):
            cache.get_or_compute(fresh, torch.ones(8))  # type: ignore[arg-type]
        with pytest.raises(ArgumentTypeError, match="ReservationTicket"):
            cache.adopt({"slot": 0}, fresh)  # type: ignore[arg-type]
        res = cache.try_reserve(fresh)
        assert res is not None and res.owned
        forged = dataclasses.replace(res.hand_over(), lease=("name", "token"))  # a tuple, a str token
        with pytest.raises(ArgumentTypeError, match="lease must be a Lease"):
            cache.adopt(forged, fresh)
        ticket = dataclasses.replace(forged, lease=None)
        for field, bad in (("slot", 1.5), ("slot", None), ("gen", True), ("giver", "0")):
            with pytest.raises(ArgumentTypeError, match="must be ints"):
                cache.adopt(dataclasses.replace(ticket, **{field: bad}), fresh)
        for field, bad in (("slot", 10**6), ("slot", -1), ("gen", 0), ("giver", 10**6)):
            with pytest.raises(InvalidKey, match="names no reservation"):  # IndexError, TypeError before
                cache.adopt(dataclasses.replace(ticket, **{field: bad}), fresh)
        res.abandon("not adopted")  # the hand-over ends here: nothing was adopted
        cache.flush_releases()
        stats = cache.stats()
        assert (stats["references"], stats["reserved"], stats["entries"]) == (0, 0, 1)
        assert torch.equal(cache.get(stored), torch.ones(8)) and cache.get(fresh) is None


def _misuses(
    cache: EmbeddingCache, k: EmbeddingCacheKey
) -> list[tuple[Callable[[], object], type[Exception]]]:
    """A call with an argument of the wrong type, and the error it must raise."""
    return [
        (lambda: cache.get(None), KeyTypeError),  # type: ignore[arg-type]
        (lambda: cache.get(k, request_id=["r"]), RequestIdTypeError),
        (lambda: cache.get_many([k, None]), KeyTypeError),  # type: ignore[list-item]
        (lambda: cache.put(None, torch.ones(2)), KeyTypeError),  # type: ignore[arg-type]
        (lambda: cache.get_or_compute("k", lambda: torch.ones(2)), KeyTypeError),  # type: ignore[arg-type]
        (lambda: cache.reserve(None), KeyTypeError),  # type: ignore[arg-type]
        (lambda: cache.try_reserve(k, request_id={}), RequestIdTypeError),
        (lambda: cache.try_reserve_many([None]), KeyTypeError),  # type: ignore[list-item]
        (lambda: cache.contains("abc"), KeyTypeError),  # type: ignore[arg-type]
        (lambda: cache.contains_many([k, None]), KeyTypeError),  # type: ignore[list-item]
        (lambda: cache.hold(None, "r"), KeyTypeError),  # type: ignore[arg-type]
        (lambda: cache.hold(k, None), RequestIdTypeError),  # type: ignore[arg-type]
        (lambda: cache.cleanup_request(None), RequestIdTypeError),  # type: ignore[arg-type]
        (lambda: cache.cleanup_request([1]), RequestIdTypeError),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_a_wrong_argument_type_is_the_same_type_error_enabled_or_not(
    config: CacheConfig, pconfig: EncoderPreprocessingConfig, enabled: bool
) -> None:
    """What works with the cache switched off works with it on: the pass-through checks too."""
    settings = config if enabled else dataclasses.replace(config, enable_embedding_cache=False)
    with EmbeddingCache(settings) as cache:
        k = key(pconfig, "stored")
        cache.put(k, torch.ones(8))
        for call, error in _misuses(cache, k):
            with pytest.raises(error):
                call()
        if not enabled:  # a pass-through never reads a value (a CUDA one would be copied to check it)
            assert cache.put(k, {1}) is None  # type: ignore[func-returns-value, arg-type]
        else:
            with pytest.raises(UnsupportedValue):
                cache.put(k, {1})  # type: ignore[arg-type]
            cache.flush_releases()
            stats = cache.stats()
            assert (stats["references"], stats["reserved"], stats["entries"]) == (0, 0, 1)


def test_abandon_with_a_reason_that_is_no_str_keeps_the_reservation(
    config: CacheConfig, pconfig: EncoderPreprocessingConfig
) -> None:
    with EmbeddingCache(config) as cache:
        res = cache.reserve(key(pconfig, "fresh"))
        with pytest.raises(ArgumentTypeError, match="reason must be a str"):
            res.abandon(123)  # type: ignore[arg-type]
        assert cache.stats()["reserved"] == 1 and res.owned  # still this caller's to end
        res.abandon("given up")
        assert cache.stats()["reserved"] == 0
