"""The GPU record: where the device copy of a GPU entry lives, kept as the entry's attachment.

The producing process seals a GPU entry with a `GpuRecord`: the IPC handle of its device buffer's
allocation, the buffer's offset inside it, and the exporter's identity. The node layer stores the
packed record as an opaque attachment (`shmcache.node.attachments`) whose first 8 bytes are the
entry's generation; this module is the only one that decodes it.

Record bytes (little-endian, `ATTACHMENT_SIZE` in all): gen u64, exporter row i32, exporter pid
u32, exporter start ticks u64, exporter's device ordinal i32, flags u32 (1: withdrawn), offset of
the buffer in its allocation u64, buffer bytes u64, device uuid 16 B, IPC handle 64 B, crc32 u32 of
the preceding 128 bytes, then zeros.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

import numpy as np

from shmcache.node.clients import ClientIdentity
from shmcache.node.layout import ATTACHMENT_SIZE

if TYPE_CHECKING:
    from shmcache.node.attachments import AttachmentTable
    from shmcache.node.index import NodeIndex
    from shmcache.node.slots import SlotTable

__all__ = [
    "GPU_HEAD_DTYPE",
    "GPU_RECORD_SIZE",
    "GpuRecord",
    "live_mask",
    "withdraw_record",
]

_RECORD: Final = struct.Struct("<QiIQiIQQ16s64s")
_CRC: Final = struct.Struct("<I")
GPU_RECORD_SIZE: Final = _RECORD.size + _CRC.size  # the meaningful bytes; `pack` pads them
GPU_HEAD_DTYPE: Final = np.dtype({"names": ["gen", "flags"], "formats": ["<u8", "<u4"], "offsets": [0, 28]})
_WITHDRAWN: Final = 1
_PADDING: Final = bytes(ATTACHMENT_SIZE - GPU_RECORD_SIZE)
assert GPU_RECORD_SIZE <= ATTACHMENT_SIZE


@dataclass(frozen=True)
class GpuRecord:
    """Where the device copy of entry `gen` lives: exported by `exporter` on the device `device_uuid`,
    at `offset` bytes into the allocation that `handle` opens, `nbytes` long."""

    gen: int
    exporter: ClientIdentity
    device_ordinal: int  # in the exporter's numbering (diagnostics: ordinals differ across processes)
    offset: int
    nbytes: int
    device_uuid: bytes
    handle: bytes
    withdrawn: bool = False

    def pack(self) -> bytes:
        """The attachment bytes: the record, its crc, zero padding to `ATTACHMENT_SIZE`."""
        body = _RECORD.pack(
            self.gen,
            self.exporter.row,
            self.exporter.pid,
            self.exporter.start_ticks,
            self.device_ordinal,
            _WITHDRAWN if self.withdrawn else 0,
            self.offset,
            self.nbytes,
            self.device_uuid,
            self.handle,
        )
        return body + _CRC.pack(zlib.crc32(body)) + _PADDING

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> GpuRecord | None:
        """The record in `raw`, or None if it is short or fails its crc (torn or never written)."""
        if len(raw) < GPU_RECORD_SIZE:
            return None
        body = bytes(raw[: _RECORD.size])
        if _CRC.unpack_from(raw, _RECORD.size)[0] != zlib.crc32(body):
            return None
        gen, row, pid, ticks, ordinal, flags, offset, nbytes, uuid, handle = _RECORD.unpack(body)
        exporter = ClientIdentity(row, pid, ticks)
        return cls(gen, exporter, ordinal, offset, nbytes, uuid, handle, bool(flags & _WITHDRAWN))

    @classmethod
    def from_attachment(cls, raw: bytes | None) -> GpuRecord | None:
        """The record in an entry's attachment (`NodeIndex.attachment`, `SealedEntry.attachment`);
        None if there is none, it fails its crc, or its gen is not the one the attachment is
        stamped with."""
        if raw is None:
            return None
        record = cls.unpack(raw)
        if record is None or record.gen != int.from_bytes(raw[:8], "little"):
            return None
        return record

    def withdraw(self) -> GpuRecord:
        """The same record, withdrawn: no reader opens its handle."""
        return replace(self, withdrawn=True)


def withdraw_record(node: NodeIndex, slot: int, gen: int) -> bool:
    """Mark entry (slot, gen)'s GPU record withdrawn: from now on no reader opens its handle.
    False if the entry has no GPU record (it left the index, or it never had one)."""
    withdrawn = False

    def update(raw: bytes) -> bytes:
        nonlocal withdrawn
        record = GpuRecord.from_attachment(raw)
        if record is None:
            return raw
        withdrawn = True
        return record.withdraw().pack()

    return node.update_attachment(slot, gen, update) and withdrawn


def live_mask(slots: SlotTable, attachments: AttachmentTable) -> np.ndarray:
    """Boolean array over slots: the slot's current generation has a GPU record that is not
    withdrawn (read without a lock, for statistics; the record's crc is not checked, so a damaged
    one counts here while a reader, which checks it, reads the host copy)."""
    table = attachments.table(GPU_HEAD_DTYPE)
    live: np.ndarray = (
        (table["gen"] == slots.array["gen"]) & (table["flags"] & _WITHDRAWN == 0) & (table["gen"] > 0)
    )
    return live
