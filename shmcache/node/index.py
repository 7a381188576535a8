"""`NodeIndex`: one process's handle on a namespace's shared index, offering whole transactions.

The parts, each in its own module: the byte layout (layout.py), the slot state machine (slots.py),
sections and their repairs (sections.py), pins (pins.py), client records (clients.py), counters
(counters.py), attachments (attachments.py), the allocator (allocator.py), the reservation
protocol (reservations.py), the repairs (repair.py) and the crash-point table (crashpoints.py).
docs/design.md has the why.

Transactions (each takes the sections it needs, in the lock order node → one stripe):
`lookups` (lookups.py: find and pin sealed entries, existence and repeat-hit checks, natively),
`reserve` (a hit, our reservation, someone else's, or no
room), `commit` (allocate, write, seal: one path for computed and pulled values), `abandon`,
`adopt` / `let_go` (hand a reservation to another process), `release` (drop pins), `add_ref`,
`drop`, `reap`, `attach` and `detach`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shmcache.errors import CapacityError, CorruptSegment, LockTimeout, PinLimitReached
from shmcache.kernel.namespace import Segments
from shmcache.node import _native, crashpoints
from shmcache.node.allocator import Allocator, aligned
from shmcache.node.attachments import AttachmentTable
from shmcache.node.clients import ClientIdentity, ClientTable
from shmcache.node.counters import Counters
from shmcache.node.crashpoints import CrashPoint
from shmcache.node.layout import MAGIC, Counter, Header
from shmcache.node.lookups import Lookups
from shmcache.node.pins import PinTable, after_reclaim
from shmcache.node.repair import Repairs
from shmcache.node.reservations import Claim, ClaimKind, Reservations
from shmcache.node.sections import Sections
from shmcache.node.slots import FailureKind, SealedEntry, SlotState, SlotTable

__all__ = ["NodeIndex"]

Writer = Callable[[int, int], bytes | None]  # (offset, size) -> the entry's attachment, if any


class NodeIndex:
    """One client's handle on a namespace's shared index (see the module docstring)."""

    def __init__(self, segments: Segments, lock_timeout: float) -> None:
        self.segments = segments
        self.layout = layout = segments.layout
        self._idx = idx = memoryview(segments.index)
        buf = segments.index
        self.ttl: float | None = Header.read(buf).ttl or None
        self.capacity = segments.capacity
        self.native = native = layout.native(buf, self.ttl, lock_timeout, SealedEntry, segments.sems.semid)
        self.slots = SlotTable(idx, layout, native, self.ttl)
        self.pins = PinTable(idx, layout, native)
        self.clients = ClientTable(idx, layout, buf, segments.sems)
        self.counters = Counters(idx, layout, native)
        self.attachments = AttachmentTable(idx, layout, buf)
        self.sections = Sections(
            idx,
            layout,
            native,
            repair_stripe=lambda stripe: self.repairs.stripe(stripe),
            repair_node=lambda: self.repairs.node(),
        )
        self.reservations = Reservations(self.slots, segments.sems, self.sections)
        self.repairs = Repairs(self, self.capacity)
        self.lookups = Lookups(
            native, self.sections, self.repairs.quarantine, self.stripe_of, lambda: self.reclaim()
        )
        self.slots.on_damaged = self.repairs.quarantine
        self.allocator = Allocator(self.slots, self.sections, self.capacity, self.reservations.owner_alive)
        self.client = -1
        self.reclaim: Callable[[], bool] = lambda: False  # the process's dead views' pins, released
        # at once when the arena is full or the pin records are all taken (process/releases.py);
        # True if any were

    # ------------------------------------------------------------------ attach and detach
    def attach(self) -> None:
        """Claim a client record (under the node section), reaping dead clients if all are taken."""
        with self.sections.node():
            row = self.clients.claim()
            if row is None and self.repairs.reap_dead():
                row = self.clients.claim()
            if row is None:
                raise CapacityError(f"all {self.layout.clients} client records are in use (max_clients)")
            self.client = self.reservations.client = row
            self.native.bind(row)  # our pins and counters
            self.repairs.reap_dead()

    def detach(self) -> None:
        """Release every pin of this client, fold its counters, free its record."""
        self.release([entry for entry, count in self.pins.held().items() for _ in range(count)])
        with self.sections.node():
            self.native.bind(-1)
            self.counters.retire(self.client, self.clients.clear)
            self.clients.release(self.client)
        self.client = -1

    # ------------------------------------------------------------------ lookups
    def stripe_of(self, needle: bytes) -> int:
        return int.from_bytes(needle[16:24], "little") % self.layout.stripes

    def entry_state(self, slot: int, gen: int) -> tuple[bool, int]:
        """(entry (slot, gen) is still indexed, its references), read without a lock."""
        record, _valid = self.slots.raw(slot)
        return record.is_entry(gen), record.refs

    # ------------------------------------------------------------------ reservations
    def reserve(self, needle: bytes, meta: tuple[int, int], pins: int) -> Claim:
        """One get-or-reserve step for `needle` (modality and key-kind `meta`): a pinned hit, our new
        reservation, a live owner's, or FULL, in one native call (lookup, then claim); the locked
        path does both when the stripe needs its repair. Out of pin records, `reclaim` first."""
        answer: SealedEntry | _native.RawClaim | _native.Slow | Claim
        try:  # `after_reclaim` written out (no closure per call)
            answer = self.native.reserve(needle, *meta, pins)
        except PinLimitReached:
            if not self.reclaim():
                raise
            answer = self.native.reserve(needle, *meta, pins)
        if isinstance(answer, _native.Slow):
            answer = self._reserve_locked(needle, meta, pins)
        if isinstance(answer, SealedEntry):
            return Claim(ClaimKind.HIT, answer.slot, answer.gen, hit=answer)
        claim = answer if isinstance(answer, Claim) else self.reservations.claimed(answer)
        if claim.kind is ClaimKind.OWNER:
            crashpoints.reached(CrashPoint.RESERVED)
        return claim

    def _reserve_locked(self, needle: bytes, meta: tuple[int, int], pins: int) -> SealedEntry | Claim:
        """`reserve` in a stripe section entered from Python (which runs its repair first)."""
        stripe, now = self.stripe_of(needle), time.monotonic()
        with self.sections.stripe(stripe):
            hit = self.lookups.hit_in(stripe, needle, now, pins)
            return hit if hit is not None else self.reservations.claim_in(stripe, needle, meta, now)

    def wait(self, slot: int, timeout: float) -> None:
        """Block until slot's reservation ends or its owner dies (`SemaphoreTimeout`)."""
        self.reservations.wait(slot, timeout)

    def failure(self, slot: int, gen: int) -> tuple[FailureKind, str] | None:
        return self.slots.failure(slot, gen)

    def commit(self, slot: int, gen: int, nbytes: int, write: Writer, pins: int) -> SealedEntry:
        """Store a value for our reservation (slot, gen): `allocate`, `write(offset, size)` the entry
        there (outside any lock: nobody reads a reservation's extent), `seal` with `pins` pins and
        the attachment `write` returned. A failure abandons it (waiters learn why) and is raised."""
        try:
            offset = self.allocate(slot, gen, nbytes)
            attachment = write(offset, nbytes)
            crashpoints.reached(CrashPoint.UNSEALED_PAYLOAD)
        except CapacityError as exc:
            self.abandon(slot, gen, FailureKind.UNCACHEABLE, str(exc))
            raise
        except BaseException as exc:
            self.abandon(slot, gen, FailureKind.FAILED, f"{type(exc).__name__}: {exc}")
            raise
        return self.seal(slot, gen, pins, attachment)

    def allocate(self, slot: int, gen: int, nbytes: int) -> int:
        """Give our reservation (slot, gen) `nbytes` of arena (replacing any extent): the offset.
        When the arena is full, `reclaim` first, then once more. `CapacityError` (no room) or
        `ReservationLost` (taken over) leave it unchanged."""
        need = aligned(nbytes)
        if need > self.capacity:
            raise CapacityError(f"value of {nbytes} bytes exceeds capacity_bytes={self.capacity}")
        return after_reclaim(lambda: self._place(slot, gen, need), self.reclaim)

    def _place(self, slot: int, gen: int, need: int) -> int:
        """`allocate`'s step under the node section: find room, evicting, and take it."""
        with self.sections.node():
            offset = self.allocator.find(need, self.repairs.reap_dead)
            self.allocator.set_extent(slot, gen, offset, need)
        return offset

    def shrink(self, slot: int, gen: int, nbytes: int) -> None:
        """Cut our reservation's extent to its first `nbytes` (0: give it all back). This frees
        arena, which needs only the stripe section (the allocator's rule). `ReservationLost` if
        it was taken over."""
        self.allocator.set_extent(slot, gen, None, aligned(nbytes))

    def seal(self, slot: int, gen: int, pins: int, attachment: bytes | None) -> SealedEntry:
        """Fenced seal of our reservation with `pins` pins (none if we are out of pin records) and
        its `attachment` (`Reservations.seal`); `ReservationLost` if taken over. The semaphore
        is released."""
        return self.reservations.seal(slot, gen, pins, attachment)

    def set_aside(self, slot: int, gen: int) -> bool:
        """Take our reservation out of the index, its extent kept by one pin of ours (slots.py): a
        transfer we gave up on may still write there. Waiters look again. False (unchanged) if
        this process is out of pin records or it was taken over."""
        with self.sections.stripe(slot // self.layout.ways):
            record = self.slots.read(slot)
            if record is None or not record.owned_by(self.client, gen):
                return False
            try:
                self.pins.add(slot, gen, 1)
            except CapacityError:
                return False
            done = self.reservations.set_aside_in(slot, gen)
            assert done  # the record was read as ours above, in the same section
            self.reservations.release(slot, gen)
            return True

    def abandon(self, slot: int, gen: int, kind: FailureKind, message: str) -> bool:
        """Fenced abandon: free our reservation and record why for its waiters. The reservation
        semaphore is released whatever happens."""
        try:
            with self.sections.stripe(slot // self.layout.ways):
                done = self.reservations.abandon_in(slot, gen, kind, message)
                self.reservations.release(slot, gen)
                return done
        finally:
            self.reservations.release(slot, gen)

    def adopt(self, slot: int, gen: int, giver: int) -> bool:
        """Take over reservation (slot, gen) from client `giver`, a live process that hands it to
        us; False if it is not the giver's any more. The giver then calls `let_go`."""
        with self.sections.stripe(slot // self.layout.ways):
            return self.reservations.adopt_in(slot, gen, giver)

    def let_go(self, slot: int, gen: int) -> bool:
        """Release our hold of a reservation we handed over, once it was adopted (or ended);
        False while it is still ours."""
        with self.sections.stripe(slot // self.layout.ways):
            return self.reservations.let_go_in(slot, gen)

    # ------------------------------------------------------------------ references and attachments
    def release(self, pins: list[tuple[int, int]]) -> None:
        """Drop one pin per (slot, gen) listed, one native stripe section per stripe touched; an
        unreferenced STALE entry is freed right there. Stripes that need a repair (and damaged
        records) are finished on the locked Python path. A stripe held past the lock timeout
        holds back only its own pins: the others are dropped, then `LockTimeout` is raised. If it
        raises (`LockTimeout`, a signal while it waits), the exception's `unreleased` lists the
        pins it did not drop (each at most once: release them later, never the others again)."""
        counts: dict[tuple[int, int], int] = {}
        for entry in pins:
            counts[entry] = counts.get(entry, 0) + 1
        try:
            left = self.native.release(sorted((slot, gen, count) for (slot, gen), count in counts.items()))
        except BaseException as exc:
            exc.unreleased = _each_pin(getattr(exc, "unreleased", []))  # type: ignore[attr-defined]
            raise
        # `untried` are not dropped; one is taken out once its stripe is entered: a signal can then
        # leak it, never drop it twice
        untried, timeout = dict(enumerate(left)), None
        try:
            for n, (slot, gen, count) in enumerate(left):
                try:
                    with self.sections.stripe(slot // self.layout.ways):
                        del untried[n]
                        if not self.native.unpin_in(slot, gen, count):  # our pins are off a damaged record
                            self.repairs.quarantine(slot)
                except LockTimeout as exc:  # its stripe is held: the others go on
                    timeout = timeout or exc
            if timeout is not None:
                raise timeout
        except BaseException as exc:
            exc.unreleased = _each_pin(list(untried.values()))  # type: ignore[attr-defined]
            raise

    def add_ref(self, slot: int, gen: int, count: int = 1) -> bool:
        """`count` more pins on a sealed (slot, gen); False if it is no longer sealed there.
        Out of pin records, `reclaim` first, then once more (`PinLimitReached` if still out)."""
        return after_reclaim(lambda: self._add_refs(slot, gen, count), self.reclaim)

    def _add_refs(self, slot: int, gen: int, count: int) -> bool:
        with self.sections.stripe(slot // self.layout.ways):
            record = self.slots.read(slot)
            if record is None or record.state != SlotState.SEALED or record.gen != gen:
                return False
            self.pins.add(slot, gen, count)
            self.slots.write(slot, record.state, record.with_refs(record.refs + count))
            return True

    def drop(self, slot: int, gen: int) -> None:
        """Make a damaged entry unreachable; its memory is freed once nothing references it."""
        with self.sections.stripe(slot // self.layout.ways):
            record = self.slots.read(slot)
            if record is not None and record.is_entry(gen):
                self.slots.write(slot, record.state, record.retired())

    def update_attachment(self, slot: int, gen: int, update: Callable[[bytes], bytes]) -> bool:
        """Replace entry (slot, gen)'s attachment by `update(old)` in its stripe; False if none."""
        with self.sections.stripe(slot // self.layout.ways):
            old = self.attachments.get(slot, gen)
            if old is None:
                return False
            self.attachments.put(slot, update(old))
            return True

    # ------------------------------------------------------------------ clients, repair, counters
    @property
    def identity(self) -> ClientIdentity:
        """This client: its row, pid and start time."""
        return self.clients.identity(self.client)

    def client_alive(self, who: ClientIdentity) -> bool:
        return self.clients.alive(who)

    def any_other_live(self) -> bool:
        """True if a process other than this one holds a client record (also after `detach`)."""
        live = self.clients.live()
        if self.client >= 0:
            live[self.client] = False
        return bool(live.any())

    def reap(self) -> int:
        """Reap dead clients, free dead owners' reservations, repair stripes: how many reaped."""
        return self.repairs.reap()

    def count(self, counter: Counter, n: int = 1) -> None:
        """Add to this client's counter (node-wide totals are the sum over all records)."""
        self.counters.count(counter, n)

    def totals(self) -> dict[str, int]:
        """Node-wide counters: claimed clients' records plus the retired totals."""
        return self.counters.totals(self.clients.claimed)

    def check_header(self) -> None:
        """Raise `CorruptSegment` if the header lost its magic (overwritten index)."""
        if bytes(self._idx[: len(MAGIC)]) != MAGIC:
            raise CorruptSegment("index header magic was overwritten")


def _each_pin(items: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(slot, gen, count) items as one (slot, gen) per pin."""
    return [(slot, gen) for slot, gen, count in items for _ in range(count)]
