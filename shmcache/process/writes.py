"""`Writes`: this process's writes into its reservations' extents, and their end at the detach.

A reservation's extent is written by its holder alone, outside any node lock (a commit's copy, a
pull's transfer and seal). The detach withdraws the reservations this process still holds, which
frees their extents for other processes; so a write must never run into an extent the detach
freed. Each write runs inside `writing` and the detach calls `shut`, both under one lock:

- `writing` refuses (`CacheClosed`) once `shut` ran, before the write touches the extent;
- `shut` waits (bounded) for the writes already running and returns the reservations of those
  still running, which the detach leaves to them (such a late write ends with its seal fenced
  off, `ReservationLost`, and releases the reservation's semaphore; waiters take it over).
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
        self._running: collections.Counter[tuple[int, int]] = collections.Counter()
        self._shut = False

    @contextlib.contextmanager
    def writing(self, slot: int, gen: int) -> Iterator[None]:
        """Around a write into reservation (slot, gen)'s extent; `CacheClosed` after `shut`."""
        with self._changed:
            if self._shut:
                raise CacheClosed("this EmbeddingCache detached: its reservations were withdrawn")
            self._running[(slot, gen)] += 1
        try:
            yield
        finally:
            with self._changed:
                self._running[(slot, gen)] -= 1
                if not self._running[(slot, gen)]:
                    del self._running[(slot, gen)]
                self._changed.notify_all()

    def shut(self, wait_s: float) -> set[tuple[int, int]]:
        """Refuse new writes; wait up to `wait_s` for the running ones to end. Returns the
        reservations still being written (their extents must stay reserved)."""
        with self._changed:
            self._shut = True
            self._changed.wait_for(lambda: not self._running, wait_s)
            return set(self._running)
