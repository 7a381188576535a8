"""The node index: slots, stripes, reservations, pins and the arena allocator, in shared memory.

Protocol (docs/design.md has the reasons):

- A key lives in one stripe (a set of `ways` slots, chosen from its digest). Every change to a
  slot happens inside its stripe's section: the stripe's SysV semaphore held with SEM_UNDO, and a
  `held` marker set on entry and cleared on exit. Finding the marker set means the last holder
  died inside; `_repair` then rebuilds that stripe's derived state (refcounts from live clients'
  pins, dead reservations and unreferenced stale slots to EMPTY, damaged records quarantined).
- A reservation is the slot's own semaphore held (+1, SEM_UNDO) by the computing process.
  Waiters block in wait-for-zero, so a seal, an abandon or the owner's death wakes them all.
  A RESERVED slot whose semaphore is 0 has a dead owner: the next caller takes over with gen+1.
- Seal and abandon are fenced: they only apply if the slot is still RESERVED by this client
  with the same generation. Generations only grow, so (slot, gen) never names two values.
- Pins (request references and view pins) live in the pinning client's own record; the slot's
  refcount is their sum over live clients, kept in step inside the same stripe section.
  A dead client's pins stop counting the moment its liveness semaphore drops.
- Arena space is allocated under the node lock (lock order: node lock, then stripe locks).
  The allocator keeps no state of its own: the extents of non-EMPTY slots are the allocation.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, NamedTuple

import numpy as np

from shmcache.errors import CapacityError, CorruptSegment, ShmCacheError
from shmcache.gpu import GPU_HEAD_DTYPE, GPU_RECORD_SIZE, ExporterId, GpuRecord
from shmcache.keys import HASH_ALGORITHMS, MODALITIES, EmbeddingCacheKey
from shmcache.layout import (
    C_COUNTERS,
    CLIENT_HEAD,
    CLIENT_HEAD_SIZE,
    COUNTERS,
    ERROR_SIZE,
    GPU_SIZE,
    H_JOURNAL,
    H_JOURNAL_ROW,
    H_NODE_HELD,
    H_RETIRED,
    HEADER,
    KEY_HEAD,
    KEY_SIZE,
    MAGIC,
    N_COUNTERS,
    NODE_LOCK,
    PIN,
    PIN_DTYPE,
    S_ERROR,
    S_ERROR_OFF,
    S_LAST_ACCESS,
    SLOT,
    SLOT_CRC_SPAN,
    SLOT_DTYPE,
    SLOT_SIZE,
    SlotState,
)
from shmcache.namespace import Segments
from shmcache.semaphores import SemaphoreTimeout

__all__ = ["Claim", "NodeIndex", "SlotInfo"]

EMPTY, RESERVED, SEALED, STALE = SlotState.EMPTY, SlotState.RESERVED, SlotState.SEALED, SlotState.STALE
FAILED, UNCACHEABLE = 1, 2  # failure kinds recorded for waiters
ALIGN: Final = 64
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")
_KINDS = ("raw", "tensor", "token_prefix")
_META = struct.Struct("<BB")  # modality, key kind (informational, for inspection)
_META_OFF = 68
_COUNTER_INDEX: Final = {name: i for i, name in enumerate(COUNTERS)}
_ZERO_CRC: Final = zlib.crc32(bytes(KEY_SIZE), zlib.crc32(bytes(SLOT_CRC_SPAN)))
_SLOT_HEAD: Final = struct.Struct(SLOT.format[:-1])  # the slot record without its crc
assert _SLOT_HEAD.size == SLOT_CRC_SPAN


class LockTimeout(ShmCacheError, TimeoutError):
    """A stripe or node lock was held longer than lock_timeout_s (a stopped or hung holder)."""


class SlotInfo(NamedTuple):
    """Where a sealed entry lives; `pinned` is False if the pins asked for could not be taken."""

    slot: int
    gen: int
    offset: int
    size: int
    pinned: bool = True
    gpu: GpuRecord | None = None  # the entry's CUDA IPC record, if it has a device copy


@dataclass(frozen=True)
class Claim:
    """Outcome of `NodeIndex.claim`: a hit, our reservation, someone else's, or no room."""

    kind: str  # "hit" | "owner" | "wait" | "full"
    slot: int = -1
    gen: int = 0
    hit: SlotInfo | None = None
    takeover: bool = False


def needle_of(key: EmbeddingCacheKey) -> bytes:
    """The 48-byte key record that identifies `key` in the key table."""
    digest = key.digest
    return KEY_HEAD.pack(HASH_ALGORITHMS.index(key.algorithm), len(digest), 0, 0) + digest.ljust(32, b"\0")


