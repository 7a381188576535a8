"""Encoder call sites behind the node cache: `CachedEncoder` computes each item of a batched
encoder call once per node (see docs/vllm-omni.md)."""

from shmcache.integrations.encoder.hook import CachedEncoder
from shmcache.integrations.encoder.items import BatchedItems, ItemLayout, PackedItems

__all__ = ["BatchedItems", "CachedEncoder", "ItemLayout", "PackedItems"]
