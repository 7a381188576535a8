"""The cross-node leases one process holds (the protocol is `lease.py`'s): each by the node
reservation it covers, other nodes' tokens by when this process first saw them, and the removals
an outage put off until the store answers again."""

from __future__ import annotations

import threading
from collections.abc import Callable

from shmcache.format.values import Value
from shmcache.process.reservation import Reservation
from shmcache.remote import lease
from shmcache.remote.store import RemoteStore

__all__ = ["Leases"]


class Leases:
    """One process's leases in `store`, taken for `timeout_s` under its node's tag `node`."""

    def __init__(self, store: RemoteStore, timeout_s: float, node: str) -> None:
        self._store, self._timeout, self._node = store, timeout_s, node
        self._held: dict[tuple[int, int], lease.Lease] = {}  # by the (slot, gen) it covers
        self._seen: dict[bytes, float] = {}  # other nodes' lease tokens: when first seen
        self._owed: list[lease.Lease] = []  # ours to remove once the store answers again
        self._owed_lock = threading.Lock()

    def hold_or_wait(
        self, reservation: Reservation, name: str, pull: Callable[[], Value | None]
    ) -> Value | None:
        """`lease.hold_or_wait` for `reservation`'s key (`name`): None if we hold its lease now
        (we compute), else the value another node computed."""
        self.settle_owed()
        token, value = lease.hold_or_wait(self._store, name, self._timeout, self._node, pull)
        if token is not None:
            self._held[(reservation.slot, reservation.gen)] = lease.Lease(name, token)
        return value

    def take_now(self, reservation: Reservation, name: str, *, take: bool) -> bool:
        """`lease.try_hold` for `reservation`'s key (`name`), without waiting: False if another
        node holds it. With `take` off only look (`lease.held_elsewhere`): nothing is taken."""
        self.settle_owed()
        if not take:
            return not lease.held_elsewhere(self._store, name, self._node, self._timeout, self._seen)
        token = lease.try_hold(self._store, name, self._timeout, self._node, self._seen)
        if token is None:
            return False
        self._held[(reservation.slot, reservation.gen)] = lease.Lease(name, token)
        return True

    def of(self, reservation: Reservation) -> lease.Lease | None:
        """The lease we hold for `reservation` (it goes with the reservation when handed over)."""
        return self._held.get((reservation.slot, reservation.gen))

    def adopt(self, reservation: Reservation, held: lease.Lease) -> None:
        """Hold `held` for `reservation`, adopted from the process that took it: our publish (or
        our failure) removes it."""
        self._held[(reservation.slot, reservation.gen)] = held

    def forget(self, slot: int, gen: int) -> lease.Lease | None:
        """The lease held for reservation (slot, gen), no longer ours to keep track of."""
        return self._held.pop((slot, gen), None)

    def end(self, slot: int, gen: int, *, failed: bool) -> None:
        """Reservation (slot, gen) ended here: forget its lease, and remove it if the compute
        failed (a waiting node then takes over at once instead of at the lease's deadline)."""
        held = self.forget(slot, gen)
        if held is not None and failed:
            self.release(held)

    def release(self, held: lease.Lease) -> None:
        """Remove our lease `held` (`lease.release`) now, or, while the store does not answer, at
        this process's first lease step once it does: a lease left would hold other nodes up to
        half their compute timeout."""
        if self._store.available:
            lease.release(self._store, held)
            return
        with self._owed_lock:
            self._owed.append(held)

    def settle_owed(self) -> None:
        """Remove the leases owed since an outage, the store answering again."""
        if not self._owed or not self._store.available:
            return
        with self._owed_lock:
            owed, self._owed = self._owed, []
        for held in owed:
            lease.release(self._store, held)
