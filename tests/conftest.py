"""Shared fixtures: isolated namespaces and a leak check around every test."""

from __future__ import annotations

import gc
import uuid
from collections.abc import Iterator

import pytest

from shmcache import CacheConfig, EncoderPreprocessingConfig, destroy_namespace
from shmcache.testing import sample_cache_config, sample_preprocessing
from tests.helpers import kernel_objects

pytest_plugins = ["pytester"]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (vLLM, torch, transformers: ~400k objects) out of the
    cycle collector's reach: every `gc.collect()` of a test or of the cache (each `close` and
    `flush_releases` makes one) then scans what the tests made, not 0.2 s of module objects."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Hand the frozen objects back, so that the interpreter's exit frees them as it would."""
    gc.unfreeze()


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
    return sample_cache_config(namespace)


@pytest.fixture
def pconfig() -> EncoderPreprocessingConfig:
    return sample_preprocessing()


@pytest.fixture
def other_namespace() -> Iterator[str]:
    """A second node's namespace."""
    name = f"node-b-{uuid.uuid4().hex[:10]}"
    yield name
    destroy_namespace(name)
