"""The bootstrap lock: one flock on ``/dev/shm/shmcache.UID.NS.lock`` serialises attach, detach,
wipe and destroy of a namespace; the kernel releases it when its holder dies.

The lock file is opened without following links and verified on its descriptor before it is
locked (`ForeignObject` if another user made it, or if it is wider than the configured mode).
A failed open of a namespace does not leave the lock file behind: if the body under the lock
raises, the file is unlinked when this call created it, or when the namespace has no index left
(nothing live can need it, and we hold the lock: a waiter sees the name gone and starts over).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

from shmcache.errors import SemaphoreTimeout
from shmcache.kernel.names import ObjectNames
from shmcache.kernel.ownership import Expected, open_verified

__all__ = ["ANY_MODE", "bootstrap_lock"]

ANY_MODE = 0o777  # `widest` for callers that check the owner only (destroy: any mode of ours goes)


@contextlib.contextmanager
def bootstrap_lock(
    names: ObjectNames, mode: int, timeout: float, *, create: bool = True, widest: int | None = None
) -> Iterator[bool]:
    """Hold the namespace's flock; yields False (holding nothing) if `create` is off and the lock file
    is gone, which means the namespace was destroyed. Retries if the file is unlinked while we wait.

    The lock file is verified first (`ForeignObject`: another user's, a link, or wider than
    `widest`, which defaults to `mode` when `create` and to any mode otherwise). If the body
    fails, the lock file is removed when this call created it or when the namespace has no index
    left (nothing live can need it; we hold the lock)."""
    deadline = time.monotonic() + timeout
    expected = Expected(names.uid, widest if widest is not None else mode if create else None)
    while True:
        opened = _open_lock(names, mode, expected, create)
        if opened is None:
            yield False
            return
        fd, created = opened
        try:
            _flock(fd, names, deadline, timeout)
            identity = os.fstat(fd)
            current = _lstat(names.lock_path)
            if current is not None and (current.st_ino, current.st_dev) == (identity.st_ino, identity.st_dev):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the file we locked was unlinked by a destroyer: lock the new one
    try:
        yield True
    except BaseException:
        if create and (created or not os.path.lexists(names.index_path)):
            _unlink_lock_if(names, identity)
        raise
    finally:
        os.close(fd)  # closing the only descriptor releases the flock


def _open_lock(names: ObjectNames, mode: int, expected: Expected, create: bool) -> tuple[int, bool] | None:
    """(descriptor, created by this call) of the verified lock file; None if absent and not `create`."""
    while True:
        if create:
            try:
                fd = open_verified(
                    names.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, expected, "lock file", mode
                )
            except FileExistsError:
                pass
            else:
                assert fd is not None
                return fd, True
        fd = open_verified(names.lock_path, os.O_RDWR, expected, "lock file")
        if fd is not None:
            return fd, False
        if not create:
            return None  # else: unlinked between our two opens; create it again


def _flock(fd: int, names: ObjectNames, deadline: float, timeout: float) -> None:
    delay = 0.0005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise SemaphoreTimeout(f"bootstrap lock {names.lock_path} busy for {timeout:.1f}s") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _unlink_lock_if(names: ObjectNames, identity: os.stat_result) -> None:
    """Unlink the lock file if the name still refers to the file we hold."""
    current = _lstat(names.lock_path)
    if current is not None and (current.st_ino, current.st_dev) == (identity.st_ino, identity.st_dev):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(names.lock_path)
