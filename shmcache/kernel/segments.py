"""The mapped objects of an attached namespace, and the one way a whole segment is mapped."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

from shmcache.kernel.cowmap import CowMapper
from shmcache.kernel.names import ObjectNames
from shmcache.kernel.semaphores import SemaphoreSet
from shmcache.node.layout import Layout

__all__ = ["Segments", "map_whole"]


@dataclass
class Segments:
    """The mapped objects of an attached namespace."""

    names: ObjectNames
    layout: Layout
    index: mmap.mmap
    arena: mmap.mmap
    arena_views: CowMapper  # copy-on-write views of the arena: what readers are given
    capacity: int
    sems: SemaphoreSet

    def close(self) -> None:
        """Close the arena's descriptor (the mappings stay until they are collected)."""
        self.arena_views.close()


def map_whole(fd: int | None) -> mmap.mmap | None:
    """A shared read-write mapping of the whole file `fd` (None for no file or an empty one)."""
    if fd is None:
        return None
    size = os.fstat(fd).st_size
    return mmap.mmap(fd, size) if size else None
