"""What else a batched encoder call passes besides its items' inputs, as a digest for their keys.

An encoder's output for an item depends on every argument of the call, not only on the item's
rows: `interpolate_pos_encoding=True`, a per-item attention mask, a scale. Each item's key
therefore covers a digest of the call's other arguments (and of the item's own rows of per-item
arguments): the same rows called otherwise are another key, never a false hit. Tensors and arrays
are digested by dtype, shape and contents; None, bools, numbers, strings and bytes by value;
dtypes, devices and enum members by their repr (which names them whole); lists, tuples and dicts
by their items. Anything else cannot be digested exactly (a repr may leave state out):
`call_context` answers None, and the hook runs such a call without the cache.
"""

from __future__ import annotations

import enum
import hashlib
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from shmcache.errors import ShmCacheError
from shmcache.keys.dtypes import tensor_bytes

__all__ = ["call_context", "opaque"]


class _Opaque(Exception):
    """A value that cannot be digested exactly."""


def call_context(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bytes | None:
    """The digest of `args` and `kwargs`: b"" when both are empty (keys as without a context),
    None when one of them cannot be digested exactly (named by `opaque`)."""
    if not args and not kwargs:
        return b""
    digest = hashlib.blake2b(digest_size=16)
    try:
        _feed(digest, (args, dict(kwargs)))
    except _Opaque:
        return None
    return digest.digest()


def opaque(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """The type name of the first argument `call_context` cannot digest ("" if none)."""
    for value in (*args, *kwargs.values()):
        try:
            _feed(hashlib.blake2b(), value)
        except _Opaque:
            return type(value).__name__
    return ""


def _named_whole(value: Any) -> bool:
    """A value its repr names whole: an enum member, a numpy dtype, a torch dtype or device."""
    if isinstance(value, enum.Enum | np.dtype):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.dtype | torch.device)


def _feed(digest: Any, value: Any) -> None:
    if value is None or isinstance(value, bool | int | float | str | bytes) or _named_whole(value):
        digest.update(f"{type(value).__qualname__}:{value!r};".encode())
    elif isinstance(value, list | tuple):
        digest.update(f"{type(value).__name__}[{len(value)}](".encode())
        for item in value:
            _feed(digest, item)
        digest.update(b")")
    elif isinstance(value, dict):
        digest.update(f"dict[{len(value)}](".encode())
        for name in sorted(value, key=repr):
            _feed(digest, name)
            _feed(digest, value[name])
        digest.update(b")")
    else:
        try:
            dtype, shape, content = tensor_bytes(value)
        except ShmCacheError:  # not a tensor or array, or one that has no raw bytes
            raise _Opaque from None
        digest.update(f"tensor:{dtype}:{shape}:".encode())
        digest.update(content)
