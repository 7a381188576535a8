"""Type stub of the copy-on-write mapping extension (mapping.c)."""

from collections.abc import Callable
from typing import Any, TypeVar, overload

import numpy as np
from typing_extensions import Buffer

_T = TypeVar("_T")

class Mapping:
    """Some bytes of a file mapped copy-on-write (a writable buffer); the mapping is unmapped when
    the last Mapping over it dies."""

class Pool:
    """The copy-on-write views of one file (not owning its descriptor); reset mappings of dead
    views are kept for the next view of the same pages."""

    def __init__(self, fd: int) -> None: ...
    @overload
    def map(self, offset: int, size: int, /) -> np.ndarray[Any, np.dtype[np.uint8]]: ...
    @overload
    def map(
        self, offset: int, size: int, on_death: Callable[[_T], object], arg: _T, /
    ) -> np.ndarray[Any, np.dtype[np.uint8]]: ...
    @overload
    def map_many(
        self, offsets: list[int], sizes: list[int], /
    ) -> list[np.ndarray[Any, np.dtype[np.uint8]]]: ...
    @overload
    def map_many(
        self, offsets: list[int], sizes: list[int], on_death: Callable[[_T], object], args: list[_T], /
    ) -> list[np.ndarray[Any, np.dtype[np.uint8]]]: ...
    def disarm(self, view: Any, /) -> bool: ...
    def watched(self) -> int: ...
    def close(self) -> None: ...
    def idle(self) -> int: ...

def is_watched(view: Any, /) -> bool:
    """Whether the death of the bytes under the numpy array `view` calls the `on_death` it was
    made with (`TypeError`: not a view of a Mapping)."""

def copy_into(destination: Buffer, source: Buffer, /) -> None:
    """Copy the bytes of `source` to the start of the writable `destination` (from 2 MiB on x86-64
    with stores that bypass the cache; the GIL released from 64 KiB); `ValueError` if they do not
    fit."""
