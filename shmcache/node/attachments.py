"""Attachments: one opaque record per slot that a layer above keeps with an entry.

The node layer stores, returns and stamps them, and knows nothing of their contents (the GPU layer
keeps its CUDA IPC record here). The first 8 bytes of a record are the generation of the entry it
belongs to, so a record of an earlier generation of the slot is never taken for the current one.
Writes happen inside the slot's stripe section (at seal, or through `NodeIndex.update_attachment`).
"""

from __future__ import annotations

import struct
from typing import Final

import numpy as np

from shmcache.node.layout import ATTACHMENT_SIZE, IndexBuffer, Layout

__all__ = ["AttachmentTable"]

_GEN: Final = struct.Struct("<Q")


class AttachmentTable:
    """The attachment records of one mapped index."""

    def __init__(self, idx: memoryview, layout: Layout, buf: IndexBuffer) -> None:
        self._idx, self._layout, self._buf = idx, layout, buf

    def get(self, slot: int, gen: int) -> bytes | None:
        """The record of entry (slot, gen), None if it has none."""
        off = self._layout.attachment_off(slot)
        if _GEN.unpack_from(self._idx, off)[0] != gen or gen == 0:
            return None
        return bytes(self._idx[off : off + ATTACHMENT_SIZE])

    def put(self, slot: int, record: bytes) -> None:
        """Store `record` (its first 8 bytes: its entry's generation) in one copy."""
        if len(record) != ATTACHMENT_SIZE:
            raise ValueError(f"an attachment is {ATTACHMENT_SIZE} bytes, got {len(record)}")
        off = self._layout.attachment_off(slot)
        self._idx[off : off + ATTACHMENT_SIZE] = record

    def table(self, dtype: np.dtype) -> np.ndarray:
        """Every record as one array of `dtype` (a prefix of the record), read without a lock."""
        table: np.ndarray = np.ndarray(
            (self._layout.slots,),
            dtype,
            buffer=self._buf,
            offset=self._layout.attachments_off,
            strides=(ATTACHMENT_SIZE,),
        )
        return table
