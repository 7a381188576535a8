"""Unambiguous ("framed") serialization of key fields for hashing.

Every item is written as a one-byte type tag, then its length, then its bytes. Tuples carry their
element count and frame every element, so ("ab", "c") and ("a", "bc"), "" and None, (1, (2,)) and
(1, 2), or 1 and True and 1.0 can never serialize to the same bytes (the bug of vllm#54283).
What cannot be framed is a typed error: `InvalidKey` for NaN and text with lone surrogates,
`KeyTypeError` for a value of another type.
"""

from __future__ import annotations

import math
import struct

from shmcache.errors import InvalidKey, KeyTypeError
from shmcache.keys.text import utf8

__all__ = ["Frameable", "frame"]

Frameable = None | bool | int | float | str | bytes | tuple["Frameable", ...]

_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR, _BYTES, _TUPLE = (bytes([i]) for i in range(1, 9))
_LEN = struct.Struct("<Q")
_F64 = struct.Struct("<d")


def frame(value: Frameable) -> bytes:
    """Return the framed bytes of `value` (None, bool, int, float, str, bytes or nested tuples)."""
    out: list[bytes] = []
    _frame_into(value, out)
    return b"".join(out)


def _frame_into(value: Frameable, out: list[bytes]) -> None:
    if value is None:
        out.append(_NONE)
    elif value is True:
        out.append(_TRUE)
    elif value is False:
        out.append(_FALSE)
    elif isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        out += (_INT, _LEN.pack(len(raw)), raw)
    elif isinstance(value, float):
        if math.isnan(value):
            raise InvalidKey("NaN cannot be part of a key: it never compares equal to itself")
        out += (_FLOAT, _F64.pack(value))
    elif isinstance(value, str):
        raw = utf8(value, "a key string", InvalidKey)
        out += (_STR, _LEN.pack(len(raw)), raw)
    elif isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        out += (_BYTES, _LEN.pack(len(raw)), raw)
    elif isinstance(value, tuple):
        out += (_TUPLE, _LEN.pack(len(value)))
        for item in value:
            _frame_into(item, out)
    else:
        raise KeyTypeError(f"cannot frame a value of type {type(value).__name__}")
