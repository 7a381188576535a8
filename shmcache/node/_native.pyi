"""Type stub of the node layer's C extension (native.c has the protocol and the docs)."""

from typing import Any, Final

from shmcache.node.slots import SealedEntry

class Slow:
    """The type of SLOW: take the locked Python path (a stripe needs a repair, a record is damaged)."""

SLOW: Final[Slow]
SLOT_SIZE: Final[int]
S_CRC: Final[int]
S_LAST_ACCESS: Final[int]
KEY_SIZE: Final[int]
STRIPE_SIZE: Final[int]
LOCK_SIZE: Final[int]
H_READY: Final[int]
H_RETIRE_SEQ: Final[int]
DESTROYED: Final[int]
CLIENT_HEAD_SIZE: Final[int]
C_COUNTERS: Final[int]
PIN_SIZE: Final[int]
ATTACHMENT_SIZE: Final[int]
COUNTER_HITS_PROCESS: Final[int]
COUNTER_HITS_NODE: Final[int]
COUNTER_MISSES: Final[int]
COUNTER_EVICTIONS_TTL: Final[int]
COUNTER_EVICTIONS_LRU: Final[int]
COUNTER_TAKEOVERS: Final[int]
S_META: Final[int]
CLAIM_OWNER: Final[int]
CLAIM_TAKEOVER: Final[int]
CLAIM_WAIT: Final[int]
CLAIM_FULL: Final[int]

RawRecord = tuple[int, int, int, int, int, float, int, bool]  # the record's fields, crc ok
RawClaim = tuple[int, int, int]  # (CLAIM_* kind, slot, gen): reservations.Claim's fields

class Index:
    def __init__(
        self,
        *,
        buffer: object,
        locks_off: int,
        stripes: int,
        ways: int,
        clients: int,
        pins: int,
        stripes_off: int,
        slots_off: int,
        keys_off: int,
        attachments_off: int,
        clients_off: int,
        client_size: int,
        ttl: float,
        lock_timeout: float,
        sealed: type[tuple[Any, ...]],
        semid: int = -1,
    ) -> None: ...
    def lookup(self, needle: bytes, pins: int, counted: bool, /) -> SealedEntry | Slow | None: ...
    def lookup_many(
        self, needles: list[bytes], pins: int, counted: bool, /
    ) -> list[SealedEntry | Slow | None]: ...
    def hit_in(self, stripe: int, needle: bytes, now: float, pins: int, /) -> SealedEntry | int | None: ...
    def reserve(
        self, needle: bytes, modality: int, kind: int, pins: int, /
    ) -> SealedEntry | RawClaim | Slow: ...
    def claim_in(
        self, stripe: int, needle: bytes, modality: int, kind: int, now: float, /
    ) -> RawClaim | int: ...
    def seal(
        self, slot: int, gen: int, pins: int, attachment: bytes | None, /
    ) -> SealedEntry | Slow | None: ...
    def seal_in(
        self, slot: int, gen: int, pins: int, attachment: bytes | None, now: float, /
    ) -> SealedEntry | int | None: ...
    def contains(self, needle: bytes, /) -> bool | Slow: ...
    def contains_many(self, needles: list[bytes], /) -> list[bool | Slow]: ...
    def release(self, pins: list[tuple[int, int, int]], /) -> list[tuple[int, int, int]]: ...
    def unpin_in(self, slot: int, gen: int, count: int, /) -> bool: ...
    def repeat_hit(self, slot: int, gen: int, counted: bool, /) -> bool: ...
    def touch(self, slot: int, now: float, /) -> None: ...
    def expired(self, slot: int, now: float, /) -> bool: ...
    def enter(self, lock: int, held_off: int, what: str, /) -> bool: ...
    def leave(self, lock: int, held_off: int, clean: bool, /) -> None: ...
    def read_record(self, slot: int, /) -> RawRecord: ...
    def write_record(
        self,
        slot: int,
        state: int,
        owner: int,
        gen: int,
        offset: int,
        size: int,
        sealed_at: float,
        refs: int,
        needle: bytes | None,
        /,
    ) -> None: ...
    def bind(self, row: int, /) -> None: ...
    def retire_begin(self) -> None: ...
    def retire_end(self) -> None: ...
    def retire_seq(self, again: bool, /) -> int: ...
    def pin_add(self, slot: int, gen: int, count: int, /) -> None: ...
    def pin_remove(self, slot: int, gen: int, count: int, /) -> int: ...
    def pins_held(self) -> dict[tuple[int, int], int]: ...
    def pins_spare(self) -> int: ...
    def count(self, counter: int, n: int, /) -> None: ...
    def gap(self, need: int, capacity: int, /) -> int | None: ...
    def evictable(self, now: float, limit: int, /) -> tuple[list[int], list[int], bool]: ...

def arm(point: str | None, /) -> None: ...
def first_fit(extents: list[tuple[int, int]], need: int, capacity: int, /) -> int | None: ...
def init_locks(buffer: object, offset: int, count: int, /) -> None: ...
