"""Claims and commits: how this process gets a value or the right to compute it, and stores it.

`claim` loops over the node's `reserve` transaction: a hit is delivered, our reservation returned,
and another live process's reservation waited on (in slices, looking again between them) until it
is sealed, abandoned or its owner dies (then we take over). `commit` encodes a value and runs the
node's `commit` transaction, which abandons the reservation on any failure.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import threading
import time
from collections.abc import Iterator, Sequence

from shmcache.config import CacheConfig
from shmcache.errors import CacheClosed, CapacityError, ComputeReentered, InvalidKey
from shmcache.format import entry, values
from shmcache.format.values import Value
from shmcache.gpu.side import DeviceSide
from shmcache.keys.key import EmbeddingCacheKey
from shmcache.node.index import NodeIndex
from shmcache.node.layout import Counter, key_meta, needle_of
from shmcache.node.reservations import Claim, ClaimKind
from shmcache.node.slots import FailureKind, SealedEntry
from shmcache.process import waiting
from shmcache.process.releases import Releases
from shmcache.process.requests import RequestRefs
from shmcache.process.reservation import RequestId, Reservation, ReservationTicket
from shmcache.process.views import Views
from shmcache.process.writes import Writes
from shmcache.remote.bridge import LOOK_AGAIN, RemoteBridge

__all__ = ["Claims"]

log = logging.getLogger("shmcache")


class Claims:
    """Get-or-reserve and commit for one process (the `ReservationHolder` of its reservations)."""

    def __init__(
        self,
        node: NodeIndex,
        arena: mmap.mmap,
        config: CacheConfig,
        views: Views,
        device: DeviceSide,
        requests: RequestRefs,
        releases: Releases,
    ) -> None:
        self._node, self._arena, self._config = node, arena, config
        self._views, self._device, self._requests, self._releases = views, device, requests, releases
        self.bridge: RemoteBridge | None = None  # set when a remote store is configured
        self.writes = Writes()  # our writes into our reservations' extents (the bridge's too)
        self._computing = threading.local()  # `needles`: the keys this thread is computing

    @contextlib.contextmanager
    def computing(self, reservation: Reservation) -> Iterator[None]:
        """While this thread computes `reservation`'s value, a wait of this thread for its key
        raises `ComputeReentered` instead of waiting on itself until compute_timeout_s."""
        here = self._computing_here()
        needle = needle_of(reservation.key)
        outermost = needle not in here
        here.add(needle)
        try:
            yield
        finally:
            if outermost:
                here.discard(needle)

    def _computing_here(self) -> set[bytes]:
        here: set[bytes] | None = getattr(self._computing, "needles", None)
        if here is None:
            here = self._computing.needles = set()
        return here

    def claim(
        self,
        key: EmbeddingCacheKey,
        needle: bytes,
        request_id: RequestId | None,
        *,
        wait: bool,
        counted: bool = True,
        pull: bool = False,
    ) -> Reservation | None:
        """The value of `key` (as a settled reservation), or our reservation of it, or an uncached
        one (no slot free, or the key's reservation is ours, kept: `_kept`); None if another
        process holds it and `wait` is off. With `pull`, a node miss is first looked up in the
        remote store, under our reservation. With `counted` off (a `put`, not a lookup) neither a
        hit nor a miss is counted."""
        node = self._node
        local = self._views.repeat_hit(needle, key, request_id, count=counted)
        if local is not None:
            return Reservation(self, key, request_id, value=local)
        deadline = time.monotonic() + self._config.compute_timeout_s
        reaped = waited = False
        meta, pins = key_meta(key), self._views.pins_for(request_id)
        while True:
            claim = node.reserve(needle, meta, pins)
            if claim.kind is ClaimKind.HIT:
                hit = self._hit(claim.hit, key, needle, request_id, count=counted)
                if hit is not None:
                    return hit
                continue  # a damaged entry was dropped: look again
            if claim.kind is ClaimKind.OWNER:
                settled = self._owned(claim, key, request_id, pull=pull, counted=counted)
                if settled is not None:
                    return settled
                pull = counted = False  # the pull ended our reservation: look again (counted once)
                continue
            if claim.kind is ClaimKind.FULL:  # every way of the stripe referenced
                if reaped:
                    return Reservation(self, key, request_id)
                reaped = True
                node.reclaim()  # our views that died since
                node.reap()  # and dead processes' pins
                continue
            kept = self._kept(claim)  # ours: computed uncached, never waited on (nor a wait counted)
            if kept or not wait:
                return Reservation(self, key, request_id) if kept else None
            if not waited:
                node.count(Counter.COALESCED_WAITS)
                waited = True
            if self._wait_out(claim, key, needle, deadline):
                return Reservation(self, key, request_id)

    def _wait_out(self, claim: Claim, key: EmbeddingCacheKey, needle: bytes, deadline: float) -> bool:
        """One slice of the wait on another holder's reservation `claim`; True if it ended with a
        value that could not be stored (we compute it ourselves, uncached)."""
        if needle in self._computing_here():
            raise ComputeReentered(f"{key!r}: asked for by its own compute (it would wait on itself)")
        ended = waiting.wait_slice(self._node, key, claim.slot, deadline, self._config.compute_timeout_s)
        return ended and waiting.failed_uncacheable(self._node, key, claim.slot, claim.gen)

    def _kept(self, claim: Claim) -> bool:
        """Whether `claim` found our reservation kept while a transfer may write it (`SetAside.keeps`)."""
        return self.bridge is not None and self.bridge.set_aside.keeps(claim.slot, claim.gen)

    def _hit(
        self,
        hit: SealedEntry | None,
        key: EmbeddingCacheKey,
        needle: bytes,
        request_id: RequestId | None,
        *,
        count: bool,
    ) -> Reservation | None:
        """A node hit delivered as a settled reservation; None if the entry was found damaged."""
        assert hit is not None
        if count:
            self._node.count(Counter.HITS_NODE)
        value = self._views.deliver(key, needle, hit, request_id)
        return None if value is None else Reservation(self, key, request_id, value=value)

    def put(self, key: EmbeddingCacheKey, needle: bytes, value: Value, request_id: RequestId | None) -> None:
        """`EmbeddingCache.put`: claim `key` (not a lookup: nothing counted) and commit `value`."""
        res = self.claim(key, needle, request_id, wait=False, counted=False)
        if res is not None and res.value is None and res.cached:
            res.commit(value, view=False)
            return
        no_room = res is not None and res.value is None  # else the key is stored or in flight
        del res  # no view of the stored entry outlives this call, not even in a traceback
        values.plan(value)  # nothing is stored, but a value `put` cannot hold is still refused
        if no_room:
            raise CapacityError(f"{key!r}: no slot is free in its stripe (every way is referenced)")

    def claim_many(
        self,
        keys: Sequence[EmbeddingCacheKey],
        needles: Sequence[bytes],
        request_id: RequestId | None,
        *,
        lease: bool = True,
        counted: bool = True,
    ) -> list[Reservation | None]:
        """`claim` of every key without waiting (hits and misses counted if `counted`); then the
        node misses we own are pulled in one batch (under their reservations), and the rest leased
        (single flight; `lease` off: only looked at; `RemoteBridge.pull_or_lease_many`): one
        another node is computing is given back (None, as for a key another process holds)."""
        claims: list[Reservation | None] = []
        owned: dict[int, Reservation] = {}
        bridge = self.bridge
        try:
            for i, (key, needle) in enumerate(zip(keys, needles, strict=True)):
                res = self.claim(key, needle, request_id, wait=False, counted=counted)
                claims.append(res)
                if res is not None and res.owned:
                    owned[i] = res
            if bridge is None or not owned:
                return claims
            pulled = bridge.pull_or_lease_many(list(owned.values()), take=lease)
            for i, value in zip(owned, pulled, strict=True):
                if value is LOOK_AGAIN:  # no longer ours, not a value for us (another node may
                    claims[i] = None  # compute it): as a key another process holds
                elif value is not None:
                    claims[i] = Reservation(None, keys[i], request_id, value=value)
        except BaseException:  # what we reserved goes back unused (waiters look again, no failure)
            for res in owned.values():
                if res.owned and (bridge is None or not bridge.set_aside.interrupted(res)):
                    res.withdraw()
            raise
        return claims

    def _owned(
        self, claim: Claim, key: EmbeddingCacheKey, request_id: RequestId | None, *, pull: bool, counted: bool
    ) -> Reservation | None:
        """Our reservation of a node miss (a miss if `counted`), `_pulled` first with `pull`."""
        if counted:
            self._node.count(Counter.MISSES)
        ours = Reservation(self, key, request_id, slot=claim.slot, gen=claim.gen)
        return self._pulled(ours) if pull else ours

    def _pulled(self, res: Reservation) -> Reservation | None:
        """Our reservation of a node miss, or the value the store had for it (pulled under it: one
        pull per node); None if the pull ended it without a value for us (`LOOK_AGAIN`)."""
        if self.bridge is None:
            return res
        try:
            pulled = self.bridge.pull_or_lease(res)
        except BaseException:  # given back unused: a waiter looks again (no failure to report)
            if not self.bridge.set_aside.interrupted(res):
                res.withdraw()
            raise
        if pulled is LOOK_AGAIN:
            return None
        return res if pulled is None else Reservation(None, res.key, res.request_id, value=pulled)

    # ------------------------------------------------------------------ ReservationHolder
    def commit(self, reservation: Reservation, value: Value, *, view: bool) -> Value:
        """Store `value` for `reservation` and seal it; the cached view when `view`, else `value`.
        A value that cannot be stored raises `CapacityError` (counted as uncacheable); one after
        this process detached, `CacheClosed` (the detach withdrew the reservation)."""
        node, key, slot, gen = self._node, reservation.key, reservation.slot, reservation.gen
        request_id = reservation.request_id
        try:
            encoded = values.plan(value)
        except BaseException as exc:
            self.abandon(reservation, f"{type(exc).__name__}: {exc}")
            raise
        exported = False

        def write(offset: int, size: int) -> bytes | None:
            nonlocal exported
            target = memoryview(self._arena)[offset : offset + size]
            try:
                entry.write_entry(target, key, gen, encoded, checksum=self._config.debug_check_views)
            finally:
                target.release()
            record = self._device.export(encoded, slot, gen)
            exported = record is not None
            return None if record is None else record.pack()

        sealed = None
        try:
            pins = self._views.commit_pins(request_id, view=view)
            with self.writes.writing(slot, gen):
                sealed = node.commit(slot, gen, entry.entry_size(encoded), write, pins)
        except CapacityError:
            node.count(Counter.UNCACHEABLE)
            raise
        except CacheClosed:  # refused by the detach, nothing written: end it here (fenced)
            self._end(slot, gen, FailureKind.NONE, "its process detached")
            raise
        finally:
            if exported:
                self._settle_export(slot, gen)
            if self.bridge is not None and sealed is None:  # failed: another node takes over
                self.bridge.leases.end(slot, gen, failed=True)
        node.count(Counter.PUTS)
        node.count(Counter.BYTES_PUT, sealed.size)
        if self.bridge is not None:
            self.bridge.publish(key, sealed)
        return self._views.hand_out(reservation.key, request_id, value, sealed, view=view)

    def _settle_export(self, slot: int, gen: int) -> None:
        """After a seal (or its failure): our device copy is read by others only if its record
        made it into the index."""
        if self._node.attachments.get(slot, gen) is None:
            self._device.exports.discard(slot, gen)  # fenced off: nobody will read our copy
        else:
            self._device.exports.published(slot, gen)

    def abandon(self, reservation: Reservation, reason: str) -> None:
        self._end(reservation.slot, reservation.gen, FailureKind.FAILED, reason)

    def withdraw(self, reservation: Reservation) -> None:
        self._end(reservation.slot, reservation.gen, FailureKind.NONE, "withdrawn")

    def dropped(self, slot: int, gen: int) -> None:
        self._releases.later(functools.partial(self._end, slot, gen, FailureKind.NONE, "dropped unended"))

    def withdraw_held(self, wait_s: float) -> None:
        """At the detach: shut our writes (waiting up to `wait_s`), withdraw what none may write."""
        busy = self.writes.shut(wait_s) | (self.bridge.set_aside.still_written() if self.bridge else set())
        for slot, gen in self._node.reservations.held().items() - busy:
            try:  # a lock timeout: the semaphore is released anyway (waiters take over); go on
                self._end(slot, gen, FailureKind.NONE, "its process detached")
            except Exception as exc:
                log.warning("shmcache: a withdraw at detach failed: %s", str(exc))

    def _end(self, slot: int, gen: int, kind: FailureKind, reason: str) -> None:
        """Abandon reservation (slot, gen) (fenced: not if another process adopted it or took it
        over); its lease is removed if it ended here, else only forgotten (the adopter holds it)."""
        ended = self._node.abandon(slot, gen, kind, reason)
        if self.bridge is not None:
            self.bridge.leases.end(slot, gen, failed=ended)

    def ticket(self, reservation: Reservation) -> ReservationTicket:
        return ReservationTicket(
            self._config.namespace,
            reservation.slot,
            reservation.gen,
            self._node.client,
            reservation.key.digest,
            None if self.bridge is None else self.bridge.leases.of(reservation),
        )

    def let_go(self, reservation: Reservation) -> bool:
        adopted_or_ended = self._node.let_go(reservation.slot, reservation.gen)
        if adopted_or_ended and self.bridge is not None:
            self.bridge.leases.end(reservation.slot, reservation.gen, failed=False)  # the adopter's now
        return adopted_or_ended

    def adopt(
        self, ticket: ReservationTicket, key: EmbeddingCacheKey, request_id: RequestId | None
    ) -> Reservation | None:
        """Our reservation of `key`, adopted from the process that handed out `ticket`; None if it
        is not that process's any more (sealed, abandoned, taken over, or it died)."""
        if ticket.namespace != self._config.namespace or ticket.digest != key.digest:
            raise InvalidKey(f"{key!r}: the ticket is for another key or namespace")
        if not self._node.adopt(ticket.slot, ticket.gen, ticket.giver):
            return None
        reservation = Reservation(self, key, request_id, slot=ticket.slot, gen=ticket.gen)
        if ticket.lease is not None and self.bridge is not None:
            self.bridge.leases.adopt(reservation, ticket.lease)  # our publish or failure removes it
        return reservation
