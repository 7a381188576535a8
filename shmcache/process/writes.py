"""`Writes`: this process's writes into its reservations' extents, and their end at the detach.

A reservation's extent is written by its holder alone, outside any node lock (a commit's copy, a
pull's transfer and seal). The detach withdraws the reservations this process still holds, which
frees their extents for other processes; so a write must never run into an extent the detach
freed. Each write runs inside `writing` and the detach calls `shut`, both under one lock:

- `writing` refuses (`CacheClosed`) once `shut` ran, before the write touches the extent;
- `shut` waits (bounded) for the writes already running in other threads and returns the
  reservations of those still running, which the detach leaves to them (such a late write ends
  with its seal fenced off, `ReservationLost`, and releases the reservation's semaphore; waiters
  take it over). A write of the thread that runs `shut` (a detach started inside a write: an
  allocation that releases dead views' pins of a closed cache) is not waited for, which could
  only end at the wait's bound: it is returned as still running.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

from shmcache.errors import CacheClosed

__all__ = ["Writes"]


class Writes:
    """The writes running into this process's reservations' extents, by (slot, gen)."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        # (slot, gen, thread id) of each running write: how many
        self._running: collections.Counter[tuple[int, int, int]] = collections.Counter()
        self._shut = False

    @contextlib.contextmanager
    def writing(self, slot: int, gen: int) -> Iterator[None]:
        """Around a write into reservation (slot, gen)'s extent; `CacheClosed` after `shut`."""
        write = (slot, gen, threading.get_ident())
        with self._changed:
            if self._shut:
                raise CacheClosed("this EmbeddingCache detached: its reservations were withdrawn")
            self._running[write] += 1
        try:
            yield
        finally:
            with self._changed:
                self._running[write] -= 1
                if not self._running[write]:
                    del self._running[write]
                self._changed.notify_all()

    def shut(self, wait_s: float) -> set[tuple[int, int]]:
        """Refuse new writes; wait up to `wait_s` for those running in other threads to end.
        Returns the reservations still being written (their extents must stay reserved)."""
        me = threading.get_ident()
        with self._changed:
            self._shut = True
            self._changed.wait_for(lambda: all(thread == me for _, _, thread in self._running), wait_s)
            return {(slot, gen) for slot, gen, _ in self._running}
