"""Type stub of the copy-on-write mapping extension (mapping.c)."""

from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

class Mapping:
    """Some bytes of a file mapped copy-on-write (a writable buffer); the mapping is unmapped when
    the last Mapping over it dies."""

    def on_death(self, callback: Callable[[_T], object], arg: _T, /) -> None: ...

def map_private(fd: int, offset: int, size: int, /) -> Mapping: ...
def map_private_many(fd: int, offsets: list[int], sizes: list[int], /) -> list[Mapping]: ...
