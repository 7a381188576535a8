"""The slot state machine: states, the slot record, the legal transitions, and the one writer.

::

    EMPTY ──reserve──► RESERVED(owner, gen) ──seal (fenced: same owner and gen)──► SEALED
      ▲                  │ │ │ allocate, shrink: the extent is set (RESERVED, same gen)     │
      │                  │ │ └ takeover of a dead owner: RESERVED(new owner, gen + 1)       │
      ├──abandon, dead───┘ └──set aside (fenced, one pin of the owner)──┐                   │
      ├──────────────── evict / expire / drop, unreferenced ◄───────────┼───────────────────┤
      │                                                      expire / drop, still referenced│
      └── last release ◄── STALE ◄──────────────────────────────────────┴───────────────────┘

A pin change rewrites SEALED or STALE as itself. STALE is an entry that is a miss for every new
lookup (expired, damaged or dropped) whose memory is kept until its last reference is released.
A reservation whose extent a failed remote transfer may still write is *set aside*: STALE with
one pin of its owner, which keeps the memory out of the allocator's hands until that transfer
can no longer write (the owner's detach or death releases the pin).

Every write of a record goes through the native writer (native.c, rule 3), which writes the
record and its crc in one copy of their bytes: never field by field in place, so a reader without
the lock (the allocator's looks, native.c rule 7; repeat hits, existence checks) never sees a
live record as EMPTY and hands its memory out again. Python's writes go through
`SlotTable.write`, which first checks the transition against `TRANSITIONS`; the native hot path
makes only pin changes (SEALED/STALE as themselves), expiry (SEALED -> STALE or EMPTY) and the
last release (STALE -> EMPTY), all in the table. The one unchecked write is `quarantine`, whose old
record is unreadable. Every caller holds the slot's stripe section (sections.py).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from typing import Final, NamedTuple

import numpy as np

from shmcache.errors import ProtocolViolation
from shmcache.node import _native
from shmcache.node.layout import (
    ERROR_SIZE,
    FAILURE,
    S_FAILURE,
    S_LAST_ACCESS,
    SLOT_DTYPE,
    SLOT_SIZE,
    Layout,
)

__all__ = ["TRANSITIONS", "FailureKind", "SealedEntry", "SlotRecord", "SlotState", "SlotTable"]


class SlotState(enum.IntEnum):
    """A slot's state (see the module docstring)."""

    EMPTY = 0
    RESERVED = 1
    SEALED = 2
    STALE = 3

    @property
    def label(self) -> str:
        return self.name.lower()


class FailureKind(enum.IntEnum):
    """Why a reservation ended without a seal, as recorded for its waiters."""

    NONE = 0
    FAILED = 1  # the compute raised (or the holder gave up): waiters get ComputeFailed
    UNCACHEABLE = 2  # the value cannot be stored: waiters compute it themselves


EMPTY, RESERVED, SEALED, STALE = SlotState
_STATES: Final = tuple(SlotState)  # by value: an index is ~10x cheaper than the enum's call

TRANSITIONS: Final[frozenset[tuple[SlotState, SlotState]]] = frozenset(
    {
        (EMPTY, RESERVED),  # reserve
        (RESERVED, RESERVED),  # allocate or shrink an extent; take over a dead owner's reservation
        (RESERVED, SEALED),  # seal
        (RESERVED, EMPTY),  # abandon; a dead owner's reservation freed
        (RESERVED, STALE),  # set aside: a failed transfer may still write its extent
        (SEALED, SEALED),  # pin, unpin
        (SEALED, STALE),  # expired or dropped while referenced
        (SEALED, EMPTY),  # evicted, expired or dropped while unreferenced
        (STALE, STALE),  # unpin
        (STALE, EMPTY),  # last release
        (EMPTY, EMPTY),  # repair rewrites a free record
    }
)


class SlotRecord(NamedTuple):
    """The crc-covered part of a slot record."""

    state: SlotState
    owner: int  # client row of a reservation's owner or of the sealer; -1 when free
    gen: int
    offset: int
    size: int
    sealed_at: float
    refs: int

    def owned_by(self, client: int, gen: int) -> bool:
        """The fence of seal, allocate and abandon: still RESERVED by `client` with `gen`."""
        return self.state == RESERVED and self.owner == client and self.gen == gen

    def is_entry(self, gen: int) -> bool:
        """True if this record still holds the entry (slot, `gen`), sealed or stale."""
        return self.gen == gen and self.state in (SEALED, STALE)

    def freed(self) -> SlotRecord:
        """The EMPTY record that keeps this generation (generations never repeat)."""
        return SlotRecord(EMPTY, -1, self.gen, 0, 0, 0.0, 0)

    def retired(self) -> SlotRecord:
        """Out of the index: STALE while still referenced, else EMPTY."""
        return self._replace(state=STALE) if self.refs else self.freed()

    def with_refs(self, refs: int) -> SlotRecord:
        """The same record with `refs` references; an unreferenced STALE record is freed."""
        if self.state == STALE and refs == 0:
            return self.freed()
        return self._replace(refs=refs)


