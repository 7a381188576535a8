"""`ShmCacheECConnector`: vLLM's encoder-cache connector over a node-wide shmcache namespace.

Both roles open the namespace named in `ec_connector_extra_config` (scheduler side in the engine
core process, worker side in the worker process; one process in vLLM's in-process mode). A cache
failure never fails a request: the failing call behaves as if no connector were there (no item
found, nothing to load, nothing stored), and each kind of failure is counted and logged once.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from shmcache.errors import ShmCacheError
from shmcache.integrations.vllm.metadata import ShmCacheECMetadata
from shmcache.integrations.vllm.scheduler import SchedulerSide
from shmcache.integrations.vllm.settings import ConnectorSettings, KeyMaker, preprocessing_of
from shmcache.integrations.vllm.worker import WorkerSide
from shmcache.process.cache import EmbeddingCache

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["ShmCacheECConnector"]

log = logging.getLogger("shmcache")


class ShmCacheECConnector(ECConnectorBase):
    """vLLM EC connector: node-wide exactly-once encoder outputs in shared memory (docs/vllm.md)."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        transfer = vllm_config.ec_transfer_config
        settings = ConnectorSettings.from_extra_config(
            transfer.ec_connector_extra_config if transfer else None
        )
        self.failures: Counter[str] = Counter()  # kind of failure -> how many times
        self._cache = EmbeddingCache(settings.cache)
        keys = KeyMaker(preprocessing_of(vllm_config, settings.key_salt), settings.cache)
        scheduler = role == ECConnectorRole.SCHEDULER
        self._scheduler = SchedulerSide(self._cache, keys, stores=self.is_producer) if scheduler else None
        # loads go where the model runner keeps its encoder outputs: the engine's device (not
        # `ec_buffer_device`, which vLLM defaults to "cuda" for its own transfer buffers)
        device = vllm_config.device_config.device_type or "cpu"
        self._worker = WorkerSide(self._cache, "cpu" if device.startswith("cpu") else device)

    def _failed(self, what: str, exc: BaseException) -> None:
        """Count a failure; log the first of each kind (the engine carries on without the cache)."""
        self.failures[what] += 1
        if self.failures[what] == 1:
            log.warning("shmcache connector: %s failed, continuing without the cache: %s", what, str(exc))

    # ------------------------------------------------------------------ scheduler side
    def has_cache_item(self, identifier: str) -> bool:
        if self._scheduler is None or not self.is_consumer:
            return False
        try:
            return self._scheduler.has_item(identifier)
        except Exception as exc:  # never fail the request
            self._failed("has_cache_item", exc)
            return False

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self._scheduler is None:
            return True
        try:
            return self._scheduler.ensure(request, num_computed_tokens)
        except Exception as exc:  # never fail the request
            self._failed("ensure_cache_available", exc)
            return True

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if self._scheduler is None:
            return
        try:
            self._scheduler.after_alloc(request, index)
        except Exception as exc:  # never fail the request
            self._failed("update_state_after_alloc", exc)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        if self._scheduler is None:
            return ShmCacheECMetadata()
        try:
            return self._scheduler.build()
        except Exception as exc:  # never fail the request
            self._failed("build_connector_meta", exc)
            return ShmCacheECMetadata()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            try:
                self._scheduler.finished(request)
            except Exception as exc:  # never fail the request
                self._failed("request_finished", exc)
        return False, None

    # ------------------------------------------------------------------ worker side
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        metadata = self._connector_metadata
        if not isinstance(metadata, ShmCacheECMetadata) or not metadata.loads:
            return
        try:
            missing = self._worker.load(metadata, encoder_cache)
        except Exception as exc:  # never fail the request
            self._failed("start_load_caches", exc)
            return
        if missing:
            self._failed("start_load_caches", ShmCacheError(f"{len(missing)} planned loads were gone"))

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if not self.is_producer:
            return
        metadata = self._connector_metadata
        try:
            self._worker.save(
                metadata if isinstance(metadata, ShmCacheECMetadata) else None, encoder_cache, mm_hash
            )
        except Exception as exc:  # never fail the request
            self._failed("save_caches", exc)

    def shutdown(self) -> None:
        try:
            if self._scheduler is not None:
                self._scheduler.close()
        finally:
            self._cache.close()
