"""`EmbeddingCache`: the process layer over the node index.

Per process it keeps the arena mapping, a map from key to the live zero-copy mapping of its entry
(repeat hits reuse it without a lock), request references for `cleanup_request`, and a drain
thread that releases view pins when returned views are garbage collected.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmcache import entry, values
from shmcache.config import CacheConfig
from shmcache.device import DeviceSide
from shmcache.errors import (
    CacheClosed,
    CapacityError,
    ComputeFailed,
    ComputeTimeout,
    CorruptValue,
    InvalidKey,
    ReservationLost,
    ViewMutated,
)
from shmcache.gpu import GpuRecord
from shmcache.keys import EmbeddingCacheKey, HashAlgorithm, Modality
from shmcache.layout import SlotState
from shmcache.namespace import (
    bootstrap_lock,
    create,
    destroy_namespace,
    object_names,
    open_existing,
    remove_objects,
    wipe,
)
from shmcache.node import FAILED, UNCACHEABLE, NodeIndex, SlotInfo, needle_of
from shmcache.preprocessing import EncoderPreprocessingConfig
from shmcache.remote import RemoteStore, remote_key
from shmcache.semaphores import SemaphoreTimeout
from shmcache.values import Value

__all__ = ["EmbeddingCache", "Reservation"]

log = logging.getLogger("shmcache")
RequestId = Hashable
_RELEASE_BATCH_S = 0.005
_RELEASE_WAIT_S = 0.1  # how long flush_releases waits for a batch the release thread holds
_WAIT_SLICE_S = 1.0  # a waiter re-checks which key its slot holds at least this often
_open_caches: weakref.WeakSet[EmbeddingCache] = weakref.WeakSet()


@atexit.register
def _detach_at_exit() -> None:
    """Detach caches still open at interpreter exit, so the last one out removes the namespace."""
    for cache in list(_open_caches):
        cache._force_close()


def _weak(value: Value) -> weakref.ref[Any] | None:
    """A weak reference to `value` where its type allows one (dicts and lists do not)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return None


@dataclass(frozen=True)
class _Mapping:
    """This process's live zero-copy mapping of one entry."""

    slot: int
    gen: int
    holder: weakref.ref[np.ndarray]  # the entry's bytes; alive while any returned view is
    parsed: values.ParsedValue
    template: weakref.ref[Any] | None  # a value returned earlier, aliased by repeat hits
    aliases: GpuRecord | None = None  # the template aliases this exporter's device memory


class Reservation:
    """The right to compute one key, or the value if it already existed.

    `value` is set on a hit. Otherwise the holder computes and calls `commit(value)` (which returns
    the cached view) or `abandon()`. As a context manager it abandons on an exception and on exit
    without a commit. A reservation that could not be cached (value too large, no free slot)
    has `cached=False`: `commit` then returns the value as given.
    """

    def __init__(
        self,
        cache: EmbeddingCache,
        key: EmbeddingCacheKey,
        request_id: RequestId | None,
        *,
        value: Value | None = None,
        slot: int = -1,
        gen: int = 0,
    ) -> None:
        self._cache = cache
        self.key = key
        self.request_id = request_id
        self.value = value
        self._slot = slot
        self._gen = gen
        self._open = value is None

    @property
    def owned(self) -> bool:
        """True while this reservation holds the node-wide right to compute the key."""
        return self._open and self._slot >= 0

    @property
    def cached(self) -> bool:
        """False when a commit will not be stored (no room), True otherwise."""
        return self.value is not None or self._slot >= 0

    def commit(self, value: Value) -> Value:
        """Store `value`, wake every waiter, and return the cached view (or `value` if uncached)."""
        if not self._open:
            raise ReservationLost(f"{self.key!r}: this reservation was already committed or abandoned")
        self._open = False
        if self._slot < 0:
            self.value = value
            return value
        self.value = self._cache._commit(self.key, self._slot, self._gen, value, self.request_id)
        return self.value

    def _store(self, value: Value) -> None:
        """`commit` without building the returned view (for `put`)."""
        if self._open and self._slot >= 0:
            self._open = False
            self._cache._commit(self.key, self._slot, self._gen, value, self.request_id, deliver=False)

    def abandon(self, reason: str = "abandoned") -> None:
        """Give the key up: waiters are woken and the first of them computes it instead."""
        if self._open:
            self._open = False
            if self._slot >= 0:
                self._cache._index().abandon(self._slot, self._gen, FAILED, reason)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._open:
            cause = f"{exc_type.__name__}: {exc}" if exc_type is not None else "not committed"
            self.abandon(cause)


