"""This process's live mappings of entries: the record a delivery leaves, and the table of them.

Per process there is one live mapping per entry: a holder array made straight from the arena
mapping (every returned array derives from it, so its mapping is given back only after the last
view dies, and then enqueues the release of the view pin) and the parsed value format. A repeat
hit of the same key reuses it without a lock after a lock-free check that (slot, gen) is still
sealed and unexpired (`repeats.py`). After the views of an entry died, the parsed head stays:
delivering that very entry (slot, gen) again skips the head check and the parse. The newest
`REMEMBERED` such dead mappings are kept (live ones always), so a process that sees ever new keys
holds bounded memory.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Final, NamedTuple

import numpy as np

from shmcache.format import decode, entry
from shmcache.format.values import Value
from shmcache.gpu.record import GpuRecord
from shmcache.gpu.side import DeviceSide
from shmcache.node.slots import SealedEntry

__all__ = ["REMEMBERED", "Mapping", "Mappings", "made_in_python"]

REMEMBERED: Final = 4096  # dead views' mappings a process remembers (newest first) for re-delivery


class Mapping(NamedTuple):
    """This process's live zero-copy mapping of one entry and the value returned over it, which
    repeat hits alias while it is alive and unchanged (a NamedTuple: made on every delivery, by
    position in `arrays.c`'s `deliver` for a one-array value)."""

    sealed: SealedEntry  # the entry whose head was parsed: (slot, gen) and where it lies in the arena
    holder: weakref.ref[np.ndarray]  # the entry's bytes; alive while any returned view is
    parsed: decode.ParsedValue
    template: weakref.ref[Any] | None  # the value returned; None: never aliased (`decode.aliasing`)
    signature: tuple[Any, ...]  # the template's signature when it was returned
    aliasing: decode.Aliasing | None  # how to check the template again and alias it
    aliases: GpuRecord | None  # the template aliases this exporter's device memory


class Mappings:
    """The newest delivery's `Mapping` of each needle in this process: read without a lock
    (`local`, a dict), changed under a lock (`keep`, `forget`)."""

    def __init__(self) -> None:
        self.local: dict[bytes, Mapping] = {}
        self._lock = threading.Lock()
        self._bound = REMEMBERED  # `local`'s size that makes `keep` forget dead mappings

    def keep(self, kept: dict[bytes, Mapping]) -> None:
        """Remember each delivered view's mapping as the newest of its needle. Past the bound, the
        oldest dead mappings go down to `REMEMBERED`, and the next sweep waits until twice as many
        are held (each sweep is paid for by the deliveries since the last)."""
        with self._lock:
            local = self.local
            for needle, mapping in kept.items():
                local.pop(needle, None)  # to the end: dicts keep insertion order
                local[needle] = mapping
            if len(local) > self._bound:
                excess = len(local) - REMEMBERED
                for old in [n for n, m in local.items() if m.holder() is None][:excess]:
                    del local[old]
                self._bound = max(REMEMBERED, 2 * len(local))

    def forget(self, needle: bytes | None = None) -> None:
        """Drop the mapping of `needle` (a written view's), or every mapping (detach)."""
        with self._lock:
            if needle is None:
                self.local.clear()
            else:
                self.local.pop(needle, None)


def made_in_python(
    device: DeviceSide, clone: bool, holder: np.ndarray, sealed: SealedEntry, parsed: decode.ParsedValue
) -> tuple[Value, Mapping | None]:
    """`Views._build` of a value not delivered in one native call (`arrays.c`): any value in
    clone mode (a copy: no record), a value of several arrays or one born on a GPU."""
    on_device = device.materialize(holder, sealed, parsed, copy=clone) if parsed.on_device else None
    value, aliased = on_device or (decode.materialize(holder, parsed, clone, entry.ENTRY_HEADER_SIZE), False)
    if clone:
        return value, None
    ops = decode.aliasing(value)
    template, signature = (None, ()) if ops is None else (weakref.ref(value), ops.signature(value))
    record = GpuRecord.from_attachment(sealed.attachment) if aliased else None
    return value, Mapping(sealed, weakref.ref(holder), parsed, template, signature, ops, record)
