"""`EmbeddingCache.stats()`: node-wide counters and the occupancy of the slot table."""

from __future__ import annotations

from shmcache.gpu.record import live_mask
from shmcache.gpu.side import DeviceSide
from shmcache.node.index import NodeIndex
from shmcache.node.slots import SlotState

__all__ = ["node_stats"]


def node_stats(node: NodeIndex, device: DeviceSide) -> dict[str, int]:
    """Counters summed over every process of the node, and what the namespace holds right now
    (read without locks: each figure is exact for some instant, not all for the same one)."""
    totals = node.totals()
    slots = node.slots.array
    sealed = slots["state"] == SlotState.SEALED
    on_gpu = sealed & live_mask(node)
    totals.update(
        entries=int(sealed.sum()),
        bytes=int(slots["size"][sealed].sum()),
        gpu_entries=int(on_gpu.sum()),
        gpu_bytes=int(slots["size"][on_gpu].sum()),
        gpu_exported_bytes=device.exports.nbytes,
        reserved=int((slots["state"] == SlotState.RESERVED).sum()),
        stale=int((slots["state"] == SlotState.STALE).sum()),
        references=int(slots["refcount"].sum()),
        capacity_bytes=node.capacity,
        max_entries=node.layout.slots,
        clients=int(node.clients.live().sum()),
    )
    return totals
