"""`Reservation`: the right to compute one key node-wide, or the value if it already existed."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from shmcache.errors import ReservationLost
from shmcache.format.values import Value
from shmcache.keys.key import EmbeddingCacheKey
from shmcache.process import outputs

if TYPE_CHECKING:
    import torch

    from shmcache.process.outputs import Output
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

    def create(self, reservation: Reservation, shape: tuple[int, ...], dtype: torch.dtype) -> Output | None:
        """The output to write in place, over the reservation's extent; None if it cannot be
        stored (the reservation then ended as uncacheable)."""

    def seal(self, reservation: Reservation, output: Output) -> Value:
        """Store what was written into `output`; the cached view."""

    def abandon(self, reservation: Reservation, reason: str) -> None:
        """Give the reservation up, telling its waiters `reason`."""

    def withdraw(self, reservation: Reservation) -> None:
        """Give the reservation back unused, reporting no failure to its waiters."""

    def ticket(self, reservation: Reservation) -> ReservationTicket:
        """The ticket another process adopts the reservation with."""

    def let_go(self, reservation: Reservation) -> bool:
        """Release a handed-over reservation once it was adopted; False while it is still ours."""


class Reservation:
    """The right to compute one key, or the value if it already existed.

    `value` is set on a hit. Otherwise the holder computes and calls `commit(value)` (which returns
    the cached view) or `abandon()`; or it writes its output in place: `create(shape, dtype)`
    gives a tensor in node memory to write it into, and `seal()` stores it with no copy. As a
    context manager it abandons on an exception and on exit without a commit. A reservation that
    could not be cached (value too large, no free slot) has `cached=False`: `commit` then returns
    the value as given, and `create` a tensor of this process's own.
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
        self._output: torch.Tensor | None = None  # what `create` handed out
        self._in_place: Output | None = None  # ... when it is over our extent (not frozen yet)

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
        uncached, or with `view=False`)."""
        if not self._open:
            raise ReservationLost(f"{self.key!r}: this reservation was already committed or abandoned")
        self._let_output_go()
        self._open = False
        if self._holder is None or self.slot < 0:
            self.value = value
            return value
        self.value = self._holder.commit(self, value, view=view)
        return self.value

    def create(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A writable CPU tensor of `shape` and `dtype` for the compute to write its output into,
        in node memory (uncached: this process's own); then `seal()` stores it with no copy.

        From the end of the reservation on (seal, or any other end), a write through the tensor
        changes only this process's copy of it, never the cached entry. `ArgumentTypeError` /
        `InvalidArgument` for a bad shape or dtype, `UnsupportedValue` for a dtype the value
        format does not hold; `ReservationLost` unless the reservation is open and has no output
        yet.
        """
        if not self._open or self._output is not None:
            raise ReservationLost(f"{self.key!r}: create needs an open reservation without an output")
        dims, dtype = outputs.check_output(shape, dtype)
        if self._holder is not None and self.slot >= 0:
            self._in_place = self._holder.create(self, dims, dtype)
            if self._in_place is None:  # no room: uncached from here on
                self.slot = -1
        in_place = self._in_place
        self._output = in_place.tensor if in_place is not None else outputs.private_output(dims, dtype)
        return self._output

    def seal(self) -> Value:
        """Store what the compute wrote into the tensor of `create`, wake every waiter, and return
        the cached view (the tensor itself when uncached). `ReservationLost` unless the
        reservation is open and has an output."""
        if not self._open or self._output is None:
            raise ReservationLost(f"{self.key!r}: seal needs an open reservation with an output (create)")
        self._open = False
        in_place, self._in_place = self._in_place, None
        if in_place is None or self._holder is None:
            self.value = self._output
            return self.value
        self.value = self._holder.seal(self, in_place)
        return self.value

    def _let_output_go(self) -> None:
        """Before the reservation ends otherwise than by `seal`: the output written in place is
        frozen (a write through it no longer reaches the extent, which is freed or reused)."""
        in_place, self._in_place = self._in_place, None
        if in_place is not None:
            in_place.freeze()

    def abandon(self, reason: str = "abandoned") -> None:
        """Give the key up: waiters are woken and the first of them computes it instead. After
        `hand_over` this ends the reservation only if it was not adopted yet."""
        if self._open or self._handed:
            self._let_output_go()
            self._open = False
            if self._holder is not None and self.slot >= 0:
                self._holder.abandon(self, reason)

    def withdraw(self) -> None:
        """Give the reservation back unused (a scheduler that defers the request, say): waiters
        look again and the first of them reserves the key; no failure is reported to them. After
        `hand_over` this ends the reservation only if it was not adopted yet."""
        if self._open or self._handed:
            self._let_output_go()
            self._open = False
            if self._holder is not None and self.slot >= 0:
                self._holder.withdraw(self)

    def hand_over(self) -> ReservationTicket:
        """Hand the right to compute to another process (of the same engine, say): it calls
        `EmbeddingCache.adopt(ticket, key)`, then this process calls `let_go()` until it returns
        True. Until the adoption this process still holds the reservation (and may `abandon` it);
        if either process dies, the reservation ends as if its holder died."""
        if not self.owned or self._holder is None:
            raise ReservationLost(f"{self.key!r}: only an owned reservation can be handed over")
        self._let_output_go()
        self._open, self._handed = False, True
        return self._holder.ticket(self)

    def let_go(self) -> bool:
        """After `hand_over`: release this process's hold once the other process adopted the
        reservation (or it ended); False while it has not, so call it again later."""
        if not self._handed or self._holder is None:
            raise ReservationLost(f"{self.key!r}: this reservation was not handed over")
        return self._holder.let_go(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._open:
            cause = f"{exc_type.__name__}: {exc}" if exc_type is not None else "not committed"
            self.abandon(cause)
