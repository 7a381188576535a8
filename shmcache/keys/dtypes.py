"""Canonical dtype names and raw-byte access for torch tensors and numpy arrays.

A torch dtype and the numpy dtype of the same values share one canonical name ("float32",
"bfloat16", ...), so a key or a stored value does not depend on which library held the data.
"""

from __future__ import annotations

import re
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from shmcache.errors import CudaError, UnsupportedValue

if TYPE_CHECKING:
    import torch

__all__ = ["numpy_dtype", "tensor_bytes", "torch_dtype", "torch_dtype_name"]

# quantized dtypes need a quantizer; sub-byte int1..int7/uint1..uint7 are shells torch cannot fill
_SHELL_DTYPE = re.compile(r"^(q|qu)int|^u?int[1-7]$")
# numpy kinds stored as raw bytes: bool, signed, unsigned, float, complex
_NUMPY_KINDS = "biufc"


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    found = {}
    for attribute in dir(torch):
        candidate = getattr(torch, attribute)
        if not isinstance(candidate, torch.dtype):
            continue
        name = str(candidate).removeprefix("torch.")
        if not _SHELL_DTYPE.match(name):
            found[name] = candidate
    return found


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical name; `UnsupportedValue` if this torch has none."""
    try:
        return _torch_dtypes()[name]
    except KeyError:
        raise UnsupportedValue(f"torch has no dtype {name!r}") from None


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in _torch_dtypes():
        raise UnsupportedValue(f"dtype {dtype} cannot be stored as raw bytes")
    return name


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The native-byte-order numpy dtype of a canonical name."""
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise UnsupportedValue(f"numpy has no dtype {name!r}") from None
    if dtype.kind not in _NUMPY_KINDS:
        raise UnsupportedValue(f"numpy dtype {name!r} cannot be stored as raw bytes")
    return dtype


def tensor_bytes(tensor: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """(canonical dtype name, shape, C-contiguous bytes) of a torch tensor or numpy array.

    CUDA tensors are copied to the host; non-contiguous inputs are made contiguous; numpy arrays
    in non-native byte order are converted to native order; 0-d arrays stay 0-d (shape ``()``).
    Raises `UnsupportedValue` for object, string, quantized, sparse, nested and meta data, and
    `CudaError` if a CUDA tensor cannot be copied to the host.
    """
    if isinstance(tensor, np.ndarray):
        if tensor.dtype.kind not in _NUMPY_KINDS:
            raise UnsupportedValue(f"numpy dtype {tensor.dtype} cannot be stored as raw bytes")
        # np.asarray keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d: a false hit)
        array = np.asarray(tensor, dtype=tensor.dtype.newbyteorder("="), order="C")
        return array.dtype.name, tuple(array.shape), _byte_view(array)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None  # type: ignore[assignment]
    if torch is None or not isinstance(tensor, torch.Tensor):
        raise UnsupportedValue(f"expected a torch.Tensor or numpy.ndarray, got {type(tensor).__name__}")
    if tensor.is_nested:
        raise UnsupportedValue("nested tensors cannot be stored or hashed (no single shape)")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise UnsupportedValue(f"only strided tensors can be stored, got layout {tensor.layout}")
    if tensor.is_quantized:
        raise UnsupportedValue("quantized tensors cannot be stored as raw bytes")
    if tensor.device.type == "meta":
        raise UnsupportedValue("meta tensors have no data to store or hash")
    name = torch_dtype_name(tensor.dtype)
    host = tensor.detach()
    try:
        if host.device.type != "cpu":
            host = host.cpu()
        host = host.resolve_conj().resolve_neg().contiguous()
    except (RuntimeError, NotImplementedError) as exc:  # a device or tensor type torch cannot copy
        reason = f"cannot read the data of a {host.device.type} tensor: {str(exc)[:80]}"
        raise (CudaError if host.device.type == "cuda" else UnsupportedValue)(reason) from None
    shape = tuple(host.shape)
    if host.numel() == 0:
        return name, shape, memoryview(b"")
    flat = host.reshape(-1).view(torch.uint8)
    return name, shape, _byte_view(flat.numpy())


def _byte_view(array: np.ndarray[Any, Any]) -> memoryview:
    """A flat unsigned-byte memoryview over a C-contiguous array (no copy)."""
    return array.reshape(-1).view(np.uint8).data if array.size else memoryview(b"")
