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

Every value round-trips as it was put: 0-d arrays keep shape ``()``, a `HiddenStatePrefix` gets
back hidden states of the library it was stored with (torch or numpy). What cannot be stored is
refused at `plan` with `UnsupportedValue` (meta, nested or sparse tensors, tensor dict keys that
are not valid text, metadata that is not JSON), never accepted and then lost.

No pickle anywhere: a shared segment must not be a code-execution path into other processes.
This module holds the value types and the encoder (`plan`, `encode`); reading is in
`shmcache.format.decode`, which bounds-checks every field and raises `CorruptValue` for
truncated or malformed input.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from shmcache.errors import UnsupportedValue
from shmcache.kernel import copy_into
from shmcache.keys.dtypes import tensor_bytes
from shmcache.keys.text import short_repr, utf8

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGNMENT",
    "EncodedValue",
    "HiddenStatePrefix",
    "Value",
    "encode",
    "plan",
]

ALIGNMENT: Final = 64
MAGIC: Final = b"SHMV"
VERSION: Final = 1
HEADER = struct.Struct("<4sHBBIIQII")
DESCRIPTOR = struct.Struct("<BBBBQQ")
DIM = struct.Struct("<Q")
MAX_ARRAYS: Final = 65536
MAX_NDIM: Final = 64
MAX_META: Final = 1 << 20

KIND_TENSOR, KIND_NDARRAY, KIND_TOKEN_IDS, KIND_HIDDEN_STATE_PREFIX, KIND_TENSOR_DICT = 1, 2, 3, 4, 5
KIND_NAMES: Final = {
    KIND_TENSOR: "tensor",
    KIND_NDARRAY: "ndarray",
    KIND_TOKEN_IDS: "token_ids",
    KIND_HIDDEN_STATE_PREFIX: "hidden_state_prefix",
    KIND_TENSOR_DICT: "tensor_dict",
}
_LIB_TORCH, _LIB_NUMPY, _LIB_TORCH_CUDA, _LIB_CUDA_ARRAY = 1, 2, 3, 4
TORCH_LIBS: Final = (_LIB_TORCH, _LIB_TORCH_CUDA)
DEVICE_LIBS: Final = (_LIB_TORCH_CUDA, _LIB_CUDA_ARRAY)

MetadataValue = str | int | float | bool | None


@dataclass(frozen=True)
class HiddenStatePrefix:
    """Token ids with the hidden states computed for them, plus JSON-able metadata.

    `hidden_states` is a torch tensor (CPU or CUDA) or a numpy array, and comes back as the same
    kind of array it was stored as.
    """

    token_ids: list[int]
    hidden_states: torch.Tensor | np.ndarray[Any, Any]
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
            copy_into(buffer[offset : offset + data.nbytes], data)

    def to_bytes(self) -> bytes:
        """The encoding as one bytes object (copies; for tests and transport)."""
        out = bytearray(self.total_len)
        self.write_into(memoryview(out))
        return bytes(out)


def align(n: int) -> int:
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
    return hasattr(type(value), "__cuda_array_interface__") and not is_tensor(value)


def is_tensor(value: Any) -> bool:
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
    if is_tensor(value) and value.device.type == "cuda":
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
        if len(value) > MAX_ARRAYS:  # refused before any array is read (a CUDA one is copied)
            raise UnsupportedValue(f"a value holds at most {MAX_ARRAYS} arrays, got {len(value)}")
        arrays = []
        for name, item in value.items():
            if not isinstance(name, str):
                raise UnsupportedValue(f"tensor dict keys must be str, got {type(name).__name__}")
            if len(utf8(name, "a tensor dict key", UnsupportedValue)) > 255:
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
            raise UnsupportedValue(
                f"metadata {short_repr(name)}: names are str, values str, int, float, bool or None"
            )
    try:
        raw = json.dumps(dict(metadata), sort_keys=True, allow_nan=False).encode()
    except ValueError as exc:
        raise UnsupportedValue(f"metadata is not JSON-safe: {exc}") from None
    if len(raw) > MAX_META:
        raise UnsupportedValue(f"metadata is limited to {MAX_META} bytes of JSON")
    return raw


def plan(value: Value) -> EncodedValue:
    """Lay out `value` without copying its payload; raises `UnsupportedValue` for other types."""
    kind, arrays, meta = _classify(value)
    descriptors = []
    for array in arrays:
        dtype_raw, name_raw = array.dtype.encode(), array.name.encode()
        if len(array.shape) > MAX_NDIM:
            raise UnsupportedValue(f"at most {MAX_NDIM} dimensions are supported")
        descriptors.append((array, dtype_raw, name_raw))
    descriptors_len = sum(
        DESCRIPTOR.size + DIM.size * len(a.shape) + len(d) + len(n) for a, d, n in descriptors
    )
    offset = align(HEADER.size + descriptors_len + len(meta))
    parts = []
    payloads = []
    device_payloads = []
    for array, dtype_raw, name_raw in descriptors:
        nbytes = array.data.nbytes
        parts.append(
            DESCRIPTOR.pack(array.lib, len(dtype_raw), len(array.shape), len(name_raw), offset, nbytes)
        )
        parts.extend(DIM.pack(dim) for dim in array.shape)
        parts += (dtype_raw, name_raw)
        payloads.append((offset, array.data))
        if array.device is not None and nbytes:
            device_payloads.append((offset, array.device))
        offset = align(offset + nbytes)
    if len({str(tensor.device) for _, tensor in device_payloads}) > 1:
        raise UnsupportedValue("the CUDA arrays of one value must be on one device")
    total = offset
    header = HEADER.pack(MAGIC, VERSION, kind, 0, len(arrays), len(meta), total, descriptors_len, 0)
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