def first_fit(starts: np.ndarray, ends: np.ndarray, need: int, capacity: int) -> int | None:
    """The lowest offset of `need` free bytes in [0, capacity) outside every [start, end).

    The extents may overlap or be empty (a racy snapshot holds half-freed records): gaps start at
    the running maximum of the ends, so no listed extent is ever handed out again.
    """
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    gap_starts = np.concatenate(([0], np.maximum.accumulate(ends))) if ends.size else np.zeros(1, np.int64)
    gap_ends = np.concatenate((starts, [capacity]))
    fits = np.nonzero(gap_ends - gap_starts >= need)[0]
    return int(gap_starts[fits[0]]) if fits.size else None


def _start_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


class _Section:
    """A held-marker critical section on one semaphore (a stripe, or the node lock if stripe < 0)."""

    __slots__ = ("held_off", "index", "sem", "stripe")

    def __init__(self, index: NodeIndex, sem: int, held_off: int, stripe: int) -> None:
        self.index, self.sem, self.held_off, self.stripe = index, sem, held_off, stripe

    def __enter__(self) -> None:
        index = self.index
        if index._enter(self.sem, self.held_off, "the node lock" if self.stripe < 0 else "a stripe lock"):
            try:
                if self.stripe >= 0:
                    index._repair_stripe(self.stripe)
                else:
                    index._replay_journal()
                    index._reap_dead()
                    index.count("repairs")
            except BaseException:
                index._leave(self.sem, self.held_off, clean=False)
                raise

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # CapacityError is only raised before a section writes anything: that exit is clean too
        self.index._leave(self.sem, self.held_off, clean=exc_type is None or exc_type is CapacityError)


