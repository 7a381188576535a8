"""The key schema: digests pinned across versions, and the memo of key headers (a memoised header
never skips a check a cold one makes)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import pytest
import torch

from shmcache import EmbeddingCacheKey
from shmcache.errors import InvalidKey, KeyTypeError, UnsupportedValue
from shmcache.keys._native import Header
from shmcache.keys._native import header as header_of
from shmcache.testing import sample_preprocessing


def test_digests_are_pinned_across_versions() -> None:
    """Keys are shared between processes, nodes and releases: the framing of KEY_SCHEMA_VERSION 1
    must give these digests forever (a change to them is a schema change, with a new version)."""
    config = sample_preprocessing()
    made = [
        EmbeddingCacheKey.from_raw_bytes(b"abc", config, modality="image"),
        EmbeddingCacheKey.from_raw_bytes(
            b"abc", config, modality="audio", algorithm="sha256", tenant_salt="t"
        ),
        EmbeddingCacheKey.from_decoded_tensor(torch.arange(6).reshape(2, 3), config, modality="image"),
        EmbeddingCacheKey.from_token_prefix([1, 2, 3], config, parent=b"p"),
        EmbeddingCacheKey.from_external_id("id", config, source="vllm", modality="image"),
    ]
    assert [key.hex for key in made] == [
        "073ec4c8f23b174346115504c0492f38",
        "b6168dec664100b1f8b1fe1d98bad59253e0a1281fc903f53c424a4f02c4bac0",
        "99b8af58a8030d0d2ab27fa417ac3925",
        "dad876823269d01ea973eba9fa803c12",
        "32f55c7c2be33e436600c85cee0ff14e",
    ]


def test_a_salt_is_checked_whether_or_not_a_header_is_memoised() -> None:
    config = sample_preprocessing()
    made = EmbeddingCacheKey.from_raw_bytes(b"x", config, modality="image", tenant_salt=b"s")
    with pytest.raises(KeyTypeError):  # equal to b"s", and still not a salt
        EmbeddingCacheKey.from_raw_bytes(b"x", config, modality="image", tenant_salt=memoryview(b"s"))
    assert EmbeddingCacheKey.from_raw_bytes(b"x", config, modality="image", tenant_salt="s") == made


def test_from_raw_bytes_takes_its_arguments_as_a_python_signature_would() -> None:
    """`from_raw_bytes` is one native call (keys/native.c): the same keys whichever way the
    arguments come, and Python's own TypeErrors for arguments that do not fit the signature."""
    config = sample_preprocessing()
    made = EmbeddingCacheKey.from_raw_bytes(b"abc", config, modality="image")
    assert made.hex == "073ec4c8f23b174346115504c0492f38"  # pinned above
    assert EmbeddingCacheKey.from_raw_bytes(data=b"abc", config=config, modality="image") == made
    assert EmbeddingCacheKey.from_raw_bytes(b"abc", config=config, modality="image", tenant_salt=None) == made
    assert EmbeddingCacheKey.from_raw_bytes(bytearray(b"abc"), config, modality="image") == made
    assert EmbeddingCacheKey.from_raw_bytes(memoryview(b"xabc")[1:], config, modality="image") == made
    make = EmbeddingCacheKey.from_raw_bytes
    odd: list[tuple[Callable[[], object], str]] = [
        (lambda: make(b"abc", config), "missing 1 required keyword-only argument: 'modality'"),
        (lambda: make(b"abc", modality="image"), "missing 1 required positional argument: 'config'"),
        (lambda: make(b"abc", config, "image"), "takes 3 positional arguments but 4 were given"),
        (lambda: make(b"abc", config, modality="image", salt="s"), "unexpected keyword argument 'salt'"),
        (lambda: make(b"abc", config, data=b"abc", modality="image"), "multiple values for argument 'data'"),
    ]  # fmt: skip
    for call, message in odd:
        with pytest.raises(TypeError, match=message):
            call()
    with pytest.raises(UnsupportedValue, match="C-contiguous"):
        EmbeddingCacheKey.from_raw_bytes(memoryview(b"abcdef")[::2], config, modality="image")
    with pytest.raises(UnsupportedValue, match="got str"):
        EmbeddingCacheKey.from_raw_bytes("abc", config, modality="image")  # type: ignore[arg-type]
    released = memoryview(b"abc")
    released.release()
    with pytest.raises(ValueError, match="released"):
        EmbeddingCacheKey.from_raw_bytes(released, config, modality="image")


