"""`EmbeddingCache`: the public facade every process opens over a namespace.

It composes the process layer: the attachment to the namespace (attachment.py), claims and
commits (claims.py), returned views and repeat hits (views.py), the release thread (releases.py),
request references (requests.py), the GPU side (shmcache.gpu) and the remote bridge
(shmcache.remote). With `enable_embedding_cache=False` it is a pass-through that never touches
shared memory.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from shmcache.config import CacheConfig
from shmcache.errors import CacheClosed, CapacityError, PinLimitReached
from shmcache.format.values import Value
from shmcache.gpu.side import DeviceSide
from shmcache.kernel.namespace import destroy_namespace
from shmcache.keys.key import EmbeddingCacheKey, Modality
from shmcache.keys.preprocessing import EncoderPreprocessingConfig
from shmcache.node.index import NodeIndex
from shmcache.node.layout import Counter
from shmcache.process import arguments
from shmcache.process.attachment import Attachment
from shmcache.process.claims import Claims
from shmcache.process.releases import Releases
from shmcache.process.requests import RequestRefs
from shmcache.process.reservation import RequestId, Reservation, ReservationTicket
from shmcache.process.scope import request_scope
from shmcache.process.stats import node_stats
from shmcache.process.views import Views
from shmcache.remote.bridge import RemoteBridge

__all__ = ["EmbeddingCache", "Reservation", "ReservationTicket", "open_caches"]

log = logging.getLogger("shmcache")
_open: weakref.WeakSet[EmbeddingCache] = weakref.WeakSet()
_forks = 0  # forks this interpreter went through (counted in the child by os.register_at_fork)


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)


def _forked_since(forks: int) -> bool:
    """True in a child forked after `forks` forks were counted (a counter, not `os.getpid()`:
    that is a system call, and the check runs on every call of a cache)."""
    return _forks != forks


@atexit.register
def _detach_at_exit() -> None:
    """Detach caches still open at interpreter exit, so the last one out removes the namespace."""
    for cache in list(_open):
        cache._force_close()


def _close_quietly(device: DeviceSide) -> None:
    """Close this process's GPU side; a broken CUDA context must not keep the process attached."""
    try:
        device.close()
    except Exception as exc:
        log.warning("shmcache: closing the GPU side failed: %s", str(exc))


def open_caches() -> list[EmbeddingCache]:
    """The caches of this process that have not detached yet (closed ones may wait for views)."""
    return list(_open)


