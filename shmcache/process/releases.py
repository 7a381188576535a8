"""The release thread: view pins go back to the node when returned views are garbage collected.

Every zero-copy view derives from one holder array per mapping; when the holder dies its mapping
is given back (reset, kept for reuse, or unmapped) and only enqueues its (slot, gen) and rings a
bell (the `on_death` it was made with, `CowMapper.watched_view`: two `SimpleQueue.put`, safe in
a deallocator). One daemon thread per cache wakes on the bell, pauses a few milliseconds so
releases batch, waits for GPU work still reading released device aliases, then drops the pins
in one node transaction. The pause holds no pin back: `release_now` (an allocation that found the
arena full, a claim that found its stripe full) and `flush` release what is queued at once in
the calling thread. One batch is released at a time (`_releasing`), so `release_now` also waits
for a batch the thread is releasing. The thread also runs what `later` queues before each batch:
the withdraw of a reservation garbage collected unended (queued by its deallocator, which takes
no lock itself).
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from shmcache.errors import LockTimeout
from shmcache.gpu.side import DeviceSide
from shmcache.node.index import NodeIndex

__all__ = ["Releases"]

log = logging.getLogger("shmcache")
_BATCH_S = 0.005
_RETRY_S = 1.0  # the pause before trying again pins a lock timeout left


def _drain(items: queue.SimpleQueue[Any]) -> list[Any]:
    """Everything queued in `items` now."""
    taken: list[Any] = []
    while True:
        try:
            taken.append(items.get_nowait())
        except queue.Empty:
            return taken


class Releases:
    """Counts this process's live views and releases their pins when they die. A view is live from
    the moment it is made (`watched()` counts it in the same native step, so no signal can leave
    a watched view uncounted) until its pin is released here."""

    def __init__(
        self, node: NodeIndex, device: DeviceSide, on_idle: Callable[[], None], watched: Callable[[], int]
    ) -> None:
        self._node, self._device, self._on_idle, self._watched = node, device, on_idle, watched
        self._queue: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # `later`
        self._bell: queue.SimpleQueue[bool] = queue.SimpleQueue()  # True: a pin queued; False: stop
        self._lock = threading.Lock()  # `_released`, `closing`
        self._releasing = threading.Lock()  # one batch at a time
        self._batches = 0  # batches that released pins so far
        self._released = 0  # views whose pins were released
        self._pause = _BATCH_S  # the thread's pause before a batch (_RETRY_S after a lock timeout)
        self.closing = False  # once set, the last release calls `on_idle`
        self._thread = threading.Thread(target=self._run, name="shmcache-release", daemon=True)
        self._thread.start()

    def enqueue(self, pin: tuple[int, int]) -> None:
        """The death callback of a view's mapping: the mapping of (slot, gen) died."""
        self._queue.put(pin)
        self._bell.put(True)

    def later(self, job: Callable[[], None]) -> None:
        """Run `job` in the release thread soon, before its next batch (two `SimpleQueue.put`:
        safe in a deallocator). A job that fails is logged."""
        self._jobs.put(job)
        self._bell.put(True)

    def stop(self) -> None:
        """Ask the thread to end after what is queued."""
        self._bell.put(False)

    def idle(self) -> bool:
        with self._lock:
            return self._watched() == self._released

    def close(self) -> None:
        """From now on the release that leaves no live view calls `on_idle`."""
        with self._lock:
            self.closing = True

    def disarmed(self) -> None:
        """A delivery failed and gave its pins back (its view, if it made one, disarmed): after
        `close`, if that left no live view, call `on_idle`, as that view's release would have
        (`on_idle` may run more than once: a detach is idempotent). A failing `on_idle` is
        logged: the delivery's own outcome is what its caller gets."""
        with self._lock:
            idle = self.closing and self._watched() == self._released
        if idle:
            try:
                self._on_idle()
            except Exception as exc:  # a lock held past its timeout, ...: the exit detaches
                log.warning("shmcache: detaching after the last view failed: %s", str(exc))

    def _run(self) -> None:
        while True:
            rings = [self._bell.get()]
            if rings[0]:
                time.sleep(self._pause)
            rings += _drain(self._bell)
            if self._release_queued() or not all(rings):
                return

    def release_now(self) -> bool:
        """Release the queued pins of dead views now, in this thread, not after the release
        thread's pause (they may be what keeps the arena full); True if a batch was released
        since the call (by us, or by the thread while we waited for it). Nothing once closing:
        the release that leaves no live view detaches, which is the thread's or `flush`'s to do.
        Nothing queued and no batch being released: False at once, without waiting."""
        if self.closing or (self._queue.empty() and not self._releasing.locked()):
            return False
        before = self._batches
        self._release_queued()
        return self._batches != before

    def flush(self) -> bool:
        """Release the pins of views already garbage collected, now, in this thread; True if no
        live view is left afterwards."""
        gc.collect()  # views in reference cycles
        self._release_queued()
        return self.idle()

    def _release_queued(self) -> bool:
        """Release every pin queued (after a batch another thread is releasing), then call
        `on_idle` if that left no live view after `close`; True if it did."""
        self._run_jobs()  # not under `_releasing`: a job may wait on the remote store
        with self._releasing:
            idle = self._release()
        if idle:
            self._on_idle()
        return idle

    def _run_jobs(self) -> None:
        """Run what `later` queued, each once (a signal queues those not run yet again)."""
        jobs = _drain(self._jobs)
        for n, job in enumerate(jobs):
            try:
                job()
            except Exception as exc:  # a stripe held too long, the namespace destroyed, ...
                log.warning("shmcache: a deferred withdraw failed: %s", str(exc))
            except BaseException:
                list(map(self._jobs.put, jobs[n + 1 :]))
                raise

    def _release(self) -> bool:
        """Unpin the queued pins of released views; True if a batch leaves no live view after
        `close`. The pins it could not drop (a stripe held past the lock timeout, then retried
        after `_RETRY_S`; a signal in `flush` while it waits) are queued again, each at most once."""
        pins: list[tuple[int, int]] = []
        unreleased = pins  # what a signal here leaves: all of them
        try:
            while True:  # taken one by one into our list: a signal loses at most the one in hand
                try:
                    pins.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if not pins:
                return False
            try:
                self._device.settle()  # kernels still reading released GPU aliases finish first
            except Exception as exc:  # a broken CUDA context: its kernels will not run any more
                log.warning("shmcache: waiting for GPU work on released views failed: %s", str(exc))
            unreleased = []  # from here on an exception lists what it left (`NodeIndex.release`)
            self._node.release(pins)
            self._device.sweep()  # released entries may let exported device copies go
        except LockTimeout as exc:  # a stopped or hung process holds a stripe: try again later
            unreleased = getattr(exc, "unreleased", [])
            log.warning("shmcache: %d view pins wait for another try: %s", len(unreleased), str(exc))
            self._pause = _RETRY_S
            self._bell.put(True)
        except Exception as exc:  # the namespace was destroyed under us, or similar
            log.debug("shmcache: releasing view pins failed: %s", str(exc))
        except BaseException as exc:
            unreleased = getattr(exc, "unreleased", unreleased)
            raise
        finally:
            list(map(self._queue.put, unreleased))  # queued again in one native loop: no signal inside
            with self._lock:
                self._released += len(pins) - len(unreleased)
                idle = bool(pins) and self.closing and self._watched() == self._released
            self._batches += len(pins) > len(unreleased)  # `release_now` asks whether any went
        if not unreleased:
            self._pause = _BATCH_S
        return idle
