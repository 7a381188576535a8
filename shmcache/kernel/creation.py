"""Creating a namespace's objects, in the order that lets a creator killed at any point leave
nothing the next attacher cannot find and wipe (docs/design.md, "Creation order")."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import replace

from shmcache.config import CacheConfig
from shmcache.errors import CapacityError, ForeignObject
from shmcache.kernel.cowmap import CowMapper
from shmcache.kernel.names import SHM_DIR, ObjectNames
from shmcache.kernel.ownership import Expected, open_verified, owner_by_name
from shmcache.kernel.segments import Segments, map_whole
from shmcache.kernel.semaphores import KEY_LIMIT, SemaphoreSet
from shmcache.keys.key import HASH_ALGORITHMS
from shmcache.node import crashpoints
from shmcache.node.crashpoints import CrashPoint
from shmcache.node.layout import H_READY, LAYOUT_VERSION, MAGIC, Header, Layout

__all__ = ["create"]


def create(names: ObjectNames, config: CacheConfig) -> Segments:
    """Create a namespace's objects (the caller holds the bootstrap lock and has wiped)."""
    layout = Layout(config.n_stripes, config.ways, config.max_clients, config.max_pins_per_process)
    _check_room(config, layout)
    created: list[str] = []
    sems: SemaphoreSet | None = None
    try:
        # order matters for a creator killed midway: the index (all zeros: stale) first, then its
        # header without the magic (so a wiper knows the key the set is made under), the semaphore
        # set, named in the header by id, the magic, and the slow arena reservation last; `ready`
        # is set only when everything exists
        index = _map_new(names.index_path, layout.size, config.mode, created)
        layout.init_locks(index)
        header = Header(
            magic=MAGIC,
            layout_version=LAYOUT_VERSION,
            ready=0,
            stripes=layout.stripes,
            ways=layout.ways,
            clients=layout.clients,
            pins=layout.pins,
            capacity=config.capacity_bytes,
            semid=-1,
            signature=secrets.randbelow((1 << 30) - 1) + 1,
            ttl=config.ttl_s or 0.0,
            created=time.time(),
            algorithm=HASH_ALGORITHMS.index(config.hash_algorithm),
            node_held=0,
            journal_row=-1,
            mode=config.mode,
            semkey=0,
        )
        header, sems = _create_set(index, header, config.mode)
        _write_header(index, header)
        index[: len(MAGIC)] = MAGIC  # last: a header without its magic was never finished
        crashpoints.reached(CrashPoint.CREATING_NAMESPACE)
        arena_views = CowMapper(_create_shm(names.arena_path, config.capacity_bytes, config.mode, created))
        try:
            arena = map_whole(arena_views.fd)
            assert arena is not None
            index[H_READY : H_READY + 4] = (1).to_bytes(4, "little")
        except BaseException:
            arena_views.close()
            raise
        return Segments(names, layout, index, arena, arena_views, config.capacity_bytes, sems)
    except BaseException:
        for path in created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if sems is not None:
            sems.remove()
        raise


def _check_room(config: CacheConfig, layout: Layout) -> None:
    """`CapacityError` if /dev/shm has no room for the namespace's index and arena."""
    stat = os.statvfs(SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    needed = config.capacity_bytes + layout.size
    if needed > free:
        raise CapacityError(
            f"{SHM_DIR} has {free / 2**20:.1f} MiB free; namespace {config.namespace!r} needs "
            f"{needed / 2**20:.1f} MiB (capacity_bytes + index). Lower capacity_bytes or enlarge "
            f"{SHM_DIR} (docker: --shm-size)"
        )


def _create_set(index: mmap.mmap, header: Header, mode: int) -> tuple[Header, SemaphoreSet]:
    """Make the namespace's semaphore set under a fresh random key, each key written into the
    header (magic still absent) before the set is made, and sign it; the header naming it."""
    layout = header.layout
    while True:
        header = replace(header, semkey=secrets.randbelow(KEY_LIMIT - 1) + 1)
        _write_header(index, header)
        try:
            with _short_of_room(
                (errno.ENOSPC, errno.ENOMEM, errno.EINVAL),
                f"cannot create a set of {layout.semaphores} semaphores",
            ):
                sems = SemaphoreSet.create(header.semkey, layout.semaphores, mode)
            break
        except FileExistsError:
            continue  # another set has this key: draw again
    try:
        crashpoints.reached(CrashPoint.CREATING_SEMAPHORES)
        sems.set_value(layout.signature_sem, header.signature & 0x7FFF)
        sems.set_value(layout.signature_sem + 1, header.signature >> 15)
    except BaseException:
        sems.remove()
        raise
    return replace(header, semid=sems.semid), sems


def _write_header(index: mmap.mmap, header: Header) -> None:
    """Write every field of `header` but its magic (the creator writes the magic last)."""
    packed = header.pack()
    index[len(MAGIC) : len(packed)] = packed[len(MAGIC) :]


def _map_new(path: str, size: int, mode: int, created: list[str]) -> mmap.mmap:
    """Create `path` with `size` bytes reserved and map it."""
    fd = _create_shm(path, size, mode, created)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _create_shm(path: str, size: int, mode: int, created: list[str]) -> int:
    """Create `path` with `size` bytes reserved; its descriptor (closed if this raises)."""
    expected = Expected(os.geteuid(), mode)
    try:
        fd = open_verified(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, expected, "segment", mode)
    except FileExistsError:
        raise ForeignObject(
            f"segment {path} (owner uid {owner_by_name(path)}) appeared while this process created "
            "the namespace under its lock"
        ) from None
    assert fd is not None
    created.append(path)
    try:
        with _short_of_room(
            (errno.ENOSPC, errno.ENOMEM, errno.EFBIG), f"cannot reserve {size} bytes for {path} in {SHM_DIR}"
        ):
            os.posix_fallocate(fd, 0, size)  # reserve now: a full tmpfs fails here, not with SIGBUS later
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _short_of_room(errnos: tuple[int, ...], what: str) -> Iterator[None]:
    """Raise an `OSError` with one of `errnos` as `CapacityError` saying `what` failed."""
    try:
        yield
    except OSError as exc:
        if exc.errno in errnos:
            raise CapacityError(f"{what}: {exc.strerror}") from None
        raise
