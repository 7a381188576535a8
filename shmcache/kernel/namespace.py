"""A namespace's kernel objects: create, verify, attach, wipe and destroy them, under a bootstrap lock.

Objects of namespace NS for user UID (owner-only, mode 0600 by default):

- ``/dev/shm/shmcache.UID.NS.index``  the index segment (POSIX shm, see `shmcache.node.layout`)
- ``/dev/shm/shmcache.UID.NS.arena``  the data arena (POSIX shm, reserved up front with fallocate)
- ``/dev/shm/shmcache.UID.NS.lock``   the bootstrap lock file (flock; released by the kernel at death)
- one SysV semaphore set, made under a random key that the index header records before the set
  is made (so a wiper finds a set its creator died before naming), its id stored in the header

Attach, detach and destroy run under the bootstrap lock. Every object is verified before it is
used or removed (`shmcache.kernel.ownership`): files are opened without following links and
checked on the descriptor (regular, owned by UID, mode no wider than the configured one), the
semaphore set by IPC_STAT (owner and creator UID, mode) and its signature; a mismatch raises
`ForeignObject` and nothing is attached, created or wiped. Tools that only read or clean up
(`config=None`, `create=False`) check the owner, not the mode.

The first attacher after every client died (or after a creator died mid-creation) wipes the stale
objects and creates them afresh; only a *proven-dead* namespace is wiped, and an index whose header
fails its checks is `CorruptSegment`, never stale (`shmcache.kernel.identity` has the rules). A
failed open removes the lock file when it created it, or when no index is left to protect.
"""

from __future__ import annotations

import contextlib
import os

from shmcache.config import CacheConfig
from shmcache.errors import CorruptSegment, LayoutMismatch
from shmcache.kernel.cowmap import CowMapper
from shmcache.kernel.creation import create
from shmcache.kernel.identity import judge, keyed_set, namespace_set, never_written, signed_set
from shmcache.kernel.lockfile import ANY_MODE, bootstrap_lock
from shmcache.kernel.names import PREFIX, SHM_DIR, ObjectNames, list_namespaces, object_names
from shmcache.kernel.ownership import Expected, open_verified
from shmcache.kernel.segments import Segments, map_whole
from shmcache.kernel.semaphores import SemaphoreSet
from shmcache.keys.key import HASH_ALGORITHMS
from shmcache.node.layout import DESTROYED, H_READY, HEADER_SIZE, LAYOUT_VERSION, MAGIC, Header

__all__ = [
    "PREFIX",
    "SHM_DIR",
    "ObjectNames",
    "Segments",
    "bootstrap_lock",
    "create",
    "destroy_namespace",
    "list_namespaces",
    "object_names",
    "open_existing",
    "remove_fragments",
    "remove_objects",
    "wipe",
]


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


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


def _shown(name: str, value: int | float) -> object:
    """A setting as a config spells it (the hash algorithm by its name, not its index)."""
    if name == "hash_algorithm" and isinstance(value, int) and 0 <= value < len(HASH_ALGORITHMS):
        return HASH_ALGORITHMS[value]
    return value


def _expected(names: ObjectNames, config: CacheConfig | None) -> Expected:
    return Expected(names.uid, None if config is None else config.mode)


def open_existing(names: ObjectNames, config: CacheConfig | None) -> Segments | None:
    """Attach to a live namespace. Returns None if it is absent or proven dead (no live client, or
    half-created); the caller then wipes and creates. Raises `ForeignObject` if an object is not
    ours (nothing is touched), `LayoutMismatch` if it is live with other settings and
    `CorruptSegment` if its header is damaged. With `config=None` any settings are taken.
    """
    expected = _expected(names, config)
    index_fd = arena_fd = None
    try:
        index_fd = open_verified(names.index_path, os.O_RDWR, expected, "index segment")
        arena_fd = open_verified(names.arena_path, os.O_RDWR, expected, "arena segment")
        index = map_whole(index_fd)
        if index is None:
            return None  # absent, or its creator died before sizing it
        try:
            found = judge(index, names.index, expected)
            if found is None:
                index.close()
                return None
            header, sems = found
            arena = map_whole(arena_fd)
            if arena is None or len(arena) != header.capacity:
                raise CorruptSegment(f"arena {names.arena} is missing or its size is not the header's")
            if config is not None:
                try:
                    _check_settings(header, config)
                except LayoutMismatch:
                    arena.close()
                    raise
        except BaseException:
            index.close()
            raise
        assert arena_fd is not None  # else `arena` is None: raised above
        segments = Segments(names, header.layout, index, arena, CowMapper(arena_fd), header.capacity, sems)
        arena_fd = None  # the mapper owns it now
        return segments
    finally:
        _close(index_fd)
        _close(arena_fd)


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
        f"{name}: namespace has {_shown(name, t)!r}, config has {_shown(name, o)!r}"
        for name, t, o in zip(_SETTING_NAMES, theirs, _settings(config), strict=True)
        if t != o
    ]
    if diffs:
        raise LayoutMismatch(
            f"namespace {config.namespace!r} is live with other settings: " + "; ".join(diffs)
        )


