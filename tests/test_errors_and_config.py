"""Errors are typed, subclass their builtins and pickle; CacheConfig validates every field."""

from __future__ import annotations

import inspect
import pickle

import pytest

from shmcache import CacheConfig, ConfigTypeError, InvalidConfig, errors
from shmcache.errors import ShmCacheError

ERROR_CLASSES = [
    obj
    for _, obj in inspect.getmembers(errors, inspect.isclass)
    if issubclass(obj, ShmCacheError) and obj is not ShmCacheError
]


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=[c.__name__ for c in ERROR_CLASSES])
def test_errors_pickle_and_subclass_a_builtin(cls: type[ShmCacheError]) -> None:
    err = cls("what went wrong")
    restored = pickle.loads(pickle.dumps(err))
    assert type(restored) is cls and str(restored) == "what went wrong"
    builtins = [
        b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (object, BaseException, Exception)
    ]
    assert builtins, f"{cls.__name__} subclasses no specific builtin"


def test_builtin_pairs_from_the_design() -> None:
    assert issubclass(errors.ComputeTimeout, TimeoutError)
    assert issubclass(errors.CapacityError, MemoryError)
    assert issubclass(errors.LayoutMismatch, ValueError)


def test_cache_config_defaults_are_a_pass_through() -> None:
    assert CacheConfig().enable_embedding_cache is False


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("enable_embedding_cache", 1, ConfigTypeError),
        ("namespace", "bad/name", InvalidConfig),
        ("namespace", "", InvalidConfig),
        ("capacity_bytes", 1024, InvalidConfig),
        ("capacity_bytes", "1G", ConfigTypeError),
        ("max_entries", 4, InvalidConfig),
        ("ttl_s", 0, InvalidConfig),
        ("ttl_s", float("inf"), InvalidConfig),
        ("compute_timeout_s", -1, InvalidConfig),
        ("return_mode", "copy", InvalidConfig),
        ("hash_algorithm", "md5", InvalidConfig),
        ("mode", 0o644 | 0o4000, InvalidConfig),
        ("mode", 0o400, InvalidConfig),
    ],
)
def test_cache_config_rejects_bad_fields_naming_them(
    field: str, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=field.split("_")[0]):
        CacheConfig(**{field: value})  # type: ignore[arg-type]


def test_stage_config_schema() -> None:
    config = CacheConfig.from_stage_config({"enable_embedding_cache": True, "capacity_bytes": 64 << 20})
    assert config.enable_embedding_cache and config.capacity_bytes == 64 << 20
    with pytest.raises(InvalidConfig, match="capacity_gb"):
        CacheConfig.from_stage_config({"capacity_gb": 1})
