"""The value format: a small fixed header, array descriptors, then raw 64-byte-aligned payloads.

Layout (little endian)::

    header      magic "SHMV", version u16, kind u8, flags u8, n_arrays u32, meta_len u32,
                total_len u64, descriptors_len u32, reserved u32
    descriptor  per array: lib u8 (1 torch, 2 numpy, 3 torch on CUDA, 4 CUDA array such as cupy),
                dtype_len u8, ndim u8, name_len u8,
                offset u64, nbytes u64, dims u64 x ndim, dtype name, array name (utf-8)
    metadata    JSON object (HiddenStatePrefix only), utf-8
    payloads    each at a 64-byte aligned offset from the start

Arrays that were on a GPU (lib 3 and 4) are stored here as their host copy; `EncodedValue` also
carries the device arrays, which the GPU layer exports (see `shmcache.gpu`). Readers without CUDA
get them back as CPU torch tensors (3) and numpy arrays (4).

No pickle anywhere: a shared segment must not be a code-execution path into other processes.
`decode` bounds-checks every field and raises `CorruptValue` for truncated or malformed input.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from shmcache.dtypes import numpy_dtype, tensor_bytes, torch_dtype
from shmcache.errors import CorruptValue, UnsupportedValue

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGNMENT",
    "EncodedValue",
    "HiddenStatePrefix",
    "Value",
    "ParsedValue",
    "alias",
    "decode",
    "describe",
    "materialize",
    "parse",
    "encode",
    "plan",
]

ALIGNMENT: Final = 64
MAGIC: Final = b"SHMV"
VERSION: Final = 1
_HEADER = struct.Struct("<4sHBBIIQII")
_DESCRIPTOR = struct.Struct("<BBBBQQ")
_DIM = struct.Struct("<Q")
_MAX_ARRAYS: Final = 65536
_MAX_NDIM: Final = 64
_MAX_META: Final = 1 << 20

KIND_TENSOR, KIND_NDARRAY, KIND_TOKEN_IDS, KIND_HIDDEN_STATE_PREFIX, KIND_TENSOR_DICT = 1, 2, 3, 4, 5
KIND_NAMES: Final = {
    KIND_TENSOR: "tensor",
    KIND_NDARRAY: "ndarray",
    KIND_TOKEN_IDS: "token_ids",
    KIND_HIDDEN_STATE_PREFIX: "hidden_state_prefix",
    KIND_TENSOR_DICT: "tensor_dict",
}
_LIB_TORCH, _LIB_NUMPY, _LIB_TORCH_CUDA, _LIB_CUDA_ARRAY = 1, 2, 3, 4
_TORCH_LIBS: Final = (_LIB_TORCH, _LIB_TORCH_CUDA)
DEVICE_LIBS: Final = (_LIB_TORCH_CUDA, _LIB_CUDA_ARRAY)

MetadataValue = str | int | float | bool | None


@dataclass(frozen=True)
class HiddenStatePrefix:
    """Token ids with the hidden states computed for them, plus JSON-able metadata."""

    token_ids: list[int]
    hidden_states: torch.Tensor
    metadata: dict[str, MetadataValue] = field(default_factory=dict)


Value = Any  # torch.Tensor | np.ndarray | list[int] | HiddenStatePrefix | dict[str, torch.Tensor]


@dataclass(frozen=True)
class _Array:
    lib: int
    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    name: str = ""
    device: Any = None  # the contiguous CUDA tensor the host bytes were copied from (lib 3 and 4)


@dataclass(frozen=True)
class EncodedValue:
    """An encoded value not yet written anywhere: its header bytes and where each payload goes."""

    kind: int
    head: bytes
    payloads: tuple[tuple[int, memoryview], ...]
    total_len: int
    arrays: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, shape) of each array, for inspection
    device_payloads: tuple[tuple[int, Any], ...] = ()  # (offset, CUDA tensor) of arrays born on a GPU

    @property
    def device(self) -> Any:
        """The torch.device of the value's CUDA arrays, None if it has none."""
        return self.device_payloads[0][1].device if self.device_payloads else None

    def write_into(self, buffer: memoryview) -> None:
        """Write the whole encoding into `buffer` (at least `total_len` writable bytes): one copy."""
        buffer[: len(self.head)] = self.head
        for offset, data in self.payloads:
            buffer[offset : offset + data.nbytes] = data

    def to_bytes(self) -> bytes:
        """The encoding as one bytes object (copies; for tests and transport)."""
        out = bytearray(self.total_len)
        self.write_into(memoryview(out))
        return bytes(out)


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _token_array(token_ids: Any) -> _Array:
    if not isinstance(token_ids, list | tuple):
        raise UnsupportedValue(f"token ids must be a list of int, got {type(token_ids).__name__}")
    for token in token_ids:
        if isinstance(token, bool) or not isinstance(token, int):
            raise UnsupportedValue(f"token ids must be ints, got {type(token).__name__}")
    try:
        array = np.asarray(token_ids, dtype="<i8")
    except OverflowError:
        raise UnsupportedValue("token ids must fit in int64") from None
    return _Array(_LIB_NUMPY, "int64", (len(token_ids),), array.view(np.uint8).data)


