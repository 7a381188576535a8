"""Every byte of a namespace's index segment and semaphore set: the one place that knows offsets.

Index segment (all little-endian)::

    header      4096 B       `Header` (magic, layout version, settings, semaphore-set id, node-lock
                             held marker, counter journal row, semaphore-set key), then the retire
                             sequence, the retired counters, then the counter journal
    locks       64 B x (1+S) process-shared robust mutexes: the node lock, then one per stripe
    stripes     8 B x S      held marker u32 (the holder's pid; 0: clean), repairs u32
    slots       80 B x N     `SlotRecord` (state, owner, gen, offset, size, sealed_at, refcount),
                             crc u32, last_access f64, failure record (gen u64, kind u32),
                             key meta (modality u8, key kind u8)
    keys        48 B x N     algorithm u8, digest length u8, 14 B pad, digest 32 B
    errors      128 B x N    failure message of the slot's last failed reservation (utf-8)
    attachments 192 B x N    an opaque record a layer above keeps per entry (the GPU layer's CUDA
                             IPC record); its first 8 bytes are the generation it belongs to
    clients     (512 + 16 P) B x C   state u32, pid u32, start ticks u64, attached at f64, counters
                                     at +64, then P pins (slot i32, count u32, gen u64)

Semaphore set: [N reservations] [C client liveness] [2 signature].
"""

from __future__ import annotations

import enum
import mmap
import struct
from dataclasses import astuple, dataclass
from functools import cached_property
from typing import Any, Final

import numpy as np

from shmcache.errors import CorruptSegment
from shmcache.keys.key import KEY_KINDS, MODALITIES, RECORD_HEAD, RECORD_SIZE, EmbeddingCacheKey
from shmcache.node import _native

__all__ = [
    "ATTACHMENT_SIZE",
    "HEADER_SIZE",
    "IndexBuffer",
    "LAYOUT_VERSION",
    "MAGIC",
    "NODE_LOCK",
    "Counter",
    "Header",
    "Layout",
    "key_meta",
    "needle_of",
]

IndexBuffer = mmap.mmap | bytearray  # a mapped index segment, or a private copy of one (snapshots)

MAGIC: Final = b"SHMCIDX\x01"
LAYOUT_VERSION: Final = 6
NODE_LOCK: Final = 0  # the node lock's index in the lock table (stripe s: 1 + s)
LOCK_SIZE: Final = 64


class Counter(enum.IntEnum):
    """Node-wide counters, in their order in every client record (stats() names them in lower case)."""

    HITS_PROCESS = 0
    HITS_NODE = enum.auto()
    MISSES = enum.auto()
    COMPUTES = enum.auto()
    COALESCED_WAITS = enum.auto()
    TAKEOVERS = enum.auto()
    EVICTIONS_LRU = enum.auto()
    EVICTIONS_TTL = enum.auto()
    PUTS = enum.auto()
    BYTES_PUT = enum.auto()
    UNCACHEABLE = enum.auto()
    COMPUTE_FAILURES = enum.auto()
    TIMEOUTS = enum.auto()
    CORRUPT_RECORDS = enum.auto()
    REPAIRS = enum.auto()
    REAPED_CLIENTS = enum.auto()
    HITS_REMOTE = enum.auto()
    REMOTE_PUBLISHES = enum.auto()
    REMOTE_PUBLISH_DROPS = enum.auto()
    REMOTE_ERRORS = enum.auto()
    REMOTE_REJECTED = enum.auto()
    REMOTE_OUTAGES = enum.auto()
    REMOTE_SET_ASIDE = enum.auto()  # pulls whose transfer failed into node memory (set aside)
    GPU_EXPORTS = enum.auto()
    GPU_EXPORT_SKIPS = enum.auto()
    GPU_HITS_ALIAS = enum.auto()
    GPU_HITS_PEER = enum.auto()
    GPU_HITS_HOST_COPY = enum.auto()
    GPU_DEAD_EXPORTER = enum.auto()

    @property
    def label(self) -> str:
        """The counter's name in stats() and metrics."""
        return self.name.lower()


N_COUNTERS: Final = len(Counter)

# ---------------------------------------------------------------------------------------- header
HEADER_SIZE: Final = 4096
_HEADER: Final = struct.Struct("<8sIIIIIIQiIddIIiIi")
H_READY: Final = 12  # u32, set to 1 when every object of the namespace exists, DESTROYED once removed
DESTROYED: Final = 2
H_NODE_HELD: Final = 68  # u32, the node lock's held marker
H_JOURNAL_ROW: Final = 72  # i32, the client row being retired, -1 when none
H_RETIRE_SEQ: Final = 88  # u64, odd while a retire folds a client's counters in (native.c, point 8)
H_RETIRED: Final = 128  # u64 x N_COUNTERS: counters of clients that left
H_JOURNAL: Final = H_RETIRED + 8 * N_COUNTERS  # u64 x N_COUNTERS: the retired totals before a retire
assert _HEADER.size <= H_RETIRE_SEQ and H_RETIRE_SEQ + 8 <= H_RETIRED
assert H_JOURNAL + 8 * N_COUNTERS <= HEADER_SIZE


