"""A stored entry: a 64-byte entry header that binds the bytes to their key, then the encoded value.

Entry header (little endian): magic "SHME", algorithm u8, flags u8, pad u16, value length u64,
generation u64, checksum u64 (xxh3-64 of the value, 0 when not computed), key digest 32 B.
The node layer and the remote layer store exactly this; readers verify magic, length and digest
before they decode, so a torn, stale or foreign entry is never returned as data.
"""

from __future__ import annotations

import struct
from typing import Final

import xxhash

from shmcache.errors import CorruptValue
from shmcache.format.values import EncodedValue
from shmcache.keys.key import HASH_ALGORITHMS, EmbeddingCacheKey

__all__ = ["ENTRY_HEADER_SIZE", "entry_size", "verify", "write_entry"]

ENTRY_MAGIC: Final = b"SHME"
ENTRY: Final = struct.Struct("<4sBBHQQQ32s")
ENTRY_HEADER_SIZE: Final = 64
FLAG_CHECKSUM: Final = 1


def entry_size(encoded: EncodedValue) -> int:
    """Bytes an entry of `encoded` occupies."""
    return ENTRY_HEADER_SIZE + encoded.total_len


def write_entry(
    buffer: memoryview, key: EmbeddingCacheKey, gen: int, encoded: EncodedValue, *, checksum: bool
) -> None:
    """Write the value first, then its header (one copy of the payload)."""
    body = buffer[ENTRY_HEADER_SIZE : ENTRY_HEADER_SIZE + encoded.total_len]
    encoded.write_into(body)
    digest = xxhash.xxh3_64_intdigest(body) if checksum else 0
    ENTRY.pack_into(
        buffer,
        0,
        ENTRY_MAGIC,
        HASH_ALGORITHMS.index(key.algorithm),
        FLAG_CHECKSUM if checksum else 0,
        0,
        encoded.total_len,
        gen,
        digest,
        key.digest.ljust(32, b"\0"),
    )


def verify(buffer: memoryview, key: EmbeddingCacheKey, gen: int | None) -> memoryview:
    """Check the header against `key` (and `gen` if given); return the value bytes.

    Raises `CorruptValue` naming what did not match.
    """
    if buffer.nbytes < ENTRY_HEADER_SIZE:
        raise CorruptValue("entry shorter than its header")
    magic, algo, _flags, _pad, length, stored_gen, _checksum, digest = ENTRY.unpack_from(buffer, 0)
    if magic != ENTRY_MAGIC:
        raise CorruptValue(f"bad entry magic {bytes(magic)!r}")
    if algo >= len(HASH_ALGORITHMS) or HASH_ALGORITHMS[algo] != key.algorithm:
        raise CorruptValue("entry was stored under another hash algorithm")
    if digest != key.digest.ljust(32, b"\0"):
        raise CorruptValue("entry belongs to another key")
    if gen is not None and stored_gen != gen:
        raise CorruptValue(f"entry generation {stored_gen} is not the expected {gen}")
    if ENTRY_HEADER_SIZE + length > buffer.nbytes:
        raise CorruptValue(f"entry truncated: {length} value bytes announced, {buffer.nbytes - 64} present")
    return buffer[ENTRY_HEADER_SIZE : ENTRY_HEADER_SIZE + length]


def set_generation(buffer: memoryview, gen: int) -> None:
    """Rewrite an entry header's generation (an entry pulled from another node gets ours)."""
    struct.pack_into("<Q", buffer, 16, gen)


def checksum_matches(buffer: memoryview) -> bool:
    """True if the entry has no checksum or its value still matches it."""
    _m, _a, flags, _p, length, _g, checksum, _d = ENTRY.unpack_from(buffer, 0)
    if not flags & FLAG_CHECKSUM:
        return True
    body = buffer[ENTRY_HEADER_SIZE : ENTRY_HEADER_SIZE + length]
    return bool(xxhash.xxh3_64_intdigest(body) == checksum)
