"""The reservation protocol: one compute per key per node, surviving the computing process's death.

- A reservation is the slot's own semaphore held (+1, SEM_UNDO) by the computing process, and
  the slot's record RESERVED with that client as owner and a fresh generation.
- Waiters block in wait-for-zero on that semaphore, so a seal, an abandon or the owner's death
  wakes them all at once. They wait in slices and look again between them (the slot may have been
  sealed, evicted and reserved for another key before a waiter started waiting).
- A RESERVED record whose semaphore is 0 has a dead owner: the next claimer takes it over with
  gen + 1 (a repair or the allocator may also free it). The claim (this rule, a live owner's to
  wait on, or a new reservation in a free or freed way) and the seal run in native.c
  (`claim_in`, `seal_in`, rule 9 there); this module keeps what this process holds.
- Seal and abandon are fenced: they apply only if the record is still RESERVED by this client with
  the same generation. Generations only grow, so (slot, gen) never names two values.
- Whatever happens in seal and abandon, the semaphore is released before they return or raise.
  A release names the generation too: the process remembers which one it holds each semaphore
  for, so a call for an ended reservation (an abandon repeated after a hand-over, say) never
  releases the semaphore of a newer reservation of the same slot.
- An abandon records why (failed, or uncacheable) with the generation, for the waiters.
- Hand-off to another process (a serving engine reserves in its scheduler process and commits in
  its worker process): the receiver *adopts* the reservation (slot, gen, giver): it joins the
  semaphore (1 -> 2, refused if it is 0: the giver died) and names itself as the owner, in the
  stripe section. The giver then *lets go*: it releases its hold only once the record no longer
  names it, so the value never passes through 0 and no waiter takes over a live hand-off. Either
  side's death drops only its own hold: a receiver that dies after the giver let go leaves 0
  (takeover); a giver still holding lets go when it sees the record is not its own any more.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass

from shmcache.errors import ReservationLost
from shmcache.kernel.semaphores import SemaphoreSet
from shmcache.node import _native
from shmcache.node.sections import Sections
from shmcache.node.slots import FailureKind, SealedEntry, SlotState, SlotTable

__all__ = ["Claim", "ClaimKind", "Reservations"]


class ClaimKind(enum.Enum):
    """What one claim step found."""

    HIT = "hit"  # a sealed entry, pinned as asked
    OWNER = "owner"  # this process now holds the reservation
    WAIT = "wait"  # another live process holds it: wait on its slot
    FULL = "full"  # every way of the key's stripe is referenced or reserved


@dataclass(frozen=True)
class Claim:
    """Outcome of one claim step; `slot`/`gen` name the reservation to own or wait on."""

    kind: ClaimKind
    slot: int = -1
    gen: int = 0
    takeover: bool = False
    hit: SealedEntry | None = None


class Reservations:
    """The reservation semaphores of a namespace, and which of them this process holds."""

    def __init__(self, slots: SlotTable, sems: SemaphoreSet, sections: Sections) -> None:
        self._slots, self._sems, self._layout, self._native = slots, sems, slots.layout, slots.native
        self._sections = sections
        self._held: dict[int, int] = {}  # slot -> the generation we hold its semaphore for
        self._lock = threading.Lock()
        self.client = -1

    # ------------------------------------------------------------------ semaphores
    def owner_alive(self, slot: int) -> bool:
        """True if some live process holds slot's reservation semaphore."""
        return self._sems.value(self._layout.slot_sem(slot)) != 0

    def owner_pid(self, slot: int) -> int:
        return self._sems.last_pid(self._layout.slot_sem(slot))

    def held(self) -> dict[int, int]:
        """The slots whose reservation semaphore this process holds, each with its generation."""
        with self._lock:
            return dict(self._held)

    def release(self, slot: int, gen: int) -> None:
        """Release slot's semaphore if this process still holds it for reservation (slot, gen)
        (waiters wake; if the slot is still RESERVED they take it over with gen + 1, which
        fencing makes safe)."""
        if self._forget(slot, gen):
            self._sems.release(self._layout.slot_sem(slot))

    def _forget(self, slot: int, gen: int) -> bool:
        """Stop recording our hold of reservation (slot, gen)'s semaphore (its caller gives it
        back now, exactly once); False if we do not hold it."""
        with self._lock:
            held = self._held.get(slot) == gen
            if held:
                del self._held[slot]
        return held

    def wait(self, slot: int, timeout: float) -> None:
        """Block until slot's reservation is released or its owner dies (`SemaphoreTimeout`)."""
        self._sems.wait_zero(self._layout.slot_sem(slot), timeout)

    # ------------------------------------------------------------------ claim (in the stripe section)
    def claim_in(self, stripe: int, needle: bytes, meta: tuple[int, int], now: float) -> Claim:
        """After a miss in `stripe` (its section held): wait on, take over, or make the reservation
        of `needle` (native.c's `claim_in`; damaged records met are quarantined on the way)."""
        while True:
            answer = self._native.claim_in(stripe, needle, *meta, now)
            if not isinstance(answer, int):
                return self.claimed(answer)
            self._slots.on_damaged(answer)

    def claimed(self, answer: _native.RawClaim) -> Claim:
        """The `Claim` a native claim answered; a reservation it made is remembered as held."""
        kind, slot, gen = answer
        if kind == _native.CLAIM_WAIT:
            return Claim(ClaimKind.WAIT, slot, gen)
        if kind == _native.CLAIM_FULL:
            return Claim(ClaimKind.FULL)
        with self._lock:
            self._held[slot] = gen
        if kind == _native.CLAIM_TAKEOVER:
            return Claim(ClaimKind.OWNER, slot, gen, takeover=True)
        return Claim(ClaimKind.OWNER, slot, gen)

    # ------------------------------------------------------------------ fenced ends (in the stripe section)
    def seal(self, slot: int, gen: int, pins: int, attachment: bytes | None) -> SealedEntry:
        """Seal our reservation (slot, gen) with `pins` pins (none if we are out of pin records)
        and `attachment`, and release its semaphore in the same stripe section (a claim must not
        see the entry sealed with its semaphore held), whatever happens: one native call
        (native.c's `seal_in`), or the locked path when the stripe needs its repair (a damaged
        record quarantined). `ReservationLost` if it was fenced off."""
        held = self._forget(slot, gen)
        sealed: SealedEntry | _native.Slow | int | None = self._native.seal(slot, gen, pins, attachment, held)
        if isinstance(sealed, _native.Slow):
            try:
                with self._sections.stripe(slot // self._layout.ways):
                    sealed = self._native.seal_in(slot, gen, pins, attachment, time.monotonic())
                    if isinstance(sealed, int):
                        self._slots.on_damaged(sealed)  # the reservation is lost with its record
                    if held:
                        held = False
                        self._sems.release(self._layout.slot_sem(slot))
            finally:
                if held:
                    self._sems.release(self._layout.slot_sem(slot))
        if not isinstance(sealed, SealedEntry):
            raise ReservationLost(f"reservation (slot {slot}, gen {gen}) was taken over")
        return sealed

    def abandon_in(self, slot: int, gen: int, kind: FailureKind, message: str) -> bool:
        """Free our reservation (slot, gen) and tell its waiters why; False if fenced off."""
        record = self._slots.read(slot)
        if record is None or not record.owned_by(self.client, gen):
            return False
        self._slots.record_failure(slot, gen, kind, message)
        self._slots.write(slot, record.state, record.freed())
        return True

    def set_aside_in(self, slot: int, gen: int) -> bool:
        """Turn our reservation (slot, gen) into a STALE entry with one reference (the caller has
        taken that pin), its extent kept; False if fenced off. Waiters find no failure recorded
        and look again. The caller releases the semaphore."""
        record = self._slots.read(slot)
        if record is None or not record.owned_by(self.client, gen):
            return False
        now = time.monotonic()
        self._slots.write(slot, record.state, record._replace(state=SlotState.STALE, sealed_at=now, refs=1))
        return True

    def adopt_in(self, slot: int, gen: int, giver: int) -> bool:
        """Make reservation (slot, gen) of client `giver` ours (see the module docstring); False if
        it is no longer the giver's (sealed, abandoned, taken over) or its holders all died."""
        record = self._slots.read(slot)
        if record is None or not record.owned_by(giver, gen) or giver == self.client:
            return False
        with self._lock:
            ours = self._held.get(slot) == gen
        if ours:  # handed back to us before we let go: our hold stays
            self._slots.write(slot, record.state, record._replace(owner=self.client))
            return True
        if not self._sems.join(self._layout.slot_sem(slot)):
            return False  # nobody holds it any more: it is a dead owner's, for a takeover
        with self._lock:
            self._held[slot] = gen
        self._slots.write(slot, record.state, record._replace(owner=self.client))
        return True

    def let_go_in(self, slot: int, gen: int) -> bool:
        """After handing (slot, gen) over: release our hold once the record no longer names us as
        its owner (adopted, sealed, abandoned or taken over); False while it still does."""
        record = self._slots.read(slot)
        if record is not None and record.owned_by(self.client, gen):
            return False
        self.release(slot, gen)
        return True

    def free_dead_in(self, slot: int) -> None:
        """Free slot's reservation if its owner died."""
        record = self._slots.read(slot)
        if record is not None and record.state == SlotState.RESERVED and not self.owner_alive(slot):
            self._slots.write(slot, record.state, record.freed())
