"""How a stored torch array is made a tensor again: as a numpy array of its numpy twin, or over
DLPack as torch itself reads it (the DLPack type asked of torch, never written down here)."""

from __future__ import annotations

import sys
from functools import cache
from typing import Any, NamedTuple

import numpy as np

from shmcache.errors import UnsupportedValue
from shmcache.format import _arrays
from shmcache.keys.dtypes import numpy_dtype

__all__ = ["DLType", "TensorReading", "tensor_reading"]


class DLType(NamedTuple):
    """An element type as DLPack names it (dlpack.h's DLDataType), as this torch reads it back."""

    code: int
    bits: int
    lanes: int


class TensorReading(NamedTuple):
    """How the tensor of one torch dtype is made over stored bytes: exactly one of `np_dtype`
    and `dlpack` is set."""

    np_dtype: np.dtype[Any] | None  # its numpy twin: a numpy array made in C, `torch.from_numpy`
    dlpack: DLType | None  # else the DLPack type of a tensor made in C, `torch.from_dlpack`
    view_as: Any  # the torch dtype that DLPack tensor is viewed as (one DLPack lacks); None: none


def tensor_reading(name: str, torch_type: Any) -> TensorReading:
    """How a tensor of `torch_type` (canonical name `name`) is made: over its numpy twin (the
    cheaper step for those: 0.7 µs), else (bfloat16, float8 & co) over DLPack as its own dtype
    (0.75 µs, against 1.15 µs as integers of its size viewed as it), else (bits8 & co, which
    DLPack lacks) over DLPack as the integer of its size, viewed as it. `UnsupportedValue` if
    there is no such integer."""
    try:
        twin = numpy_dtype(name)
        if twin.itemsize == torch_type.itemsize:
            return TensorReading(twin, None, None)
    except UnsupportedValue:
        pass
    own = _dlpack_type(torch_type)
    if own is not None:
        return TensorReading(None, own, None)
    integer = getattr(sys.modules["torch"], f"int{8 * torch_type.itemsize}", None)
    carrier = None if integer is None else _dlpack_type(integer)
    if carrier is None:
        raise UnsupportedValue(f"torch dtype {name}: no {torch_type.itemsize}-byte type to read it as")
    return TensorReading(None, carrier, torch_type)


@cache
def _dlpack_type(torch_type: Any) -> DLType | None:
    """The DLPack type this torch exchanges `torch_type` as (read from a capsule it made of one
    element, viewed from bytes: no warning for an experimental dtype); None if it exchanges none
    (`BufferError`)."""
    torch = sys.modules["torch"]
    try:
        capsule = torch.empty(torch_type.itemsize, dtype=torch.uint8).view(torch_type).__dlpack__()
    except BufferError:
        return None
    return DLType(*_arrays.dltype(capsule))
