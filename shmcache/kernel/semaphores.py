"""One SysV semaphore set with SEM_UNDO, through libc: the kernel-robust primitive.

The set is made under a random key that its namespace's index records first, so that a creator
killed before the index names the set by id leaves a set that the next attacher can still find
(`find`) and remove: a set made with IPC_PRIVATE would have no name left at all.

Every "hold" is a +1 with SEM_UNDO, so the kernel undoes it when the holder dies, SIGKILL included.
Waiters block in the kernel (wait-for-zero, `semtimedop`) with a timeout: no polling, and a seal,
an abort or the holder's death wakes all of them at once. One set holds every reservation and
client-liveness semaphore of a namespace, so a namespace costs one kernel IPC object. (The short
critical sections are robust mutexes in the index instead: node/native.c says why.)

ctypes releases the GIL around each call, so other threads run while one waits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import time
from typing import Any, Final

import numpy as np

from shmcache.errors import CacheClosed, SemaphoreTimeout

__all__ = ["KEY_LIMIT", "SemaphoreSet", "set_size"]

KEY_LIMIT: Final = 1 << 31  # keys are 1 .. KEY_LIMIT - 1 (0 is IPC_PRIVATE, -1 is no key)

_IPC_CREAT: Final = 0o1000
_IPC_EXCL: Final = 0o2000
_IPC_NOWAIT: Final = 0o4000
_IPC_RMID: Final = 0
_SEM_UNDO: Final = 0x1000
_GETPID: Final = 11
_GETVAL: Final = 12
_GETALL: Final = 13
_SETVAL: Final = 16
_SETALL: Final = 17


class _Sembuf(ctypes.Structure):
    _fields_ = [("sem_num", ctypes.c_ushort), ("sem_op", ctypes.c_short), ("sem_flg", ctypes.c_short)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_semget = _libc.semget
_semget.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
_semget.restype = ctypes.c_int
_semtimedop = _libc.semtimedop
_semtimedop.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_semtimedop.restype = ctypes.c_int
_semctl = _libc.semctl
_semctl.restype = ctypes.c_int


def _raise_errno(what: str) -> None:
    code = ctypes.get_errno()
    if code in (errno.EIDRM, errno.EINVAL):
        raise CacheClosed(f"{what}: the namespace's semaphore set was removed (destroyed?)")
    raise OSError(code, f"{what}: {os.strerror(code)}")


class SemaphoreSet:
    """A set of `count` SysV semaphores identified by `semid`."""

    def __init__(self, semid: int, count: int) -> None:
        self.semid = semid
        self.count = count
        self._prebuilt: dict[tuple[str, int], Any] = {}

    @classmethod
    def create(cls, key: int, count: int, mode: int = 0o600) -> SemaphoreSet:
        """Create a new set under `key` with every value 0; `FileExistsError` if a set has that key."""
        semid = _semget(key, count, _IPC_CREAT | _IPC_EXCL | mode)
        if semid < 0:
            code = ctypes.get_errno()
            detail = "" if code == errno.EEXIST else "; see `ipcs -ls` for limits"
            raise OSError(code, f"semget({key:#x}, {count}): {os.strerror(code)}{detail}")
        return cls(semid, count)

    @staticmethod
    def find(key: int) -> int | None:
        """The id of the set made under `key`, or None if there is none (or it is not readable)."""
        semid = _semget(key, 0, 0)
        return None if semid < 0 else int(semid)

    def probe(self) -> bool:
        """True if `semid` names a set of exactly `count` semaphores that this user can read."""
        if _semctl(self.semid, self.count - 1, _GETVAL) < 0:
            return False
        return bool(_semctl(self.semid, self.count, _GETVAL) < 0)  # one past the end must not exist

    def remove(self) -> None:
        """Remove the set (waiters get EIDRM). Missing sets are ignored."""
        _semctl(self.semid, 0, _IPC_RMID)

    def value(self, index: int) -> int:
        """The current value of one semaphore."""
        result = _semctl(self.semid, index, _GETVAL)
        if result < 0:
            _raise_errno("semctl(GETVAL)")
        return int(result)

    def last_pid(self, index: int) -> int:
        """The pid of the last process that operated on one semaphore."""
        result = _semctl(self.semid, index, _GETPID)
        if result < 0:
            _raise_errno("semctl(GETPID)")
        return int(result)

    def values(self) -> np.ndarray:
        """Every value, in one system call."""
        out = np.zeros(self.count, dtype=np.ushort)
        if _semctl(self.semid, 0, _GETALL, out.ctypes.data_as(ctypes.c_void_p)) < 0:
            _raise_errno("semctl(GETALL)")
        return out

    def set_value(self, index: int, value: int) -> None:
        """Set one value (creation time only: it does not touch undo adjustments)."""
        if _semctl(self.semid, index, _SETVAL, ctypes.c_int(value)) < 0:
            _raise_errno("semctl(SETVAL)")

    def try_acquire(self, index: int) -> bool:
        """If the value is 0, make it 1 (undone by the kernel at death), atomically and without
        waiting; False if it is not 0."""
        return self._nowait("try_acquire", index)

    def join(self, index: int) -> bool:
        """Add this process's hold to a semaphore some process holds (value >= 1 -> value + 1),
        atomically and without waiting; False if its value is 0. Undone by the kernel at death,
        like `acquire`. A reservation changes hands this way without its value ever being 0."""
        return self._nowait("join", index)

    def _nowait(self, what: str, index: int) -> bool:
        """Run the two-operation `what` without waiting; False if it would have to wait."""
        if _semtimedop(self.semid, self._ops(what, index), 2, None) == 0:
            return True
        if ctypes.get_errno() in (errno.EAGAIN, errno.EINTR):
            return False
        _raise_errno(what)
        return False  # pragma: no cover

    def release(self, index: int) -> None:
        """Undo this process's `acquire` (value 1 -> 0, wakes every waiter for zero)."""
        if _semtimedop(self.semid, self._ops("release", index), 1, None) != 0:
            _raise_errno("release")

    def wait_zero(self, index: int, timeout: float | None) -> None:
        """Block until the value is 0 (released, or its holder died); `SemaphoreTimeout` after `timeout`."""
        self._op("wait_zero", index, 1, timeout)

    def _ops(self, what: str, index: int) -> Any:
        """The prebuilt sembuf array of one operation on one semaphore (built once, reused)."""
        key = (what, index)
        ops = self._prebuilt.get(key)
        if ops is None:
            spec = {
                "try_acquire": ((index, 0, _IPC_NOWAIT), (index, 1, _SEM_UNDO | _IPC_NOWAIT)),
                "release": ((index, -1, _SEM_UNDO | _IPC_NOWAIT),),
                # -1 then +2 as one operation: fails while the value is 0; net +1, undone at death
                "join": ((index, -1, _SEM_UNDO | _IPC_NOWAIT), (index, 2, _SEM_UNDO | _IPC_NOWAIT)),
                "wait_zero": ((index, 0, 0),),
            }[what]
            ops = self._prebuilt[key] = (_Sembuf * len(spec))(*(_Sembuf(*op) for op in spec))
        return ops

    def _op(self, what: str, index: int, nops: int, timeout: float | None) -> None:
        ops = self._ops(what, index)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            spec = None
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())
                spec = ctypes.byref(_Timespec(int(left), int((left % 1) * 1e9)))
            if _semtimedop(self.semid, ops, nops, spec) == 0:
                return
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            if code == errno.EAGAIN:
                raise SemaphoreTimeout(f"{what} on semaphore {index} timed out after {timeout:.3f}s")
            _raise_errno(what)


def set_size(semid: int, most: int = 1 << 16) -> int:
    """How many semaphores set `semid` has (0 if it cannot be read): the first index GETVAL
    refuses, found by bisection."""
    low, high = 0, most
    while low < high:
        middle = (low + high) // 2
        if _semctl(semid, middle, _GETVAL) < 0:
            high = middle
        else:
            low = middle + 1
    return low
