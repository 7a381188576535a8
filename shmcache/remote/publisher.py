"""Publishing: the bounded asynchronous queue of puts into the store, and its bounded end.

A publish reads node memory (its entry, pinned until then) in its *reading part*: a thin client's
copy into its publish buffer, or, with our own segment, the whole put (Mooncake reads the arena).
`read()` gives the pin back when that part ends; `done(stored)` ends the publish (the lease goes).
A publish's end (its counter, an outage it found, `read`, `done`: `done` even if one before it
raised) runs once, under the publish's lock, which the reading part also holds. So `close` can end
a publish that does not answer: it takes the lock (waiting for a reading part up to its `drain_s`)
and ends the publish as dropped; the thread, if Mooncake ever answers it, touches nothing of ours
(the node may be detached by then). A reading part still running at the drain's end is orphaned:
whatever it would run when it ends is skipped (the detach gives its pin back), and the memory it
reads is freed under it (logged as an error).

Close: queued publishes go on while one of them ends at least every `remote_timeout_s`. Once none
does (the master or the holder stopped answering: Mooncake's own put waits 30 s on a stopped
master, 61 s on a stopped holder), the store is marked down, queued publishes are dropped, and
those in the store's hands are ended as dropped (warned, counted); their calls run on in a
client left to process exit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import NamedTuple

from shmcache.node.layout import Counter
from shmcache.remote.answers import MASTER_GONE
from shmcache.remote.health import Health
from shmcache.remote.staging import ABANDONED, TOO_LARGE, Staging

__all__ = ["Done", "Outcome", "Publish", "Publisher"]

log = logging.getLogger("shmcache")

Done = Callable[[bool], None]  # a publish's end: `done(stored)`
Count = Callable[[Counter, int], None]
Outage = Callable[[], None] | None  # begins the outage a publish found


class Publish:
    """One queued publish of [address, address + nbytes) as `name`, and what its end runs."""

    __slots__ = (
        "_count",
        "_done",
        "_ended",
        "_gate",
        "_lock",
        "_orphaned",
        "_read",
        "_was_read",
        "address",
        "name",
        "nbytes",
    )

    def __init__(
        self, name: str, address: int, nbytes: int, read: Callable[[], None], done: Done, count: Count
    ) -> None:
        self.name, self.address, self.nbytes = name, address, nbytes
        self._read, self._done, self._count = read, done, count
        self._lock = threading.Lock()  # held by the reading part and by the end
        self._gate = threading.Lock()  # held while anything of ours runs: `orphan` waits for it
        self._ended = self._was_read = self._orphaned = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[bool]:
        """The reading part: True if it may read node memory (the publish was not ended); `read()`
        runs as it ends, and `close` waits for it."""
        with self._lock:
            if self._ended:
                yield False
                return
            try:
                yield True
            finally:
                with self._gate:
                    if not self._orphaned:
                        self._give_back_read()

    def end(self, counter: Counter | None, *, stored: bool = False, outage: Outage = None) -> bool:
        """End it (False if it already was): count `counter`, begin the `outage`, `read()` if
        the reading part did not, `done(stored)`. `close` may end it first, as dropped."""
        with self._lock:
            return self._end_held(counter, stored, outage)

    def abandon(self, timeout: float) -> bool:
        """`close`: end it as dropped, waiting up to `timeout` for its reading part; else (False)
        orphan it: nothing of ours runs when that part ends. A part that ended as the wait ran
        out (its `read()` ran) is not orphaned: the publish is ended, unless it already was."""
        if not self._lock.acquire(timeout=max(timeout, 0.0)):
            with self._gate:
                if not self._was_read:  # still reading node memory
                    self._orphaned = True
                    return False
                self._end_gated(Counter.REMOTE_PUBLISH_DROPS, False, None)
            return True
        try:
            self._end_held(Counter.REMOTE_PUBLISH_DROPS, False, None)
        finally:
            self._lock.release()
        return True

    def _end_held(self, counter: Counter | None, stored: bool, outage: Outage) -> bool:
        with self._gate:
            return self._end_gated(counter, stored, outage)

    def _end_gated(self, counter: Counter | None, stored: bool, outage: Outage) -> bool:
        """The end, once, by whoever holds the gate first (`_end_held`, or `abandon` after the
        reading part ended)."""
        if self._ended or self._orphaned:
            return False
        self._ended = True
        try:
            if counter is not None:
                self._count(counter, 1)
            if outage is not None:
                outage()
        finally:
            try:
                self._give_back_read()
            finally:
                self._done(stored)
        return True

    def _give_back_read(self) -> None:
        if not self._was_read:
            self._was_read = True
            self._read()


class Outcome(NamedTuple):
    """What a publish's put came to: the counter it adds, whether it stored, the outage it found."""

    counter: Counter | None
    stored: bool = False
    outage: Outage = None


