"""The remote layer: Mooncake Store behind the node layer (pull once per node, publish async).

Who mounts the Mooncake segment: with `remote_holder`, the node's long-lived `mooncake_client`
(`holder.py`), and this process is a thin client of it (`setup_dummy`): what it publishes outlives
it. Without, this process mounts a segment of `remote_segment_bytes` itself, and the remote copies
it published disappear about `client_ttl` (10 s) after its death (node-local data is never lost:
that is in the node layer).

TTL policy (the RFC's open question 3): the local `ttl_s` governs node copies only. Remote copies
get no TTL of ours: Mooncake's own LRU eviction (at its high watermark) and the mounting client's
lifetime bound them. A remote hit re-seeds the node copy, whose TTL starts afresh; nothing touches
the remote copy on a hit.

Outages (a master killed, restarted, hung) are survived: see `health.py`; each store call a
lookup or a pull makes (a pull makes up to three: a guessed `get_into`, `get_size`, `get_into`)
waits at most `remote_timeout_s`, and the first that gets no answer ends the remote steps.

Values in the store are exactly node entries (entry header + encoded value); every pull verifies
magic, length and key digest, so a corrupt or foreign value is a counted miss, never data.
Addresses: P2PHANDSHAKE metadata; this process's segment is advertised at `remote_local_host`
(127.0.0.1 by default, so one host only: a cluster sets each node's own address), and Mooncake's TCP
transport binds there too (`MC_TCP_BIND_ADDRESS`, unless the environment already sets it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from typing import Any

import numpy as np

from shmcache.config import CacheConfig
from shmcache.errors import InvalidConfig, RemoteUnavailable
from shmcache.keys.key import KEY_SCHEMA_VERSION, EmbeddingCacheKey
from shmcache.node.layout import Counter
from shmcache.remote.answers import (
    BUFFER_TOO_SMALL,
    MASTER_GONE,
    NOT_AVAILABLE,
    OBJECT_NOT_FOUND,
    RAISED,
    TIMED_OUT,
    CallStart,
    Fetched,
    Transfer,
    batch_clean,
    get_into_outcome,
    nothing_in_flight,
    taints,
    transferred,
)
from shmcache.remote.connection import Connection, leave_to_exit
from shmcache.remote.health import Health
from shmcache.remote.publisher import Done, Publisher
from shmcache.remote.registered import NodeMemory
from shmcache.remote.staging import Loan, Staging

__all__ = ["RemoteStore", "remote_key"]

log = logging.getLogger("shmcache")

Stuck = Callable[[Future[Any]], None] | None  # told of a call that outlived its wait
PROBE_KEY = "shmcache@probe"  # the recovery probe's 1-byte value (first writer wins: never rewritten)


def remote_key(prefix: str, key: EmbeddingCacheKey) -> str:
    """`<prefix>@v<schema>@<algorithm>@<digest hex>`: the same on every node."""
    return f"{prefix}@v{KEY_SCHEMA_VERSION}@{key.algorithm}@{key.hex}"


class RemoteStore:
    """One process's Mooncake client, with a bounded asynchronous publisher.

    `count(counter, n)` is called for every remote event (REMOTE_PUBLISHES, REMOTE_PUBLISH_DROPS,
    REMOTE_ERRORS, REMOTE_OUTAGES), so the node-wide stats show them. A lookup or a pull waits at
    most `timeout_s` for the store; an outage is survived (`health.py`).
    """

    def __init__(self, config: CacheConfig, count: Callable[[Counter, int], None]) -> None:
        """Connect to `config.remote_master` with its `remote_*` settings (`RemoteUnavailable`
        in strict mode when the master is down)."""
        if config.remote_master is None:
            raise InvalidConfig("remote_master is not set")
        self.master = master = config.remote_master
        self._count, self._timeout = count, config.remote_timeout_s
        self._holder, self._buffer_bytes = config.remote_holder, config.remote_buffer_bytes
        self._tcp = config.remote_protocol == "tcp"  # config.py
        self._client: Any = None
        self._running: dict[Future[Any], bool] = {}  # calls not done yet: do they write node memory
        self._submitting, self._closing = threading.Lock(), False
        self.staging: Staging | None = None
        self._node_memory = NodeMemory(thin=self._holder is not None)
        self._calls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="shmcache-remote")
        self.health = Health(master, self._answers, count)
        self._publisher = Publisher(
            config.remote_publish_queue, self._timeout, self.health, lambda: self.staging, count
        )
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.remote_local_host)  # read once, as Mooncake loads
        self._connection = Connection(config, self._ready)
        why = self._connection.connect(child_first=False)
        if why is not None:
            if config.store_unavailable_mode == "strict":
                self.close()
                raise RemoteUnavailable(why + " and store_unavailable_mode is 'strict'")
            self.health.down(why)

    def _ready(self, client: Any) -> None:
        """The client is set up (`Connection`): calls may use it, in node memory registered now
        if `register` was asked for it before (the master was down at open)."""
        self.staging = Staging(client, pooled=self._holder is not None, pool_bytes=self._buffer_bytes)
        self._client = client
        self._node_memory.ready(client)

    def _answers(self) -> bool:
        """The prober's question: can values be stored again? The client is set up if it never
        was; then a 1-byte put must succeed (after a master restart the master answers ~1 s
        before the segments are mounted again, and a publish then would fail with no space). With
        no transfer buffer (`remote_buffer_bytes=0`) a put of bytes cannot work: the master's
        answer to a lookup is the probe then."""
        if self._client is None:
            return self._connection.connect(child_first=True) is None
        if self._buffer_bytes == 0:
            rc = self._call("get_size", PROBE_KEY)
            return isinstance(rc, int) and (rc >= 0 or rc == OBJECT_NOT_FOUND)
        return bool(self._call("put", PROBE_KEY, b"\0") == 0)

    @property
    def available(self) -> bool:
        return self.health.up and self._client is not None and not self._closing

    def _call(self, method: str, *args: Any, stuck: Stuck = None, writes_node: bool = False) -> Any:
        """`client.method(*args)` (a return code, or a list of them), waiting at most `timeout_s`.
        An outage begins when the master is gone (None; a batch's list is kept: its other items
        may have transferred, or failed mid-transfer) or does not answer in time (`TIMED_OUT`:
        the call goes on in its thread and may still write into the memory it was given; its
        future is handed to `stuck`, as it is when the wait is interrupted).
        A call that raised answers `RAISED` (counted, warned); one cancelled by `close`, None.
        `writes_node`: it writes node memory (`close` waits for it up to its `drain_s`)."""
        client = self._client
        if client is None:
            return None
        with self._submitting:  # `close` shuts the pool under this lock: no call it does not see
            try:
                future = self._calls.submit(getattr(client, method), *args)
            except RuntimeError:  # the executor is shut down: closing
                return None
            self._running[future] = writes_node
        future.add_done_callback(lambda done: self._running.pop(done, None))
        try:
            result = future.result(self._timeout)
        except FutureTimeout:
            self._outlived(future, stuck)
            self.health.down(f"no answer from Mooncake master {self.master} in {self._timeout} s")
            return TIMED_OUT
        except CancelledError:  # by `close` before it ran
            return None
        except Exception as exc:  # the call itself raised
            self._count(Counter.REMOTE_ERRORS, 1)
            log.warning("shmcache: Mooncake's %s raised %s: %s", method, type(exc).__name__, str(exc))
            return RAISED
        except BaseException:  # a KeyboardInterrupt while it waits: the call goes on
            if not future.done():
                self._outlived(future, stuck)
            raise
        batch = isinstance(result, list)
        gone = next((rc for rc in (result if batch else [result]) if rc in MASTER_GONE), None)
        if gone is not None:
            self.health.down(f"Mooncake master {self.master} stopped answering (rc {gone})")
            return result if batch else None  # each item's code still says what its transfer did
        return result

    def _outlived(self, call: Future[Any], stuck: Stuck) -> None:
        """`call` runs on after we stopped waiting: `stuck` is told."""
        if stuck is not None:
            stuck(call)

    def register(self, address: int, nbytes: int) -> None:
        """Register node memory for zero-copy transfers (once per range; a thin client cannot);
        asked before the client is set up, it is registered when it is."""
        self._node_memory.register(address, nbytes, self._client)

    def size_of(self, name: str) -> int | None:
        """The stored size of `name`, or None when it is not available."""
        if not self.available:
            return None
        size = self._call("get_size", name)
        if not isinstance(size, int) or size < 0:
            if isinstance(size, int) and size not in NOT_AVAILABLE:
                self._count(Counter.REMOTE_ERRORS, 1)
            return None
        return int(size)

    def fetch(self, name: str, size: int) -> np.ndarray | None:
        """The `size` stored bytes of `name`, in this client's pull buffer (valid until the next
        fetch); None on any failure."""
        staging = self.staging
        if not self.available or staging is None:
            return None
        loan = self._lend(staging, size, nothing_in_flight)
        if loan is None:
            if self.available:  # no buffer could hold it (not an outage, not the close)
                self._count(Counter.REMOTE_ERRORS, 1)
            return None
        buffer = loan.buffer
        fetched = self.fetch_into(name, int(buffer.ctypes.data), size, loan.calls.append)
        if fetched.outcome is not Transfer.TAINTED:
            staging.give_back(loan)
        return buffer[: fetched.nbytes] if fetched.outcome is Transfer.DONE else None

    def _lend(self, staging: Staging, size: int, clean: Callable[[Any], bool]) -> Loan | None:
        """A pull buffer of `size` bytes lent to one transfer call (`Staging.lend`); None if none
        can hold it or the store is closing. Under the lock `close` takes before it closes the
        client: registering a buffer with a closed client kills the process (SIGSEGV)."""
        with self._submitting:
            buffer = None if self._closing or not self.available else staging.pull_buffer(size)
            return None if buffer is None else staging.lend(buffer, clean)

    def pulls_in_place(self, address: int, nbytes: int) -> bool:
        """Whether a pull can land straight in [address, address + nbytes): memory registered by
        `register` (never as a thin client, whose transfers go through the holder's pool)."""
        return self.available and self._node_memory.covers(address, nbytes)

    def fetch_into(self, name: str, address: int, room: int, stuck: Stuck = None) -> Fetched:
        """`get_into` of the stored bytes of `name` at `address` (registered memory, `room` bytes:
        the object's size or more); a call that outlived its wait is handed to `stuck` (TAINTED)."""
        started = CallStart.now()
        writes_node = self._node_memory.covers(address, room)
        rc = self._call("get_into", name, address, room, stuck=stuck, writes_node=writes_node)
        fetched = get_into_outcome(rc, room, failure_settled=started.failure_settled(self._tcp))
        if isinstance(rc, int) and (fetched.outcome is Transfer.TAINTED or taints(rc)):
            self._count(Counter.REMOTE_ERRORS, 1)  # a failed transfer, settled or not
        return fetched

    def put_bytes(self, name: str, data: bytes) -> bool:
        """`put` (first writer wins); False when the store does not answer."""
        return self.available and self._call("put", name, data) == 0

    def upsert_bytes(self, name: str, data: bytes) -> bool:
        """`upsert` (overwrites); False when the store does not answer or refuses."""
        return self.available and self._call("upsert", name, data) == 0

    def get_bytes(self, name: str) -> bytes | None:
        """A small value, or None (missing, or the store does not answer: Mooncake's `get`
        cannot tell these apart)."""
        if not self.available:
            return None
        value = self._call("get", name)
        return bytes(value) if isinstance(value, bytes) and value else None

    def remove(self, name: str) -> None:
        """Remove `name`, read leases notwithstanding."""
        if self.available:
            self._call("remove", name, True)

    def fetch_many(self, names: list[str], cap: int) -> tuple[list[np.ndarray | None], list[int]]:
        """`fetch` of many names in one `batch_get_into`, each given at most `cap` bytes: per name
        its bytes (valid until the next fetch) or None, and the indices of the names stored with
        more than `cap` bytes (for the caller to fetch alone). An item answered with more than
        `cap` bytes may have written into the next item's room: then none is returned."""
        staging = self.staging
        found: list[np.ndarray | None] = [None] * len(names)
        loan = self._lend(staging, cap * len(names), batch_clean) if staging is not None else None
        if loan is None:
            return found, list(range(len(names))) if self.available else []
        assert staging is not None
        buffer, base = loan.buffer, int(loan.buffer.ctypes.data)
        addresses = [base + i * cap for i in range(len(names))]
        started = CallStart.now()
        rcs = self._call("batch_get_into", names, addresses, [cap] * len(names), stuck=loan.calls.append)
        failure_settled = started.failure_settled(self._tcp)
        if not isinstance(rcs, list):
            if not taints(rcs):  # no transfer ran (no client, or closing)
                staging.give_back(loan)
            return found, []
        if batch_clean(rcs, failure_settled=failure_settled):
            staging.give_back(loan)  # else a failed transfer may still write into its part of it
        if any(transferred(rc) and rc > cap for rc in rcs):  # never seen: no item's bytes are sure
            self._count(Counter.REMOTE_ERRORS, 1)
            log.warning("shmcache: a batch pull answered more bytes than an item's room: %s", rcs)
            return found, []
        larger = []
        for i, rc in enumerate(rcs):
            if transferred(rc):
                found[i] = buffer[i * cap : i * cap + rc]
            elif rc == BUFFER_TOO_SMALL:
                larger.append(i)
            elif taints(rc):
                self._count(Counter.REMOTE_ERRORS, 1)  # a failed transfer, settled or not
        return found, larger

    def publish(self, name: str, address: int, nbytes: int, read: Callable[[], None], done: Done) -> bool:
        """Queue `put_from(name, address, nbytes)` (`publisher.py`): `read()` once that memory is
        not read any more (a thin client's copy into its publish buffer, else the put's end),
        `done(stored)` after the put, each once, unless the close ends the publish first: then
        `done(False)` while an abandoned put may still run, and neither if its reading part
        outlived the drain (orphaned: the detach gives the pin back). Never blocks: a full queue
        or an unavailable store drops it (counted) and returns False (then neither runs)."""
        if not self.available:
            self._count(Counter.REMOTE_PUBLISH_DROPS, 1)
            return False
        return self._publisher.submit(name, address, nbytes, read, done)

    def writing_node_memory(self) -> bool:
        """Whether a call that writes node memory is still running."""
        return any(writes and not future.done() for future, writes in list(self._running.items()))

    def close(self, drain_s: float = 0.0) -> bool:
        """Stop probing, finish queued publishes while the store answers (`Publisher.close`), wait
        up to `drain_s` for the calls still writing node memory (it is freed with the cache), then
        disconnect if no call runs any more (a client closed under a transfer crashes the
        process) and the master answers (Mooncake's close waits 60 s for one that does not):
        True if the client was closed."""
        self._connection.close()  # first: a prober in a child set-up ends it, and the join is short
        self.health.close()
        deadline = time.monotonic() + drain_s
        published = self._publisher.close(drain_s)
        if self.available:  # Mooncake's close waits 60 s for a master that does not answer: ask first
            self._call("get_size", PROBE_KEY)
        with self._submitting:
            self._closing = True  # nothing asks the client from here on (its buffers included)
            self._calls.shutdown(wait=False, cancel_futures=True)
            running = [
                (future, writes) for future, writes in list(self._running.items()) if not future.done()
            ]
        writing = [future for future, writes in running if writes]
        try:
            # the memory they write is freed with the cache
            futures_wait(writing, timeout=max(deadline - time.monotonic(), 0.0))
        except BaseException:  # interrupted: what runs on keeps the client until the exit
            leave_to_exit(self._client, self.staging, "the close was interrupted")
            raise
        if not published:
            return leave_to_exit(self._client, self.staging, "a publish is still in Mooncake's hands")
        if any(not future.done() for future, _ in running):
            return leave_to_exit(self._client, self.staging, "a Mooncake call is still running")
        if self._client is not None and not self.health.up:
            return leave_to_exit(self._client, self.staging, "the Mooncake master does not answer")
        if self._client is not None:
            self._client.close()
        return True