class EmbeddingCache:
    """A node-wide cache of encoder outputs shared by every process that opens the same namespace.

    With `enable_embedding_cache=False` it is a pass-through that never touches shared memory.
    """

    def __init__(self, config: CacheConfig | None = None) -> None:
        self.config = config = config or CacheConfig()
        self._enabled = config.enable_embedding_cache
        self._pid = os.getpid()
        self._closed = False
        if not self._enabled:
            return
        self._names = object_names(config.namespace)
        with bootstrap_lock(self._names, config.mode, config.lock_timeout_s):
            segments = open_existing(self._names, config)
            if segments is None:
                wipe(self._names)
                segments = create(self._names, config)
            self._node = NodeIndex(segments, config.lock_timeout_s)
            self._node.attach_client()
        self._device = DeviceSide(
            self._node, reads_host=config.gpu_reads == "host", export_bytes=config.gpu_export_bytes
        )
        self._segments = segments
        self._destroyed = False
        self._detached = False
        self._state_lock = threading.Lock()
        self._released = threading.Condition(self._state_lock)  # notified after each release batch
        self._detach_lock = threading.RLock()
        self._local: dict[bytes, _Mapping] = {}
        self._requests: dict[RequestId, list[tuple[int, int]]] = {}
        self._live_views = 0
        self._releases: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._drain = threading.Thread(target=self._drain_releases, name="shmcache-release", daemon=True)
        self._drain.start()
        self._remote: RemoteStore | None = None
        self._staging: np.ndarray | None = None
        self._staging_lock = threading.Lock()
        self._poisoned: list[np.ndarray] = []  # staging buffers a failed transfer may still write into
        _open_caches.add(self)
        if config.remote_master is not None:
            self._open_remote(config)

    # ----------------------------------------------------------------- keys
    def key_from_raw_bytes(
        self, data: bytes | bytearray | memoryview, config: EncoderPreprocessingConfig, *, modality: Modality
    ) -> EmbeddingCacheKey:
        """`EmbeddingCacheKey.from_raw_bytes` with this cache's hash algorithm and tenant salt."""
        return EmbeddingCacheKey.from_raw_bytes(
            data, config, modality=modality, algorithm=self._algorithm, tenant_salt=self.config.tenant_salt
        )

    def key_from_decoded_tensor(
        self, tensor: Any, config: EncoderPreprocessingConfig, *, modality: Modality
    ) -> EmbeddingCacheKey:
        """`EmbeddingCacheKey.from_decoded_tensor` with this cache's hash algorithm and tenant salt."""
        return EmbeddingCacheKey.from_decoded_tensor(
            tensor, config, modality=modality, algorithm=self._algorithm, tenant_salt=self.config.tenant_salt
        )

    @property
    def _algorithm(self) -> HashAlgorithm:
        return self.config.hash_algorithm

    # ----------------------------------------------------------------- public API
    def get(self, key: EmbeddingCacheKey, request_id: RequestId | None = None) -> Value | None:
        """The cached value of `key` or None. With `request_id`, the entry is referenced until
        `cleanup_request(request_id)`: it survives TTL expiry and eviction pressure until then."""
        if not self._enabled:
            return None
        node = self._index()
        needle = self._needle(key)
        value = self._local_hit(needle, key, request_id)
        if value is not None:
            return value
        info = node.lookup(needle, pins=self._pins_for(request_id))
        if info is None:
            node.count("misses")
            return None
        node.count("hits_node")
        return self._deliver(key, info, request_id)

    def put(self, key: EmbeddingCacheKey, value: Value, request_id: RequestId | None = None) -> None:
        """Store `value` under `key`. The first writer wins: an existing or in-flight entry is kept.

        Raises `CapacityError` if the value cannot be stored (larger than the cache, or everything
        referenced) and `UnsupportedValue` for types the value format does not hold.
        """
        if not self._enabled:
            return
        res = self._reserve(key, request_id, wait=False, count_hits=False)
        if res is None or res.value is not None:
            return
        if not res.cached:
            raise CapacityError(f"{key!r}: no slot is free in its stripe (every way is referenced)")
        res._store(value)

    def get_or_compute(
        self, key: EmbeddingCacheKey, compute_fn: Callable[[], Value], request_id: RequestId | None = None
    ) -> Value:
        """The cached value of `key`, computing it with `compute_fn` once per node on a miss.

        Concurrent callers on the node (threads and processes) wait for the one computing; if it
        fails they get `ComputeFailed` naming the cause; if it dies, one of them takes over.
        A value that cannot be cached is still returned (counted as `uncacheable`).
        """
        if not self._enabled:
            return compute_fn()
        with self.reserve(key, request_id) as res:
            if res.value is not None:
                return res.value
            if not res.owned:
                self._index().count("uncacheable")
                return compute_fn()
            self._index().count("computes")
            try:
                value = compute_fn()
            except BaseException as exc:
                self._index().count("compute_failures")
                res.abandon(f"{type(exc).__name__}: {exc}")
                raise
            try:
                return res.commit(value)
            except CapacityError:
                return value

    def reserve(self, key: EmbeddingCacheKey, request_id: RequestId | None = None) -> Reservation:
        """Get the value, or the node-wide right to compute it (see `Reservation`). With a remote
        store, a node miss is pulled from it under the reservation (one pull per node).

        Blocks while another thread or process holds the reservation, at most `compute_timeout_s`
        (then `ComputeTimeout`). Raises `ComputeFailed` if that holder failed.
        """
        if not self._enabled:
            return Reservation(self, key, request_id)
        res = self._reserve(key, request_id, wait=True)
        assert res is not None
        if res.owned and self._remote is not None:
            try:
                pulled = self._pull(res)  # a node miss: look in the store, under our reservation
            except BaseException:
                res.abandon("pulling from the remote store failed")
                raise
            if pulled is not None:
                return Reservation(self, key, request_id, value=pulled)
        return res

    def cleanup_request(self, request_id: RequestId) -> int:
        """Release every reference taken for `request_id` in this process; returns how many."""
        if not self._enabled:
            return 0
        with self._state_lock:
            refs = self._requests.pop(request_id, [])
        self._index().unpin_many(refs)
        return len(refs)

    def stats(self) -> dict[str, int]:
        """Node-wide counters (summed over every process) and current occupancy."""
        if not self._enabled:
            return {}
        node = self._index()
        totals = node.totals()
        slots = node.slots
        sealed = slots["state"] == SlotState.SEALED
        on_gpu = sealed & node.gpu_records_live()
        totals.update(
            entries=int(sealed.sum()),
            bytes=int(slots["size"][sealed].sum()),
            gpu_entries=int(on_gpu.sum()),
            gpu_bytes=int(slots["size"][on_gpu].sum()),
            gpu_exported_bytes=self._device.exports.nbytes,
            reserved=int((slots["state"] == SlotState.RESERVED).sum()),
            stale=int((slots["state"] == SlotState.STALE).sum()),
            references=int(slots["refcount"].sum()),
            capacity_bytes=node.capacity,
            max_entries=node.layout.slots,
            clients=int(node.live_clients().sum()),
        )
        return totals

    def gc(self) -> int:
        """Reap dead processes' records and pins now, and free this process's exported device
        copies of entries that left the cache; returns how many processes were reaped."""
        if not self._enabled:
            return 0
        reaped = self._index().reap()
        self._device.sweep()
        return reaped

    def close(self) -> None:
        """Release this process's references and detach; the last process to detach removes the
        namespace. Views still alive keep their pins until they are garbage collected (or the
        interpreter exits), and the detach waits for that."""
        if not self._enabled or self._closed or os.getpid() != self._pid:
            self._closed = True
            return
        for request_id in list(self._requests):
            self.cleanup_request(request_id)
        if self._remote is not None:
            self._remote.close()  # waits for queued publishes, which hold pins
        self._close_device()
        with self._state_lock:
            self._closed = True
        self.flush_releases()
        with self._state_lock:
            busy = self._live_views > 0
        if not busy:
            self._detach()

    def flush_releases(self) -> None:
        """Release the pins of views already garbage collected now, in this thread, instead of
        within the release thread's few milliseconds; a closed cache then finishes its detach."""
        if not self._enabled:
            return
        with self._detach_lock:
            if self._detached:
                return
            gc.collect()  # views in reference cycles
            pending: list[tuple[int, int] | None] = []
            while True:
                try:
                    pending.append(self._releases.get_nowait())
                except queue.Empty:
                    break
            if None in pending:
                self._releases.put(None)  # the release thread's stop signal: leave it for that thread
            pins: list[tuple[int, int] | None] = [item for item in pending if item is not None]
            if pins:
                self._release(pins)
            with self._released:  # the release thread may hold a batch it took just before us
                self._released.wait_for(lambda: self._live_views == 0, timeout=_RELEASE_WAIT_S)
                done = self._closed and self._live_views == 0
            if done:
                self._detach()

    def _force_close(self) -> None:
        """Detach now even if views are alive (interpreter exit: nothing will read them again)."""
        if not self._enabled or os.getpid() != self._pid or self._detached:
            return
        self._closed = True
        self._close_device()
        self._detach()

    def _close_device(self) -> None:
        try:
            self._device.close()
        except Exception as exc:  # a broken CUDA context must not keep this process attached
            log.warning("shmcache: closing the GPU side failed: %s", str(exc))

    def destroy(self) -> None:
        """Remove the namespace now, whoever is attached (they get `CacheClosed` on their next call)."""
        if not self._enabled:
            return
        self.close()
        self._destroyed = True
        destroy_namespace(self.config.namespace, timeout=self.config.lock_timeout_s)

    def __enter__(self) -> EmbeddingCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internals
    def _index(self) -> NodeIndex:
        if self._closed:
            raise CacheClosed("this EmbeddingCache is closed")
        if os.getpid() != self._pid:
            raise CacheClosed("an EmbeddingCache cannot be used across fork(); open a new one in the child")
        return self._node

    def _needle(self, key: EmbeddingCacheKey) -> bytes:
        if not isinstance(key, EmbeddingCacheKey):
            raise InvalidKey(f"expected an EmbeddingCacheKey, got {type(key).__name__}")
        if key.algorithm != self.config.hash_algorithm:
            raise InvalidKey(
                f"key uses {key.algorithm}, this cache is configured for {self.config.hash_algorithm}"
            )
        return needle_of(key)

    def _pins_for(self, request_id: RequestId | None) -> int:
        """Pins a delivery takes: a view pin in view mode, plus a request ref. In clone mode
        without a request, one pin covers the copy and is released right after it."""
        pins = (self.config.return_mode == "view") + (request_id is not None)
        return max(pins, 1)

    def _reserve(
        self, key: EmbeddingCacheKey, request_id: RequestId | None, *, wait: bool, count_hits: bool = True
    ) -> Reservation | None:
        node = self._index()
        needle = self._needle(key)
        local = self._local_hit(needle, key, request_id, count=count_hits)
        if local is not None:
            return Reservation(self, key, request_id, value=local)
        deadline = time.monotonic() + self.config.compute_timeout_s
        reaped = waited = False
        while True:
            claim = node.claim(needle, key, self._pins_for(request_id))
            if claim.kind == "hit":
                assert claim.hit is not None
                if count_hits:
                    node.count("hits_node")
                value = self._deliver(key, claim.hit, request_id)
                if value is not None:
                    return Reservation(self, key, request_id, value=value)
                continue  # damaged entry was dropped: look again
            if claim.kind == "owner":
                node.count("misses")
                return Reservation(self, key, request_id, slot=claim.slot, gen=claim.gen)
            if claim.kind == "full":
                if not reaped:
                    reaped = True
                    node.reap()
                    continue
                return Reservation(self, key, request_id)
            if not wait:
                return None
            if not waited:
                node.count("coalesced_waits")
                waited = True
            try:
                # in slices: between them we look again, in case the slot we wait on was sealed,
                # evicted and reserved for another key before this thread started waiting
                node.wait(claim.slot, max(0.0, min(_WAIT_SLICE_S, deadline - time.monotonic())))
            except SemaphoreTimeout:
                if time.monotonic() < deadline:
                    continue
                node.count("timeouts")
                raise ComputeTimeout(
                    f"{key!r}: waited {self.config.compute_timeout_s}s for the compute of pid "
                    f"{node.owner_pid(claim.slot)}"
                ) from None
            failure = node.failure(claim.slot, claim.gen)
            if failure is not None:
                kind, message = failure
                if kind == UNCACHEABLE:
                    return Reservation(self, key, request_id)
                raise ComputeFailed(f"{key!r}: the process computing it failed: {message}")

    def _commit(
        self,
        key: EmbeddingCacheKey,
        slot: int,
        gen: int,
        value: Value,
        request_id: RequestId | None,
        *,
        deliver: bool = True,
        publish: bool = True,
    ) -> Value:
        """Store `value` for reservation (slot, gen) and seal it. Any failure before the seal
        abandons the reservation (waiters learn why). Returns the cached view when `deliver`."""
        node = self._index()
        try:
            encoded = values.plan(value)
            size = entry.entry_size(encoded)
            offset = node.allocate(slot, gen, size)
            if offset is None:
                raise ReservationLost(f"{key!r}: reservation (slot {slot}, gen {gen}) was taken over")
            target = memoryview(self._segments.arena)[offset : offset + size]
            try:
                entry.write_entry(target, key, gen, encoded, checksum=self.config.debug_check_views)
            finally:
                target.release()
            gpu = self._device.export(encoded, slot, gen)
        except CapacityError as exc:
            node.count("uncacheable")
            node.abandon(slot, gen, UNCACHEABLE, str(exc))
            raise
        except BaseException as exc:
            node.abandon(slot, gen, FAILED, f"{type(exc).__name__}: {exc}")
            raise
        pins = self._pins_for(request_id) if deliver else int(request_id is not None)
        try:
            info = node.seal(slot, gen, pins, gpu)
        finally:
            if gpu is not None:
                if node.gpu_record(slot, gen) is None:
                    self._device.exports.discard(slot, gen)  # fenced off: nobody will read our copy
                else:
                    self._device.exports.published(slot, gen)
        if info is None:
            raise ReservationLost(f"{key!r}: reservation (slot {slot}, gen {gen}) was taken over")
        node.count("puts")
        node.count("bytes_put", size)
        if publish:
            self._publish(key, slot, gen, offset, size)
        if not info.pinned:
            return value  # stored for everyone; this process is out of pins, so it keeps its own value
        if not deliver:
            if request_id is not None:
                with self._state_lock:
                    self._requests.setdefault(request_id, []).append((slot, gen))
            return value
        result = self._deliver(key, info, request_id)
        return value if result is None else result

    # ----------------------------------------------------------------- remote layer
    def _open_remote(self, config: CacheConfig) -> None:
        assert config.remote_master is not None
        try:
            self._remote = RemoteStore(
                config.remote_master,
                protocol=config.remote_protocol,
                segment_bytes=config.remote_segment_bytes,
                buffer_bytes=config.remote_buffer_bytes,
                queue_size=config.remote_publish_queue,
                strict=config.store_unavailable_mode == "strict",
                count=self._node.count,
            )
        except BaseException:
            self.close()
            raise
        arena = np.frombuffer(self._segments.arena, dtype=np.uint8)
        self._arena_address = arena.ctypes.data
        self._remote.register(self._arena_address, arena.nbytes)
        del arena

    def _pull(self, res: Reservation) -> Value | None:
        """Under our reservation: copy the key's entry from Mooncake into node memory and seal it.

        The transfer lands in a private staging buffer first (Mooncake may still write into memory
        after a failed or timed-out call, which must never be arena memory that others read), is
        verified (entry header and value format), then copied into the arena. None on any miss.
        """
        remote = self._remote
        if remote is None or not remote.available:
            return None
        node = self._index()
        name = remote_key(self.config.remote_key_prefix, res.key)
        size = remote.size_of(name)
        if size is None:
            return None
        if size <= entry.ENTRY_HEADER_SIZE or size > node.capacity:
            node.count("remote_rejected")
            return None
        with self._staging_lock:
            staging = self._staging
            if staging is None or staging.nbytes < size:
                staging = self._staging = np.empty(max(size, 1 << 20), dtype=np.uint8)
                remote.register(staging.ctypes.data, staging.nbytes)
            if not remote.get_into(name, staging.ctypes.data, size):
                self._poisoned.append(staging)  # a late write may still land there: never reuse it
                self._staging = None
                return None
            try:
                body = entry.verify(staging[:size].data, res.key, None)
                values.parse(body)
            except CorruptValue as exc:
                node.count("remote_rejected")
                log.warning(
                    "shmcache: rejected remote value %s: %s", name, str(exc)
                )  # not exc: its traceback would keep frames (and views) alive
                return None
            value = self._store_pulled(res, staging[:size])
        if value is not None:
            node.count("hits_remote")
        return value

    def _store_pulled(self, res: Reservation, data: np.ndarray) -> Value | None:
        """Seal a verified entry pulled from the store under reservation `res`."""
        node = self._index()
        slot, gen, size = res._slot, res._gen, data.nbytes
        try:
            offset = node.allocate(slot, gen, size)
        except CapacityError:
            return None
        if offset is None:
            raise ReservationLost(f"{res.key!r}: reservation (slot {slot}, gen {gen}) was taken over")
        arena = np.frombuffer(self._segments.arena, dtype=np.uint8, count=size, offset=offset)
        arena[:] = data
        entry.set_generation(arena.data, gen)
        del arena
        res._open = False
        info = node.seal(slot, gen, self._pins_for(res.request_id))
        if info is None:
            raise ReservationLost(f"{res.key!r}: reservation (slot {slot}, gen {gen}) was taken over")
        if not info.pinned:
            return self.get(res.key, res.request_id)
        return self._deliver(res.key, info, res.request_id)

    def _publish(self, key: EmbeddingCacheKey, slot: int, gen: int, offset: int, size: int) -> None:
        """Queue the publish of a freshly computed entry, pinned until the store has read it."""
        remote = self._remote
        if remote is None or not remote.available:
            return
        node = self._index()
        try:
            if not node.add_ref(slot, gen):
                return
        except Exception as exc:  # out of pins, a lock timeout: the value is stored, skip the publish
            node.count("remote_publish_drops")
            log.info("shmcache: not publishing %r: %s", key, str(exc))
            return
        name = remote_key(self.config.remote_key_prefix, key)
        if not remote.publish(name, self._arena_address + offset, size, lambda: node.unpin(slot, gen, 1)):
            node.unpin(slot, gen, 1)

    def _deliver(self, key: EmbeddingCacheKey, info: SlotInfo, request_id: RequestId | None) -> Value | None:
        """Turn a pinned entry into the returned value. Pins taken for it: a view pin (view mode)
        and a request ref (if request_id). Returns None if the entry failed verification."""
        node = self._node
        # the holder must be made straight from the mapping (not sliced from another array), so that
        # every array derived from it keeps it as its base: its finalizer then releases the view pin
        holder = np.frombuffer(self._segments.arena, dtype=np.uint8, count=info.size, offset=info.offset)
        clone = self.config.return_mode == "clone"
        try:
            body = entry.verify(holder.data, key, info.gen)
            self._check_unmodified(key, holder, info.slot, info.gen)
            parsed = values.parse(body)
            on_device = (
                self._device.materialize(holder, info, parsed, copy=clone) if parsed.on_device else None
            )
            if on_device is None:
                value, aliased = (
                    values.materialize(holder, parsed, copy=clone, base=entry.ENTRY_HEADER_SIZE),
                    False,
                )
            else:
                value, aliased = on_device
        except CorruptValue as exc:
            node.count("corrupt_records")
            log.warning("shmcache: dropping entry %r: %s", key, str(exc))
            node.unpin(info.slot, info.gen, self._pins_for(request_id))
            node.drop(info.slot, info.gen)
            return None
        except BaseException:  # ViewMutated, MemoryError, ...: give the pins back, then report it
            node.unpin(info.slot, info.gen, self._pins_for(request_id))
            raise
        with self._state_lock:
            if request_id is not None:
                self._requests.setdefault(request_id, []).append((info.slot, info.gen))
            if not clone:
                self._live_views += 1
                self._local[needle_of(key)] = _Mapping(
                    info.slot,
                    info.gen,
                    weakref.ref(holder),
                    parsed,
                    _weak(value),
                    info.gpu if aliased else None,
                )
        if not clone:
            weakref.finalize(holder, self._releases.put, (info.slot, info.gen))
        elif request_id is None:
            node.unpin(info.slot, info.gen, 1)  # clone mode: the pin only covered the copy
        return value

    def _check_unmodified(self, key: EmbeddingCacheKey, holder: np.ndarray, slot: int, gen: int) -> None:
        """Debug mode: verify the entry's checksum; a mismatch means a view was written to."""
        if self.config.debug_check_views and not entry.checksum_matches(holder.data):
            self._node.count("corrupt_records")
            self._node.drop(slot, gen)
            raise ViewMutated(f"{key!r}: a returned view was written to; the entry was dropped")

    def _local_hit(
        self, needle: bytes, key: EmbeddingCacheKey, request_id: RequestId | None, *, count: bool = True
    ) -> Value | None:
        """A repeat hit served from this process's live mapping: no lock unless a ref is taken."""
        found = self._local.get(needle)
        if found is None:
            return None
        holder = found.holder()
        if holder is None:
            return None
        node = self._node
        slot, gen = found.slot, found.gen
        state, _o, cur_gen = node.slot_fields(slot)[:3]
        now = time.monotonic()
        if state != SlotState.SEALED or cur_gen != gen or node.expired(slot, now):
            return None
        template = found.template() if found.template is not None else None
        if found.parsed.on_device and self._device.reader() is not None:
            if template is None:
                return None  # a GPU entry's device arrays are made by a full delivery (its route)
            if found.aliases is not None and not self._device.still_aliasable(slot, found.aliases):
                return None  # its exporter died or withdrew it: no new aliases of that memory
        self._check_unmodified(key, holder, slot, gen)
        if request_id is not None:
            if not node.add_ref(slot, gen):
                return None
            with self._state_lock:
                self._requests.setdefault(request_id, []).append((slot, gen))
        node.touch(slot, now)
        if count:
            node.count("hits_process")
        if template is not None:
            return values.alias(template)
        return values.materialize(holder, found.parsed, base=entry.ENTRY_HEADER_SIZE)

    def _drain_releases(self) -> None:
        """Release view pins of garbage-collected views. Finalizers only enqueue; this thread
        wakes on the first release and takes a short pause, so releases are batched."""
        while True:
            item = self._releases.get()
            time.sleep(_RELEASE_BATCH_S)
            batch = [item]
            while True:
                try:
                    batch.append(self._releases.get_nowait())
                except queue.Empty:
                    break
            if self._release(batch):
                return

    def _release(self, batch: list[tuple[int, int] | None]) -> bool:
        """Unpin a batch of released views; True when this thread should stop."""
        pins = [item for item in batch if item is not None]
        try:
            self._device.settle()  # kernels still reading released GPU aliases finish first
        except Exception as exc:  # a broken CUDA context: its kernels will not run any more
            log.warning("shmcache: waiting for GPU work on released views failed: %s", str(exc))
        try:
            self._node.unpin_many(pins)
            if pins:
                self._device.sweep()  # released entries may have let exported device copies go
        except Exception as exc:  # the namespace was destroyed under us, or similar
            log.debug("shmcache: releasing view pins failed: %s", str(exc))
        with self._state_lock:
            self._live_views -= len(pins)
            detach = self._closed and self._live_views == 0 and bool(pins)
            self._released.notify_all()
        if detach:
            self._detach()
        return detach or len(pins) < len(batch)

    def _detach(self) -> None:
        with self._detach_lock:
            if self._detached:
                return
            self._releases.put(None)
            node = self._node
            if not self._destroyed:
                try:
                    with bootstrap_lock(
                        self._names, self.config.mode, self.config.lock_timeout_s, create=False
                    ) as held:
                        if held:  # else the namespace was destroyed: nothing of ours is left
                            node.detach_client()
                            if not node.any_other_live():
                                remove_objects(self._names)
                except CacheClosed:
                    pass  # destroyed already
            self._local.clear()
            self._detached = True
            _open_caches.discard(self)
