"""A namespace's kernel objects: create, attach, wipe and destroy them, under a bootstrap lock.

Objects of namespace NS for user UID (owner-only, mode 0600 by default):

- ``/dev/shm/shmcache.UID.NS.index``  the index segment (POSIX shm, see `shmcache.layout`)
- ``/dev/shm/shmcache.UID.NS.arena``  the data arena (POSIX shm, reserved up front with fallocate)
- ``/dev/shm/shmcache.UID.NS.lock``   the bootstrap lock file (flock; released by the kernel at death)
- one SysV semaphore set (IPC_PRIVATE), its id stored in the index header

Attach, detach and destroy run under the bootstrap lock. The first attacher after every client died
(or after a creator died mid-creation) wipes the stale objects and creates them afresh.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import posix_ipc

from shmcache.config import NAMESPACE_PATTERN, CacheConfig
from shmcache.errors import CapacityError, CorruptSegment, InvalidConfig, LayoutMismatch, SemaphoreTimeout
from shmcache.kernel.semaphores import SemaphoreSet
from shmcache.keys.key import HASH_ALGORITHMS
from shmcache.node import crashpoints
from shmcache.node.crashpoints import CrashPoint
from shmcache.node.layout import H_READY, HEADER_SIZE, LAYOUT_VERSION, MAGIC, Header, Layout

__all__ = [
    "SHM_DIR",
    "Segments",
    "bootstrap_lock",
    "create",
    "destroy_namespace",
    "list_namespaces",
    "object_names",
    "open_existing",
    "remove_objects",
    "wipe",
]

SHM_DIR = "/dev/shm"
PREFIX = "shmcache"


@dataclass(frozen=True)
class ObjectNames:
    """The names of a namespace's shared-memory objects."""

    index: str
    arena: str
    lock_path: str


def object_names(namespace: str, uid: int | None = None) -> ObjectNames:
    """Names for `namespace` of user `uid` (default: this process's effective uid);
    `InvalidConfig` for a name that could escape /dev/shm or is not a namespace name."""
    if not isinstance(namespace, str) or not NAMESPACE_PATTERN.match(namespace):
        raise InvalidConfig(f"namespace must match [A-Za-z0-9_.-]{{1,64}}, got {namespace!r}")
    base = f"{PREFIX}.{os.geteuid() if uid is None else uid}.{namespace}"
    return ObjectNames(f"/{base}.index", f"/{base}.arena", f"{SHM_DIR}/{base}.lock")


def list_namespaces(uid: int | None = None) -> list[str]:
    """Namespaces of user `uid` that have an index segment in /dev/shm."""
    prefix = f"{PREFIX}.{os.geteuid() if uid is None else uid}."
    return sorted(
        name[len(prefix) : -len(".index")]
        for name in os.listdir(SHM_DIR)
        if name.startswith(prefix) and name.endswith(".index")
    )


@dataclass
class Segments:
    """The mapped objects of an attached namespace."""

    names: ObjectNames
    layout: Layout
    index: mmap.mmap
    arena: mmap.mmap
    capacity: int
    sems: SemaphoreSet