def _is_cuda_array(value: Any) -> bool:
    """A GPU array of another library (cupy, numba): it has a CUDA array interface, and is no tensor."""
    return hasattr(type(value), "__cuda_array_interface__") and not _is_tensor(value)


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _array(value: Any, name: str = "", *, as_torch: bool = False) -> _Array:
    if isinstance(value, np.ndarray):
        dtype, shape, data = tensor_bytes(value)
        return _Array(_LIB_NUMPY, dtype, shape, data, name)
    lib = _LIB_TORCH
    if _is_cuda_array(value):
        import torch

        # zero-copy; DLPack (cupy has it) also orders the producer's stream before our reads
        value = (
            torch.utils.dlpack.from_dlpack(value) if hasattr(value, "__dlpack__") else torch.as_tensor(value)
        )
        lib = _LIB_TORCH if as_torch else _LIB_CUDA_ARRAY
    device = None
    if _is_tensor(value) and value.device.type == "cuda":
        device = value.detach().resolve_conj().resolve_neg().contiguous()
        value = device
        lib = _LIB_CUDA_ARRAY if lib == _LIB_CUDA_ARRAY else _LIB_TORCH_CUDA
    dtype, shape, data = tensor_bytes(value)
    return _Array(lib, dtype, shape, data, name, device)


def _classify(value: Value) -> tuple[int, list[_Array], bytes]:
    if isinstance(value, np.ndarray):
        return KIND_NDARRAY, [_array(value)], b""
    if isinstance(value, HiddenStatePrefix):
        meta = _metadata_json(value.metadata)
        return (
            KIND_HIDDEN_STATE_PREFIX,
            [_token_array(value.token_ids), _array(value.hidden_states, as_torch=True)],
            meta,
        )
    if isinstance(value, list):
        return KIND_TOKEN_IDS, [_token_array(value)], b""
    if _is_cuda_array(value):
        return KIND_NDARRAY, [_array(value)], b""
    if isinstance(value, Mapping):
        arrays = []
        for name, item in value.items():
            if not isinstance(name, str):
                raise UnsupportedValue(f"tensor dict keys must be str, got {type(name).__name__}")
            if len(name.encode()) > 255:
                raise UnsupportedValue("tensor dict keys are limited to 255 utf-8 bytes")
            arrays.append(_array(item, name))
        return KIND_TENSOR_DICT, arrays, b""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(value, torch.Tensor):
        return KIND_TENSOR, [_array(value)], b""
    raise UnsupportedValue(
        f"cannot store a {type(value).__name__}: values are torch.Tensor, numpy.ndarray, list[int], "
        "HiddenStatePrefix or dict[str, Tensor] (never pickled)"
    )


def _metadata_json(metadata: Any) -> bytes:
    if not isinstance(metadata, Mapping):
        raise UnsupportedValue("HiddenStatePrefix.metadata must be a dict")
    for name, item in metadata.items():
        if not isinstance(name, str) or not isinstance(item, str | int | float | bool | type(None)):
            raise UnsupportedValue(f"metadata {name!r}: values must be str, int, float, bool or None")
    try:
        raw = json.dumps(dict(metadata), sort_keys=True, allow_nan=False).encode()
    except ValueError as exc:
        raise UnsupportedValue(f"metadata is not JSON-safe: {exc}") from None
    if len(raw) > _MAX_META:
        raise UnsupportedValue(f"metadata is limited to {_MAX_META} bytes of JSON")
    return raw