def wipe(names: ObjectNames, mode: int | None = None) -> None:
    """Remove a namespace's index, arena and (if it is verifiably this namespace's) its semaphore
    set. Every object is verified first (owner always, `mode` when given): `ForeignObject` if one
    is not ours, and then nothing is removed."""
    expected = Expected(names.uid, mode)
    index_fd = arena_fd = None
    try:
        index_fd = open_verified(names.index_path, os.O_RDWR, expected, "index segment")
        arena_fd = open_verified(names.arena_path, os.O_RDWR, expected, "arena segment")
        sems = _set_to_remove(index_fd, expected)
        mark_destroyed(index_fd)
    finally:
        _close(index_fd)
        _close(arena_fd)
    if sems is not None:
        sems.remove()
    for path in (names.index_path, names.arena_path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def mark_destroyed(index_fd: int | None) -> None:
    """Mark a finished index destroyed, so that processes still attached get `CacheClosed` from
    their next call (native.c checks `ready` on entry: the hit path touches no kernel object that
    removing the namespace would take away)."""
    index = map_whole(index_fd)
    if index is None or len(index) < HEADER_SIZE:
        return
    with index:
        if index[: len(MAGIC)] == MAGIC:
            index[H_READY : H_READY + 4] = DESTROYED.to_bytes(4, "little")


def _set_to_remove(index_fd: int | None, expected: Expected) -> SemaphoreSet | None:
    """The semaphore set a (verified) index names, if it is this namespace's: ours, of the size
    the header gives, carrying its signature. A header not finished by its creator still names
    the set it made, by id or (killed before the id was written) by key. `ForeignObject` if the
    set named by id is another user's."""
    index = map_whole(index_fd)
    if index is None or len(index) < HEADER_SIZE:
        return None
    with index:
        raw = bytes(index[:HEADER_SIZE])
    if never_written(raw):
        if raw == bytes(HEADER_SIZE):
            return None
        raw = MAGIC + raw[len(MAGIC) :]  # fields written, magic not yet: trust only a signed set
    try:
        header = Header.read(raw)
        if header.layout_version != LAYOUT_VERSION:
            return None
        if not _plausible(header):  # damaged layout fields: the set is known by its signature
            return signed_set(header, Expected(expected.uid, None))
        if header.semid < 0:  # its creator died before naming the set: it is known by its key
            return keyed_set(header, Expected(expected.uid, None))
        return namespace_set(header, Expected(expected.uid, None), strict=False)
    except CorruptSegment:
        return None  # nothing trustworthy names a semaphore set: leave IPC alone


def _plausible(header: Header) -> bool:
    """Layout fields small enough to size a semaphore set by (the signature decides the rest)."""
    return 1 <= header.stripes <= 1 << 16 and 1 <= header.ways <= 64 and 1 <= header.clients <= 4096


def destroy_namespace(namespace: str, *, timeout: float = 10.0, unless_attached: bool = False) -> bool:
    """Remove every object of `namespace`, attached processes or not (they get `CacheClosed`);
    with `unless_attached`, only if no process is attached, judged under the bootstrap lock (one
    creating or attaching meanwhile counts): False then, nothing removed. Only objects owned by
    this user are removed (`ForeignObject` otherwise, and nothing is)."""
    names = object_names(namespace)
    with bootstrap_lock(names, 0o600, timeout, widest=ANY_MODE):
        live = open_existing(names, None) if unless_attached else None
        if live is None:
            remove_objects(names)
    if live is not None:
        live.close()  # its mappings go with it
    return live is None


def remove_objects(names: ObjectNames) -> None:
    """Wipe a namespace and unlink its lock file (the caller holds the bootstrap lock)."""
    wipe(names)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(names.lock_path)


def remove_fragments(names: ObjectNames) -> list[str]:
    """Remove the index and arena of a namespace that has no lock file (nothing can be running its
    protocol), after verifying they are ours; returns the names removed."""
    present = [name for name in (names.index, names.arena) if os.path.lexists(f"{SHM_DIR}{name}")]
    wipe(names)
    return present
