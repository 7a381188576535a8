"""The worker side of the connector: fill vLLM's encoder cache from the node, and store what the
encoder computed (under the reservation the scheduler handed over, or first-writer-wins)."""

from __future__ import annotations

from typing import Any

import torch

from shmcache.integrations.vllm.metadata import SaveItem, ShmCacheECMetadata
from shmcache.process.cache import EmbeddingCache

__all__ = ["WorkerSide"]


class WorkerSide:
    """Worker-side state of one engine's connector."""

    def __init__(self, cache: EmbeddingCache, device: str) -> None:
        self._cache, self._device = cache, device

    def load(self, metadata: ShmCacheECMetadata, encoder_cache: dict[str, torch.Tensor]) -> list[str]:
        """Put every planned load into `encoder_cache` (zero-copy on CPU); the identifiers that
        could not be loaded."""
        missing = []
        for item in metadata.loads:
            if item.identifier in encoder_cache:
                continue
            value = self._cache.get(item.key)
            if not isinstance(value, torch.Tensor):
                missing.append(item.identifier)
                continue
            encoder_cache[item.identifier] = value if self._device == "cpu" else value.to(self._device)
        return missing

    def save(
        self, metadata: ShmCacheECMetadata | None, encoder_cache: dict[str, Any], identifier: str
    ) -> None:
        """Store the encoder output of `identifier`: commit the handed-over reservation, or put."""
        item = self._planned(metadata, identifier)
        if item is None:
            return  # not planned by our scheduler side (cannot happen while both sides run)
        value = encoder_cache[identifier].detach()
        res = None if item.ticket is None else self._cache.adopt(item.ticket, item.key)
        if res is not None:
            res.commit(value, view=False)
        else:
            self._cache.put(item.key, value)

    @staticmethod
    def _planned(metadata: ShmCacheECMetadata | None, identifier: str) -> SaveItem | None:
        if metadata is None:
            return None
        return next((item for item in metadata.saves if item.identifier == identifier), None)
