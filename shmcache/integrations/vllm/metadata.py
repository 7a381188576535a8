"""The metadata the scheduler side sends the worker side each step (pickled across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

from shmcache.keys.key import EmbeddingCacheKey
from shmcache.process.reservation import ReservationTicket

__all__ = ["LoadItem", "SaveItem", "ShmCacheECMetadata"]


@dataclass(frozen=True)
class LoadItem:
    """An item the worker loads from the node instead of running the encoder."""

    identifier: str
    key: EmbeddingCacheKey


@dataclass(frozen=True)
class SaveItem:
    """An item the worker computes: under the reservation the scheduler hands it (`ticket`), or
    without one (stored first-writer-wins)."""

    identifier: str
    key: EmbeddingCacheKey
    ticket: ReservationTicket | None


@dataclass
class ShmCacheECMetadata(ECConnectorMetadata):
    """One step's loads and saves."""

    loads: list[LoadItem] = field(default_factory=list)
    saves: list[SaveItem] = field(default_factory=list)
