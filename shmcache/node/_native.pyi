"""Type stub of the node layer's C extension (native.c has the protocol and the docs)."""

from typing import Final

class Slow:
    """The type of SLOW: take the locked Python path (a stripe needs a repair, a record is damaged)."""

SLOW: Final[Slow]
SLOT_SIZE: Final[int]
S_CRC: Final[int]
S_LAST_ACCESS: Final[int]
KEY_SIZE: Final[int]
STRIPE_SIZE: Final[int]
CLIENT_HEAD_SIZE: Final[int]
C_COUNTERS: Final[int]
PIN_SIZE: Final[int]
ATTACHMENT_SIZE: Final[int]
COUNTER_EVICTIONS_TTL: Final[int]

Hit = tuple[int, int, int, int, bytes | None]  # slot, gen, offset, size, attachment
RawRecord = tuple[int, int, int, int, int, float, int, bool]  # the record's fields, crc ok

class Index:
    def __init__(
        self,
        *,
        buffer: object,
        semid: int,
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
    ) -> None: ...
    def lookup(self, needle: bytes, pins: int, /) -> Hit | Slow | None: ...
    def lookup_many(self, needles: list[bytes], pins: int, /) -> list[Hit | Slow | None]: ...
    def hit_in(self, stripe: int, needle: bytes, now: float, pins: int, /) -> Hit | int | None: ...
    def contains(self, needle: bytes, /) -> bool | Slow: ...
    def contains_many(self, needles: list[bytes], /) -> list[bool | Slow]: ...
    def release(self, pins: list[tuple[int, int, int]], /) -> list[tuple[int, int, int]]: ...
    def unpin_in(self, slot: int, gen: int, count: int, /) -> bool: ...
    def repeat_hit(self, slot: int, gen: int, /) -> bool: ...
    def touch(self, slot: int, now: float, /) -> None: ...
    def expired(self, slot: int, now: float, /) -> bool: ...
    def enter(self, sem: int, held_off: int, what: str, /) -> bool: ...
    def leave(self, sem: int, held_off: int, clean: bool, /) -> None: ...
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
        /,
    ) -> None: ...
    def bind(self, row: int, /) -> None: ...
    def pin_add(self, slot: int, gen: int, count: int, /) -> None: ...
    def pin_remove(self, slot: int, gen: int, count: int, /) -> int: ...
    def pins_held(self) -> dict[tuple[int, int], int]: ...
    def pins_spare(self) -> int: ...
    def count(self, counter: int, n: int, /) -> None: ...

def arm(point: str | None, /) -> None: ...
