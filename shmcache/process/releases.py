"""The release thread: view pins go back to the node when returned views are garbage collected.

Every zero-copy view derives from one holder array per mapping; when the holder dies its mapping
is given back (reset, kept for reuse, or unmapped) and only enqueues its (slot, gen)
(`CowMapper.on_death`). One daemon thread per cache
wakes on the first item, pauses a few milliseconds so releases batch, waits for GPU work still
reading released device aliases, then drops the pins in one node transaction. The pause holds no
item back: `release_now` (the allocator, when the arena is full) and `flush` release everything
queued at once in the calling thread, so a view dead before a `put` never keeps it from evicting.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections.abc import Callable

from shmcache.gpu.side import DeviceSide
from shmcache.node.index import NodeIndex

__all__ = ["Releases"]

log = logging.getLogger("shmcache")
_BATCH_S = 0.005
_WAIT_S = 0.1  # how long flush waits for a batch the release thread holds


class Releases:
    """Counts this process's live views and releases their pins when they die."""

    def __init__(self, node: NodeIndex, device: DeviceSide, on_idle: Callable[[], None]) -> None:
        self._node, self._device, self._on_idle = node, device, on_idle
        self._queue: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # notified after each batch
        self._live = 0
        self.closing = False  # once set, the last release calls `on_idle`
        self._thread = threading.Thread(target=self._run, name="shmcache-release", daemon=True)
        self._thread.start()

    def opened(self, count: int) -> None:
        """`count` more live mappings (each one's death will `enqueue` it)."""
        with self._lock:
            self._live += count

    def enqueue(self, pin: tuple[int, int]) -> None:
        """The death callback of a view's mapping: the mapping of (slot, gen) died."""
        self._queue.put(pin)

    def stop(self) -> None:
        """Ask the thread to end after what is queued."""
        self._queue.put(None)

    def idle(self) -> bool:
        with self._lock:
            return self._live == 0

    def close(self) -> None:
        """From now on the release that leaves no live view calls `on_idle`."""
        with self._lock:
            self.closing = True

    def _run(self) -> None:
        while True:
            self._queue.put(self._queue.get())  # wake on the first item, leaving it queued
            time.sleep(_BATCH_S)
            batch = self._drain()  # empty if `release_now` took it all meanwhile
            if batch and self._release(batch):
                return

    def _drain(self) -> list[tuple[int, int] | None]:
        items: list[tuple[int, int] | None] = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def release_now(self) -> bool:
        """Release the queued pins of dead views now, in this thread, not after the release
        thread's pause (the arena is full: they may be what keeps it full); True if any were.
        Nothing once closing: the last release then detaches, which is `flush`'s to do."""
        return not self.closing and self._release_queued()

    def flush(self) -> bool:
        """Release the pins of views already garbage collected, now, in this thread; True if no
        live view is left afterwards."""
        gc.collect()  # views in reference cycles
        self._release_queued()
        with self._released:  # the thread may hold a batch it took just before us
            return self._released.wait_for(lambda: self._live == 0, timeout=_WAIT_S)

    def _release_queued(self) -> bool:
        """Release every pin queued, in this thread; True if there were any."""
        pending = self._drain()
        if None in pending:
            self._queue.put(None)  # the thread's stop signal: leave it for the thread
        pins: list[tuple[int, int] | None] = [item for item in pending if item is not None]
        if pins:
            self._release(pins)
        return bool(pins)

    def _release(self, batch: list[tuple[int, int] | None]) -> bool:
        """Unpin a batch of released views; True when the thread should stop."""
        pins = [item for item in batch if item is not None]
        try:
            self._device.settle()  # kernels still reading released GPU aliases finish first
        except Exception as exc:  # a broken CUDA context: its kernels will not run any more
            log.warning("shmcache: waiting for GPU work on released views failed: %s", str(exc))
        try:
            self._node.release(pins)
            if pins:
                self._device.sweep()  # released entries may let exported device copies go
        except Exception as exc:  # the namespace was destroyed under us, or similar
            log.debug("shmcache: releasing view pins failed: %s", str(exc))
        with self._lock:
            self._live -= len(pins)
            idle = self.closing and self._live == 0 and bool(pins)
            self._released.notify_all()
        if idle:
            self._on_idle()
        return idle or len(pins) < len(batch)
