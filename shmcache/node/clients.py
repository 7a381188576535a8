"""Client records: one per attached process, its liveness held by the kernel.

A process claims a free record under the node section and holds the record's liveness semaphore
(+1, SEM_UNDO) until it detaches; the kernel drops it when the process dies, SIGKILL included.
A record is *claimed* when its state is 1 and *live* when it is claimed and its semaphore is up.
Claimed records that are not live belong to the dead: they are reaped (their pins recounted away,
their counters retired) under the node section.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from shmcache.errors import SemaphoreTimeout
from shmcache.kernel.semaphores import SemaphoreSet
from shmcache.node.layout import CLIENT_HEAD, IndexBuffer, Layout

__all__ = ["ClientIdentity", "ClientTable"]

_CLAIMED = 1


@dataclass(frozen=True)
class ClientIdentity:
    """A process as the index knows it: its record, pid and kernel start time (pids are reused,
    the pair is not)."""

    row: int
    pid: int
    start_ticks: int


def start_ticks(pid: int) -> int:
    """The kernel start time of `pid` in clock ticks (0 if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


class ClientTable:
    """The client records of one mapped index."""

    def __init__(self, idx: memoryview, layout: Layout, buf: IndexBuffer, sems: SemaphoreSet) -> None:
        self._idx, self._layout, self._sems = idx, layout, sems
        stride = (layout.client_size,)
        self.states = np.ndarray((layout.clients,), "<u4", buf, layout.clients_off, stride)
        self.pids = np.ndarray((layout.clients,), "<u4", buf, layout.clients_off + 4, stride)

    def claim(self) -> int | None:
        """Claim a free record for this process (the caller holds the node section); None if all
        are claimed."""
        for row in range(self._layout.clients):
            if self.states[row] == 0 and self._sems.try_acquire(self._layout.client_sem(row)):
                self.clear(row)
                pid = os.getpid()
                off = self._layout.client_off(row)
                self._idx[off : off + CLIENT_HEAD.size] = CLIENT_HEAD.pack(
                    _CLAIMED, pid, start_ticks(pid), time.time()
                )
                return row
        return None

    def clear(self, row: int) -> None:
        """Zero record `row` (pins and counters included): it is free again."""
        off = self._layout.client_off(row)
        self._idx[off : off + self._layout.client_size] = bytes(self._layout.client_size)

    def release(self, row: int) -> None:
        """Give up the liveness of `row` (after it was retired)."""
        self._sems.release(self._layout.client_sem(row))

    def claimed(self) -> np.ndarray:
        """Boolean array: records claimed by a process, alive or dead."""
        claimed: np.ndarray = self.states == _CLAIMED
        return claimed

    def live(self) -> np.ndarray:
        """Boolean array: records held by a live process (kernel-tracked)."""
        values = self._sems.values()
        first = self._layout.client_sem(0)
        live: np.ndarray = (values[first : first + self._layout.clients] != 0) & self.claimed()
        return live

    def dead(self) -> list[int]:
        """Rows claimed by processes that died."""
        return [int(row) for row in np.nonzero(self.claimed() & ~self.live())[0]]

    def gone_within(self, row: int, timeout: float) -> bool:
        """Whether the process of `row` is gone, waiting up to `timeout` seconds for the kernel to
        drop its liveness. A process killed holding a lock hands the lock on (robust mutex) a
        moment before that: its semaphores are undone only when its last thread has exited."""
        try:
            self._sems.wait_zero(self._layout.client_sem(row), timeout)
        except SemaphoreTimeout:
            return False
        return True

    def identity(self, row: int) -> ClientIdentity:
        _state, pid, ticks, _attached = CLIENT_HEAD.unpack_from(self._idx, self._layout.client_off(row))
        return ClientIdentity(row, pid, ticks)

    def alive(self, who: ClientIdentity) -> bool:
        """True if the process `who` still holds its record."""
        if not 0 <= who.row < self._layout.clients:
            return False
        if self._sems.value(self._layout.client_sem(who.row)) == 0:
            return False
        return self.states[who.row] == _CLAIMED and self.identity(who.row) == who
