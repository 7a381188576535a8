"""Type stub of the value-array extension (arrays.c)."""

from typing import Any

import numpy as np

from shmcache.format.reading import Recipe

def build(buffer: np.ndarray[Any, np.dtype[np.uint8]], base: int, recipe: Recipe, /) -> Any:
    """The array `recipe` describes (a numpy array, read-only, or a tensor) over `buffer` (a 1-D,
    C-contiguous uint8 ndarray, its base), whose byte `base` is the value's first byte. `ValueError`
    if it does not fit in `buffer`, `TypeError` for arguments of the wrong kind."""

def deliver(
    buffer: np.ndarray[Any, np.dtype[np.uint8]],
    base: int,
    recipe: Recipe,
    record_type: type[tuple[Any, ...]],
    sealed: Any,
    parsed: Any,
    /,
) -> tuple[Any, Any]:
    """(value, record) of a hit: the value as `build` makes it, and `record_type(sealed,
    weakref(buffer), parsed, weakref(value), signature, recipe.aliasing, None)`, the signature
    being what `recipe.aliasing.signature` reads from the value as returned."""

def deliver_many(
    buffers: list[np.ndarray[Any, np.dtype[np.uint8]]],
    base: int,
    recipes: list[Recipe | None],
    record_type: type[tuple[Any, ...]],
    sealeds: list[Any],
    parseds: list[Any],
    /,
) -> list[tuple[Any, Any]]:
    """`deliver` of each hit of a batch (four lists of one length), as (value, record) pairs in
    their order; all or none (`ValueError` if the lists differ in length)."""

def dltype(capsule: Any, /) -> tuple[int, int, int]:
    """(code, bits, lanes) of the tensor in a "dltensor" capsule not yet taken over."""
