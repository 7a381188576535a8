"""Sample configurations: the one preprocessing config and the one small cache config that tests,
benchmarks and the demo share, instead of each spelling out its own keyword literal.

    from shmcache.testing import sample_cache_config, sample_preprocessing

    key = EmbeddingCacheKey.from_raw_bytes(data, sample_preprocessing(), modality="image")
    with EmbeddingCache(sample_cache_config("my-test", capacity_bytes=8 << 20)) as cache: ...

Overrides go through the configs' own validation (a wrong type still raises `ConfigTypeError`).

This module imports only the two config classes, so package code may use it too: `shmcache demo`
(shmcache/ops/demo.py) builds its preprocessing config here, overriding what describes its own
encoder. The demo is a sample workload, so its sample inputs belong with the others rather than in
`shmcache.keys`, whose public surface is what a serving stack needs; and `shmcache.testing` pulls in
nothing the demo does not already import (pytest only enters through `pytest_plugin`, which the
package `__init__` does not import).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

from shmcache.config import CacheConfig
from shmcache.keys.preprocessing import EncoderPreprocessingConfig

__all__ = ["SAMPLE_PREPROCESSING", "sample_cache_config", "sample_preprocessing"]

SAMPLE_PREPROCESSING: Final = EncoderPreprocessingConfig(
    cache_schema_version=1,
    model_id="Qwen/Qwen2.5-Omni-7B",
    model_revision="abc123",
    encoder_config_hash="e0c0",
    processor_version="4.51.0",
    processor_config_hash="3a7e",
    resize_mode="bicubic",
    image_size=(448, 448),
    crop_mode="center",
    normalize_mean=(0.48145466, 0.4578275, 0.40821073),
    normalize_std=(0.26862954, 0.26130258, 0.27577711),
    audio_sample_rate=16000,
    audio_codec_version="",
    audio_codec_config_hash="",
    video_frame_stride=2,
    input_dtype="bfloat16",
)
"""A complete image/audio/video encoder config (every field set, most of them non-empty)."""

_SMALL_CACHE: Final[dict[str, Any]] = {
    "enable_embedding_cache": True,
    "capacity_bytes": 32 << 20,
    "max_entries": 256,
    "ways": 8,
    "max_clients": 32,
    "max_pins_per_process": 256,
    "compute_timeout_s": 60.0,
}


def sample_preprocessing(**overrides: Any) -> EncoderPreprocessingConfig:
    """`SAMPLE_PREPROCESSING` with `overrides` (field name -> value), validated like any config."""
    return dataclasses.replace(SAMPLE_PREPROCESSING, **overrides) if overrides else SAMPLE_PREPROCESSING


def sample_cache_config(namespace: str, **overrides: Any) -> CacheConfig:
    """An enabled cache on `namespace` sized for tests (32 MiB, 256 entries in 8 ways, 32 clients,
    256 pins per process, 60 s compute timeout), with `overrides` (field name -> value)."""
    return CacheConfig(**{**_SMALL_CACHE, "namespace": namespace, **overrides})
