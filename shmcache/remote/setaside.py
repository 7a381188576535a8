"""Node memory that a transfer may still write: one process's transfers into its reservations'
extents, from the `get_into` call until the memory is safe to free again.

A transfer is *unread* from before its call until its answer is read (`start` ... `read`). One
that timed out, or failed in a way that may leave slices in flight (answers.py), may still write
after the call returned, so its reservation is *set aside* (`NodeIndex.set_aside`: out of the
index, its extent kept by one pin of ours) and freed when the call that outlived its wait answers
that nothing writes there any more (the object arrived, or no transfer ran); else at the detach,
which the store's close delays (up to `DRAIN_S`) while a transfer into node memory still runs.
No transfer into node memory starts once the close began (`closing`).
Without a spare pin (or when the set-aside fails otherwise) it stays reserved, ours, *kept*:
abandoned (its waiters compute) when its late call answers that nothing writes there any more,
else at close; meanwhile a claim of ours that finds it computes uncached instead of waiting on
itself.
An exception between the call and the reading of its answer (a KeyboardInterrupt) leaves the
transfer unread, and the caller's exception path (`interrupted`) sets it aside before it may give
the reservation back. `set_aside` records each step it took and leaves the unread list last, so a
run cut short by an interrupt is finished by `interrupted` without repeating a step.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from shmcache.node.index import NodeIndex
from shmcache.node.layout import Counter
from shmcache.node.slots import FailureKind
from shmcache.process.reservation import Reservation
from shmcache.remote.answers import nothing_in_flight
from shmcache.remote.staging import LateCall

__all__ = ["SetAside", "Unread"]


@dataclass(eq=False)
class Unread:
    """A transfer into a reservation's extent whose answer was not read yet: the extent may be
    written. `calls` gets the call if it outlives its wait; the rest is how far its set-aside
    got."""

    reservation: Reservation
    calls: list[Future[Any]] = field(default_factory=list)
    set_aside: bool | None = None  # None: not tried; False: kept reserved until close instead
    watched: bool = False  # its late call frees the memory when it answers clean


class SetAside:
    """One process's transfers into node memory that may still be written, and what keeps it."""

    def __init__(self, node: NodeIndex) -> None:
        self._node = node
        self._kept: list[Reservation] = []  # set aside without a pin to do it: kept till close
        self._unread: list[Unread] = []
        self._closing, self._closed = threading.Lock(), False

    def start(self, reservation: Reservation) -> Unread | None:
        """Before a transfer into `reservation`'s extent starts: from here an exception sets it
        aside. None once the store closes: no transfer into node memory starts then (its close
        would not wait for it, and the detach would free the memory it writes)."""
        with self._closing:
            if self._closed:
                return None
            transfer = Unread(reservation)
            self._unread.append(transfer)
        return transfer

    def read(self, transfer: Unread) -> None:
        """Its answer was read and nothing writes there any more: the extent is the caller's again."""
        self._unread.remove(transfer)

    def set_aside(self, transfer: Unread) -> None:
        """The transfer failed or was not waited for: set its reservation aside (kept reserved
        till close if that cannot be done), its memory freed when the late call answers clean."""
        node, reservation = self._node, transfer.reservation
        slot, gen = reservation.slot, reservation.gen
        if transfer.set_aside is None:
            try:
                done = node.set_aside(slot, gen)
            except Exception:  # a lock timeout: never let the caller's abandon free this memory
                done = False
            if not done:
                with self._closing:  # as the late call's callback rebuilds the list
                    self._kept.append(reservation)  # stays reserved (ours) until its call ends
            transfer.set_aside = done
            node.count(Counter.REMOTE_SET_ASIDE)
        call = next(iter(transfer.calls), None)
        if call is not None and not transfer.watched:
            transfer.watched = True  # first: never two callbacks, each releasing a pin
            if transfer.set_aside:
                call.add_done_callback(lambda done: self._transfer_ended(done, slot, gen))
            else:
                call.add_done_callback(lambda done: self._kept_transfer_ended(done, reservation))
        self._unread.remove(transfer)

    def _transfer_ended(self, call: Future[Any], slot: int, gen: int) -> None:
        """A set-aside extent's late call returned: free it if nothing writes there any more (the
        whole object arrived, or no transfer ran; a failed one may leave slices in flight, as
        its answer came after we stopped waiting: that memory waits for the detach)."""
        with self._closing:
            if self._closed or not LateCall(call, nothing_in_flight).ended():
                return
            self._node.release([(slot, gen)])

    def _kept_transfer_ended(self, call: Future[Any], reservation: Reservation) -> None:
        """A kept reservation's late call returned: if nothing writes its extent any more, it is
        abandoned (its waiters compute), no longer kept till close."""
        with self._closing:
            if self._closed or not LateCall(call, nothing_in_flight).ended():
                return
            self._node.abandon(  # first: if it raises, it stays kept (the close abandons it)
                reservation.slot, reservation.gen, FailureKind.UNCACHEABLE, "a remote transfer failed"
            )
            self._kept = [kept for kept in self._kept if kept is not reservation]

    def keeps(self, slot: int, gen: int) -> bool:
        """Whether (slot, gen) is a reservation of ours kept while a transfer may write it: a
        claim that finds it computes uncached instead of waiting on it (on itself)."""
        return any(kept.slot == slot and kept.gen == gen for kept in list(self._kept))

    def interrupted(self, reservation: Reservation) -> bool:
        """A pull under `reservation` raised: True if the caller must not give the reservation
        back (its extent may still be written), else False. A transfer whose answer was never read
        is set aside first, as a failed one is."""
        unread = next((t for t in list(self._unread) if t.reservation is reservation), None)
        if unread is not None:
            self.set_aside(unread)
        return any(kept is reservation for kept in self._kept)

    def still_written(self) -> set[tuple[int, int]]:
        """The reservations (slot, gen) a transfer may still write: kept reserved, or unread."""
        held = list(self._kept) + [transfer.reservation for transfer in list(self._unread)]
        return {(res.slot, res.gen) for res in held}

    def closing(self) -> None:
        """From now on no transfer into node memory starts, and late calls leave their memory to
        the detach (the store's close waits for the transfers into node memory still running)."""
        with self._closing:
            self._closed = True

    def closed(self) -> None:
        """The store's client is closed (no transfer runs any more): free what was kept reserved."""
        with self._closing:
            kept, self._kept = self._kept, []
        for res in kept:
            self._node.abandon(res.slot, res.gen, FailureKind.UNCACHEABLE, "a remote transfer failed")
