"""The bridge between the node layer and Mooncake Store: pull on a node miss, publish after a compute.

A pull runs under the node reservation (N processes of a node that miss together cause one pull).
The transfer lands in a private staging buffer first (Mooncake may still write into memory after a
failed or timed-out call, which must never be arena memory that others read), is verified (entry
header and value format), then sealed through the node's one commit transaction. Many misses of
one request are pulled in one `batch_get_into` (`pull_many`). A publish pins the entry until the
store has read it, and never blocks (store.py's bounded queue).
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Sequence
from typing import Final

import numpy as np

from shmcache.config import CacheConfig
from shmcache.errors import CapacityError, CorruptValue
from shmcache.format import decode, entry
from shmcache.format.values import Value
from shmcache.keys.key import EmbeddingCacheKey
from shmcache.node.index import NodeIndex
from shmcache.node.layout import Counter, needle_of
from shmcache.node.slots import SealedEntry
from shmcache.process.reservation import Reservation
from shmcache.process.views import Views
from shmcache.remote import lease
from shmcache.remote.store import RemoteStore, remote_key

__all__ = ["BATCH_ITEM_BYTES", "RemoteBridge"]

BATCH_ITEM_BYTES: Final = 64 << 10  # a batch pull gives each item this much room (measured: 66
# items of 4 KiB in 5-8 ms with 64 KiB each, 150 ms with 1 MiB each; alone: 30-54 ms + sizes)

log = logging.getLogger("shmcache")


class RemoteBridge:
    """One process's link from its node index to the remote store."""

    def __init__(
        self,
        store: RemoteStore,
        node: NodeIndex,
        arena: mmap.mmap,
        views: Views,
        prefix: str,
        *,
        single_flight: bool = False,
        lease_s: float = 300.0,
    ) -> None:
        self.store, self._node, self._arena, self._views, self._prefix = store, node, arena, views, prefix
        address = np.frombuffer(arena, dtype=np.uint8)
        self._arena_address = int(address.ctypes.data)
        store.register(self._arena_address, address.nbytes)
        del address
        self._lock = threading.Lock()  # one pull at a time: they share the store's pull buffer
        self._single_flight, self._lease_s = single_flight, lease_s
        self._leases: dict[tuple[int, int], tuple[str, bytes]] = {}  # (slot, gen) -> (name, token)

    @classmethod
    def open(cls, config: CacheConfig, node: NodeIndex, arena: mmap.mmap, views: Views) -> RemoteBridge:
        """Connect to `config.remote_master` (`RemoteUnavailable` in strict mode if it is down)."""
        assert config.remote_master is not None
        store = RemoteStore(config, node.count)
        return cls(
            store,
            node,
            arena,
            views,
            config.remote_key_prefix,
            single_flight=config.remote_single_flight,
            lease_s=config.compute_timeout_s,
        )

    def close(self) -> None:
        """Finish queued publishes (they hold pins), then disconnect."""
        self.store.close()

    def pull(self, reservation: Reservation) -> Value | None:
        """Under our `reservation`: copy the key's entry from the store into node memory and seal
        it; the value, or None on any miss (the reservation is then still ours)."""
        if not self.store.available:
            return None
        name = remote_key(self._prefix, reservation.key)
        size = self.store.size_of(name)
        if size is None:
            return None
        if size <= entry.ENTRY_HEADER_SIZE or size > self._node.capacity:
            self._node.count(Counter.REMOTE_REJECTED)
            return None
        with self._lock:
            return self._settle(reservation, name, self.store.fetch(name, size))

    def pull_or_lease(self, reservation: Reservation) -> Value | None:
        """`pull`; on a miss, with cross-node single flight on, take the key's lease in the store
        (None: we hold it and compute) or wait for the node that holds it (its value)."""
        value = self.pull(reservation)
        if value is not None or not self._single_flight or not self.store.available:
            return value
        name = remote_key(self._prefix, reservation.key)
        token, value = lease.hold_or_wait(self.store, name, self._lease_s, lambda: self.pull(reservation))
        if token is not None:
            self._leases[(reservation.slot, reservation.gen)] = (name, token)
        return value

    def end_lease(self, reservation: Reservation, *, failed: bool) -> None:
        """The reservation ended: forget its lease, and remove it if the compute failed (a
        waiting node then takes over at once instead of at the lease's deadline)."""
        held = self._leases.pop((reservation.slot, reservation.gen), None)
        if held is not None and failed:
            lease.release(self.store, *held)

    def pull_many(self, reservations: Sequence[Reservation]) -> list[Value | None]:
        """`pull` of many node misses in one batch call (each value up to `BATCH_ITEM_BYTES`;
        larger ones are pulled alone afterwards); per reservation its value or None."""
        if not reservations or not self.store.available:
            return [None] * len(reservations)
        names = [remote_key(self._prefix, res.key) for res in reservations]
        with self._lock:
            fetched, larger = self.store.fetch_many(names, BATCH_ITEM_BYTES)
            values = [
                self._settle(res, name, data)
                for res, name, data in zip(reservations, names, fetched, strict=True)
            ]
        for i in larger:
            values[i] = self.pull(reservations[i])
        return values

    def _settle(self, reservation: Reservation, name: str, data: np.ndarray | None) -> Value | None:
        """Verify fetched bytes and seal them under `reservation` (hold the pull lock: `data` is
        in the shared pull buffer); None for a miss or a rejected value."""
        if data is None:
            return None
        node = self._node
        if data.nbytes <= entry.ENTRY_HEADER_SIZE or data.nbytes > node.capacity:
            node.count(Counter.REMOTE_REJECTED)
            return None
        try:
            decode.parse(entry.verify(data.data, reservation.key, None))
        except CorruptValue as exc:
            node.count(Counter.REMOTE_REJECTED)
            log.warning("shmcache: rejected remote value %s: %s", name, str(exc))  # not exc: frames
            return None
        value = self._seal(reservation, data)
        node.count(Counter.HITS_REMOTE)
        return value

    def _seal(self, reservation: Reservation, data: np.ndarray) -> Value:
        """Seal a verified pulled entry under `reservation` and deliver it; a private copy when
        the node has no room for it or this process no pins left."""
        slot, gen, request_id = reservation.slot, reservation.gen, reservation.request_id

        def write(offset: int, size: int) -> None:
            arena = np.frombuffer(self._arena, dtype=np.uint8, count=size, offset=offset)
            arena[:] = data
            entry.set_generation(arena.data, gen)

        try:
            sealed = self._node.commit(slot, gen, data.nbytes, write, self._views.pins_for(request_id))
        except CapacityError:
            sealed = None
        if sealed is not None and sealed.pinned:
            value = self._views.deliver(reservation.key, needle_of(reservation.key), sealed, request_id)
            if value is not None:
                return value
        return decode.decode(data[entry.ENTRY_HEADER_SIZE :], copy=True)

    def publish(self, key: EmbeddingCacheKey, sealed: SealedEntry) -> None:
        """Queue the publish of a freshly computed entry, pinned until the store has read it.
        The lease we held for it (if any) is removed when the value will not be in the store
        (dropped, failed): waiting nodes then take over at once, not at the lease's deadline."""
        node, slot, gen = self._node, sealed.slot, sealed.gen
        held = self._leases.pop((slot, gen), None)

        def unpublished() -> None:
            if held is not None:
                lease.release(self.store, *held)

        def done(stored: bool) -> None:
            node.release([(slot, gen)])
            if not stored:
                unpublished()

        if not self.store.available:
            return  # the store does not answer: the lease cannot be removed either
        try:
            if not node.add_ref(slot, gen):
                unpublished()
                return
        except Exception as exc:  # out of pins, a lock timeout: the value is stored, skip the publish
            node.count(Counter.REMOTE_PUBLISH_DROPS)
            log.info("shmcache: not publishing %r: %s", key, str(exc))
            unpublished()
            return
        name = remote_key(self._prefix, key)
        address = self._arena_address + sealed.offset
        if not self.store.publish(name, address, sealed.size, done):
            done(False)