def plan(value: Value) -> EncodedValue:
    """Lay out `value` without copying its payload; raises `UnsupportedValue` for other types."""
    kind, arrays, meta = _classify(value)
    descriptors = []
    for array in arrays:
        dtype_raw, name_raw = array.dtype.encode(), array.name.encode()
        if len(array.shape) > _MAX_NDIM:
            raise UnsupportedValue(f"at most {_MAX_NDIM} dimensions are supported")
        descriptors.append((array, dtype_raw, name_raw))
    descriptors_len = sum(
        _DESCRIPTOR.size + _DIM.size * len(a.shape) + len(d) + len(n) for a, d, n in descriptors
    )
    offset = _align(_HEADER.size + descriptors_len + len(meta))
    parts = []
    payloads = []
    device_payloads = []
    for array, dtype_raw, name_raw in descriptors:
        nbytes = array.data.nbytes
        parts.append(
            _DESCRIPTOR.pack(array.lib, len(dtype_raw), len(array.shape), len(name_raw), offset, nbytes)
        )
        parts.extend(_DIM.pack(dim) for dim in array.shape)
        parts += (dtype_raw, name_raw)
        payloads.append((offset, array.data))
        if array.device is not None and nbytes:
            device_payloads.append((offset, array.device))
        offset = _align(offset + nbytes)
    if len({str(tensor.device) for _, tensor in device_payloads}) > 1:
        raise UnsupportedValue("the CUDA arrays of one value must be on one device")
    total = offset
    header = _HEADER.pack(MAGIC, VERSION, kind, 0, len(arrays), len(meta), total, descriptors_len, 0)
    return EncodedValue(
        kind=kind,
        head=header + b"".join(parts) + meta,
        payloads=tuple(payloads),
        total_len=total,
        arrays=tuple((a.dtype, a.shape) for a, _, _ in descriptors),
        device_payloads=tuple(device_payloads),
    )


def encode(value: Value) -> bytes:
    """Encode `value` to bytes (see the module docstring for the layout)."""
    return plan(value).to_bytes()


@dataclass(frozen=True)
class ArraySpec:
    """One checked array descriptor, with its dtype already resolved."""

    lib: int
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    name: str
    np_dtype: np.dtype[Any] | None  # numpy dtype of the elements, None if numpy has no twin
    torch_dtype: Any  # torch.dtype for torch arrays, None for numpy arrays


@dataclass(frozen=True)
class ParsedValue:
    """The checked header and array descriptors of an encoded value."""

    kind: int
    arrays: tuple[ArraySpec, ...]
    meta: bytes
    total_len: int

    @property
    def on_device(self) -> bool:
        """True if any array was on a GPU when it was stored."""
        return any(spec.lib in DEVICE_LIBS for spec in self.arrays)


_parsed_heads: dict[bytes, ParsedValue] = {}
_PARSED_HEADS_MAX = 4096


def parse(buffer: memoryview) -> ParsedValue:
    """Parse and bounds-check the header and descriptors; raises `CorruptValue`.

    Results are memoised by the head bytes (header, descriptors and metadata, which determine the
    result entirely), so entries of the same shape and dtype are parsed once per process.
    """
    size = buffer.nbytes
    if size < _HEADER.size:
        raise CorruptValue(f"value truncated: {size} bytes is shorter than the {_HEADER.size}-byte header")
    head = _HEADER.unpack_from(buffer)
    end_of_head = _HEADER.size + head[7] + head[5]
    if end_of_head > size or head[6] > size:
        raise CorruptValue(f"value truncated: header announces more than the {size} bytes present")
    raw_head = bytes(buffer[:end_of_head])
    parsed = _parsed_heads.get(raw_head)
    if parsed is None:
        parsed = _parse_head(memoryview(raw_head), head)
        if len(_parsed_heads) >= _PARSED_HEADS_MAX:
            _parsed_heads.clear()
        _parsed_heads[raw_head] = parsed
    return parsed


