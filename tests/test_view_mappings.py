"""The mappings under views (kernel/cowmap.py, mapping.c): what an idle mapping keeps for the next
view of the same bytes, against real files and this process's page tables (/proc/self/pagemap)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

from shmcache.kernel.cowmap import CowMapper
from tests.helpers import pages_present


def test_an_idle_mapping_keeps_its_pages_mapped_unless_a_view_wrote_one(tmp_path: Path) -> None:
    """A large view's mapping, idle after its death, keeps the file's pages mapped for the next
    view of the same bytes (no faults to read them again), but is reset once a view wrote a page:
    the next view reads the file, not the old view's copy. A small one is always reset."""
    size = 1 << 20
    fd = os.open(tmp_path / "arena", os.O_RDWR | os.O_CREAT)
    os.pwrite(fd, b"\x11" * size, 0)
    mapper = CowMapper(fd)
    view = mapper.view(0, size)
    assert int(view.sum()) == 0x11 * size  # read: every page mapped
    address = view.ctypes.data
    del view
    gc.collect()
    again = mapper.view(0, size)
    assert again.ctypes.data == address  # the idle mapping, reused
    assert pages_present(again) == size // 4096  # still mapped: it was not written
    again[size // 2] = 0x22  # a consumer's in-place op: this view's own copy of one page
    del again
    gc.collect()
    third = mapper.view(0, size)
    assert third.ctypes.data == address
    assert pages_present(third) == 0  # reset: the written copy was dropped (before reading it)
    assert int(third[size // 2]) == 0x11 and os.pread(fd, 1, size // 2) == b"\x11"  # the file's byte
    del third
    small = mapper.view(0, 4096)
    int(small.sum())
    del small
    gc.collect()
    small = mapper.view(0, 4096)
    assert pages_present(small) == 0  # below 64 KiB: always reset (one madvise is cheaper)
    del small
    mapper.close()