class SealedEntry(NamedTuple):
    """Where a sealed entry lives; `pinned` is False if the pins asked for could not be taken."""

    slot: int
    gen: int
    offset: int
    size: int
    pinned: bool = True
    attachment: bytes | None = None  # the entry's attachment record, if it has one


_F64 = struct.Struct("<d")


class SlotTable:
    """The slot, key, failure and error records of one mapped index. Records, their crc, access
    stamps and expiry go through the native handle (native.c): one implementation for Python's
    slow paths and the native hot ones."""

    def __init__(self, idx: memoryview, layout: Layout, native: _native.Index, ttl: float | None) -> None:
        self.idx = idx
        self.layout = layout
        self.ttl = ttl
        self.native = native
        self.on_damaged: Callable[[int], None] = lambda slot: None  # the index quarantines
        self._slots_off = layout.slots_off
        self.array = np.ndarray((layout.slots,), SLOT_DTYPE, buffer=idx, offset=layout.slots_off)

    # ------------------------------------------------------------------ records
    def raw(self, slot: int) -> tuple[SlotRecord, bool]:
        """The stored record, unchecked, and whether its crc verifies (no lock needed). The crc
        covers the record and its key, xor-ed so that a never-written (all-zero) slot verifies;
        an unknown state reads as STALE (and fails)."""
        state, owner, gen, offset, size, sealed_at, refs, valid = self.native.read_record(slot)
        known = 0 <= state < len(_STATES)
        record = SlotRecord(_STATES[state] if known else STALE, owner, gen, offset, size, sealed_at, refs)
        return record, valid

    def read(self, slot: int) -> SlotRecord | None:
        """The record; None if it fails its crc, after `on_damaged` quarantined it."""
        record, valid = self.raw(slot)
        if valid:
            return record
        self.on_damaged(slot)
        return None

    def write(self, slot: int, was: SlotState, record: SlotRecord, needle: bytes | None = None) -> None:
        """Replace a record read as state `was` (in the same section) by `record`, after checking
        the transition; record and crc are written in one copy. With `needle`, the slot is named
        for that key first, in the same native call (the crc covers the key)."""
        if (was, record.state) not in TRANSITIONS:
            raise ProtocolViolation(f"slot {slot}: illegal transition {was.label} -> {record.state.label}")
        self.native.write_record(slot, *record, needle)

    def quarantine(self, slot: int, record: SlotRecord) -> None:
        """The unchecked write for a record that failed its crc: `record` must be STALE or EMPTY."""
        assert record.state in (STALE, EMPTY)
        self.native.write_record(slot, *record, None)

    # ------------------------------------------------------------------ access times
    def last_access(self, slot: int) -> float:
        return float(_F64.unpack_from(self.idx, self._slots_off + SLOT_SIZE * slot + S_LAST_ACCESS)[0])

    # ------------------------------------------------------------------ failures
    def record_failure(self, slot: int, gen: int, kind: FailureKind, message: str) -> None:
        """Tell the waiters of reservation (slot, gen) why it ended without a seal."""
        eoff = self.layout.error_off(slot)
        raw = message.encode("utf-8", "replace")[:ERROR_SIZE]
        self.idx[eoff : eoff + ERROR_SIZE] = raw.ljust(ERROR_SIZE, b"\0")
        off = self._slots_off + SLOT_SIZE * slot + S_FAILURE
        self.idx[off : off + FAILURE.size] = FAILURE.pack(gen, kind)

    def failure(self, slot: int, gen: int) -> tuple[FailureKind, str] | None:
        """(kind, message) if the reservation (slot, gen) ended in a recorded failure."""
        fail_gen, kind = FAILURE.unpack_from(self.idx, self._slots_off + SLOT_SIZE * slot + S_FAILURE)
        if fail_gen != gen or kind not in (FailureKind.FAILED, FailureKind.UNCACHEABLE):
            return None
        eoff = self.layout.error_off(slot)
        raw = bytes(self.idx[eoff : eoff + ERROR_SIZE]).rstrip(b"\0")
        return FailureKind(kind), raw.decode("utf-8", "replace")