@contextlib.contextmanager
def bootstrap_lock(names: ObjectNames, mode: int, timeout: float, *, create: bool = True) -> Iterator[bool]:
    """Hold the namespace's flock; yields False (holding nothing) if `create` is off and the lock file
    is gone, which means the namespace was destroyed. Retries if the file is unlinked while we wait."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    while True:
        try:
            fd = os.open(names.lock_path, flags, mode)
        except FileNotFoundError:
            yield False
            return
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise SemaphoreTimeout(
                            f"bootstrap lock {names.lock_path} busy for {timeout:.1f}s"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
            try:
                current = os.stat(names.lock_path)
            except FileNotFoundError:
                current = None
            if current is not None and current.st_ino == os.fstat(fd).st_ino:
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the file we locked was unlinked by a destroyer: lock the new one
    try:
        yield True
    finally:
        os.close(fd)  # closing the only descriptor releases the flock


def _open_shm(name: str) -> mmap.mmap | None:
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        return None
    try:
        if shm.size == 0:
            return None
        return mmap.mmap(shm.fd, shm.size)
    finally:
        shm.close_fd()


def _unlink(name: str) -> None:
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(name)


def _settings(config: CacheConfig) -> tuple[int | float, ...]:
    return (
        config.n_stripes,
        config.ways,
        config.max_clients,
        config.max_pins_per_process,
        config.capacity_bytes,
        config.ttl_s or 0.0,
        HASH_ALGORITHMS.index(config.hash_algorithm),
    )


_SETTING_NAMES = (
    "stripes",
    "ways",
    "max_clients",
    "max_pins_per_process",
    "capacity_bytes",
    "ttl_s",
    "hash_algorithm",
)


def _signature(sems: SemaphoreSet, layout: Layout) -> int:
    return sems.value(layout.signature_sem) | sems.value(layout.signature_sem + 1) << 15


def open_existing(names: ObjectNames, config: CacheConfig | None) -> Segments | None:
    """Attach to a live namespace. Returns None if it is absent or stale (no live client, or
    half-created); the caller then wipes and creates. Raises `LayoutMismatch` if it is live with other
    settings and `CorruptSegment` if its header is damaged. With `config=None` any settings are taken.
    """
    index = _open_shm(names.index)
    if index is None:
        return None
    if len(index) >= HEADER_SIZE and index[: len(MAGIC)] == bytes(len(MAGIC)):
        index.close()  # never written: its creator died before the header (we hold the bootstrap lock)
        return None
    try:
        header = Header.read(index)
    except CorruptSegment:
        index.close()
        raise
    if header.layout_version != LAYOUT_VERSION:
        index.close()
        raise LayoutMismatch(
            f"namespace {names.index} has layout version {header.layout_version}, "
            f"this shmcache writes {LAYOUT_VERSION}"
        )
    layout = header.layout
    sems = SemaphoreSet(header.semid, layout.semaphores)
    stale = (
        header.ready != 1
        or len(index) != layout.size
        or not sems.probe()
        or _signature(sems, layout) != header.signature
    )
    if not stale:
        live = sems.values()[layout.client_sem(0) : layout.client_sem(layout.clients)]
        stale = not live.any()
    if stale:
        index.close()
        return None
    if config is not None:
        try:
            _check_settings(header, config)
        except LayoutMismatch:
            index.close()
            raise
    arena = _open_shm(names.arena)
    if arena is None or len(arena) != header.capacity:
        index.close()
        raise CorruptSegment(f"arena {names.arena} is missing or has the wrong size")
    return Segments(names, layout, index, arena, header.capacity, sems)


def _check_settings(header: Header, config: CacheConfig) -> None:
    """`LayoutMismatch` naming every setting of the live namespace that `config` does not share."""
    theirs = (
        header.stripes,
        header.ways,
        header.clients,
        header.pins,
        header.capacity,
        header.ttl,
        header.algorithm,
    )
    diffs = [
        f"{name}: namespace has {t!r}, config has {o!r}"
        for name, t, o in zip(_SETTING_NAMES, theirs, _settings(config), strict=True)
        if t != o
    ]
    if diffs:
        raise LayoutMismatch(
            f"namespace {config.namespace!r} is live with other settings: " + "; ".join(diffs)
        )


def create(names: ObjectNames, config: CacheConfig) -> Segments:
    """Create a namespace's objects (the caller holds the bootstrap lock and has wiped)."""
    layout = Layout(config.n_stripes, config.ways, config.max_clients, config.max_pins_per_process)
    stat = os.statvfs(SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    needed = config.capacity_bytes + layout.size
    if needed > free:
        raise CapacityError(
            f"{SHM_DIR} has {free / 2**20:.1f} MiB free; namespace {config.namespace!r} needs "
            f"{needed / 2**20:.1f} MiB (capacity_bytes + index). Lower capacity_bytes or enlarge "
            f"{SHM_DIR} (docker: --shm-size)"
        )
    created: list[str] = []
    sems: SemaphoreSet | None = None
    try:
        # order matters for a creator killed midway: the index (all zeros: stale) first, then the
        # semaphore set, named in the header right away (so a wiper finds and removes it), and the
        # slow arena reservation last; `ready` is set only when everything exists
        index = _create_shm(names.index, layout.size, config.mode, created)
        sems = SemaphoreSet.create(layout.semaphores, config.mode)
        sig = secrets.randbelow((1 << 30) - 1) + 1
        sems.set_value(layout.signature_sem, sig & 0x7FFF)
        sems.set_value(layout.signature_sem + 1, sig >> 15)
        ttl, algo = config.ttl_s or 0.0, HASH_ALGORITHMS.index(config.hash_algorithm)
        header = Header(
            magic=MAGIC,
            layout_version=LAYOUT_VERSION,
            ready=0,
            stripes=layout.stripes,
            ways=layout.ways,
            clients=layout.clients,
            pins=layout.pins,
            capacity=config.capacity_bytes,
            semid=sems.semid,
            signature=sig,
            ttl=ttl,
            created=time.time(),
            algorithm=algo,
            node_held=0,
            journal_row=-1,
            mode=config.mode,
        )
        index[:HEADER_SIZE] = header.pack().ljust(HEADER_SIZE, b"\0")
        crashpoints.reached(CrashPoint.CREATING_NAMESPACE)
        arena = _create_shm(names.arena, config.capacity_bytes, config.mode, created)
        index[H_READY : H_READY + 4] = (1).to_bytes(4, "little")
        return Segments(names, layout, index, arena, config.capacity_bytes, sems)
    except BaseException:
        for name in created:
            _unlink(name)
        if sems is not None:
            sems.remove()
        raise


def _create_shm(name: str, size: int, mode: int, created: list[str]) -> mmap.mmap:
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode)
    created.append(name)
    try:
        try:
            os.posix_fallocate(shm.fd, 0, size)  # reserve now: a full tmpfs fails here, not with SIGBUS later
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise CapacityError(
                    f"cannot reserve {size} bytes for {name} in {SHM_DIR}: {exc.strerror}"
                ) from None
            raise
        return mmap.mmap(shm.fd, size)
    finally:
        shm.close_fd()


def wipe(names: ObjectNames) -> None:
    """Remove a namespace's index, arena and (if it is verifiably ours) its semaphore set."""
    index = _open_shm(names.index)
    if index is not None:
        try:
            header = Header.read(index)
            layout = header.layout
            sems = SemaphoreSet(header.semid, layout.semaphores)
            if sems.probe() and _signature(sems, layout) == header.signature:
                sems.remove()
        except CorruptSegment:
            pass  # nothing trustworthy names a semaphore set: leave IPC alone
        finally:
            index.close()
    _unlink(names.index)
    _unlink(names.arena)


def destroy_namespace(namespace: str, *, timeout: float = 10.0) -> None:
    """Remove every object of `namespace`, attached processes or not (they get `CacheClosed`)."""
    names = object_names(namespace)
    with bootstrap_lock(names, 0o600, timeout):
        remove_objects(names)


def remove_objects(names: ObjectNames) -> None:
    """Wipe a namespace and unlink its lock file (the caller holds the bootstrap lock)."""
    wipe(names)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(names.lock_path)
