"""Reading the value format (see `shmcache.format.values` for the layout): parse and
bounds-check a head, then build the value over the buffer, zero-copy where it can.

`decode` bounds-checks every field and raises `CorruptValue` for truncated or malformed input.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from shmcache.errors import CorruptValue, UnsupportedValue
from shmcache.format import _arrays
from shmcache.format.reading import Recipe, numpy_recipe, torch_recipe
from shmcache.format.values import (
    ALIGNMENT,
    DESCRIPTOR,
    DEVICE_LIBS,
    DIM,
    HEADER,
    KIND_HIDDEN_STATE_PREFIX,
    KIND_NAMES,
    KIND_NDARRAY,
    KIND_TENSOR,
    KIND_TOKEN_IDS,
    MAGIC,
    MAX_ARRAYS,
    MAX_META,
    MAX_NDIM,
    TORCH_LIBS,
    VERSION,
    HiddenStatePrefix,
    Value,
    align,
)
from shmcache.keys.dtypes import numpy_dtype, torch_dtype

__all__ = [
    "Aliasing",
    "ArraySpec",
    "DeviceBuilder",
    "ParsedValue",
    "aliasing",
    "as_byte_array",
    "decode",
    "describe",
    "materialize",
    "parse",
]


@dataclass(frozen=True)
class ArraySpec:
    """One checked array descriptor, with its dtype already resolved."""

    lib: int
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    name: str
    torch_dtype: Any  # torch.dtype for torch arrays, None for numpy arrays
    recipe: Recipe  # how `arrays.c` makes it over the value's bytes


@dataclass(frozen=True)
class ParsedValue:
    """The checked header and array descriptors of an encoded value."""

    kind: int
    arrays: tuple[ArraySpec, ...]
    meta: bytes
    total_len: int
    on_device: bool  # any array was on a GPU when it was stored
    single: ArraySpec | None  # the array that is the value itself (a tensor or ndarray value)
    native: Recipe | None  # `single`'s recipe if it is not a GPU's: a hit's delivery is one native call


_MAX_SPAN = 1 << 62  # bytes an array's nonzero dimensions may span (its strides then fit in 64 bits)
_parsed_heads: dict[bytes, ParsedValue] = {}
_PARSED_HEADS_MAX = 4096


def parse(buffer: memoryview) -> ParsedValue:
    """Parse and bounds-check the header and descriptors; raises `CorruptValue`.

    Results are memoised by the head bytes (header, descriptors and metadata, which determine the
    result entirely), so entries of the same shape and dtype are parsed once per process.
    """
    size = buffer.nbytes
    if size < HEADER.size:
        raise CorruptValue(f"value truncated: {size} bytes is shorter than the {HEADER.size}-byte header")
    head = HEADER.unpack_from(buffer)
    end_of_head = HEADER.size + head[7] + head[5]
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
    _check_header(head)
    _magic, _version, kind, _flags, n_arrays, meta_len, total, descriptors_len, _ = head
    end_of_head = HEADER.size + descriptors_len + meta_len
    if end_of_head > total:
        raise CorruptValue("value descriptors overrun the value")
    end_of_descriptors = HEADER.size + descriptors_len
    position = HEADER.size
    arrays = []
    floor = align(end_of_head)
    for _ in range(n_arrays):
        spec, position = _read_descriptor(buffer, position, end_of_descriptors, floor, total)
        floor = spec.offset + spec.nbytes
        arrays.append(spec)
    if position != end_of_descriptors:
        raise CorruptValue("value descriptor length mismatch")
    meta = bytes(buffer[end_of_head - meta_len : end_of_head])
    on_device = any(spec.lib in DEVICE_LIBS for spec in arrays)
    single = None
    if kind in (KIND_TENSOR, KIND_NDARRAY):
        single = arrays[0]
        if (single.lib in TORCH_LIBS) != (kind == KIND_TENSOR):
            raise CorruptValue("array library does not match the value kind")
    native = None if single is None or single.lib in DEVICE_LIBS else single.recipe
    return ParsedValue(kind, tuple(arrays), meta, total, on_device, single, native)


def _check_header(head: tuple[Any, ...]) -> None:
    """The header fields that need nothing past the header: magic, version, kind and counts."""
    magic, version, kind, _flags, n_arrays, meta_len, _total, _descriptors_len, _ = head
    if magic != MAGIC:
        raise CorruptValue(f"bad value magic {bytes(magic)!r}")
    if version != VERSION:
        raise CorruptValue(f"unsupported value format version {version}")
    if kind not in KIND_NAMES:
        raise CorruptValue(f"unknown value kind {kind}")
    if n_arrays > MAX_ARRAYS or meta_len > MAX_META:
        raise CorruptValue("value header counts out of range")
    expected_arrays = {KIND_TENSOR: 1, KIND_NDARRAY: 1, KIND_TOKEN_IDS: 1, KIND_HIDDEN_STATE_PREFIX: 2}
    if kind in expected_arrays and n_arrays != expected_arrays[kind]:
        raise CorruptValue(f"a {KIND_NAMES[kind]} value holds {expected_arrays[kind]} arrays, not {n_arrays}")


def _read_descriptor(
    buffer: memoryview, position: int, end: int, floor: int, total: int
) -> tuple[ArraySpec, int]:
    """The descriptor at `position` (descriptors end at `end`; its payload must start at or past
    `floor` and end within `total`), and the position of the next one."""
    if position + DESCRIPTOR.size > end:
        raise CorruptValue("value descriptor truncated")
    lib, dtype_len, ndim, name_len, offset, nbytes = DESCRIPTOR.unpack_from(buffer, position)
    position += DESCRIPTOR.size
    tail = position + DIM.size * ndim + dtype_len + name_len
    if tail > end or ndim > MAX_NDIM or not 1 <= lib <= 4:
        raise CorruptValue("value descriptor out of range")
    shape = struct.unpack_from(f"<{ndim}Q", buffer, position)
    position += DIM.size * ndim
    try:
        dtype = bytes(buffer[position : position + dtype_len]).decode("ascii")
        name = bytes(buffer[position + dtype_len : tail]).decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptValue("value descriptor names are not valid text") from None
    if offset % ALIGNMENT or offset < floor or offset + nbytes > total:
        raise CorruptValue(f"array payload [{offset}, {offset + nbytes}) out of bounds")
    return _spec(lib, dtype, shape, offset, nbytes, name), tail


def _spec(lib: int, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int, name: str) -> ArraySpec:
    count, span = 1, 1
    for dim in shape:
        count *= dim
        span *= max(dim, 1)
    try:
        if lib not in TORCH_LIBS:
            numpy_type, torch_type = numpy_dtype(dtype), None
            itemsize = numpy_type.itemsize
            recipe = numpy_recipe(offset, numpy_type, shape, _ALIASING_BY_TYPE[np.ndarray])
        else:
            torch_type = torch_dtype(dtype)
            itemsize = torch_type.itemsize
            recipe = torch_recipe(offset, dtype, torch_type, shape, _tensor_aliasing())
    except UnsupportedValue as exc:
        raise CorruptValue(str(exc)) from None
    if span * itemsize > _MAX_SPAN:  # a zero dimension beside a huge one: strides would overflow
        raise CorruptValue(f"array dimensions {list(shape)} out of range")
    if count * itemsize != nbytes:
        raise CorruptValue(f"array of {dtype} {list(shape)} does not match its {nbytes} bytes")
    return ArraySpec(lib, dtype, shape, offset, nbytes, name, torch_type, recipe)


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
    copy: bool = False,
    base: int = 0,
    *,
    device: DeviceBuilder | None = None,
) -> Value:
    """Build the value that `parsed` describes over `array`, whose byte `base` is the value's
    first byte (already parsed: no checks repeated). Views keep `array` alive. With `device`,
    arrays born on a GPU are built by it instead (see `shmcache.gpu`). (`copy` and `base` may be
    passed by position: the hit path does, a keyword costs a delivery ~0.1 µs.)"""
    single = parsed.single
    if single is not None and (device is None or single.lib not in DEVICE_LIBS):
        return _materialize(array, single, copy, base)  # the common case, in one step
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
    """One array of a value (a numpy array read-only unless a copy)."""
    value = _arrays.build(array, base, spec.recipe)
    if not copy:
        return value
    return value.copy() if spec.torch_dtype is None else value.clone()


def _assemble(parsed: ParsedValue, values: list[Any]) -> Value:
    kind = parsed.kind
    if parsed.single is not None:
        return values[0]
    if kind == KIND_TOKEN_IDS:
        return _token_list(values[0])
    if kind == KIND_HIDDEN_STATE_PREFIX:
        try:
            metadata = json.loads(parsed.meta.decode("utf-8")) if parsed.meta else {}
        except ValueError:
            raise CorruptValue("HiddenStatePrefix metadata is not valid JSON") from None
        if not isinstance(metadata, dict):
            raise CorruptValue("HiddenStatePrefix metadata is not a JSON object")
        # hidden states come back as they went in: a torch tensor, or a numpy array
        return HiddenStatePrefix(_token_list(values[0]), values[1], metadata)
    names = [spec.name for spec in parsed.arrays]
    if len(set(names)) != len(names):
        raise CorruptValue("tensor dict has duplicate names")
    return dict(zip(names, values, strict=True))


def _token_list(array: Any) -> list[int]:
    if not isinstance(array, np.ndarray) or array.dtype != np.int64 or array.ndim != 1:
        raise CorruptValue("token ids must be a flat int64 array")
    tokens: list[int] = array.tolist()
    return tokens


def _array_signature(array: np.ndarray[Any, Any]) -> tuple[Any, ...]:
    return array.shape, array.strides, array.dtype, array.flags.writeable  # memory: not swappable


def _tensor_signature(tensor: Any) -> tuple[Any, ...]:
    return tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype


class Aliasing(NamedTuple):
    """How a repeat hit checks a value of one type returned earlier (`signature`: the memory it
    points at, its shape, strides and dtype; `arrays.c` makes the same of a value it delivers)
    and makes a new handle of it (`alias`)."""

    signature: Callable[[Any], tuple[Any, ...]]
    alias: Callable[[Any], Value]


_ALIASING_BY_TYPE: dict[type, Aliasing] = {np.ndarray: Aliasing(_array_signature, np.ndarray.view)}


def aliasing(value: Value) -> Aliasing | None:
    """How a repeat hit aliases `value`, a value it returned, which its holder may change in place
    (`unsqueeze_`, `t_`, `t.data = ...`, `a.shape = ...`): for a plain array or tensor. None for
    any other value, never aliased (the items of a container, the token ids and metadata of a
    prefix can be replaced: it is rebuilt)."""
    found = _ALIASING_BY_TYPE.get(type(value))  # the common types in one look
    if found is None:
        torch = sys.modules.get("torch")
        if torch is None or type(value) is not torch.Tensor:
            return None
        found = _tensor_aliasing()
    return found


def _tensor_aliasing() -> Aliasing:
    """`aliasing` of a torch tensor (torch is imported)."""
    torch = sys.modules["torch"]
    found = _ALIASING_BY_TYPE.get(torch.Tensor)
    if found is None:
        found = _ALIASING_BY_TYPE[torch.Tensor] = Aliasing(_tensor_signature, torch.Tensor.detach)
    return found


def describe(buffer: memoryview | bytes) -> tuple[str, list[tuple[str, tuple[int, ...]]]]:
    """(kind name, [(dtype, shape), ...]) of an encoded value, without materializing it."""
    parsed = parse(memoryview(buffer))
    return KIND_NAMES[parsed.kind], [(spec.dtype, spec.shape) for spec in parsed.arrays]
