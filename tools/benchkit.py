"""What the benchmarks here share: their keys, a fresh namespace's config, percentiles."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from shmcache import CacheConfig, EmbeddingCacheKey
from shmcache.testing import sample_preprocessing


def key(name: str) -> EmbeddingCacheKey:
    """The benchmarks' key of `name` (raw bytes, one preprocessing config, image modality)."""
    return EmbeddingCacheKey.from_raw_bytes(name.encode(), sample_preprocessing(), modality="image")


def node_config(capacity: int, **extra: Any) -> CacheConfig:
    """An enabled cache of `capacity` bytes in a fresh namespace."""
    return CacheConfig(
        enable_embedding_cache=True,
        namespace=f"bench-{uuid.uuid4().hex[:8]}",
        capacity_bytes=capacity,
        **extra,
    )


def percentile(samples: list[float], q: float) -> float:
    """The `q`th percentile of `samples`."""
    return float(np.percentile(samples, q))


def micros(samples: list[float]) -> dict[str, float]:
    """p50 and p99 of `samples` (seconds) in microseconds."""
    return {"p50_us": percentile(samples, 50) * 1e6, "p99_us": percentile(samples, 99) * 1e6}
