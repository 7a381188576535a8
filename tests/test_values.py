"""Value format: bit-identical round trips for every type and dtype, zero-copy views, typed errors."""

from __future__ import annotations

import contextlib
import struct
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmcache import CorruptValue, HiddenStatePrefix, UnsupportedValue
from shmcache.format import _arrays
from shmcache.format.decode import aliasing, as_byte_array, decode, parse
from shmcache.format.reading import DLType, Recipe, numpy_recipe
from shmcache.format.values import ALIGNMENT, DESCRIPTOR, DIM, HEADER, encode, plan
from shmcache.keys.dtypes import _torch_dtypes
from shmcache.process.mappings import Mapping


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


def _bf16() -> DLType:
    return DLType(*_arrays.dltype(torch.empty(1, dtype=torch.bfloat16).__dlpack__()))


def _identity(array: np.ndarray) -> np.ndarray:
    return array


def test_the_native_array_step_checks_every_bound_and_keeps_its_buffer() -> None:
    buffer = np.arange(64, dtype=np.uint8)
    words = _arrays.build(buffer, 4, numpy_recipe(4, np.dtype("<u4"), (2, 3), None))
    assert words.base is buffer and words.flags.c_contiguous and not words.flags.writeable
    assert words.tolist() == np.frombuffer(bytes(range(8, 32)), "<u4").reshape(2, 3).tolist()
    twin = Recipe(0, np.dtype(np.uint8), None, (4,), _identity, None, None, None)  # a tensor's: writable
    assert _arrays.build(buffer, 0, twin).flags.writeable
    buffer.flags.writeable = False
    assert not _arrays.build(buffer, 0, twin).flags.writeable
    assert _arrays.build(buffer, 64, numpy_recipe(0, np.dtype(np.float64), (0, 5), None)).shape == (0, 5)
    for base, offset, shape in [
        (0, 57, (1,)),
        (50, 7, (1,)),
        (-1, 0, (1,)),
        (0, -1, (1,)),
        (0, 65, (0,)),
        (0, 0, (9,)),
        (0, 0, (-1,)),
        (0, 0, (1 << 40, 1 << 40)),
        (1 << 62, 1 << 62, (0,)),
    ]:
        with pytest.raises(ValueError):
            _arrays.build(buffer, base, numpy_recipe(offset, np.dtype(np.float64), shape, None))
    for bad in [
        (buffer.reshape(8, 8), numpy_recipe(0, np.dtype(np.uint8), (1,), None)),  # not 1-D
        (buffer[::2], numpy_recipe(0, np.dtype(np.uint8), (1,), None)),  # not contiguous
        (buffer.view(np.int8), numpy_recipe(0, np.dtype(np.uint8), (1,), None)),  # not uint8
        (bytes(8), numpy_recipe(0, np.dtype(np.uint8), (1,), None)),  # not an array
        (buffer, numpy_recipe(0, np.dtype(object), (1,), None)),  # holds references
        (buffer, numpy_recipe(0, "float32", (1,), None)),  # not a dtype
        (buffer, numpy_recipe(0, np.dtype(np.uint8), [1], None)),  # not a tuple
        (buffer, numpy_recipe(0, np.dtype(np.uint8), (1,) * 33, None)),  # too many dimensions
        (buffer, (0, np.dtype(np.uint8), None, (1,))),  # not a recipe
    ]:
        with pytest.raises(TypeError):
            _arrays.build(bad[0], 0, bad[1])  # type: ignore[arg-type]


def test_a_tensor_made_over_dlpack_keeps_its_buffer_while_it_or_a_view_of_it_lives() -> None:
    """A bfloat16 tensor handed to torch over DLPack is zero-copy over the buffer (a write reaches
    it), holds the buffer until the tensor and every tensor derived from it are gone (then, and
    in a thread of its own, lets it go), and one torch refuses lets it go at once."""
    buffer = np.zeros(64, dtype=np.uint8)
    alive = weakref.ref(buffer)
    recipe = Recipe(0, None, _bf16(), (2, 3), torch.from_dlpack, None, None, None)
    tensor = _arrays.build(buffer, 8, recipe)
    assert tensor.dtype == torch.bfloat16 and tensor.shape == (2, 3) and tensor.stride() == (3, 1)
    assert tensor.data_ptr() == buffer.ctypes.data + 8
    tensor[1, 2] = 1.0  # bfloat16 1.0 is 0x3F80, little-endian
    assert buffer[8 + 10 : 8 + 12].tolist() == [0x80, 0x3F]
    row, buffer = tensor[1], None
    del tensor
    assert alive() is not None  # the derived row still holds it
    holder = [row]
    del row
    done = threading.Thread(target=holder.clear)  # the last reference dies in another thread
    done.start()
    done.join()
    assert alive() is None
    buffer = np.zeros(64, dtype=np.uint8)
    alive = weakref.ref(buffer)
    with pytest.raises(RuntimeError, match="refused"):
        _arrays.build(buffer, 0, recipe._replace(to_torch=_refuse))
    buffer = None
    assert alive() is None  # the capsule torch never took over let it go