def _parse_head(buffer: memoryview, head: tuple[Any, ...]) -> ParsedValue:
    magic, version, kind, _flags, n_arrays, meta_len, total, descriptors_len, _ = head
    if magic != MAGIC:
        raise CorruptValue(f"bad value magic {bytes(magic)!r}")
    if version != VERSION:
        raise CorruptValue(f"unsupported value format version {version}")
    if kind not in KIND_NAMES:
        raise CorruptValue(f"unknown value kind {kind}")
    if n_arrays > _MAX_ARRAYS or meta_len > _MAX_META:
        raise CorruptValue("value header counts out of range")
    expected_arrays = {KIND_TENSOR: 1, KIND_NDARRAY: 1, KIND_TOKEN_IDS: 1, KIND_HIDDEN_STATE_PREFIX: 2}
    if kind in expected_arrays and n_arrays != expected_arrays[kind]:
        raise CorruptValue(f"a {KIND_NAMES[kind]} value holds {expected_arrays[kind]} arrays, not {n_arrays}")
    end_of_head = _HEADER.size + descriptors_len + meta_len
    if end_of_head > total:
        raise CorruptValue("value descriptors overrun the value")
    position = _HEADER.size
    arrays = []
    floor = _align(end_of_head)
    for _ in range(n_arrays):
        if position + _DESCRIPTOR.size > _HEADER.size + descriptors_len:
            raise CorruptValue("value descriptor truncated")
        lib, dtype_len, ndim, name_len, offset, nbytes = _DESCRIPTOR.unpack_from(buffer, position)
        position += _DESCRIPTOR.size
        tail = position + _DIM.size * ndim + dtype_len + name_len
        if tail > _HEADER.size + descriptors_len or ndim > _MAX_NDIM or not 1 <= lib <= 4:
            raise CorruptValue("value descriptor out of range")
        shape = struct.unpack_from(f"<{ndim}Q", buffer, position)
        position += _DIM.size * ndim
        try:
            dtype = bytes(buffer[position : position + dtype_len]).decode("ascii")
            name = bytes(buffer[position + dtype_len : tail]).decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptValue("value descriptor names are not valid text") from None
        position = tail
        if offset % ALIGNMENT or offset < floor or offset + nbytes > total:
            raise CorruptValue(f"array payload [{offset}, {offset + nbytes}) out of bounds")
        floor = offset + nbytes
        arrays.append(_spec(lib, dtype, shape, offset, nbytes, name))
    if position != _HEADER.size + descriptors_len:
        raise CorruptValue("value descriptor length mismatch")
    meta = bytes(buffer[end_of_head - meta_len : end_of_head])
    return ParsedValue(kind, tuple(arrays), meta, total)


def _spec(lib: int, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int, name: str) -> ArraySpec:
    count = 1
    for dim in shape:
        count *= dim
    try:
        if lib not in _TORCH_LIBS:
            np_dtype: np.dtype[Any] | None = numpy_dtype(dtype)
            torch_type = None
            itemsize = np_dtype.itemsize if np_dtype is not None else 0
        else:
            torch_type = torch_dtype(dtype)
            itemsize = torch_type.itemsize
            np_dtype = _numpy_twin(dtype, itemsize)
    except UnsupportedValue as exc:
        raise CorruptValue(str(exc)) from None
    if count * itemsize != nbytes:
        raise CorruptValue(f"array of {dtype} {list(shape)} does not match its {nbytes} bytes")
    return ArraySpec(lib, dtype, shape, offset, nbytes, name, np_dtype, torch_type)


def _numpy_twin(name: str, itemsize: int) -> np.dtype[Any] | None:
    """The numpy dtype with the same name and size as a torch dtype (None for bfloat16 & co)."""
    try:
        twin = numpy_dtype(name)
    except UnsupportedValue:
        return None
    return twin if twin.itemsize == itemsize else None