class Publisher:
    """The publish queue of one process's store client: at most `queue` publishes queued or
    running, two running at a time (`workers`), each put through `staging()` while `health` is up."""

    def __init__(
        self,
        queue: int,
        timeout_s: float,
        health: Health,
        staging: Callable[[], Staging | None],
        count: Count,
    ) -> None:
        self._timeout, self._health, self._staging, self._count = timeout_s, health, staging, count
        self._slots = threading.BoundedSemaphore(queue)
        # not daemons: a daemon thread in a put Mooncake answers during the exit aborts the process
        # (std::terminate, tried); so an exit waits for such a put's answer
        self.workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="shmcache-publish")
        self._lock = threading.Lock()  # a submitted publish is in `_pending` for `close` to see
        self._pending: dict[Future[None], Publish] = {}  # not over yet: queued or running
        self._warned_full = False

    def submit(self, name: str, address: int, nbytes: int, read: Callable[[], None], done: Done) -> bool:
        """Queue the publish. Never blocks: a full queue or a closed one drops it (counted) and
        returns False (then neither `read` nor `done` runs)."""
        if not self._slots.acquire(blocking=False):
            self._count(Counter.REMOTE_PUBLISH_DROPS, 1)
            if not self._warned_full:  # once: the counter tells how many more
                self._warned_full = True
                log.warning(
                    "shmcache: publish queue full, dropping publishes (counted as remote_publish_drops): %s",
                    name,
                )
            return False
        publish = Publish(name, address, nbytes, read, done, self._count)
        with self._lock:
            try:
                future = self.workers.submit(self._run, publish)
            except RuntimeError:  # shut down: closing
                self._slots.release()
                self._count(Counter.REMOTE_PUBLISH_DROPS, 1)
                return False
            self._pending[future] = publish
        future.add_done_callback(self._over)  # after the insertion: it runs after it
        return True

    def _over(self, future: Future[None]) -> None:
        # without `_lock`: a cancel runs it under the executor's lock, which `submit` takes under ours
        self._pending.pop(future, None)

    def _run(self, publish: Publish) -> None:
        outcome = self._put(publish)
        self._slots.release()  # before the end: `done` may ask the store to remove a lease
        publish.end(outcome.counter, stored=outcome.stored, outage=outcome.outage)

    def _put(self, publish: Publish) -> Outcome:
        try:
            staging = self._staging()
            if staging is None or not self._health.up:
                return Outcome(Counter.REMOTE_PUBLISH_DROPS)  # an outage began since it was queued
            rc = staging.put_from(publish.name, publish.address, publish.nbytes, publish.reading)
        except Exception as exc:  # a publish must never take the process down
            log.debug("shmcache: publish of %s failed: %s", publish.name, str(exc))
            return Outcome(Counter.REMOTE_ERRORS)
        if rc == 0:
            return Outcome(Counter.REMOTE_PUBLISHES, stored=True)
        if rc == TOO_LARGE:
            log.debug("shmcache: %s is larger than the publish buffer, not published", publish.name)
            return Outcome(Counter.REMOTE_PUBLISH_DROPS)
        if rc in MASTER_GONE:
            why = f"a publish found the master gone (rc {rc})"
            return Outcome(Counter.REMOTE_PUBLISH_DROPS, outage=lambda: self._health.down(why))
        return Outcome(None if rc == ABANDONED else Counter.REMOTE_ERRORS)

    def close(self, drain_s: float) -> bool:
        """Let queued publishes end while one of them ends every `remote_timeout_s`; else mark the
        store down and end the rest as dropped, waiting up to `drain_s` in all for those whose put
        reads node memory. True if no put is left running in the client."""
        self.workers.shutdown(wait=False)  # none is queued from here on
        with self._lock:
            pending = set(self._pending)
        while pending:
            ended, pending = futures_wait(pending, timeout=self._timeout, return_when=FIRST_COMPLETED)
            if not ended:
                break
        if not pending:
            return True
        self._health.down(f"no publish ended in {self._timeout} s")  # closing: marked only
        with self._lock:
            left = list(self._pending.items())  # before the cancel: a cancelled future leaves it
        log.warning("shmcache: closing: no publish ended in %s s, dropping %d", self._timeout, len(left))
        self.workers.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + drain_s
        for _, publish in left:
            try:
                if not publish.abandon(deadline - time.monotonic()):
                    log.error("shmcache: a Mooncake put still reads node memory at close: %s", publish.name)
            except Exception as exc:  # its callbacks raised: the others are still ended
                log.warning("shmcache: ending the publish of %s raised %s", publish.name, str(exc))
        return all(future.done() for future, _ in left)
