"""`Reservation`: the right to compute one key node-wide, or the value if it already existed."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from shmcache.errors import ArgumentTypeError, ReservationLost
from shmcache.format.values import Value
from shmcache.keys.key import EmbeddingCacheKey

if TYPE_CHECKING:
    from shmcache.remote.lease import Lease

__all__ = ["RequestId", "Reservation", "ReservationHolder", "ReservationTicket"]

RequestId = Hashable


@dataclass(frozen=True)
class ReservationTicket:
    """What another process needs to adopt a reservation (`EmbeddingCache.adopt`); picklable."""

    namespace: str
    slot: int
    gen: int
    giver: int  # the client record of the handing process
    digest: bytes  # the key's digest: adoption checks the adopter means the same key
    lease: Lease | None = None  # the cross-node lease taken for it, which the adopter then holds


class ReservationHolder(Protocol):
    """What a `Reservation` asks of the process layer that made it."""

    def commit(self, reservation: Reservation, value: Value, *, view: bool) -> Value:
        """Store `value` for the reservation; the cached view if `view`, else `value`."""

    def abandon(self, reservation: Reservation, reason: str) -> None:
        """Give the reservation up, telling its waiters `reason`."""

    def withdraw(self, reservation: Reservation) -> None:
        """Give the reservation back unused, reporting no failure to its waiters."""

    def ticket(self, reservation: Reservation) -> ReservationTicket:
        """The ticket another process adopts the reservation with."""

    def let_go(self, reservation: Reservation) -> bool:
        """Release a handed-over reservation once it was adopted; False while it is still ours."""

    def computing(self, reservation: Reservation) -> contextlib.AbstractContextManager[None]:
        """Mark this thread as computing `reservation`'s value while the block runs."""

    def dropped(self, slot: int, gen: int) -> None:
        """The reservation (slot, gen) was garbage collected unended: withdraw it soon, elsewhere
        (called from a deallocator)."""


class Reservation:
    """The right to compute one key, or the value if it already existed.

    `value` is set on a hit. Otherwise the holder computes and calls `commit(value)` (which returns
    the cached view) or `abandon()`. As a context manager it abandons on an exception and on exit
    without a commit; one garbage collected unended is withdrawn soon after. A reservation that
    could not be cached (no slot free in its stripe) has `cached=False`: `commit` then returns the
    value as given. An owned reservation's `commit` of a value the cache cannot hold (larger than
    it, or all of it referenced) raises `CapacityError`, and its waiters compute it themselves.
    """

    def __init__(
        self,
        holder: ReservationHolder | None,
        key: EmbeddingCacheKey,
        request_id: RequestId | None,
        *,
        value: Value | None = None,
        slot: int = -1,
        gen: int = 0,
    ) -> None:
        self._holder = holder
        self.key = key
        self.request_id = request_id
        self.value = value
        self.slot = slot
        self.gen = gen
        self._open = value is None
        self._handed = False

    @property
    def owned(self) -> bool:
        """True while this reservation holds the node-wide right to compute the key."""
        return self._open and self.slot >= 0

    @property
    def cached(self) -> bool:
        """False when a commit will not be stored (no room), True otherwise."""
        return self.value is not None or self.slot >= 0

    def commit(self, value: Value, *, view: bool = True) -> Value:
        """Store `value`, wake every waiter, and return the cached view (or `value` itself when
        uncached, or with `view=False`); `CapacityError` if the cache cannot hold it."""
        if not self._open:
            raise ReservationLost(f"{self.key!r}: this reservation was already committed or abandoned")
        self._open = False
        if self._holder is None or self.slot < 0:
            self.value = value
            return value
        self.value = self._holder.commit(self, value, view=view)
        return self.value

    def abandon(self, reason: str = "abandoned") -> None:
        """Give the key up: waiters are woken and the first of them computes it instead. After
        `hand_over` this ends the reservation only if it was not adopted yet. `reason` (a str)
        reaches the waiters in their `ComputeFailed`."""
        if not isinstance(reason, str):
            raise ArgumentTypeError(f"reason must be a str, got {type(reason).__name__}")
        if self._open or self._handed:
            self._open = False
            if self._holder is not None and self.slot >= 0:
                self._holder.abandon(self, reason)

    def withdraw(self) -> None:
        """Give the reservation back unused (a scheduler that defers the request, say): waiters
        look again and the first of them reserves the key; no failure is reported to them. After
        `hand_over` this ends the reservation only if it was not adopted yet."""
        if self._open or self._handed:
            self._open = False
            if self._holder is not None and self.slot >= 0:
                self._holder.withdraw(self)

    def computing(self) -> contextlib.AbstractContextManager[None]:
        """A block in which this thread computes the value: a wait of this thread for the same
        key inside it (a compute calling back into the cache for its own key) raises
        `ComputeReentered` at once instead of waiting on itself until compute_timeout_s."""
        if not self.owned or self._holder is None:
            return contextlib.nullcontext()
        return self._holder.computing(self)

    def hand_over(self) -> ReservationTicket:
        """Hand the right to compute to another process (of the same engine, say): it calls
        `EmbeddingCache.adopt(ticket, key)`, then this process calls `let_go()` until it returns
        True. Until the adoption this process still holds the reservation (and may `abandon` it);
        if either process dies, the reservation ends as if its holder died."""
        if not self.owned or self._holder is None:
            raise ReservationLost(f"{self.key!r}: only an owned reservation can be handed over")
        self._open, self._handed = False, True
        return self._holder.ticket(self)

    def let_go(self) -> bool:
        """After `hand_over`: release this process's hold once the other process adopted the
        reservation (or it ended); False while it has not, so call it again later."""
        if not self._handed or self._holder is None:
            raise ReservationLost(f"{self.key!r}: this reservation was not handed over")
        return self._holder.let_go(self)

    def __del__(self) -> None:
        """One dropped unended (an exception between `try_reserve` and `commit`, items of
        `try_reserve_many` left unused) is withdrawn soon by the cache's release thread, instead
        of holding its key for the whole node until this process exits."""
        if self._open and self.slot >= 0 and self._holder is not None:
            with contextlib.suppress(Exception):  # interpreter exit: the process's end frees it
                self._holder.dropped(self.slot, self.gen)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._open:
            cause = f"{exc_type.__name__}: {exc}" if exc_type is not None else "not committed"
            self.abandon(cause)
