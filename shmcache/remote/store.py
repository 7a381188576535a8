"""The remote layer: Mooncake Store behind the node layer (pull once per node, publish async).

Who mounts the Mooncake segment: each process that opens a cache with `remote_master` set runs its
own Mooncake client and mounts a segment of `remote_segment_bytes`; what it publishes lives there.
Killing a worker therefore never loses node-local data (that is in the node layer), but the remote
copies it published disappear about `client_ttl` (10 s) after its death; other nodes then miss and
recompute once. A deployment that wants remote copies to outlive workers runs a long-lived per-node
`mooncake_client` (see ../shared/MOONCAKE.md); that mode is not implemented yet.

TTL policy (the RFC's open question 3): the local `ttl_s` governs node copies only. Remote copies
get no TTL of ours: Mooncake's own LRU eviction (at its high watermark) and the mounting client's
lifetime bound them. A remote hit re-seeds the node copy, whose TTL starts afresh; nothing touches
the remote copy on a hit.

Values in the store are exactly node entries (entry header + encoded value); every pull verifies
magic, length and key digest, so a corrupt or foreign value is a counted miss, never data.
Loopback only in tests: P2PHANDSHAKE metadata, `MC_TCP_BIND_ADDRESS=127.0.0.1`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shmcache.errors import RemoteUnavailable
from shmcache.keys.key import KEY_SCHEMA_VERSION, EmbeddingCacheKey
from shmcache.node.layout import Counter

__all__ = ["RemoteStore", "free_port", "remote_key"]

log = logging.getLogger("shmcache")

# Mooncake codes that mean "not available" (a miss), never data: see ../shared/MOONCAKE.md
NOT_AVAILABLE = {-200, -704, -706, -707, -800, -900, -901}
RPC_FAIL = -900


def remote_key(prefix: str, key: EmbeddingCacheKey) -> str:
    """`<prefix>@v<schema>@<algorithm>@<digest hex>`: the same on every node."""
    return f"{prefix}@v{KEY_SCHEMA_VERSION}@{key.algorithm}@{key.hex}"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RemoteStore:
    """One process's Mooncake client, with a bounded asynchronous publisher.

    `count(counter, n)` is called for every remote event (REMOTE_PUBLISHES, REMOTE_PUBLISH_DROPS,
    REMOTE_ERRORS), so the node-wide stats show them.
    """

    def __init__(
        self,
        master: str,
        *,
        protocol: str,
        segment_bytes: int,
        buffer_bytes: int,
        queue_size: int,
        strict: bool,
        count: Callable[[Counter, int], None],
    ) -> None:
        self.master = master
        self._count = count
        self._store: Any = None
        self._warned = self._warned_full = False
        self._registered: set[tuple[int, int]] = set()
        self._slots = threading.BoundedSemaphore(queue_size)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="shmcache-publish")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            self._unavailable(f"the mooncake package is not importable ({exc})", strict)
            return
        store = MooncakeDistributedStore()
        host = f"127.0.0.1:{free_port()}"
        rc = store.setup(host, "P2PHANDSHAKE", segment_bytes, buffer_bytes, protocol, "", master)
        if rc != 0 or store.health_check() != 0:
            store.close()
            self._unavailable(f"Mooncake master {master} is unreachable (setup rc {rc})", strict)
            return
        self._store = store

    @property
    def available(self) -> bool:
        return self._store is not None

    def _unavailable(self, why: str, strict: bool) -> None:
        if strict:
            raise RemoteUnavailable(why + " and store_unavailable_mode is 'strict'")
        self._degrade(why)

    def _degrade(self, why: str) -> None:
        """Continue node-local only; warn once."""
        if not self._warned:
            self._warned = True
            log.warning("shmcache: remote layer off, running node-local only: %s", why)
        self._store = None

    def register(self, address: int, nbytes: int) -> None:
        """Register node memory for zero-copy transfers (once per range)."""
        store = self._store
        if (
            store is not None
            and (address, nbytes) not in self._registered
            and store.register_buffer(address, nbytes) == 0
        ):
            self._registered.add((address, nbytes))

    def size_of(self, name: str) -> int | None:
        """The stored size of `name`, or None when it is not available."""
        store = self._store
        if store is None:
            return None
        size = store.get_size(name)
        if size < 0:
            if size == RPC_FAIL:
                self._degrade(f"Mooncake master {self.master} stopped answering")
            elif size not in NOT_AVAILABLE:
                self._count(Counter.REMOTE_ERRORS, 1)
            return None
        return int(size)

    def get_into(self, name: str, address: int, nbytes: int) -> bool:
        """Copy `name` into [address, address + nbytes); False on any failure."""
        store = self._store
        if store is None:
            return False
        rc = store.get_into(name, address, nbytes)
        if rc != nbytes:
            if rc == RPC_FAIL:
                self._degrade(f"Mooncake master {self.master} stopped answering")
            elif rc not in NOT_AVAILABLE:
                self._count(Counter.REMOTE_ERRORS, 1)
            return False
        return True

    def publish(self, name: str, address: int, nbytes: int, done: Callable[[], None]) -> bool:
        """Queue `put_from(name, address, nbytes)`; `done()` runs after it (success or not).

        Never blocks: a full queue drops the publish (counted; the first drop is warned) and returns False.
        """
        if self._store is None:
            return False
        if not self._slots.acquire(blocking=False):
            self._count(Counter.REMOTE_PUBLISH_DROPS, 1)
            if not self._warned_full:  # once: the counter tells how many more
                self._warned_full = True
                log.warning(
                    "shmcache: publish queue full, dropping publishes (counted as remote_publish_drops): %s",
                    name,
                )
            return False
        try:
            self._executor.submit(self._put, name, address, nbytes, done)
        except RuntimeError:  # shut down
            self._slots.release()
            return False
        return True

    def _put(self, name: str, address: int, nbytes: int, done: Callable[[], None]) -> None:
        try:
            store = self._store
            if store is None:
                return
            rc = store.put_from(name, address, nbytes)
            if rc == 0:
                self._count(Counter.REMOTE_PUBLISHES, 1)
            elif rc == RPC_FAIL:
                self._degrade(f"Mooncake master {self.master} stopped answering")
            else:
                self._count(Counter.REMOTE_ERRORS, 1)
        except Exception as exc:  # a publish must never take the process down
            self._count(Counter.REMOTE_ERRORS, 1)
            log.debug("shmcache: publish of %s failed: %s", name, str(exc))
        finally:
            self._slots.release()
            done()

    def close(self) -> None:
        """Finish queued publishes, then disconnect."""
        self._executor.shutdown(wait=True)
        if self._store is not None:
            self._store.close()
            self._store = None
