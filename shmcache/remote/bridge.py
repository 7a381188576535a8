"""The bridge between the node layer and Mooncake Store: pull on a node miss, publish after a compute.

A pull runs under the node reservation (N processes of a node that miss together cause one pull).
With its own segment, this process pulls straight into the reservation's extent of the arena
(not yet visible to anyone), verifies it there (entry header and value format) and seals it
through the node's fenced seal: no copy.

Where the key's kind has a steady entry size (sizes.py), the extent is that guess, and a pull asks
the store for nothing but the `get_into`. The extent is then cut to what arrived; an object
larger than the guess is refused before any transfer starts, and the pull asks for the size. A
miss, or a pull that brings nothing, gives the extent back (the room a guess made on a miss is
what the compute that follows needs: the kind's sizes are steady).

A transfer that timed out, or failed in a way that may leave slices in flight (answers.py: on TCP
a failure answered before Mooncake's own wait ran out leaves none, and its extent is given back),
may still write into its extent after the call returned, so the reservation is *set aside*
(setaside.py, slots.py): the memory stays out of the allocator's hands until the late call
answers that nothing writes there any more (the object arrived, or no transfer ran), or else
until this process detaches or dies; the caller looks the key up again.
A thin client of the node's holder can only transfer through the holder's pool: its pulls land
in a pool buffer and are copied after verification. Many misses of one request are pulled in one
`batch_get_into` (`pull_many`, through the pull buffer). A publish pins the entry until the store
has read it (a thin client: copied it into its publish buffer; else: put it), and never blocks
(store.py's bounded queue).
"""

from __future__ import annotations

import enum
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
from shmcache.process.writes import Writes
from shmcache.remote import lease
from shmcache.remote.answers import Transfer
from shmcache.remote.leases import Leases
from shmcache.remote.setaside import SetAside
from shmcache.remote.sizes import SizeGuesses
from shmcache.remote.store import RemoteStore, remote_key

__all__ = ["BATCH_ITEM_BYTES", "LOOK_AGAIN", "LookAgain", "Pulled", "RemoteBridge"]

BATCH_ITEM_BYTES: Final = 64 << 10  # a batch pull gives each item this much room (measured: 66
# items of 4 KiB in 5-8 ms with 64 KiB each, 150 ms with 1 MiB each; alone: 30-54 ms + sizes)
DRAIN_S: Final = 90.0  # at close, how long to wait for transfers still writing node memory
# (Mooncake itself gives up on a transfer after 60 s)

log = logging.getLogger("shmcache")


class LookAgain(enum.Enum):
    """A pull that ended our reservation without a value for us (its memory set aside, or sealed
    while this process had no pin left): the caller looks the key up again."""

    LOOK_AGAIN = "look again"


LOOK_AGAIN: Final = LookAgain.LOOK_AGAIN
Pulled = Value | None | LookAgain  # a value; None: a miss, the reservation still ours; LOOK_AGAIN


class NotInPlace(enum.Enum):
    """Why a pull into the reservation's extent brought nothing though another way may."""

    NO_ROOM = "no room in the arena"  # the pull buffer may still bring it
    LARGER = "the object is larger than the extent"  # after a guess: ask the store for the size


