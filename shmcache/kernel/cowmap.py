"""Copy-on-write views of a shared file: what readers are given, so no write reaches the node's copy.

Each view is its own `MAP_PRIVATE` mapping of the pages that hold the requested bytes. Until a page
is written it is the shared page itself (the kernel maps the file's page: no copy, and a change made
through the shared mapping is seen); the first write to a page gives this mapping a private copy
of it, so a consumer's in-place op changes what this mapping shows and nothing else: not the node's
copy, not another process, not another view. A mapping per view (not one private mapping of the
whole arena) is what makes that exact: a long-lived private mapping would keep a written page
after the bytes around it were freed and reused by another entry, and then show stale bytes of
that entry. The mapping is unmapped when the returned array and every array derived from it die.

`mmap` here is libc's (through ctypes), not Python's: Python's `mmap.mmap` duplicates the file
descriptor for each mapping, which would cost a descriptor per live view.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import weakref
from typing import Any, Final, cast

import numpy as np

from shmcache.errors import CacheClosed, CapacityError

__all__ = ["CowMapper"]

_PAGE: Final = mmap.PAGESIZE
_MAP_NORESERVE: Final = 0x4000  # no commit charge for the whole length: only written pages cost
_MAP_FAILED: Final = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class CowMapper:
    """Copy-on-write views of the file open as `fd` (the mapper owns the descriptor)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @property
    def fd(self) -> int:
        """The file's descriptor (`CacheClosed` once closed)."""
        if self._fd is None:
            raise CacheClosed("the arena's descriptor is closed: the cache detached")
        return self._fd

    def view(self, offset: int, size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """A writable uint8 array of `size` bytes at `offset`, over a private mapping of its pages;
        the mapping is removed when the array (and everything derived from it) is gone."""
        fd = self.fd
        start = offset - offset % _PAGE
        length = -(-(offset + size - start) // _PAGE) * _PAGE
        address = _libc.mmap(
            None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_NORESERVE, fd, start
        )
        if address in (None, _MAP_FAILED):
            code = ctypes.get_errno()
            if code == errno.ENOMEM:  # the process's mapping count (vm.max_map_count) or address space
                raise CapacityError(f"cannot map {length} bytes for a view: {os.strerror(code)}")
            raise OSError(code, os.strerror(code))
        pages = (ctypes.c_uint8 * length).from_address(address)
        array = np.frombuffer(cast(Any, pages), dtype=np.uint8, count=size, offset=offset - start)
        weakref.finalize(array, _libc.munmap, address, length)
        return array

    def close(self) -> None:
        """Close the descriptor; views made earlier stay valid."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
