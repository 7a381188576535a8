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
    assert issubclass(errors.PinLimitReached, errors.CapacityError)
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
        ("remote_protocol", "TCP", InvalidConfig),  # a thin client's failed TCP transfers free memory
        ("remote_local_host", "node-a", InvalidConfig),  # an address, as Mooncake binds to it
        ("remote_local_host", "10.0.0.7:15000", InvalidConfig),  # the port is picked per process
        ("remote_local_host", "0.0.0.0", InvalidConfig),  # advertised to peers: no wildcard
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


ODD_VALUES = [
    ("namespace", "name\n", InvalidConfig),
    ("namespace", "name\r", InvalidConfig),
    ("namespace", "x" * 65, InvalidConfig),
    ("remote_segment_bytes", -1, InvalidConfig),
    ("remote_buffer_bytes", -(1 << 20), InvalidConfig),
    ("remote_segment_bytes", 1 << 70, InvalidConfig),
    ("remote_publish_queue", 1 << 40, InvalidConfig),
    ("tenant_salt", "bad \ud800 salt", InvalidConfig),
    ("remote_key_prefix", "\udcff", InvalidConfig),
    ("remote_master", "host:\ud800", InvalidConfig),
    ("remote_master", ":", InvalidConfig),  # before, anything with a ':' was accepted (rc -600 at open)
    ("remote_master", "host:notaport", InvalidConfig),
    ("remote_master", "host:99999", InvalidConfig),
    ("remote_master", "host:0", InvalidConfig),
    ("remote_holder", "my host:50052", InvalidConfig),
    ("compute_timeout_s", float("inf"), InvalidConfig),
    ("compute_timeout_s", float("nan"), InvalidConfig),
    ("lock_timeout_s", 1e300, InvalidConfig),
    ("ttl_s", 10**400, InvalidConfig),
    ("compute_timeout_s", 10**30, InvalidConfig),
    ("capacity_bytes", 1 << 80, InvalidConfig),
    ("hash_algorithm", ["xxh3_128"], ConfigTypeError),
    ("return_mode", {"view"}, ConfigTypeError),
    ("mode", 384.0, ConfigTypeError),
]


@pytest.mark.parametrize(
    ("field", "value", "error"), ODD_VALUES, ids=[f"{f}-{i}" for i, (f, _v, _e) in enumerate(ODD_VALUES)]
)
def test_cache_config_refuses_odd_values_with_short_typed_errors(
    field: str, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=field.split("_")[0]) as raised:
        CacheConfig(**{field: value})  # type: ignore[arg-type]
    assert len(str(raised.value)) < 200


@pytest.mark.parametrize("name", ["-x", ".a", "..", "a/b", "", "a" * 65])
def test_a_namespace_that_is_no_plain_name_is_refused_by_the_rule_it_breaks(name: str) -> None:
    """A leading "-" would read as an option to `shmcache-inspect show NAMESPACE`."""
    from shmcache.config import NAMESPACE_RULE
    from shmcache.kernel.namespace import object_names

    for make in (lambda: CacheConfig(namespace=name), lambda: object_names(name)):
        with pytest.raises(InvalidConfig) as raised:
            make()
        assert str(raised.value).startswith(NAMESPACE_RULE)
    assert CacheConfig(namespace="_a-1.b").namespace == "_a-1.b"


def test_the_namespace_pattern_is_anchored_at_the_end() -> None:
    from shmcache.config import NAMESPACE_PATTERN
    from shmcache.kernel.namespace import object_names

    assert NAMESPACE_PATTERN.match("ok\n") is None and NAMESPACE_PATTERN.fullmatch("ok") is not None
    with pytest.raises(InvalidConfig):
        object_names("ok\n")
    with pytest.raises(InvalidConfig) as raised:
        object_names("/" * 10_000_000)
    assert len(str(raised.value)) < 200


@pytest.mark.parametrize(
    ("stage", "error"),
    [
        (None, ConfigTypeError),
        ([("capacity_bytes", 1)], ConfigTypeError),
        ("enable_embedding_cache", ConfigTypeError),
        ({1: True}, ConfigTypeError),
        ({"x" * 10_000_000: 1}, InvalidConfig),
        ({"enable_embedding_cache": "yes"}, ConfigTypeError),
    ],
)
def test_stage_config_refuses_what_is_not_a_mapping(stage: object, error: type[Exception]) -> None:
    with pytest.raises(error) as raised:
        CacheConfig.from_stage_config(stage)  # type: ignore[arg-type]
    assert len(str(raised.value)) < 200


def test_new_error_classes_pair_with_their_builtins() -> None:
    assert issubclass(errors.ForeignObject, PermissionError)
    assert issubclass(errors.KeyTypeError, TypeError) and issubclass(errors.KeyTypeError, errors.InvalidKey)
    assert pickle.loads(pickle.dumps(errors.ForeignObject("x"))).args == ("x",)


def test_a_cache_is_opened_with_a_cache_config_only() -> None:
    """Before: `EmbeddingCache({"namespace": "x"})` raised AttributeError from inside."""
    from shmcache import ArgumentTypeError, EmbeddingCache

    with pytest.raises(ArgumentTypeError, match="config must be a CacheConfig, got dict"):
        EmbeddingCache({"namespace": "x"})  # type: ignore[arg-type]


def test_the_demo_refuses_counts_it_cannot_run() -> None:
    """Before: `--distinct 0` raised IndexError, `--requests -3` ran and exited 0."""
    from shmcache.ops.demo import main as demo_main

    for option in ("--distinct", "--requests", "--encoders", "--prefills"):
        with pytest.raises(SystemExit) as exited:
            demo_main([option, "0"])
        assert exited.value.code == 2