def test_a_subclass_makes_keys_of_its_own_class() -> None:
    class TaggedKey(EmbeddingCacheKey):
        __slots__ = ()

    config = sample_preprocessing()
    for make in (TaggedKey.from_raw_bytes, EmbeddingCacheKey.from_raw_bytes):
        made = make(b"abc", config, modality="image")
        assert made.hex == "073ec4c8f23b174346115504c0492f38"
    assert type(TaggedKey.from_raw_bytes(b"abc", config, modality="image")) is TaggedKey
    assert type(TaggedKey.from_external_id("id", config, source="s", modality="image")) is TaggedKey
    header = header_of("xxh3_128", "raw", "image", config, None)
    with pytest.raises(TypeError, match="keys are made as EmbeddingCacheKey, not dict"):
        header.key(dict, b"abc", 3, b"", "raw")  # type: ignore[type-var]


def test_the_memo_of_headers_is_bounded() -> None:
    """A header is memoised per (algorithm, kind, modality, config, salt); a tenant per request
    must not grow it without end: it is emptied past 4096 entries (keys/native.c)."""
    config = sample_preprocessing()
    first = EmbeddingCacheKey.from_raw_bytes(b"x", config, modality="image", tenant_salt="tenant-0")
    for i in range(6000):
        EmbeddingCacheKey.from_raw_bytes(b"x", config, modality="image", tenant_salt=f"tenant-{i}")
    gc.collect()
    assert sum(type(held) is Header for held in gc.get_objects()) <= 4096
    assert EmbeddingCacheKey.from_raw_bytes(b"x", config, modality="image", tenant_salt="tenant-0") == first


def test_keys_made_from_many_threads_are_the_keys_made_alone() -> None:
    """Threads interleave inside the memo (a new header is built in Python, where the GIL may
    switch): the answer kept for the last arguments must never be another settings' header."""
    configs = [sample_preprocessing(model_revision=f"r{i}") for i in range(3)]
    settings = [(config, salt) for salt in (None, "a", b"b", "c") for config in configs]
    alone = [EmbeddingCacheKey.from_raw_bytes(b"x", c, modality="image", tenant_salt=s) for c, s in settings]
    assert len(set(alone)) == len(settings)
    wrong: list[int] = []
    make_key = EmbeddingCacheKey.from_raw_bytes

    def make(offset: int) -> None:
        for i in range(3000):
            at = (i + offset) % len(settings)
            config, salt = settings[at]
            if i % 500 == 0:  # new headers, built in Python, interleave with memoised ones
                make_key(b"x", config, modality="image", tenant_salt=f"new-{offset}-{i}")
            if make_key(b"x", config, modality="image", tenant_salt=salt) != alone[at]:
                wrong.append(at)

    threads = [threading.Thread(target=make, args=(offset,)) for offset in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_parts_of_the_wrong_type_are_key_type_errors_empty_ones_invalid_keys() -> None:
    pconfig = sample_preprocessing()
    external = EmbeddingCacheKey.from_external_id
    for call in (
        lambda: EmbeddingCacheKey.from_raw_bytes(b"x", {"model_id": "m"}, modality="image"),  # type: ignore[arg-type]
        lambda: EmbeddingCacheKey.from_token_prefix([1], pconfig, parent="abc"),  # type: ignore[arg-type]
        lambda: external(None, pconfig, source="vllm", modality="image"),  # type: ignore[arg-type]
        lambda: external("mm-hash", pconfig, source=3, modality="image"),  # type: ignore[arg-type]
    ):
        with pytest.raises(KeyTypeError):
            call()
    for empty in ({"identifier": ""}, {"source": ""}):
        arguments = {"identifier": "mm-hash", "source": "vllm", **empty}
        with pytest.raises(InvalidKey, match="non-empty") as raised:
            external(arguments["identifier"], pconfig, source=arguments["source"], modality="image")
        assert not isinstance(raised.value, TypeError)