def as_byte_array(buffer: memoryview | bytes | bytearray | np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A flat writable uint8 array over `buffer` (read-only input such as bytes is copied once)."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise CorruptValue("encoded values must be C-contiguous")
        array = buffer.reshape(-1).view(np.uint8)
    else:
        array = np.frombuffer(buffer, dtype=np.uint8)
    return array if array.flags.writeable else array.copy()


def decode(buffer: memoryview | bytes | bytearray | np.ndarray[Any, Any], *, copy: bool = False) -> Value:
    """Decode an encoded value.

    With `copy=False` the returned arrays are zero-copy views of `buffer` and keep the array
    object passed in (or one made over it) alive (numpy views are read-only). Read-only input
    (bytes) is copied once. Raises `CorruptValue` for malformed input.
    """
    array = as_byte_array(buffer)
    return materialize(array, parse(array.data), copy=copy)


DeviceBuilder = Callable[[ArraySpec], Any]


def materialize(
    array: np.ndarray[Any, Any],
    parsed: ParsedValue,
    *,
    copy: bool = False,
    base: int = 0,
    device: DeviceBuilder | None = None,
) -> Value:
    """Build the value that `parsed` describes over `array`, whose byte `base` is the value's
    first byte (already parsed: no checks repeated). Views keep `array` alive. With `device`,
    arrays born on a GPU are built by it instead (see `shmcache.gpu`)."""
    return _assemble(
        parsed,
        [
            device(spec)
            if device is not None and spec.lib in DEVICE_LIBS
            else _materialize(array, spec, copy, base)
            for spec in parsed.arrays
        ],
    )


def _materialize(array: np.ndarray[Any, Any], spec: ArraySpec, copy: bool, base: int) -> Any:
    offset = base + spec.offset
    if spec.torch_dtype is None:  # a numpy array
        assert spec.np_dtype is not None
        result = np.ndarray(spec.shape, spec.np_dtype, buffer=array, offset=offset)
        if copy:
            return result.copy()
        result.flags.writeable = False
        return result
    import torch

    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.torch_dtype)
    if spec.np_dtype is not None:
        tensor = torch.from_numpy(np.ndarray(spec.shape, spec.np_dtype, buffer=array, offset=offset))
    else:
        raw = np.ndarray((spec.nbytes,), np.uint8, buffer=array, offset=offset)
        tensor = torch.from_numpy(raw).view(spec.torch_dtype).reshape(spec.shape)
    return tensor.clone() if copy else tensor


def _assemble(parsed: ParsedValue, values: list[Any]) -> Value:
    kind = parsed.kind
    if kind in (KIND_TENSOR, KIND_NDARRAY):
        return _expect(values[0], parsed.arrays[0], torch_lib=kind == KIND_TENSOR)
    if kind == KIND_TOKEN_IDS:
        return _token_list(values[0])
    if kind == KIND_HIDDEN_STATE_PREFIX:
        try:
            metadata = json.loads(parsed.meta.decode("utf-8")) if parsed.meta else {}
        except ValueError:
            raise CorruptValue("HiddenStatePrefix metadata is not valid JSON") from None
        if not isinstance(metadata, dict):
            raise CorruptValue("HiddenStatePrefix metadata is not a JSON object")
        hidden = _expect(values[1], parsed.arrays[1], torch_lib=True)
        return HiddenStatePrefix(_token_list(values[0]), hidden, metadata)
    names = [spec.name for spec in parsed.arrays]
    if len(set(names)) != len(names):
        raise CorruptValue("tensor dict has duplicate names")
    return dict(zip(names, values, strict=True))


def _expect(value: Any, spec: ArraySpec, *, torch_lib: bool) -> Any:
    if (spec.lib in _TORCH_LIBS) != torch_lib:
        raise CorruptValue("array library does not match the value kind")
    return value


def _token_list(array: Any) -> list[int]:
    if not isinstance(array, np.ndarray) or array.dtype != np.int64 or array.ndim != 1:
        raise CorruptValue("token ids must be a flat int64 array")
    tokens: list[int] = array.tolist()
    return tokens


def alias(value: Value) -> Value:
    """A new value object sharing `value`'s memory (a repeat hit's cheap copy of the handle)."""
    if isinstance(value, np.ndarray):
        return value.view()
    if isinstance(value, HiddenStatePrefix):
        return HiddenStatePrefix(list(value.token_ids), value.hidden_states.detach(), dict(value.metadata))
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return {name: alias(item) for name, item in value.items()}
    if _is_tensor(value):
        return value.detach()
    return value.view()  # a CUDA array of another library


def describe(buffer: memoryview | bytes) -> tuple[str, list[tuple[str, tuple[int, ...]]]]:
    """(kind name, [(dtype, shape), ...]) of an encoded value, without materializing it."""
    parsed = parse(memoryview(buffer))
    return KIND_NAMES[parsed.kind], [(spec.dtype, spec.shape) for spec in parsed.arrays]