@dataclass(frozen=True)
class Header:
    """The index header. `Header.read` is the only decoder of these bytes."""

    magic: bytes
    layout_version: int
    ready: int
    stripes: int
    ways: int
    clients: int
    pins: int
    capacity: int
    semid: int  # -1 until the set exists (its creator writes every other field first)
    signature: int
    ttl: float  # 0.0: no TTL
    created: float
    algorithm: int  # index into keys.HASH_ALGORITHMS
    node_held: int
    journal_row: int
    mode: int
    semkey: int  # the key the semaphore set is made under, written before it is made

    @classmethod
    def read(cls, buf: IndexBuffer | bytes) -> Header:
        """Decode the header of `buf` (an index mapping); `CorruptSegment` if it is too short or its
        magic is not ours."""
        if len(buf) < HEADER_SIZE:
            raise CorruptSegment("index segment is shorter than its header")
        header = cls(*_HEADER.unpack_from(buf, 0))
        if header.magic != MAGIC:
            raise CorruptSegment(f"index segment has bad magic {header.magic!r}")
        return header

    def pack(self) -> bytes:
        return _HEADER.pack(*astuple(self))

    @property
    def layout(self) -> Layout:
        return Layout(self.stripes, self.ways, self.clients, self.pins)


# ---------------------------------------------------------------------------------------- slots
STRIPE_SIZE: Final = 8
SLOT_RECORD: Final = struct.Struct("<IiQQQdI")  # state, owner, gen, offset, size, sealed_at, refcount
SLOT_SIZE: Final = 80
S_CRC: Final = SLOT_RECORD.size  # u32: crc of the record and its key (see slots.py)
S_LAST_ACCESS: Final = 48  # f64, written without a lock (approximate LRU), outside the crc
S_FAILURE: Final = 56  # gen u64, kind u32 of the slot's last failed reservation
FAILURE: Final = struct.Struct("<QI")
S_META: Final = 68  # modality u8, key kind u8: informational, for inspection
META: Final = struct.Struct("<BB")
assert S_CRC == 44 and S_LAST_ACCESS >= S_CRC + 4 and S_FAILURE + FAILURE.size <= S_META
assert S_META + META.size <= SLOT_SIZE
KEY_SIZE: Final = RECORD_SIZE  # a key record (EmbeddingCacheKey.record)
KEY_HEAD: Final = RECORD_HEAD  # algorithm, digest length
KEY_DIGEST: Final = RECORD_HEAD.size  # the digest's offset in a key record
assert KEY_SIZE == 48
ERROR_SIZE: Final = 128
ATTACHMENT_SIZE: Final = 192

SLOT_DTYPE: Final = np.dtype(
    {
        "names": ["state", "owner", "gen", "offset", "size", "sealed_at", "refcount", "last_access"],
        "formats": ["<u4", "<i4", "<u8", "<u8", "<u8", "<f8", "<u4", "<f8"],
        "offsets": [0, 4, 8, 16, 24, 32, 40, S_LAST_ACCESS],
        "itemsize": SLOT_SIZE,
    }
)


def needle_of(key: EmbeddingCacheKey) -> bytes:
    """The 48-byte key record that identifies `key` in the key table (made once per key)."""
    return key.record


def key_meta(key: EmbeddingCacheKey) -> tuple[int, int]:
    """The (modality, key kind) bytes kept beside a slot record, for inspection."""
    return MODALITIES.index(key.modality), KEY_KINDS.index(key.kind)


# ---------------------------------------------------------------------------------------- clients
CLIENT_HEAD: Final = struct.Struct("<IIQd")  # state (1: claimed), pid, start ticks, attached at (wall)
CLIENT_HEAD_SIZE: Final = 512
C_COUNTERS: Final = 64
PIN: Final = struct.Struct("<iIQ")  # slot, count, gen
PIN_DTYPE: Final = np.dtype([("slot", "<i4"), ("count", "<u4"), ("gen", "<u8")])
assert C_COUNTERS + 8 * N_COUNTERS <= CLIENT_HEAD_SIZE and PIN_DTYPE.itemsize == PIN.size

