"""Shared fixtures: isolated namespaces and a leak check around every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shmcache import CacheConfig, EncoderPreprocessingConfig
from tests.helpers import kernel_objects

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Every test leaves /dev/shm and the SysV IPC tables as it found them."""
    before = kernel_objects()
    yield
    after = kernel_objects()
    assert after == before, f"leaked: {sorted(after - before)}; removed: {sorted(before - after)}"


@pytest.fixture
def namespace(shmcache_namespace: str) -> str:
    """The plugin's per-test namespace (leak-checked and destroyed after the test)."""
    return shmcache_namespace


@pytest.fixture
def config(namespace: str) -> CacheConfig:
    """An enabled small cache in the test's namespace."""
    return CacheConfig(
        enable_embedding_cache=True,
        namespace=namespace,
        capacity_bytes=32 << 20,
        max_entries=256,
        ways=8,
        max_clients=32,
        max_pins_per_process=256,
        compute_timeout_s=60.0,
    )


@pytest.fixture
def pconfig() -> EncoderPreprocessingConfig:
    return make_pconfig()


def make_pconfig(**overrides: object) -> EncoderPreprocessingConfig:
    fields: dict[str, object] = dict(
        cache_schema_version=1,
        model_id="Qwen/Qwen2.5-Omni-7B",
        model_revision="abc123",
        encoder_config_hash="e0c0",
        processor_version="4.51.0",
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
    fields.update(overrides)
    return EncoderPreprocessingConfig(**fields)  # type: ignore[arg-type]