class EmbeddingCache:
    """A node-wide cache of encoder outputs shared by every process that opens the same namespace;
    with `enable_embedding_cache=False`, a pass-through that never touches shared memory."""

    def __init__(self, config: CacheConfig | None = None) -> None:
        self.config = config = arguments.config_of(config)
        self._enabled = config.enable_embedding_cache
        self._forks = _forks  # a cache is its opener's: a forked child must open its own
        self._closed = False
        if not self._enabled:
            return
        self._attachment = Attachment.open(config)
        self._node = node = self._attachment.node
        self._segments = segments = self._attachment.segments
        self._device = DeviceSide(
            node, reads_host=config.gpu_reads == "host", export_bytes=config.gpu_export_bytes
        )
        self._detach_lock, self._detached = threading.RLock(), False
        self._requests = RequestRefs()
        self._releases = Releases(node, self._device, self._detach, segments.arena_views.watched)
        node.reclaim = self._releases.release_now  # when full: our dead views' pins first
        self._views = Views(node, segments, config, self._device, self._requests, self._releases)
        self._claims = Claims(
            node, segments.arena, config, self._views, self._device, self._requests, self._releases
        )
        self._bridge: RemoteBridge | None = None
        _open.add(self)
        if config.remote_master is not None:
            try:
                bridge = RemoteBridge(config, node, segments.arena, self._views, self._claims.writes)
                self._bridge = self._claims.bridge = bridge
            except BaseException:
                self.close()
                raise

    # ----------------------------------------------------------------- keys
    def key_from_raw_bytes(
        self, data: bytes | bytearray | memoryview, config: EncoderPreprocessingConfig, *, modality: Modality
    ) -> EmbeddingCacheKey:
        """`EmbeddingCacheKey.from_raw_bytes` with this cache's hash algorithm and tenant salt."""
        return EmbeddingCacheKey.from_raw_bytes(data, config, modality=modality, **self.config.key_settings)

    def key_from_decoded_tensor(
        self, tensor: Any, config: EncoderPreprocessingConfig, *, modality: Modality
    ) -> EmbeddingCacheKey:
        """`EmbeddingCacheKey.from_decoded_tensor` with this cache's hash algorithm and tenant salt."""
        return EmbeddingCacheKey.from_decoded_tensor(
            tensor, config, modality=modality, **self.config.key_settings
        )

    # ----------------------------------------------------------------- public API
    def get(self, key: EmbeddingCacheKey, request_id: RequestId | None = None) -> Value | None:
        """The cached value of `key` or None. With `request_id`, the entry is referenced until
        `cleanup_request(request_id)`: it survives TTL expiry and eviction pressure until then."""
        if request_id is not None:  # inlined `request_needle`: one call frame less per hit
            arguments.check_request(request_id)
        needle = arguments.needle(key, self.config.hash_algorithm)
        if not self._enabled:
            return None
        self._index()
        return self._views.lookup(key, needle, request_id)

    def get_many(
        self, keys: Sequence[EmbeddingCacheKey], request_id: RequestId | None = None
    ) -> list[Value | None]:
        """`get` of a request's items in key order (None: a miss), the node lookups in one native
        call; every key is checked first (a list or tuple), each hit pinned as `get` pins it."""
        needles = arguments.request_needles(keys, request_id, self.config.hash_algorithm)
        if not self._enabled:
            return [None] * len(keys)
        self._index()
        return self._views.lookup_many(keys, needles, request_id)

    def put(self, key: EmbeddingCacheKey, value: Value, request_id: RequestId | None = None) -> None:
        """Store `value` under `key`. The first writer wins: an existing or in-flight entry is kept.

        Raises `CapacityError` if it cannot be stored (larger than the cache, or all referenced;
        `PinLimitReached`: stored, `request_id` cannot hold it), `UnsupportedValue` if unsupported.
        """
        needle = arguments.request_needle(key, request_id, self.config.hash_algorithm)
        if not self._enabled:  # keys and request ids checked; values never read (pass-through)
            return
        self._index()
        self._claims.put(key, needle, value, request_id)

    def get_or_compute(
        self, key: EmbeddingCacheKey, compute_fn: Callable[[], Value], request_id: RequestId | None = None
    ) -> Value:
        """The cached value of `key`, computing it with `compute_fn` once per node on a miss.

        Concurrent callers on the node (threads and processes) wait for the one computing; if it
        fails they get `ComputeFailed` naming the cause; if it dies, one of them takes over. A value
        there is no room for is still returned (`uncacheable`); one of a type the cache cannot
        store raises `UnsupportedValue` (waiters: `ComputeFailed`); `PinLimitReached` as for `get`.
        """
        arguments.check_callable("compute_fn", compute_fn)
        if not self._enabled:
            arguments.request_needle(key, request_id, self.config.hash_algorithm)
            return compute_fn()
        with self.reserve(key, request_id) as res:
            if res.value is not None:
                return res.value
            node = self._index()
            if not res.owned:
                node.count(Counter.UNCACHEABLE)
                return compute_fn()
            node.count(Counter.COMPUTES)
            try:
                with res.computing():
                    value = compute_fn()
            except BaseException as exc:
                node.count(Counter.COMPUTE_FAILURES)
                res.abandon(f"{type(exc).__name__}: {exc}")
                raise
            try:
                return res.commit(value)
            except PinLimitReached:
                raise  # stored, but the request cannot hold it: as `get` would
            except CapacityError:
                return value

    def reserve(self, key: EmbeddingCacheKey, request_id: RequestId | None = None) -> Reservation:
        """Get the value, or the node-wide right to compute it (see `Reservation`). With a remote
        store, a node miss is pulled from it under the reservation (one pull per node).

        Blocks while another thread or process holds the reservation, at most `compute_timeout_s`
        (then `ComputeTimeout`). Raises `ComputeFailed` if that holder failed.
        """
        needle = arguments.request_needle(key, request_id, self.config.hash_algorithm)
        if not self._enabled:
            return Reservation(None, key, request_id)
        self._index()
        res = self._claims.claim(key, needle, request_id, wait=True, pull=True)
        assert res is not None
        return res

    def try_reserve(self, key: EmbeddingCacheKey, request_id: RequestId | None = None) -> Reservation | None:
        """`reserve` without waiting: None while another computes `key`; no remote pull (schedulers)."""
        needle = arguments.request_needle(key, request_id, self.config.hash_algorithm)
        if not self._enabled:
            return Reservation(None, key, request_id)
        self._index()
        return self._claims.claim(key, needle, request_id, wait=False)

    def try_reserve_many(
        self,
        keys: Sequence[EmbeddingCacheKey],
        request_id: RequestId | None = None,
        *,
        lease: bool = True,
        counted: bool = True,
    ) -> list[Reservation | None]:
        """`try_reserve` of a request's items, for their computer: node misses pulled in one batch,
        the rest leased across nodes (single flight). `lease` off (a caller computing for itself
        alone): no lease taken, a key another node leased still None. `counted` off: no hit or
        miss counted (the caller's own `get_many` of these keys counted them)."""
        needles = arguments.request_needles(keys, request_id, self.config.hash_algorithm)
        if not self._enabled:
            return [Reservation(None, key, request_id) for key in keys]
        self._index()
        return self._claims.claim_many(keys, needles, request_id, lease=lease, counted=counted)

    def adopt(
        self, ticket: ReservationTicket, key: EmbeddingCacheKey, request_id: RequestId | None = None
    ) -> Reservation | None:
        """Take over the reservation another process handed out (`Reservation.hand_over`); None if
        it is not that process's any more. Commit or abandon it as if this process had made it."""
        arguments.check_ticket(ticket)
        arguments.request_needle(key, request_id, self.config.hash_algorithm)
        if not self._enabled:
            return None
        arguments.check_ticket_fits(ticket, self._index().layout)
        return self._claims.adopt(ticket, key, request_id)

    def contains(self, key: EmbeddingCacheKey) -> bool:
        """True if `key` is sealed on the node right now (lock-free: no pin, no copy, no count)."""
        needle = self._needle(key)
        if not self._enabled:
            return False
        return self._index().lookups.contains(needle)

    def contains_many(self, keys: Sequence[EmbeddingCacheKey]) -> list[bool]:
        """`contains` of every key, in key order, in one native call (every key checked first)."""
        arguments.check_keys(keys)
        needles = arguments.needles(keys, self.config.hash_algorithm)
        if not self._enabled:
            return [False] * len(keys)
        return self._index().lookups.contains_many(needles)

    def hold(self, key: EmbeddingCacheKey, request_id: RequestId) -> bool:
        """Reference `key`'s entry for `request_id` (until `cleanup_request`), no view, no hit
        counted: a scheduler keeps alive an entry it plans to load. False if not sealed."""
        arguments.check_request_named(request_id)
        needle = self._needle(key)
        if not self._enabled:
            return False
        self._index()
        return self._views.hold(needle, request_id)

    def request(self, request_id: RequestId) -> contextlib.AbstractContextManager[None]:
        """Make `request_id` the request in scope of encoder calls made inside the block: a hooked
        encoder (`CachedEncoder`, `shmcache.process.scope`) takes its references for it; this
        cache's own calls take only their `request_id` argument. Release with `cleanup_request`."""
        return request_scope(request_id)

    def cleanup_request(self, request_id: RequestId) -> int:
        """Release every reference taken for `request_id` in this process; returns how many. On
        `LockTimeout` (a stripe held too long) those not released stay: call it again."""
        arguments.check_request_named(request_id)
        if not self._enabled:
            return 0
        return self._requests.release(request_id, self._index().release)

    def stats(self) -> dict[str, int]:
        """Node-wide counters (summed over every process) and current occupancy."""
        if not self._enabled:
            return {}
        return node_stats(self._index(), self._device)

    def gc(self) -> int:
        """Reap dead processes' records and pins now, repair what they died inside, and free this
        process's exported device copies of entries that left; returns how many were reaped."""
        if not self._enabled:
            return 0
        reaped = self._index().reap()
        self._device.sweep()
        return reaped

    def close(self) -> None:
        """Release this process's references and detach; the last process to detach removes the
        namespace. Views still alive keep their pins until garbage collected (or the interpreter
        exits), and the detach waits for that; it withdraws the reservations still held (their
        waiters look again; a later `commit` raises `CacheClosed`)."""
        if not self._enabled or self._closed or _forked_since(self._forks):
            self._closed = True
            return
        for request_id in self._requests.ids():
            self.cleanup_request(request_id)
        if self._bridge is not None:
            self._bridge.close()
        _close_quietly(self._device)
        self._closed = True
        self._releases.close()
        self.flush_releases()

    def flush_releases(self) -> None:
        """Release the pins of views already garbage collected now, in this thread, instead of
        within the release thread's few milliseconds; a closed cache then finishes its detach."""
        if not self._enabled or _forked_since(self._forks):  # a forked child's are its parent's
            return
        with self._detach_lock:
            if self._detached:
                return
            idle = self._releases.flush()
            if idle and self._closed:
                self._detach()

    def destroy(self) -> None:
        """Remove the namespace now, whoever is attached (they get `CacheClosed` on their next call)."""
        if not self._enabled:
            return
        self.close()
        self._attachment.destroyed = True
        destroy_namespace(self.config.namespace, timeout=self.config.lock_timeout_s)

    def __enter__(self) -> EmbeddingCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internals
    def _index(self) -> NodeIndex:
        if self._closed:
            raise CacheClosed("this EmbeddingCache is closed")
        if _forked_since(self._forks):
            raise CacheClosed("an EmbeddingCache cannot be used across fork(); open a new one in the child")
        return self._node

    def _needle(self, key: EmbeddingCacheKey) -> bytes:
        return arguments.needle(key, self.config.hash_algorithm)

    def _force_close(self) -> None:
        """Detach now even if views are alive (interpreter exit: nothing will read them again)."""
        if not self._enabled or _forked_since(self._forks) or self._detached:
            return
        self._closed = True
        _close_quietly(self._device)
        self._detach(writes_wait_s=0.0)  # a daemon thread still writing ends with the process

    def _detach(self, writes_wait_s: float | None = None) -> None:
        with self._detach_lock:
            if self._detached:
                return
            self._releases.stop()
            self._claims.withdraw_held(self.config.lock_timeout_s if writes_wait_s is None else writes_wait_s)
            self._attachment.detach()
            self._views.forget()
            self._detached = True
            _open.discard(self)
