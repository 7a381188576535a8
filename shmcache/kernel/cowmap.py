"""Copy-on-write views of a shared file: what readers are given, so no write reaches the node's copy.

Each view is its own `MAP_PRIVATE` mapping of the pages that hold the requested bytes. Until a page
is written it is the shared page itself (the kernel maps the file's page: no copy, and a change made
through the shared mapping is seen); the first write to a page gives this mapping a private copy
of it, so a consumer's in-place op changes what this mapping shows and nothing else: not the node's
copy, not another process, not another view. A mapping per view (not one private mapping of the
whole arena) is what makes that exact: a long-lived private mapping would keep a written page
after the bytes around it were freed and reused by another entry, and then show stale bytes of
that entry. When the returned array and every array derived from it die, the mapping is reset
(`madvise(MADV_DONTNEED)` drops its written pages: they read the file again, as in a fresh
mapping) and kept idle for the next view of the same pages, so a repeated get costs no `mmap`;
the pool keeps at most 64 and 256 MiB of them and unmaps them when it closes. A mapping of
64 KiB to 32 MiB that no view wrote (/proc/self/pagemap: no page of it is an anonymous copy) is not
reset: its page-table entries map the file's own pages, so they show whatever the file holds, and
the next view of those pages reads them without page faults.

A batch of views (`view_many`, for `get_many`) shares one mapping per run of nearby extents: the
mapping is then unmapped when the last view of its run dies, and each view's death is reported
on its own. That is still exact: each view exposes only its own entry's bytes (an entry asked for
twice gets two mappings), the pages of a run that no live view exposes are never read again, and
a written page shared by two neighbouring entries was copied with the neighbour's bytes as they
are (sealed entries do not change).

The mappings are made by a small C extension (`Pool` in mapping.c, next to this module): an
object that exports the bytes as a buffer and gives its mapping back when it dies, handed out as a
numpy array made in C over it, so a view costs at most one mmap system call and no Python step
(and Python's `mmap.mmap` would duplicate the file descriptor for each mapping: a descriptor per
live view).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from shmcache.errors import CacheClosed
from shmcache.kernel import _mapping

__all__ = ["CowMapper"]

T = TypeVar("T")


class CowMapper:
    """Copy-on-write views of the file open as `fd` (the mapper owns the descriptor)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._pool = _mapping.Pool(fd)

    @property
    def fd(self) -> int:
        """The file's descriptor (`CacheClosed` once closed)."""
        self._open()
        assert self._fd is not None
        return self._fd

    def _open(self) -> _mapping.Pool:
        """The pool of mappings (`CacheClosed` once closed)."""
        if self._fd is None:
            raise CacheClosed("the arena's descriptor is closed: the cache detached")
        return self._pool

    def view(self, offset: int, size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """A writable uint8 array of `size` bytes at `offset`, over a private mapping of its pages;
        the mapping is reset and kept for reuse when the array (and everything derived from it) is
        gone. `CapacityError` if the process cannot map more (vm.max_map_count, address space)."""
        return self._open().map(offset, size)

    def watched_view(
        self, offset: int, size: int, on_death: Callable[[T], object], arg: T
    ) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """`view` whose death calls `on_death(arg)` once, right after the array and everything
        derived from it are gone; `watched()` counts it from the moment it is made (one native
        step: no signal lands between)."""
        return self._open().map(offset, size, on_death, arg)

    def view_many(self, extents: list[tuple[int, int]]) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
        """`view` of each (offset, size), in order, in one call, all or none: nearby extents share
        a mapping (one system call per run of them)."""
        return self._open().map_many([o for o, _ in extents], [n for _, n in extents])

    def watched_views(
        self, extents: list[tuple[int, int]], on_death: Callable[[T], object], args: list[T]
    ) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
        """`view_many` whose views each call `on_death(args[i])` at their own death, as
        `watched_view`'s."""
        return self._open().map_many([o for o, _ in extents], [n for _, n in extents], on_death, args)

    def disarm(self, view: np.ndarray[Any, np.dtype[np.uint8]]) -> bool:
        """`view`'s death calls nothing after all, and `watched()` no longer counts it (its caller
        gives its pin back itself); False if it was not armed. `TypeError` for anything but a view."""
        return self._pool.disarm(view)

    def watched(self) -> int:
        """How many watched views were made so far, less those disarmed."""
        return self._pool.watched()

    @staticmethod
    def is_watched(view: np.ndarray[Any, np.dtype[np.uint8]]) -> bool:
        """Whether the death of the bytes under `view` calls its `on_death`."""
        return _mapping.is_watched(view)

    def idle(self) -> int:
        """How many reset mappings wait for reuse."""
        return self._pool.idle()

    def close(self) -> None:
        """Unmap the idle mappings and close the descriptor; views made earlier stay valid."""
        fd, self._fd = self._fd, None
        self._pool.close()
        if fd is not None:
            os.close(fd)
