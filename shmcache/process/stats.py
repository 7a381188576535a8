"""`EmbeddingCache.stats()`: node-wide counters and the occupancy of the slot table."""

from __future__ import annotations

from shmcache.gpu.record import live_mask
from shmcache.gpu.side import DeviceSide
from shmcache.node.attachments import AttachmentTable
from shmcache.node.index import NodeIndex
from shmcache.node.slots import SlotState, SlotTable

__all__ = ["node_stats", "occupancy"]


def occupancy(slots: SlotTable, attachments: AttachmentTable) -> dict[str, int]:
    """What the slot table holds: sealed entries and their bytes, those of them with a device copy
    not withdrawn, reservations, stale entries and references (read without locks)."""
    table = slots.array
    sealed = table["state"] == SlotState.SEALED
    on_gpu = sealed & live_mask(slots, attachments)
    return {
        "entries": int(sealed.sum()),
        "bytes": int(table["size"][sealed].sum()),
        "gpu_entries": int(on_gpu.sum()),
        "gpu_bytes": int(table["size"][on_gpu].sum()),
        "reserved": int((table["state"] == SlotState.RESERVED).sum()),
        "stale": int((table["state"] == SlotState.STALE).sum()),
        "references": int(table["refcount"].sum()),
    }


def node_stats(node: NodeIndex, device: DeviceSide) -> dict[str, int]:
    """Counters summed over every process of the node, and what the namespace holds right now
    (read without locks: each figure is exact for some instant, not all for the same one)."""
    totals = node.totals()
    totals.update(occupancy(node.slots, node.attachments))
    totals.update(
        gpu_exported_bytes=device.exports.nbytes,
        capacity_bytes=node.capacity,
        max_entries=node.layout.slots,
        clients=int(node.clients.live().sum()),
    )
    return totals