class RemoteBridge:
    """One process's link from its node index to the remote store."""

    def __init__(
        self, config: CacheConfig, node: NodeIndex, arena: mmap.mmap, views: Views, writes: Writes
    ) -> None:
        """Connect to `config.remote_master` (`RemoteUnavailable` in strict mode if it is down)."""
        assert config.remote_master is not None
        self._node, self._arena, self._views, self._prefix = node, arena, views, config.remote_key_prefix
        self._writes = writes  # our writes into node memory, which the detach shuts
        address = np.frombuffer(arena, dtype=np.uint8)
        self._arena_address, self._arena_bytes = int(address.ctypes.data), address.nbytes
        del address
        self.store = store = RemoteStore(config, node.count)
        try:
            store.register(self._arena_address, self._arena_bytes)
        except BaseException:  # no bridge to close it: its prober would connect a client nobody closes
            store.close()
            raise
        self._lock = threading.Lock()  # one staged pull at a time: they share the store's pull buffer
        self._single_flight = config.remote_single_flight
        self.leases = Leases(store, config.compute_timeout_s, lease.node_tag(node.segments.names.index))
        self._sizes = SizeGuesses()
        self.set_aside = SetAside(node)  # node memory our transfers may still write

    def close(self) -> None:
        """Finish queued publishes (they hold pins), then disconnect, first waiting (up to
        `DRAIN_S`) for the transfers into node memory still running: the memory they write is
        freed when this process detaches. None starts once the close began."""
        self.set_aside.closing()  # first: no transfer into node memory starts from here
        closed = self.store.close(drain_s=DRAIN_S)
        if closed:
            self.set_aside.closed()
        elif self.store.writing_node_memory():
            log.error("shmcache: a Mooncake transfer into node memory is still running at close")

    def pull(self, reservation: Reservation, *, guess: bool = True) -> Pulled:
        """Under our `reservation`: bring the key's entry from the store into node memory and seal
        it; the value, None on a miss (the reservation is then still ours), or LOOK_AGAIN. With
        `guess`, a pull into node memory first tries the extent `SizeGuesses` has for the key,
        without asking the store for the size."""
        store = self.store
        if not store.available:
            return None
        name = remote_key(self._prefix, reservation.key)
        in_place = self._node.pins.spare >= 2 and store.pulls_in_place(self._arena_address, self._arena_bytes)
        room = self._sizes.guess(reservation.key) if guess and in_place else None
        if room is not None:
            pulled = self._pull_in_place(reservation, name, room)
            if not isinstance(pulled, NotInPlace):
                return pulled
            if pulled is NotInPlace.NO_ROOM:
                in_place = False  # no room for the guess: in place only for a smaller object
        size = store.size_of(name)
        if size is None:
            return None
        if size <= entry.ENTRY_HEADER_SIZE or size > self._node.capacity:
            self._node.count(Counter.REMOTE_REJECTED)
            return None
        if in_place or (room is not None and size < room):
            pulled = self._pull_in_place(reservation, name, size)
            if pulled is NotInPlace.LARGER:
                return None  # stored anew since its size was asked: a miss
            if not isinstance(pulled, NotInPlace):
                return pulled
        with self._lock:  # no room in the arena: a private copy through the pull buffer
            return self._settle(reservation, name, store.fetch(name, size))

    def _pull_in_place(self, reservation: Reservation, name: str, room: int) -> Pulled | NotInPlace:
        """`pull` into an extent of `room` bytes given to the reservation (the object's size, or a
        guess: the extent is then cut to what arrived). It needs two spare pin records: one to
        deliver, one to set the extent aside if the transfer fails. A pull that brings no value
        gives the extent back; `NotInPlace` when another way may still bring it."""
        with self._writes.writing(reservation.slot, reservation.gen):
            return self._write_in_place(reservation, name, room)

    def _write_in_place(self, reservation: Reservation, name: str, room: int) -> Pulled | NotInPlace:
        """`_pull_in_place`'s writes into the reservation's extent, from its allocation to the seal."""
        node, slot, gen = self._node, reservation.slot, reservation.gen
        try:
            offset = node.allocate(slot, gen, room)
        except CapacityError:
            return NotInPlace.NO_ROOM
        transfer = self.set_aside.start(reservation)  # from here an exception sets it aside
        if transfer is None:  # closing: a miss, the extent given back
            node.shrink(slot, gen, 0)
            return None
        try:
            fetched = self.store.fetch_into(name, self._arena_address + offset, room, transfer.calls.append)
        except BaseException:  # interrupted while the transfer may go on (the call is in `calls`)
            self.set_aside.set_aside(transfer)
            raise
        if fetched.outcome is Transfer.TAINTED:
            self.set_aside.set_aside(transfer)
            return LOOK_AGAIN
        self.set_aside.read(transfer)  # nothing writes there any more: the extent is ours again
        size = fetched.nbytes  # 0 unless DONE
        if size < room:
            node.shrink(slot, gen, size)  # all of it back when nothing arrived
        if fetched.outcome is not Transfer.DONE:
            return NotInPlace.LARGER if fetched.outcome is Transfer.LARGER else None
        pulled = memoryview(self._arena)[offset : offset + size]
        try:
            checked = self._verified(reservation, name, pulled)
            if checked is None:
                node.shrink(slot, gen, 0)
                return None  # the caller computes
            entry.set_generation(pulled, gen)
        finally:
            pulled.release()
        self._sizes.saw(reservation.key, size)
        sealed = node.seal(slot, gen, self._views.pins_for(reservation.request_id), None)
        node.count(Counter.HITS_REMOTE)
        if not sealed.pinned:
            return LOOK_AGAIN  # sealed for everyone; a lookup delivers it as any hit
        key, request_id = reservation.key, reservation.request_id
        value = self._views.deliver(key, needle_of(key), sealed, request_id, checked)
        return LOOK_AGAIN if value is None else value

    def pull_or_lease(self, reservation: Reservation) -> Pulled:
        """`pull`; on a miss, with cross-node single flight on, take the key's lease in the store
        (None: we hold it and compute) or wait for the node that holds it (its value)."""
        value = self.pull(reservation)
        if value is not None or not self._single_flight or not self.store.available:
            return value
        name = remote_key(self._prefix, reservation.key)
        return self.leases.hold_or_wait(reservation, name, lambda: self.pull(reservation, guess=False))

    def pull_or_lease_many(self, reservations: Sequence[Reservation], *, take: bool = True) -> list[Pulled]:
        """The batch path's `pull_or_lease`, without waiting: `pull_many`, then each miss leased
        (`lease_now`); one another node holds is withdrawn (LOOK_AGAIN: the caller waits for it on
        the blocking path). Those whose lease we won are pulled once more, as `hold_or_wait` does: a
        holder may have published and removed its lease between our pull and our lease; a value
        found (or LOOK_AGAIN) gives the lease back, and so do all of them if that pull raises."""
        values = self.pull_many(reservations)
        won: list[int] = []
        for i, (res, value) in enumerate(zip(reservations, values, strict=True)):
            if value is not None:
                continue
            if not self.lease_now(res, take=take):
                res.withdraw()
                values[i] = LOOK_AGAIN
            elif self.leases.of(res) is not None:
                won.append(i)
        try:
            again = self.pull_many([reservations[i] for i in won])
        except BaseException:  # nobody computes under those leases: other nodes take over at once
            for i in won:
                self.leases.end(reservations[i].slot, reservations[i].gen, failed=True)
            raise
        for i, value in zip(won, again, strict=True):
            if value is not None:
                self.leases.end(reservations[i].slot, reservations[i].gen, failed=True)
                values[i] = value
        return values

    def lease_now(self, reservation: Reservation, *, take: bool = True) -> bool:
        """For a node miss the store did not have, on the batch path: with cross-node single flight
        on, take its lease without waiting; False if another node holds it (computing it). With
        `take` off (a caller computing for itself alone) only look: no lease is taken."""
        if not self._single_flight or not self.store.available:
            return True
        return self.leases.take_now(reservation, remote_key(self._prefix, reservation.key), take=take)

    def pull_many(self, reservations: Sequence[Reservation]) -> list[Pulled]:
        """`pull` of many node misses in one batch call (each value up to `BATCH_ITEM_BYTES`;
        larger ones are pulled alone afterwards); per reservation its value, None or LOOK_AGAIN."""
        if not reservations or not self.store.available:
            return [None] * len(reservations)
        names = [remote_key(self._prefix, res.key) for res in reservations]
        with self._lock:
            fetched, larger = self.store.fetch_many(names, BATCH_ITEM_BYTES)
            values: list[Pulled] = [
                self._settle(res, name, data)
                for res, name, data in zip(reservations, names, fetched, strict=True)
            ]
        for i in larger:
            values[i] = self.pull(reservations[i])
        return values

    def _verified(self, reservation: Reservation, name: str, data: memoryview) -> decode.ParsedValue | None:
        """The parsed value of pulled bytes that are an intact entry of the reservation's key;
        None (counted) if they are not."""
        node = self._node
        if data.nbytes <= entry.ENTRY_HEADER_SIZE or data.nbytes > node.capacity:
            node.count(Counter.REMOTE_REJECTED)
            return None
        try:
            return decode.parse(entry.verify(data, reservation.key, None))
        except CorruptValue as exc:
            node.count(Counter.REMOTE_REJECTED)
            log.warning("shmcache: rejected remote value %s: %s", name, str(exc))  # not exc: frames
            return None

    def _settle(self, reservation: Reservation, name: str, data: np.ndarray | None) -> Value | None:
        """Verify fetched bytes and seal them under `reservation` (hold the pull lock: `data` is
        in the shared pull buffer); None for a miss or a rejected value."""
        if data is None or self._verified(reservation, name, data.data) is None:
            return None
        value = self._seal(reservation, data)
        self._node.count(Counter.HITS_REMOTE)
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
            with self._writes.writing(slot, gen):
                sealed = self._node.commit(slot, gen, data.nbytes, write, self._views.pins_for(request_id))
        except CapacityError:
            sealed = None
        if sealed is not None and not sealed.pinned:
            sealed = self._views.pin_late(sealed, request_id, self._views.pins_for(request_id))
        if sealed is not None and sealed.pinned:
            value = self._views.deliver(reservation.key, needle_of(reservation.key), sealed, request_id)
            if value is not None:
                return value
        return decode.decode(data[entry.ENTRY_HEADER_SIZE :], copy=True)

    def publish(self, key: EmbeddingCacheKey, sealed: SealedEntry) -> None:
        """Queue the publish of a freshly computed entry, pinned until the store has read it.
        The lease we held for it (if any) is removed once the publish is over, stored or not:
        waiting nodes then find the value, or take over at once, never at the lease's deadline
        (a lease may sit in a segment that outlives us while our copy of the value does not);
        while the store does not answer, once it does (`Leases.release`)."""
        self.leases.settle_owed()
        node, slot, gen = self._node, sealed.slot, sealed.gen
        held = self.leases.forget(slot, gen)

        def over(stored: bool = False) -> None:  # stored or not, the lease goes
            if held is not None:
                self.leases.release(held)

        def read() -> None:  # the store read the entry (a thin client: into its publish buffer)
            node.release([(slot, gen)])

        if not self.store.available:  # the store does not answer: the lease goes once it does
            node.count(Counter.REMOTE_PUBLISH_DROPS)
            over()
            return
        try:
            if not node.add_ref(slot, gen):  # evicted already
                node.count(Counter.REMOTE_PUBLISH_DROPS)
                over()
                return
        except Exception as exc:  # out of pins, a lock timeout: the value is stored, skip the publish
            node.count(Counter.REMOTE_PUBLISH_DROPS)
            log.info("shmcache: not publishing %r: %s", key, str(exc))
            over()
            return
        name = remote_key(self._prefix, key)
        self._sizes.saw(key, sealed.size)
        address = self._arena_address + sealed.offset
        if not self.store.publish(name, address, sealed.size, read, over):
            read()
            over()
