"""pytest plugin (entry point `pytest11`): isolated cache namespaces and multi-process fixtures.

Fixtures (all named `shmcache_*`):

- `shmcache_namespace`: a namespace unique to the test (and to the pytest-xdist worker). After the
  test, dead processes' leftovers are reaped like the next attacher would; anything of the
  namespace still left in /dev/shm (an unclosed cache, a leaked process) fails the test, then the
  namespace is destroyed.
- `shmcache_config`: an enabled `CacheConfig` on that namespace (capacity from the options).
- `shmcache_cache`: an open `EmbeddingCache` on it, closed after the test.
- `shmcache_pool`: a `shmcache.testing.ProcessPool` of spawned workers on the same config; `run`
  returns results or re-raises a worker's exception with its remote traceback, enforces the timeout,
  and every worker is reaped afterwards. `pool.crash(point, key)` SIGKILLs a worker while computing,
  after reserve, or while holding a view.
- `shmcache_mooncake`: a real `mooncake_master` on 127.0.0.1 with free ports (a
  `shmcache.testing.MooncakeMaster`: `.address`, `.kill()`), stopped after the test; skips, naming
  what is missing, if the Mooncake package or its system libraries are not installed.
- `shmcache_mooncake_holder`: a node store holder on that master (a
  `shmcache.testing.MooncakeHolder`: `.address` for `remote_holder`, `.process`, `.kill()`).

Options (command line or ini): `--shmcache-capacity` / `shmcache_capacity_bytes` (default 64 MiB),
`--shmcache-timeout` / `shmcache_timeout` (pool timeout, default 60 s), `--shmcache-no-leak-check` /
`shmcache_leak_check = false`.

Worker helpers (`checkpoint`, `WorkerTimeout`, ...) and sample configs (`sample_preprocessing`,
`sample_cache_config`) are importable from `shmcache.testing`.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from shmcache.config import CacheConfig
from shmcache.errors import ShmCacheError
from shmcache.kernel.namespace import destroy_namespace
from shmcache.process.cache import EmbeddingCache, open_caches
from shmcache.testing.mooncake import MooncakeHolder, MooncakeMaster
from shmcache.testing.pool import ProcessPool, namespace_objects

T = TypeVar("T")

__all__ = [
    "shmcache_cache",
    "shmcache_config",
    "shmcache_mooncake",
    "shmcache_mooncake_holder",
    "shmcache_namespace",
    "shmcache_pool",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shmcache", "shmcache node caches")
    group.addoption("--shmcache-capacity", type=int, default=None, help="arena bytes of test caches")
    group.addoption("--shmcache-timeout", type=float, default=None, help="seconds a pool worker may run")
    group.addoption(
        "--shmcache-no-leak-check",
        action="store_true",
        default=False,
        help="do not fail tests that leak objects",
    )
    parser.addini("shmcache_capacity_bytes", "arena bytes of test caches", default=str(64 << 20))
    parser.addini("shmcache_timeout", "seconds a pool worker may run", default="60")
    parser.addini(
        "shmcache_leak_check", "fail tests that leave shared-memory objects", type="bool", default=True
    )


def _option(config: pytest.Config, flag: str, ini: str, kind: Callable[[str], T]) -> T:
    """The command-line `flag`, else the ini setting `ini`, as a number of `kind`; a usage error
    naming both when it is not one (a size such as "64M" is not: give it in bytes)."""
    value = config.getoption(flag)
    text = str(value) if value is not None else str(config.getini(ini))
    try:
        return kind(text)
    except ValueError:
        name = getattr(kind, "__name__", "a number")
        raise pytest.UsageError(f"{flag} (ini {ini}) must be of type {name}, got {text!r}") from None


@pytest.fixture
def shmcache_namespace(request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace unique to this test; leak-checked and destroyed afterwards."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    name = f"pytest-{worker}-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    yield name
    leak_check = request.config.getini("shmcache_leak_check") and not request.config.getoption(
        "--shmcache-no-leak-check"
    )
    for cache in open_caches():  # closed caches whose last views died with the test detach now
        if cache.config.namespace == name:
            cache.flush_releases()
    left = set()
    if namespace_objects(name):
        from shmcache.ops.inspect import gc_namespace

        with contextlib.suppress(ShmCacheError):
            gc_namespace(name)  # what the next attacher would do for processes that died
        left = namespace_objects(name)
    destroy_namespace(name)
    if leak_check and left:
        pytest.fail(
            f"shmcache namespace {name!r} leaked {sorted(left)}: a cache was not closed or a worker "
            "process is still attached",
            pytrace=False,
        )


@pytest.fixture
def shmcache_config(shmcache_namespace: str, request: pytest.FixtureRequest) -> CacheConfig:
    """An enabled cache config on the test's namespace."""
    capacity = _option(request.config, "--shmcache-capacity", "shmcache_capacity_bytes", int)
    return CacheConfig(enable_embedding_cache=True, namespace=shmcache_namespace, capacity_bytes=capacity)


@pytest.fixture
def shmcache_cache(shmcache_config: CacheConfig) -> Iterator[EmbeddingCache]:
    """An open cache on the test's namespace, closed after the test."""
    cache = EmbeddingCache(shmcache_config)
    yield cache
    cache.close()


@pytest.fixture
def shmcache_mooncake() -> Iterator[MooncakeMaster]:
    """A Mooncake master on loopback for this test (skips if Mooncake is not installed)."""
    missing = MooncakeMaster.missing()
    if missing:
        pytest.skip(f"Mooncake is not usable here: {missing}")
    master = MooncakeMaster()
    yield master
    master.kill()


@pytest.fixture
def shmcache_mooncake_holder(shmcache_mooncake: MooncakeMaster) -> Iterator[MooncakeHolder]:
    """A node store holder (`mooncake_client`, as `shmcache remote-holder` runs it) on the test's
    master, for thin clients (`remote_holder=holder.address`); killed after the test."""
    holder = MooncakeHolder(shmcache_mooncake)
    yield holder
    holder.kill()


@pytest.fixture
def shmcache_pool(shmcache_config: CacheConfig, request: pytest.FixtureRequest) -> Iterator[ProcessPool]:
    """Spawned worker processes attached to the test's cache; all reaped after the test."""
    timeout = _option(request.config, "--shmcache-timeout", "shmcache_timeout", float)
    pool = ProcessPool(shmcache_config, timeout)
    yield pool
    pool.shutdown()