_ALIVE_AT_EXIT = """
import numpy as np, torch
from shmcache.format import _arrays
from shmcache.format.reading import DLType, Recipe
class Owner(bytearray):
    def __del__(self):
        print("released", flush=True)
bf16 = DLType(*_arrays.dltype(torch.empty(1, dtype=torch.bfloat16).__dlpack__()))
recipe = Recipe(0, None, bf16, (4,), torch.from_dlpack, None, None, None)
kept = _arrays.build(np.frombuffer(Owner(64), dtype=np.uint8), 0, recipe)
"""


def test_a_tensor_made_over_dlpack_alive_at_exit_lets_its_buffer_go() -> None:
    """torch runs the deleter without the GIL, when the interpreter is already finalizing: the
    finalizing thread still lets the buffer go (the view's release, as a numpy twin's would)."""
    done = subprocess.run([sys.executable, "-c", _ALIVE_AT_EXIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "released"


def test_a_batchs_native_delivery_is_all_or_none() -> None:
    """`deliver_many` answers every hit in order, or raises having kept nothing: a value made
    before the failing one is dropped, no buffer stays referenced."""
    buffers = [np.full(64, i, dtype=np.uint8) for i in range(3)]
    good = numpy_recipe(0, np.dtype(np.uint8), (4,), None)
    made = _arrays.deliver_many(buffers, 0, [good] * 3, Mapping, [0, 1, 2], [None] * 3)
    assert [int(value[0]) for value, _ in made] == [0, 1, 2]
    assert [record.sealed for _, record in made] == [0, 1, 2]
    del made
    counts = [sys.getrefcount(buffer) for buffer in buffers]
    failing = good._replace(shape=(65,))  # overruns its buffer
    with pytest.raises(ValueError, match="overrun"):
        _arrays.deliver_many(buffers, 0, [good, good, failing], Mapping, [0, 1, 2], [None] * 3)
    assert [sys.getrefcount(buffer) for buffer in buffers] == counts
    with pytest.raises(ValueError, match="differ in length"):
        _arrays.deliver_many(buffers, 0, [good] * 2, Mapping, [0, 1, 2], [None] * 3)
    with pytest.raises(TypeError, match="lists"):
        _arrays.deliver_many(tuple(buffers), 0, [good] * 3, Mapping, [0, 1, 2], [None] * 3)  # type: ignore[arg-type]


def _refuse(capsule: object) -> None:
    raise RuntimeError("refused")


def test_the_native_dlpack_step_checks_every_bound() -> None:
    buffer = np.zeros(64, dtype=np.uint8)
    recipe = Recipe(0, None, _bf16(), (1,), torch.from_dlpack, None, None, None)
    for offset, shape in [
        (57, (4,)),
        (-1, (1,)),
        (65, (0,)),
        (0, (33,)),
        (0, (-1,)),
        (0, (1 << 40, 1 << 40)),
        (0, (0, 1 << 62, 1 << 62)),  # no element, but strides that would overflow
    ]:
        with pytest.raises(ValueError):
            _arrays.build(buffer, 0, recipe._replace(offset=offset, shape=shape))
    for dltype in [(4, 0, 1), (4, 4, 1), (256, 16, 1), (4, 16, 0)]:  # no bits, half a byte, out of range
        with pytest.raises(ValueError, match="whole bytes"):
            _arrays.build(buffer, 0, recipe._replace(dlpack=dltype))
    read_only = buffer.copy()
    read_only.flags.writeable = False
    for bad_buffer, bad in [
        (read_only, recipe),  # read-only: a torch tensor cannot be
        (buffer, recipe._replace(dlpack=[4, 16, 1])),  # not a tuple
        (buffer, recipe._replace(dlpack=(4, 16))),  # not three ints
        (buffer, recipe._replace(shape=[1])),  # not a tuple
    ]:
        with pytest.raises(TypeError):
            _arrays.build(bad_buffer, 0, bad)
    taken = torch.zeros(1).__dlpack__()
    torch.from_dlpack(taken)
    for not_a_fresh_capsule in (taken, buffer):  # taken over ("used_dltensor"), not a capsule
        with pytest.raises(ValueError):
            _arrays.dltype(not_a_fresh_capsule)


@pytest.mark.parametrize(
    "value", [np.arange(6.0).reshape(2, 3), torch.arange(6.0), torch.ones(3, 4, dtype=torch.bfloat16)]
)
def test_a_hits_native_delivery_records_what_a_repeat_hit_checks(value: object) -> None:
    """`deliver` makes the value `build` makes and the record of views' mapping, field by field,
    its signature what the value's aliasing reads from it."""
    buffer = as_byte_array(encode(value))
    parsed = parse(buffer.data)
    assert parsed.native is not None
    delivered, record = _arrays.deliver(buffer, 0, parsed.native, Mapping, "sealed", parsed)
    assert type(record) is Mapping and record.sealed == "sealed" and record.parsed is parsed
    assert record.holder() is buffer and record.template() is delivered and record.aliases is None
    ops = aliasing(delivered)
    assert record.aliasing is ops is not None and record.signature == ops.signature(delivered)
    same = np.array_equal if isinstance(value, np.ndarray) else torch.equal
    assert same(delivered, value)  # type: ignore[operator]
    with pytest.raises(TypeError, match="tuple subclass"):
        _arrays.deliver(buffer, 0, parsed.native, dict, "sealed", parsed)  # type: ignore[arg-type]


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