# native.c repeats the offsets it needs; they must be these
assert (_native.SLOT_SIZE, _native.S_CRC, _native.S_LAST_ACCESS) == (SLOT_SIZE, S_CRC, S_LAST_ACCESS)
assert (_native.KEY_SIZE, _native.STRIPE_SIZE, _native.LOCK_SIZE) == (KEY_SIZE, STRIPE_SIZE, LOCK_SIZE)
assert (ATTACHMENT_SIZE, PIN.size) == (_native.ATTACHMENT_SIZE, _native.PIN_SIZE)
assert (_native.CLIENT_HEAD_SIZE, _native.C_COUNTERS) == (CLIENT_HEAD_SIZE, C_COUNTERS)
assert (_native.COUNTER_EVICTIONS_TTL, _native.COUNTER_EVICTIONS_LRU, _native.COUNTER_TAKEOVERS) == (
    Counter.EVICTIONS_TTL,
    Counter.EVICTIONS_LRU,
    Counter.TAKEOVERS,
)
assert _native.S_META == S_META
assert (_native.COUNTER_HITS_PROCESS, _native.COUNTER_HITS_NODE, _native.COUNTER_MISSES) == (
    Counter.HITS_PROCESS,
    Counter.HITS_NODE,
    Counter.MISSES,
)
assert (_native.H_READY, _native.DESTROYED, _native.H_RETIRE_SEQ) == (H_READY, DESTROYED, H_RETIRE_SEQ)


@dataclass(frozen=True)
class Layout:
    """Offsets of every table, and indices of every lock and semaphore, for given sizes."""

    stripes: int
    ways: int
    clients: int
    pins: int

    @cached_property
    def slots(self) -> int:
        return self.stripes * self.ways

    @cached_property
    def locks_off(self) -> int:
        return HEADER_SIZE

    @cached_property
    def stripes_off(self) -> int:
        return _align(self.locks_off + LOCK_SIZE * (1 + self.stripes))

    @cached_property
    def slots_off(self) -> int:
        return _align(self.stripes_off + STRIPE_SIZE * self.stripes)

    @cached_property
    def keys_off(self) -> int:
        return self.slots_off + SLOT_SIZE * self.slots

    @cached_property
    def errors_off(self) -> int:
        return self.keys_off + KEY_SIZE * self.slots

    @cached_property
    def attachments_off(self) -> int:
        return _align(self.errors_off + ERROR_SIZE * self.slots)

    @cached_property
    def client_size(self) -> int:
        return CLIENT_HEAD_SIZE + PIN.size * self.pins

    @cached_property
    def clients_off(self) -> int:
        return _align(self.attachments_off + ATTACHMENT_SIZE * self.slots)

    @cached_property
    def size(self) -> int:
        return _align(self.clients_off + self.client_size * self.clients, 4096)

    def stripe_lock(self, stripe: int) -> int:
        return 1 + stripe

    def slot_sem(self, slot: int) -> int:
        return slot

    def client_sem(self, client: int) -> int:
        return self.slots + client

    @cached_property
    def signature_sem(self) -> int:
        return self.slots + self.clients

    @cached_property
    def semaphores(self) -> int:
        return self.signature_sem + 2

    def stripe_off(self, stripe: int) -> int:
        return self.stripes_off + STRIPE_SIZE * stripe

    def slot_off(self, slot: int) -> int:
        return self.slots_off + SLOT_SIZE * slot

    def key_off(self, slot: int) -> int:
        return self.keys_off + KEY_SIZE * slot

    def error_off(self, slot: int) -> int:
        return self.errors_off + ERROR_SIZE * slot

    def attachment_off(self, slot: int) -> int:
        return self.attachments_off + ATTACHMENT_SIZE * slot

    def client_off(self, client: int) -> int:
        return self.clients_off + self.client_size * client

    def pin_off(self, client: int, pin: int) -> int:
        return self.client_off(client) + CLIENT_HEAD_SIZE + PIN.size * pin

    def init_locks(self, buf: IndexBuffer) -> None:
        """Make the lock table's mutexes in a new index (before it is marked ready)."""
        _native.init_locks(buf, self.locks_off, 1 + self.stripes)

    def native(
        self,
        buf: IndexBuffer,
        ttl: float | None,
        lock_timeout: float,
        sealed: type[tuple[Any, ...]],
        semid: int = -1,
    ) -> _native.Index:
        """The native handle (native.c) on the index mapped at `buf`, for these sizes; its hits are
        `sealed` (slots.SealedEntry); `semid`: the namespace's semaphore set, which its claims
        take (-1: none, for a read-only look)."""
        return _native.Index(
            buffer=buf,
            locks_off=self.locks_off,
            stripes=self.stripes,
            ways=self.ways,
            clients=self.clients,
            pins=self.pins,
            stripes_off=self.stripes_off,
            slots_off=self.slots_off,
            keys_off=self.keys_off,
            attachments_off=self.attachments_off,
            clients_off=self.clients_off,
            client_size=self.client_size,
            ttl=ttl or 0.0,
            lock_timeout=lock_timeout,
            sealed=sealed,
            semid=semid,
        )


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to
