"""Who owns a namespace's objects: each one is verified before it is attached to, trusted or wiped.

A namespace's files live in /dev/shm, a directory every local user can create names in, and its
semaphore set in the machine-wide SysV IPC table, so another user can create objects under the
names a namespace of ours would have ("squatting"). Nothing of a namespace is used before:

- files (the lock file, the index and the arena): opened with ``O_NOFOLLOW`` (a symbolic link is
  refused) and ``O_NONBLOCK`` (a FIFO cannot hang the open), then checked with ``fstat`` on the
  opened descriptor, never by name: a regular file, owned by the namespace's uid, with permission
  bits no wider than the allowed mode;
- the semaphore set the index header names: ``IPC_STAT`` owner and creator are the namespace's
  uid, its permission bits no wider than the allowed mode.

A mismatch raises `ForeignObject` naming the object and its owner uid; the caller then attaches,
creates and wipes nothing. An object the kernel does not let us open (another user's 0600 file)
is a `ForeignObject` too, never a bare `PermissionError`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
from dataclasses import dataclass
from typing import Final

from shmcache.errors import ForeignObject

__all__ = [
    "Expected",
    "SemOwner",
    "check_fd",
    "check_semaphores",
    "open_verified",
    "owner_by_name",
    "semaphore_owner",
]

_IPC_STAT: Final = 2
_FILE_FLAGS: Final = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_semctl = _libc.semctl
_semctl.restype = ctypes.c_int


@dataclass(frozen=True)
class Expected:
    """What a namespace's objects must be: owned by `uid`, permission bits within `mode` (None:
    any bits, for read-only tools that trust nothing they read)."""

    uid: int
    mode: int | None


def owner_by_name(path: str) -> str:
    """The owner of `path` for an error message only (no decision is taken on it)."""
    try:
        return str(os.lstat(path).st_uid)
    except OSError:
        return "unknown"


def open_verified(
    path: str, flags: int, expected: Expected, what: str, create_mode: int = 0o600
) -> int | None:
    """Open `path` (never following a link) and verify the file; None if it does not exist.

    Raises `ForeignObject` if it is a link, not a regular file, not ours, too widely readable or
    writable, or not accessible to us; `FileExistsError` passes through for ``O_EXCL`` callers.
    """
    try:
        fd = os.open(path, flags | _FILE_FLAGS, create_mode)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise ForeignObject(
            f"{what} {path} (owner uid {owner_by_name(path)}) is not accessible to uid {os.geteuid()}"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ForeignObject(
                f"{what} {path} is a symbolic link (owner uid {owner_by_name(path)}): refused"
            ) from None
        raise
    try:
        check_fd(fd, path, expected, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_fd(fd: int, path: str, expected: Expected, what: str) -> os.stat_result:
    """`ForeignObject` unless the open file `fd` is a regular file that `expected` allows."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ForeignObject(f"{what} {path} is not a regular file (owner uid {st.st_uid})")
    if st.st_uid != expected.uid:
        raise ForeignObject(f"{what} {path} is owned by uid {st.st_uid}, not by uid {expected.uid}")
    bits = stat.S_IMODE(st.st_mode)
    if expected.mode is not None and bits & ~expected.mode:
        raise ForeignObject(
            f"{what} {path} (owner uid {st.st_uid}) has mode {bits:#o}, wider than the configured "
            f"{expected.mode:#o}"
        )
    return st


@dataclass(frozen=True)
class SemOwner:
    """The ownership fields of a SysV semaphore set (`IPC_STAT`'s ``sem_perm``)."""

    uid: int
    cuid: int
    mode: int


def semaphore_owner(semid: int) -> SemOwner | None:
    """Owner, creator and permission bits of set `semid`; None if no such set exists.

    Raises `ForeignObject` if the set exists but we may not read it (another user's set).
    """
    if not 0 <= semid <= 0x7FFFFFFF:
        return None
    buf = ctypes.create_string_buffer(512)  # struct semid_ds, with room to spare on every ABI
    if _semctl(ctypes.c_int(semid), ctypes.c_int(0), ctypes.c_int(_IPC_STAT), buf) < 0:
        code = ctypes.get_errno()
        if code in (errno.EACCES, errno.EPERM):
            raise ForeignObject(f"semaphore set {semid} is not accessible to uid {os.geteuid()}")
        return None  # EINVAL / EIDRM: there is no such set (any other error: treat it as absent)
    # struct ipc_perm (Linux, every ABI glibc supports): key i32, uid u32, gid u32, cuid u32,
    # cgid u32, then mode (the low 9 bits are the permissions, whatever the field's width)
    raw = buf.raw
    uid, cuid = int.from_bytes(raw[4:8], "little"), int.from_bytes(raw[12:16], "little")
    return SemOwner(uid, cuid, int.from_bytes(raw[20:22], "little") & 0o777)


def check_semaphores(semid: int, owner: SemOwner, expected: Expected) -> None:
    """`ForeignObject` unless set `semid` (whose `semaphore_owner` is `owner`) is one `expected`
    allows: owner and creator are the namespace's uid, permission bits within the mode."""
    if owner.uid != expected.uid or owner.cuid != expected.uid:
        raise ForeignObject(
            f"semaphore set {semid} is owned by uid {owner.uid} (created by uid {owner.cuid}), "
            f"not by uid {expected.uid}"
        )
    if expected.mode is not None and owner.mode & ~expected.mode:
        raise ForeignObject(
            f"semaphore set {semid} (owner uid {owner.uid}) has mode {owner.mode:#o}, wider than "
            f"the configured {expected.mode:#o}"
        )
