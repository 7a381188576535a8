"""Value format: bit-identical round trips for every type and dtype, zero-copy views, typed errors."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmcache import (
    CacheConfig,
    CorruptValue,
    EmbeddingCache,
    EmbeddingCacheKey,
    HiddenStatePrefix,
    UnsupportedValue,
)
from shmcache.format import _arrays
from shmcache.format.decode import aliasing, as_byte_array, decode, parse
from shmcache.format.values import ALIGNMENT, DESCRIPTOR, DIM, HEADER, encode, plan
from shmcache.keys.dtypes import _torch_dtypes
from shmcache.process.mappings import Mapping
from shmcache.testing import sample_preprocessing


def _bits(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


ALL_TORCH_DTYPES = sorted(_torch_dtypes().items())


@pytest.mark.parametrize(("name", "dtype"), ALL_TORCH_DTYPES, ids=[n for n, _ in ALL_TORCH_DTYPES])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 3, 4), (3, 0, 2)])
def test_every_torch_dtype_round_trips_bit_identically(
    name: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    original = _random_tensor(dtype, shape)
    for value in (original, original.t() if original.dim() == 2 else original):
        encoded = encode(value)
        out = decode(encoded)
        assert isinstance(out, torch.Tensor)
        assert out.dtype == dtype and tuple(out.shape) == tuple(value.shape)
        assert _bits(out) == _bits(value)  # NaN payloads and -0.0 included
        parsed = parse(memoryview(encoded))  # a hit's delivery: the same value, its own signature
        assert parsed.native is not None
        delivered, record = _arrays.deliver(as_byte_array(encoded), 0, parsed.native, Mapping, None, parsed)
        ops = aliasing(delivered)
        assert (
            ops is not None
            and record.signature == ops.signature(delivered)
            and _bits(delivered) == _bits(value)
        )


def test_shell_dtypes_are_rejected_not_pickled() -> None:
    for name in ("qint8", "quint8", "int4", "uint1"):
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        with pytest.raises(UnsupportedValue):
            from shmcache.keys.dtypes import torch_dtype_name

            torch_dtype_name(dtype)


@pytest.mark.parametrize(
    "np_dtype",
    ["bool", "int8", "uint16", "int64", "float16", "float32", "float64", "complex64", "complex128", ">f8"],
)
def test_numpy_arrays_round_trip_and_views_are_read_only(np_dtype: str) -> None:
    rng = np.random.default_rng(0)
    array = rng.integers(0, 255, size=(4, 6)).astype(np_dtype)
    out = decode(encode(array[:, ::2]))
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, array[:, ::2])
    assert out.dtype == np.dtype(np_dtype).newbyteorder("=")
    assert not out.flags.writeable
    with pytest.raises(ValueError):
        out[0, 0] = 1


def test_token_ids_hidden_state_prefix_and_dicts() -> None:
    tokens = [0, 1, -5, 2**62, 151643]
    assert decode(encode(tokens)) == tokens
    prefix = HiddenStatePrefix(
        tokens, torch.randn(5, 8).to(torch.bfloat16), {"voice": "alice", "sr": 24000, "ok": True, "x": None}
    )
    out = decode(encode(prefix))
    assert isinstance(out, HiddenStatePrefix)
    assert out.token_ids == tokens and out.metadata == prefix.metadata
    assert _bits(out.hidden_states) == _bits(prefix.hidden_states)
    outputs = {
        "pooled": torch.randn(1, 1024),
        "patches": torch.randn(256, 1024).half(),
        "mask": torch.ones(256, dtype=torch.bool),
    }
    got = decode(encode(outputs))
    assert list(got) == list(outputs)
    assert all(_bits(got[k]) == _bits(outputs[k]) for k in outputs)


def test_payloads_are_aligned_and_decode_is_zero_copy() -> None:
    value = {"a": torch.randn(3), "b": torch.randn(5, 7)}
    encoded = plan(value)
    assert all(offset % ALIGNMENT == 0 for offset, _ in encoded.payloads)
    buffer = bytearray(encoded.to_bytes())
    out = decode(memoryview(buffer))
    base = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    for tensor in out.values():
        assert base <= tensor.data_ptr() < base + len(buffer)
        assert (tensor.data_ptr() - base) % ALIGNMENT == 0
    copied = decode(memoryview(buffer), copy=True)
    assert not (base <= copied["a"].data_ptr() < base + len(buffer))


def test_unsupported_values_raise_typed_errors() -> None:
    for bad in ("text", 3, {"a": "b"}, {1: torch.ones(1)}, [1.5], [True], [2**64], object(), np.array(["x"])):
        with pytest.raises(UnsupportedValue):
            encode(bad)
    with pytest.raises(UnsupportedValue):
        encode(HiddenStatePrefix([1], torch.ones(1), {"f": float("nan")}))
    with pytest.raises(UnsupportedValue):
        encode(HiddenStatePrefix([1], torch.ones(1), {"nested": {"a": 1}}))  # type: ignore[dict-item]


def test_corrupted_headers_raise_corrupt_value() -> None:
    good = bytearray(encode({"a": torch.randn(4, 4), "b": torch.arange(3)}))
    cases = {
        "magic": lambda b: b.__setitem__(slice(0, 4), b"XXXX"),
        "version": lambda b: struct.pack_into("<H", b, 4, 99),
        "kind": lambda b: struct.pack_into("<B", b, 6, 42),
        "n_arrays": lambda b: struct.pack_into("<I", b, 8, 1000),
        "total": lambda b: struct.pack_into("<Q", b, 16, 1 << 40),
        "descriptors_len": lambda b: struct.pack_into("<I", b, 24, 1 << 20),
        "array offset": lambda b: struct.pack_into("<Q", b, 36, 3),
        "array nbytes": lambda b: struct.pack_into("<Q", b, 44, 1 << 30),
        "ndim": lambda b: struct.pack_into("<B", b, 34, 60),
        "dtype": lambda b: b.__setitem__(slice(68, 75), b"float99"),
    }
    for name, damage in cases.items():
        broken = bytearray(good)
        damage(broken)
        with pytest.raises(CorruptValue):
            decode(bytes(broken))
            pytest.fail(f"damaged {name} decoded")
    for cut in (0, 10, 31, 32, 100, len(good) - 1):
        with pytest.raises(CorruptValue):
            decode(bytes(good[:cut]))


@pytest.mark.parametrize("value", [torch.empty(0, 4), np.empty((0, 4), np.float32)], ids=["torch", "numpy"])
@pytest.mark.parametrize("huge", [1 << 63, 1 << 61])
def test_a_huge_dimension_beside_a_zero_one_is_a_corrupt_value(value: object, huge: int) -> None:
    broken = bytearray(encode(value))  # 0 bytes of payload match any second dimension
    second_dim = HEADER.size + DESCRIPTOR.size + DIM.size
    assert struct.unpack_from("<Q", broken, second_dim) == (4,)
    struct.pack_into("<Q", broken, second_dim, huge)
    with pytest.raises(CorruptValue, match="out of range"):
        decode(bytes(broken))
    struct.pack_into("<Q", broken, second_dim, 1 << 49)  # absurd, but an empty array can have it
    assert tuple(decode(bytes(broken)).shape) == (0, 1 << 49)


@settings(max_examples=400, deadline=None)
@given(
    st.binary(max_size=600), st.integers(min_value=0, max_value=400), st.integers(min_value=0, max_value=255)
)
def test_fuzzed_bytes_never_crash(noise: bytes, position: int, byte: int) -> None:
    good = bytearray(encode(HiddenStatePrefix([1, 2, 3], torch.randn(2, 3), {"k": "v"})))
    for candidate in (noise, bytes(good[:position]) + noise, _flip(good, position, byte)):
        with contextlib.suppress(CorruptValue):
            decode(candidate)


def _flip(buffer: bytearray, position: int, byte: int) -> bytes:
    out = bytearray(buffer)
    out[position % len(out)] = byte
    return bytes(out)


@pytest.mark.parametrize(
    "value",
    [
        np.array(3.0),
        np.array(7, dtype=np.uint8),
        np.array(True),
        torch.tensor(2.5),
        torch.tensor(1, dtype=torch.int8),
    ],
    ids=lambda v: f"{type(v).__module__.split('.')[0]}-{v.dtype}",
)
def test_zero_d_values_keep_their_shape(value: object) -> None:
    out = decode(encode(value))
    assert type(out) is type(value) and tuple(out.shape) == () and out.dtype == value.dtype  # type: ignore[attr-defined]
    assert out.tolist() == value.tolist()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "hidden",
    [np.arange(6, dtype=np.float16).reshape(2, 3), np.array(4.0), torch.ones(2, 3, dtype=torch.bfloat16)],
    ids=["numpy", "numpy-0d", "torch"],
)
def test_hidden_state_prefix_round_trips_numpy_and_torch_hidden_states(hidden: object) -> None:
    value = HiddenStatePrefix([1, 2], hidden, {"k": 1})  # type: ignore[arg-type]
    for copy in (False, True):
        out = decode(encode(value), copy=copy)
        assert isinstance(out, HiddenStatePrefix) and out.token_ids == [1, 2] and out.metadata == {"k": 1}
        assert type(out.hidden_states) is type(hidden) and out.hidden_states.dtype == hidden.dtype  # type: ignore[attr-defined]
        assert tuple(out.hidden_states.shape) == tuple(hidden.shape)  # type: ignore[attr-defined]
        assert out.hidden_states.tolist() == hidden.tolist()  # type: ignore[attr-defined]
        assert aliasing(out) is None  # a prefix is rebuilt by repeat hits, never aliased


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_values_that_cannot_be_stored_are_typed_errors() -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    for value in (
        torch.empty(3, device="meta"),
        nested,
        {"ok": torch.ones(1), "bad \ud800 name": torch.ones(1)},
        {"meta": torch.empty(2, device="meta")},
        HiddenStatePrefix([1], torch.empty(2, device="meta")),
        HiddenStatePrefix([1], torch.ones(1), {"x" * 10_000_000: 1}),  # type: ignore[dict-item]
        HiddenStatePrefix([1], torch.ones(1), {"nan": float("nan")}),
    ):
        with pytest.raises(UnsupportedValue) as raised:
            encode(value)
        assert len(str(raised.value)) < 200


def test_a_value_of_more_arrays_than_a_reader_accepts_is_refused_at_put(config: CacheConfig) -> None:
    """A dict past `MAX_ARRAYS` was stored, then dropped as corrupt by every reader."""
    from shmcache.format.values import MAX_ARRAYS

    most = {f"a{i}": np.zeros(0, np.uint8) for i in range(MAX_ARRAYS)}
    assert len(decode(encode(most))) == MAX_ARRAYS  # type: ignore[arg-type]
    key = EmbeddingCacheKey.from_raw_bytes(b"many", sample_preprocessing(), modality="image")
    with EmbeddingCache(config) as cache:
        with pytest.raises(UnsupportedValue, match=f"at most {MAX_ARRAYS} arrays"):
            cache.put(key, {**most, "one more": np.zeros(0, np.uint8)})
        stats = cache.stats()
        assert (stats["entries"], stats["reserved"], stats["corrupt_records"]) == (0, 0, 0)
        assert cache.get(key) is None
