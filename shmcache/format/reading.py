"""How each array of a stored value is made again over its bytes: the `Recipe` that `arrays.c`
follows. A numpy array, or a tensor of a dtype numpy has, is a numpy array made in C (then
`torch.from_numpy`); a tensor of a dtype numpy lacks is made over DLPack as torch itself reads it
(the DLPack type is asked of torch, never written down here)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from shmcache.errors import UnsupportedValue
from shmcache.format import _arrays
from shmcache.keys.dtypes import numpy_dtype

if TYPE_CHECKING:
    from shmcache.format.decode import Aliasing

__all__ = ["DLType", "Recipe", "numpy_recipe", "torch_recipe"]


class DLType(NamedTuple):
    """An element type as DLPack names it (dlpack.h's DLDataType), as this torch reads it back."""

    code: int
    bits: int
    lanes: int


class Recipe(NamedTuple):
    """How `arrays.c` makes one array of a value (it reads the fields by position, in this order).
    Exactly one of `np_dtype` and `dlpack` is set."""

    offset: int  # the array's first byte, counted from the value's first byte
    np_dtype: np.dtype[Any] | None  # made as a numpy array of this dtype (numpy's, or a tensor's twin)
    dlpack: DLType | None  # else as a DLPack tensor of this type
    shape: tuple[int, ...]
    to_torch: Callable[[Any], Any] | None  # `torch.from_numpy` / `torch.from_dlpack`; None: numpy
    view_as: Any  # the tensor then viewed as this torch dtype (one DLPack lacks); None: no view
    layout: tuple[Any, ...] | None  # a tensor's (shape, strides, dtype); None: a numpy array
    aliasing: Aliasing  # how a repeat hit checks and aliases the value (its record holds it)


def numpy_recipe(offset: int, dtype: np.dtype[Any], shape: tuple[int, ...], aliasing: Aliasing) -> Recipe:
    """The recipe of a numpy array (read-only)."""
    return Recipe(offset, dtype, None, shape, None, None, None, aliasing)


def torch_recipe(
    offset: int, name: str, torch_type: Any, shape: tuple[int, ...], aliasing: Aliasing
) -> Recipe:
    """The recipe of a tensor of `torch_type` (canonical name `name`): over its numpy twin (the
    cheaper step for those), else (bfloat16, float8 & co) over DLPack as its own dtype (one step,
    against an integer array viewed as it), else (bits8 & co, which DLPack lacks) over DLPack as
    the integer of its size, viewed as it. `UnsupportedValue` if there is no such integer."""
    torch = sys.modules["torch"]  # imported: `torch_type` is one of its dtypes
    layout = (shape, _contiguous_strides(shape), torch_type)
    try:
        twin = numpy_dtype(name)
        if twin.itemsize == torch_type.itemsize:
            return Recipe(offset, twin, None, shape, torch.from_numpy, None, layout, aliasing)
    except UnsupportedValue:
        pass
    own, view_as = _dlpack_type(torch_type), None
    if own is None:
        integer = getattr(torch, f"int{8 * torch_type.itemsize}", None)
        own, view_as = (None if integer is None else _dlpack_type(integer)), torch_type
        if own is None:
            raise UnsupportedValue(f"torch dtype {name}: no {torch_type.itemsize}-byte type to read it as")
    return Recipe(offset, None, own, shape, torch.from_dlpack, view_as, layout, aliasing)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of a C-contiguous torch tensor of `shape` (a dimension of 0 counts as 1,
    as torch counts it)."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


@cache
def _dlpack_type(torch_type: Any) -> DLType | None:
    """The DLPack type this torch exchanges `torch_type` as (read from a capsule it made of one
    element, viewed from bytes: no warning for an experimental dtype); None if it exchanges none
    (torch 2.13 raises `BufferError`; the others are what another torch might raise)."""
    torch = sys.modules["torch"]
    try:
        capsule = torch.empty(torch_type.itemsize, dtype=torch.uint8).view(torch_type).__dlpack__()
    except (BufferError, RuntimeError, TypeError, ValueError):
        return None
    return DLType(*_arrays.dltype(capsule))