class NodeIndex:
    """One client's handle on a namespace's shared index (see the module docstring)."""

    def __init__(self, segments: Segments, lock_timeout: float) -> None:
        self.seg = segments
        self.layout = layout = segments.layout
        self.idx = memoryview(segments.index)
        self.sems = segments.sems
        self.lock_timeout = lock_timeout
        header = HEADER.unpack_from(self.idx, 0)
        self.capacity = segments.capacity
        self.ttl: float | None = header[10] or None
        self.client = -1
        self._pins: dict[tuple[int, int], list[int]] = {}  # (slot, gen) -> [pin index, count]
        self._free_pins = list(range(layout.pins - 1, -1, -1))
        self._reservations: set[int] = set()  # slots whose reservation semaphore this process holds
        self._pin_lock = threading.Lock()
        self._counter_lock = threading.Lock()
        buf = segments.index
        self.slots = np.ndarray((layout.slots,), SLOT_DTYPE, buffer=buf, offset=layout.slots_off)
        self.client_states = np.ndarray(
            (layout.clients,), "<u4", buffer=buf, offset=layout.clients_off, strides=(layout.client_size,)
        )
        self.client_pids = np.ndarray(
            (layout.clients,), "<u4", buffer=buf, offset=layout.clients_off + 4, strides=(layout.client_size,)
        )
        self.all_pins = np.ndarray(
            (layout.clients, layout.pins),
            PIN_DTYPE,
            buffer=buf,
            offset=layout.clients_off + CLIENT_HEAD_SIZE,
            strides=(layout.client_size, PIN.size),
        )
        self.all_counters = np.ndarray(
            (layout.clients, N_COUNTERS),
            "<u8",
            buffer=buf,
            offset=layout.clients_off + C_COUNTERS,
            strides=(layout.client_size, 8),
        )
        self._stripes_off = layout.stripes_off
        self._stripe_sem0 = layout.stripe_sem(0)
        self._slots_off = layout.slots_off
        self._keys_off = layout.keys_off
        self._counters: memoryview | None = None
        self.retired = np.ndarray((N_COUNTERS,), "<u8", buffer=buf, offset=H_RETIRED)
        self.journal = np.ndarray((N_COUNTERS,), "<u8", buffer=buf, offset=H_JOURNAL)

    def _store(self, fmt: struct.Struct, off: int, *fields: object) -> None:
        """Write `fields` at `off` in one copy of their packed bytes. Never `pack_into` shared
        memory: it zeroes its target before writing the fields, so a process reading without the
        lock (the allocator's snapshot of the slot table, the eviction scan, repeat hits, GPU
        sweeps) would see a live record as EMPTY and hand its memory out again."""
        self.idx[off : off + fmt.size] = fmt.pack(*fields)

    # ----------------------------------------------------------------- sections and repair
    def _enter(self, sem: int, held_off: int, what: str) -> bool:
        """Take semaphore `sem` and set its held marker; True if the last holder died inside."""
        try:
            self.sems.acquire(sem, self.lock_timeout)
        except SemaphoreTimeout:
            raise LockTimeout(
                f"{what} was held for more than lock_timeout_s={self.lock_timeout}s (holder pid "
                f"{self.sems.last_pid(sem)})"
            ) from None
        repair: bool = _U32.unpack_from(self.idx, held_off)[0] != 0
        self._store(_U32, held_off, 1)
        return repair

    def _leave(self, sem: int, held_off: int, clean: bool) -> None:
        """Clear the held marker (only after a clean exit: else the next holder repairs) and release."""
        if clean:
            self._store(_U32, held_off, 0)
        self.sems.release(sem)

    def stripe_section(self, stripe: int) -> _Section:
        """Hold one stripe; repairs it first if its last holder died inside."""
        return _Section(self, self._stripe_sem0 + stripe, self._stripes_off + 8 * stripe, stripe)

    def node_section(self) -> _Section:
        """Hold the node lock (client records, counter journal, allocation)."""
        return _Section(self, NODE_LOCK, H_NODE_HELD, -1)

    def live_clients(self) -> np.ndarray:
        """Boolean array: which client rows are held by a live process (kernel-tracked)."""
        values = self.sems.values()
        first = self.layout.client_sem(0)
        live: np.ndarray = (values[first : first + self.layout.clients] != 0) & (self.client_states == 1)
        return live

    def _recount(self, slot: int, gen: int, live: np.ndarray) -> int:
        pins = self.all_pins
        match = (pins["slot"] == slot) & (pins["gen"] == gen) & live[:, None]
        return int(pins["count"][match].sum())

    def _repair_stripe(self, stripe: int) -> None:
        live = self.live_clients()
        ways = self.layout.ways
        for slot in range(stripe * ways, (stripe + 1) * ways):
            state, owner, gen, offset, size, sealed_at, _refs, crc = SLOT.unpack_from(
                self.idx, self.layout.slot_off(slot)
            )
            if crc != self._crc(slot):
                self.count("corrupt_records")
                state = STALE if state != EMPTY else EMPTY
                if not (offset >= 0 and offset + size <= self.capacity):
                    offset = size = 0
            if state == RESERVED and self.sems.value(self.layout.slot_sem(slot)) == 0:
                state, size = EMPTY, 0
            refs = self._recount(slot, gen, live) if state != EMPTY else 0
            if state == STALE and refs == 0:
                state, size = EMPTY, 0
            self._write_slot(slot, state, owner, gen, offset, size, sealed_at, refs)
        repairs_off = self.layout.stripes_off + 8 * stripe + 4
        self._store(_U32, repairs_off, _U32.unpack_from(self.idx, repairs_off)[0] + 1)
        self.count("repairs")

    # ----------------------------------------------------------------- slot records
    def _crc(self, slot: int, head: bytes | memoryview | None = None) -> int:
        """CRC of the record (`head`, else the stored one) and its key, xor-ed so that a
        never-written (all-zero) slot verifies."""
        off, koff = self._slots_off + SLOT_SIZE * slot, self._keys_off + KEY_SIZE * slot
        if head is None:
            head = self.idx[off : off + SLOT_CRC_SPAN]
        return zlib.crc32(self.idx[koff : koff + KEY_SIZE], zlib.crc32(head)) ^ _ZERO_CRC

    def _write_slot(
        self, slot: int, state: int, owner: int, gen: int, offset: int, size: int, sealed_at: float, refs: int
    ) -> None:
        """Rewrite the record and its crc in one copy (see `_store`): fields that keep their value
        never change under a reader."""
        head = _SLOT_HEAD.pack(state, owner, gen, offset, size, sealed_at, refs)
        off = self._slots_off + SLOT_SIZE * slot
        self.idx[off : off + SLOT.size] = head + _U32.pack(self._crc(slot, head))

    def _read_slot(self, slot: int) -> tuple[int, int, int, int, int, float, int] | None:
        """The slot's fields, or None after quarantining a record that fails its crc."""
        state, owner, gen, offset, size, sealed_at, refs, crc = SLOT.unpack_from(
            self.idx, self._slots_off + SLOT_SIZE * slot
        )
        if crc != self._crc(slot):
            self._quarantine(slot)
            return None
        return state, owner, gen, offset, size, sealed_at, refs

    def _quarantine(self, slot: int) -> None:
        """A damaged record: make it unreachable; keep its memory only while live pins may use it."""
        _state, owner, gen, offset, size, sealed_at, _refs, _crc = SLOT.unpack_from(
            self.idx, self.layout.slot_off(slot)
        )
        self.count("corrupt_records")
        refs = self._recount(slot, gen, self.live_clients())
        sane = offset >= 0 and offset + size <= self.capacity
        if refs and sane:
            self._write_slot(slot, STALE, owner, gen, offset, size, sealed_at, refs)
        else:
            self._write_slot(slot, EMPTY, -1, gen, 0, 0, 0.0, 0)

    def last_access(self, slot: int) -> float:
        return float(_F64.unpack_from(self.idx, self._slots_off + SLOT_SIZE * slot + S_LAST_ACCESS)[0])

    def touch(self, slot: int, now: float) -> None:
        """Record an access for LRU (a lone aligned 8-byte store; approximate by design)."""
        self._store(_F64, self._slots_off + SLOT_SIZE * slot + S_LAST_ACCESS, now)

    def expired(self, slot: int, now: float) -> bool:
        return self.ttl is not None and now - self.last_access(slot) > self.ttl

    def slot_fields(self, slot: int) -> tuple[int, int, int, int, int, float, int, int]:
        """Raw (state, owner, gen, offset, size, sealed_at, refcount, crc), without locking."""
        return SLOT.unpack_from(self.idx, self._slots_off + SLOT_SIZE * slot)

    def stripe_of(self, needle: bytes) -> int:
        return int.from_bytes(needle[16:24], "little") % self.layout.stripes

    def _find(self, stripe: int, needle: bytes) -> Iterator[int]:
        ways = self.layout.ways
        base = self._keys_off + KEY_SIZE * stripe * ways
        blob = bytes(self.idx[base : base + KEY_SIZE * ways])
        pos = blob.find(needle)
        while pos >= 0:
            if pos % KEY_SIZE == 0:
                yield stripe * ways + pos // KEY_SIZE
            pos = blob.find(needle, pos + 1)

    # ----------------------------------------------------------------- pins
    def _pin(self, slot: int, gen: int, count: int) -> None:
        """Add `count` pins of this client on (slot, gen). Caller holds the stripe section."""
        with self._pin_lock:
            entry = self._pins.get((slot, gen))
            if entry is None:
                if not self._free_pins:
                    raise CapacityError(
                        f"this process holds pins on {self.layout.pins} entries (max_pins_per_process): "
                        "release requests with cleanup_request() or drop returned views"
                    )
                entry = self._pins[(slot, gen)] = [self._free_pins.pop(), 0]
            entry[1] += count
            self._store(PIN, self.layout.pin_off(self.client, entry[0]), slot, entry[1], gen)

    def _unpin_local(self, slot: int, gen: int, count: int) -> int:
        """Remove up to `count` of this client's pins on (slot, gen); returns how many it held."""
        with self._pin_lock:
            entry = self._pins.get((slot, gen))
            if entry is None:
                return 0
            taken = min(count, entry[1])
            entry[1] -= taken
            self._store(PIN, self.layout.pin_off(self.client, entry[0]), slot, entry[1], gen)
            if entry[1] == 0:
                del self._pins[(slot, gen)]
                self._free_pins.append(entry[0])
            return taken

    def held_pins(self) -> dict[tuple[int, int], int]:
        with self._pin_lock:
            return {k: v[1] for k, v in self._pins.items()}

    def unpin(self, slot: int, gen: int, count: int) -> None:
        """Release pins; an unreferenced STALE slot is freed right here."""
        self.unpin_many([(slot, gen)] * count)

    def unpin_many(self, pins: list[tuple[int, int]]) -> None:
        """Release one pin per (slot, gen) listed, one stripe section per stripe touched."""
        by_stripe: dict[int, dict[tuple[int, int], int]] = {}
        for slot, gen in pins:
            counts = by_stripe.setdefault(slot // self.layout.ways, {})
            counts[(slot, gen)] = counts.get((slot, gen), 0) + 1
        for stripe, counts in sorted(by_stripe.items()):
            with self.stripe_section(stripe):
                for (slot, gen), count in counts.items():
                    self._unpin_in(slot, gen, count)

    def _unpin_in(self, slot: int, gen: int, count: int) -> None:
        taken = self._unpin_local(slot, gen, count)
        fields = self._read_slot(slot)
        if taken == 0 or fields is None:
            return
        state, owner, cur_gen, offset, size, sealed_at, refs = fields
        if cur_gen != gen or state == EMPTY:
            return
        refs = max(0, refs - taken)
        if state == STALE and refs == 0:
            self._write_slot(slot, EMPTY, -1, gen, 0, 0, 0.0, 0)
            self.count("evictions_ttl")
        else:
            self._write_slot(slot, state, owner, gen, offset, size, sealed_at, refs)

    def add_ref(self, slot: int, gen: int) -> bool:
        """One more pin on a sealed (slot, gen); False if it is no longer sealed there."""
        with self.stripe_section(slot // self.layout.ways):
            fields = self._read_slot(slot)
            if fields is None or fields[0] != SEALED or fields[2] != gen:
                return False
            state, owner, _gen, offset, size, sealed_at, refs = fields
            self._pin(slot, gen, 1)
            self._write_slot(slot, state, owner, gen, offset, size, sealed_at, refs + 1)
            return True

    def drop(self, slot: int, gen: int) -> None:
        """Make a damaged entry unreachable; its memory is freed once nothing references it."""
        with self.stripe_section(slot // self.layout.ways):
            fields = self._read_slot(slot)
            if fields is None or fields[2] != gen or fields[0] not in (SEALED, STALE):
                return
            _state, owner, _gen, offset, size, sealed_at, refs = fields
            if refs:
                self._write_slot(slot, STALE, owner, gen, offset, size, sealed_at, refs)
            else:
                self._write_slot(slot, EMPTY, -1, gen, 0, 0, 0.0, 0)

    # ----------------------------------------------------------------- lookups and reservations
    def _hit_in(self, stripe: int, needle: bytes, now: float, pins: int) -> SlotInfo | None:
        """Inside a stripe section: the live sealed slot of `needle`, pinned `pins` times, or None."""
        for slot in self._find(stripe, needle):
            fields = self._read_slot(slot)
            if fields is None or fields[0] != SEALED:
                continue
            state, owner, gen, offset, size, sealed_at, refs = fields
            if self.expired(slot, now):
                if refs:  # a miss from now on, freed at its last release
                    self._write_slot(slot, STALE, owner, gen, offset, size, sealed_at, refs)
                else:
                    self._write_slot(slot, EMPTY, -1, gen, 0, 0, 0.0, 0)
                    self.count("evictions_ttl")
                continue
            if pins:
                self._pin(slot, gen, pins)
                self._write_slot(slot, state, owner, gen, offset, size, sealed_at, refs + pins)
            self.touch(slot, now)
            return SlotInfo(slot, gen, offset, size, gpu=self.gpu_record(slot, gen))
        return None

    def lookup(self, needle: bytes, pins: int) -> SlotInfo | None:
        """A sealed, unexpired entry for `needle`, pinned `pins` times; None on a miss."""
        stripe = self.stripe_of(needle)
        with self.stripe_section(stripe):
            return self._hit_in(stripe, needle, time.monotonic(), pins)

    def claim(self, needle: bytes, key: EmbeddingCacheKey, pins: int) -> Claim:
        """One step of get-or-reserve for `needle`, in one stripe section."""
        stripe = self.stripe_of(needle)
        now = time.monotonic()
        with self.stripe_section(stripe):
            hit = self._hit_in(stripe, needle, now, pins)
            if hit is not None:
                return Claim("hit", hit.slot, hit.gen, hit)
            for slot in self._find(stripe, needle):
                fields = self._read_slot(slot)
                if fields is None or fields[0] != RESERVED:
                    continue
                gen = fields[2]
                if self.sems.value(self.layout.slot_sem(slot)) != 0:
                    return Claim("wait", slot, gen)
                if not self._acquire_reservation(slot):
                    return Claim("wait", slot, gen)  # raced with a live owner's release: look again
                gen = self._next_gen(slot)
                self._write_slot(slot, RESERVED, self.client, gen, 0, 0, 0.0, 0)
                self.count("takeovers")
                return Claim("owner", slot, gen, takeover=True)
            meta = _META.pack(MODALITIES.index(key.modality), _KINDS.index(key.kind))
            victim = self._victim_in(stripe, now)
            if victim is None or not self._acquire_reservation(victim):
                return Claim("full")
            slot = victim
            gen = self._next_gen(slot)
            koff = self.layout.key_off(slot)
            self.idx[koff : koff + KEY_SIZE] = needle
            meta_off = self.layout.slot_off(slot) + _META_OFF
            self.idx[meta_off : meta_off + _META.size] = meta
            self._write_slot(slot, RESERVED, self.client, gen, 0, 0, 0.0, 0)
            return Claim("owner", slot, gen)

    def _next_gen(self, slot: int) -> int:
        """A generation the slot never had, nor its GPU record (a repaired record's generation may
        have been torn, and must not meet an old GPU record again)."""
        record_gen: int = _U64.unpack_from(self.idx, self.layout.gpu_record_off(slot))[0]
        slot_gen: int = self.slot_fields(slot)[2]
        return max(slot_gen, record_gen) + 1

    def _victim_in(self, stripe: int, now: float) -> int | None:
        """A slot of `stripe` to reuse: empty, else an unreferenced sealed one (expired first, then
        least recently used), else a reservation whose owner died. Evicts it."""
        ways = self.layout.ways
        best: tuple[int, float] | None = None
        dead: int | None = None
        for slot in range(stripe * ways, (stripe + 1) * ways):
            fields = self._read_slot(slot)
            if fields is None:
                continue
            state, _owner, _gen, _offset, _size, _sealed_at, refs = fields
            if state == EMPTY:
                if self.sems.value(self.layout.slot_sem(slot)) == 0:
                    return slot
                continue  # emptied by a repair while its owner lives on: that owner still holds it
            if state == SEALED and refs == 0:
                rank = -1.0 if self.expired(slot, now) else self.last_access(slot)
                if best is None or rank < best[1]:
                    best = (slot, rank)
            elif state == RESERVED and dead is None and self.sems.value(self.layout.slot_sem(slot)) == 0:
                dead = slot
        if best is not None:
            slot = best[0]
            self.count("evictions_ttl" if best[1] < 0 else "evictions_lru")
            self._write_slot(slot, EMPTY, -1, self.slot_fields(slot)[2], 0, 0, 0.0, 0)
            return slot
        if dead is not None:
            self._write_slot(dead, EMPTY, -1, self.slot_fields(dead)[2], 0, 0, 0.0, 0)
            return dead
        return None

    def wait(self, slot: int, timeout: float) -> None:
        """Block until slot's reservation is released or its owner dies (SemaphoreTimeout)."""
        self.sems.wait_zero(self.layout.slot_sem(slot), timeout)

    def failure(self, slot: int, gen: int) -> tuple[int, str] | None:
        """(kind, message) if the reservation (slot, gen) ended in a recorded failure."""
        fail_gen, kind = S_ERROR.unpack_from(self.idx, self.layout.slot_off(slot) + S_ERROR_OFF)
        if fail_gen != gen or kind == 0:
            return None
        eoff = self.layout.error_off(slot)
        raw = bytes(self.idx[eoff : eoff + ERROR_SIZE]).rstrip(b"\0")
        return kind, raw.decode("utf-8", "replace")

    def owner_pid(self, slot: int) -> int:
        return self.sems.last_pid(self.layout.slot_sem(slot))

    # ----------------------------------------------------------------- commit path
    def allocate(self, slot: int, gen: int, nbytes: int) -> int | None:
        """Give reservation (slot, gen) an arena extent of `nbytes`, evicting LRU entries as needed.

        Returns the offset, None if the reservation was lost; raises `CapacityError` if every byte
        is referenced or reserved.
        """
        need = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        if need > self.capacity:
            raise CapacityError(f"value of {nbytes} bytes exceeds capacity_bytes={self.capacity}")
        with self.node_section():
            offset = self._gap(need)
            reaped = False
            while offset is None:
                if not self._evict_one():
                    if reaped or not self._reap_dead():
                        raise CapacityError(
                            f"no room for {nbytes} bytes: the arena ({self.capacity} bytes) is held "
                            "by referenced or in-flight entries"
                        )
                    reaped = True
                offset = self._gap(need)
            with self.stripe_section(slot // self.layout.ways):
                fields = self._read_slot(slot)
                if fields is None or fields[:3] != (RESERVED, self.client, gen):
                    return None
                self._write_slot(slot, RESERVED, self.client, gen, offset, need, 0.0, 0)
            return offset

    def _gap(self, need: int) -> int | None:
        snapshot = self.slots.copy()  # one pass: others may free extents while we look
        used = (snapshot["state"] != EMPTY) & (snapshot["size"] > 0)
        starts = snapshot["offset"][used].astype(np.int64)
        return first_fit(starts, starts + snapshot["size"][used].astype(np.int64), need, self.capacity)

    def _evict_one(self) -> bool:
        """Evict the least recently used unreferenced entry (expired ones first). False if none."""
        slots = self.slots
        now = time.monotonic()
        candidates = np.nonzero((slots["state"] == SEALED) & (slots["refcount"] == 0) & (slots["size"] > 0))[
            0
        ]
        dead = [
            int(s)
            for s in np.nonzero((slots["state"] == RESERVED) & (slots["size"] > 0))[0]
            if self.sems.value(self.layout.slot_sem(int(s))) == 0
        ]
        if not candidates.size and not dead:
            return False
        ranks = slots["last_access"][candidates]
        if self.ttl is not None:
            ranks = np.where(now - ranks > self.ttl, -1.0, ranks)
        for slot in [*dead, *(int(candidates[i]) for i in np.argsort(ranks, kind="stable"))]:
            with self.stripe_section(slot // self.layout.ways):
                fields = self._read_slot(slot)
                if fields is None:
                    return True  # quarantine may have freed it
                state, _owner, gen, _offset, size, _sealed, refs = fields
                dead_reservation = state == RESERVED and self.sems.value(self.layout.slot_sem(slot)) == 0
                if (state == SEALED and refs == 0 and size) or dead_reservation:
                    expired = state == SEALED and self.expired(slot, now)
                    self._write_slot(slot, EMPTY, -1, gen, 0, 0, 0.0, 0)
                    if state == SEALED:
                        self.count("evictions_ttl" if expired else "evictions_lru")
                    return True
        return False

    def _acquire_reservation(self, slot: int) -> bool:
        """Take slot's reservation semaphore without waiting; remember that this process holds it."""
        if not self.sems.try_acquire(self.layout.slot_sem(slot)):
            return False
        with self._pin_lock:
            self._reservations.add(slot)
        return True

    def _release_reservation(self, slot: int) -> None:
        """Release slot's reservation semaphore if this process still holds it (waiters wake; if the
        slot is still RESERVED they take it over with gen+1, which fencing makes safe)."""
        with self._pin_lock:
            held = slot in self._reservations
            self._reservations.discard(slot)
        if held:
            self.sems.release(self.layout.slot_sem(slot))

    def seal(self, slot: int, gen: int, pins: int, gpu: GpuRecord | None = None) -> SlotInfo | None:
        """Fenced seal: publish (slot, gen) with `pins` pins for this client, and its GPU record if
        given; None if fenced off. Whatever happens, the reservation semaphore is released before
        this returns or raises."""
        try:
            with self.stripe_section(slot // self.layout.ways):
                fields = self._read_slot(slot)
                if fields is None or fields[:3] != (RESERVED, self.client, gen):
                    return None
                _state, _owner, _gen, offset, size, _sealed, _refs = fields
                now = time.monotonic()
                pinned = True
                try:
                    if pins:
                        self._pin(slot, gen, pins)
                except CapacityError:  # this process holds too many pins: seal for everyone else anyway
                    pins, pinned = 0, False
                self.touch(slot, now)
                if gpu is not None:
                    goff = self.layout.gpu_record_off(slot)
                    self.idx[goff : goff + GPU_RECORD_SIZE] = gpu.pack()
                self._write_slot(slot, SEALED, self.client, gen, offset, size, now, pins)
                self._release_reservation(slot)
                return SlotInfo(slot, gen, offset, size, pinned, gpu)
        finally:
            self._release_reservation(slot)

    def abandon(self, slot: int, gen: int, kind: int, message: str) -> bool:
        """Fenced abandon: free the reservation and record why for its waiters. Whatever happens,
        the reservation semaphore is released before this returns or raises."""
        try:
            with self.stripe_section(slot // self.layout.ways):
                fields = self._read_slot(slot)
                if fields is None or fields[:3] != (RESERVED, self.client, gen):
                    return False
                eoff = self.layout.error_off(slot)
                raw = message.encode("utf-8", "replace")[:ERROR_SIZE]
                self.idx[eoff : eoff + ERROR_SIZE] = raw.ljust(ERROR_SIZE, b"\0")
                self._store(S_ERROR, self.layout.slot_off(slot) + S_ERROR_OFF, gen, kind)
                self._write_slot(slot, EMPTY, -1, gen, 0, 0, 0.0, 0)
                self._release_reservation(slot)
                return True
        finally:
            self._release_reservation(slot)

    # ----------------------------------------------------------------- GPU records
    def gpu_record(self, slot: int, gen: int) -> GpuRecord | None:
        """The GPU record of entry (slot, gen), None if it has none (records of earlier
        generations of the slot are ignored: generations never repeat)."""
        goff = self.layout.gpu_record_off(slot)
        if _U64.unpack_from(self.idx, goff)[0] != gen:
            return None
        record = GpuRecord.unpack(self.idx[goff : goff + GPU_RECORD_SIZE])
        return record if record is not None and record.gen == gen else None

    def withdraw_gpu(self, slot: int, gen: int) -> bool:
        """Mark entry (slot, gen)'s GPU record withdrawn: from now on no reader opens its handle."""
        with self.stripe_section(slot // self.layout.ways):
            record = self.gpu_record(slot, gen)
            if record is None:
                return False
            goff = self.layout.gpu_record_off(slot)
            self.idx[goff : goff + GPU_RECORD_SIZE] = record.withdraw().pack()
            return True

    def gpu_records_live(self) -> np.ndarray:
        """Boolean array over slots: the current generation has a GPU record that is not withdrawn
        (read without a lock, for statistics)."""
        table = np.ndarray(
            (self.layout.slots,),
            GPU_HEAD_DTYPE,
            buffer=self.seg.index,
            offset=self.layout.gpu_off,
            strides=(GPU_SIZE,),
        )
        live: np.ndarray = (
            (table["gen"] == self.slots["gen"]) & (table["flags"] & 1 == 0) & (table["gen"] > 0)
        )
        return live

    def entry_state(self, slot: int, gen: int) -> tuple[bool, int]:
        """(entry (slot, gen) is still indexed, its references), read without a lock."""
        state, _owner, cur_gen, _offset, _size, _sealed, refs, _crc = self.slot_fields(slot)
        return state in (SEALED, STALE) and cur_gen == gen, refs

    @property
    def identity(self) -> ExporterId:
        """This client: its row, pid and start time."""
        return self.client_identity(self.client)

    def client_identity(self, row: int) -> ExporterId:
        _state, pid, ticks, _attached = CLIENT_HEAD.unpack_from(self.idx, self.layout.client_off(row))
        return ExporterId(row, pid, ticks)

    def client_alive(self, who: ExporterId) -> bool:
        """True if the process `who` still holds its client record (kernel-tracked liveness)."""
        if not 0 <= who.row < self.layout.clients or self.sems.value(self.layout.client_sem(who.row)) == 0:
            return False
        return self.client_states[who.row] == 1 and self.client_identity(who.row) == who

    # ----------------------------------------------------------------- clients
    def attach_client(self) -> None:
        """Claim a client record (under the node lock), then reap dead clients."""
        with self.node_section():
            for attempt in range(2):
                if attempt:
                    self._reap_dead()  # every record taken: some may belong to the dead
                for row in range(self.layout.clients):
                    if self.client_states[row] == 0 and self.sems.try_acquire(self.layout.client_sem(row)):
                        self._claim_row(row)
                        self._reap_dead()
                        return
        raise CapacityError(f"all {self.layout.clients} client records are in use (max_clients)")

    def _claim_row(self, row: int) -> None:
        off = self.layout.client_off(row)
        self.idx[off : off + self.layout.client_size] = bytes(self.layout.client_size)
        pid = os.getpid()
        self._store(CLIENT_HEAD, off, 1, pid, _start_ticks(pid), time.time())
        self.client = row
        self._counters = self.idx[off + C_COUNTERS : off + C_COUNTERS + 8 * N_COUNTERS].cast("Q")

    def detach_client(self) -> None:
        """Release every pin of this client, fold its counters, free its record."""
        self.unpin_many([pin for pin, count in self.held_pins().items() for _ in range(count)])
        with self.node_section():
            self._counters = None
            self._retire(self.client)
            self.sems.release(self.layout.client_sem(self.client))
        self.client = -1

    def _retire(self, row: int) -> None:
        """Fold a client's counters into the retired totals and free its record (journaled)."""
        self.journal[:] = self.retired
        self._store(_I32, H_JOURNAL_ROW, row)
        self.retired[:] = self.retired + self.all_counters[row]
        off = self.layout.client_off(row)
        self.idx[off : off + self.layout.client_size] = bytes(self.layout.client_size)
        self._store(_I32, H_JOURNAL_ROW, -1)

    def _replay_journal(self) -> None:
        row = _I32.unpack_from(self.idx, H_JOURNAL_ROW)[0]
        if row >= 0:  # died inside _retire: restore the totals, then redo it
            self.retired[:] = self.journal
            self._retire(row)

    def _reap_dead(self) -> bool:
        """Free the records of dead clients and recount what they pinned (under the node lock)."""
        live = self.live_clients()
        dead = np.nonzero((self.client_states == 1) & ~live)[0]
        for row in (int(r) for r in dead):
            # recount first, then retire: a reaper killed midway leaves the dead record (and its
            # pin list) in place for the next reaper; the recount already ignores the dead row
            pinned = {(int(p["slot"]), int(p["gen"])) for p in self.all_pins[row] if p["count"]}
            for slot, gen in sorted(pinned):
                with self.stripe_section(slot // self.layout.ways):
                    fields = self._read_slot(slot)
                    if fields is None or fields[2] != gen or fields[0] == EMPTY:
                        continue
                    state, owner, _g, offset, size, sealed_at, _refs = fields
                    refs = self._recount(slot, gen, self.live_clients())
                    if state == STALE and refs == 0:
                        self._write_slot(slot, EMPTY, -1, gen, 0, 0, 0.0, 0)
                    else:
                        self._write_slot(slot, state, owner, gen, offset, size, sealed_at, refs)
            self._retire(row)
            self.count("reaped_clients")
        return bool(dead.size)

    def reap(self) -> int:
        """Reap dead clients and free reservations whose owner died; returns clients reaped."""
        with self.node_section():
            before = int((self.client_states == 1).sum())
            self._reap_dead()
            for found in np.nonzero(self.slots["state"] == RESERVED)[0]:
                slot = int(found)
                with self.stripe_section(slot // self.layout.ways):
                    fields = self._read_slot(slot)
                    if fields and fields[0] == RESERVED and self.sems.value(self.layout.slot_sem(slot)) == 0:
                        self._write_slot(slot, EMPTY, -1, fields[2], 0, 0, 0.0, 0)
            return before - int((self.client_states == 1).sum())

    def any_other_live(self) -> bool:
        live = self.live_clients()
        live[self.client] = False
        return bool(live.any())

    # ----------------------------------------------------------------- counters
    def count(self, name: str, n: int = 1) -> None:
        """Add to this client's counter (node-wide totals are the sum over all records)."""
        counters = self._counters
        if counters is None:
            return
        with self._counter_lock:
            counters[_COUNTER_INDEX[name]] += n

    def totals(self) -> dict[str, int]:
        """Node-wide counters: live clients' records plus the retired totals."""
        sums = self.retired + self.all_counters[self.client_states == 1].sum(axis=0, dtype=np.uint64)
        return {name: int(sums[i]) for i, name in enumerate(COUNTERS)}

    def check_header(self) -> None:
        """Raise `CorruptSegment` if the header lost its magic (overwritten index)."""
        if HEADER.unpack_from(self.idx, 0)[0] != MAGIC:
            raise CorruptSegment("index header magic was overwritten")

    def release_views(self) -> None:
        """Drop our numpy views of the index (before the mapping is closed)."""
        for name in (
            "slots",
            "client_states",
            "client_pids",
            "all_pins",
            "all_counters",
            "retired",
            "journal",
        ):
            setattr(self, name, None)
        self.idx.release()
