"""The pytest plugin, exercised with pytester in a separate pytest process."""

from __future__ import annotations

import pytest

from shmcache.errors import InvalidConfig
from shmcache.testing import ProcessPool
from tests.workers import key_of

WORKERS = """
import os
import time

import torch

from shmcache import EmbeddingCacheKey
from shmcache.testing import checkpoint, sample_preprocessing


def key(name):
    return EmbeddingCacheKey.from_raw_bytes(name.encode(), sample_preprocessing(), modality="image")


def encode(cache, name):
    value = cache.get_or_compute(key(name), lambda: torch.full((4,), float(len(name))))
    return (os.getpid(), value.tolist())


def explode(cache):
    raise ValueError("boom in the worker")


def sleep_forever(cache):
    time.sleep(600)
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(pool_workers=WORKERS)
    return pytester


def test_pool_runs_workers_and_reports_remote_tracebacks(project: pytest.Pytester) -> None:
    project.makepyfile(
        test_user="""
        import pytest
        import pool_workers

        def test_results(shmcache_pool, shmcache_cache):
            results = shmcache_pool.run(pool_workers.encode, "cat.jpg", processes=3)
            assert len({pid for pid, _ in results}) == 3
            assert all(value == [7.0] * 4 for _, value in results)
            assert shmcache_cache.stats()["computes"] == 1

        def test_worker_failure(shmcache_pool):
            shmcache_pool.run(pool_workers.explode)
        """
    )
    result = project.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*ValueError: boom in the worker*", "*in explode*", "*RemoteTraceback*"])


def test_pool_timeout_from_ini_kills_the_worker(project: pytest.Pytester) -> None:
    project.makeini("[pytest]\nshmcache_timeout = 2\n")
    project.makepyfile(
        test_user="""
        import pytest
        import pool_workers
        from shmcache.testing import WorkerTimeout

        def test_timeout(shmcache_pool):
            with pytest.raises(WorkerTimeout):
                shmcache_pool.run(pool_workers.sleep_forever)
            assert not any(w.process.is_alive() for w in shmcache_pool.workers)
        """
    )
    project.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_crash_helper_and_takeover(project: pytest.Pytester) -> None:
    project.makepyfile(
        test_user="""
        import pool_workers

        def test_crash(shmcache_pool, shmcache_cache):
            dead = shmcache_pool.crash("computing", pool_workers.key("x"))
            assert dead.process.exitcode == -9
            pid, value = shmcache_pool.run(pool_workers.encode, "x")[0]
            assert value == [1.0] * 4
            assert shmcache_cache.stats()["takeovers"] == 1
        """
    )
    project.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_a_leak_fails_the_test(project: pytest.Pytester) -> None:
    project.makepyfile(
        test_user="""
        from shmcache import EmbeddingCache

        leaked = []

        def test_forgets_to_close(shmcache_config):
            leaked.append(EmbeddingCache(shmcache_config))
        """
    )
    result = project.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*leaked*a cache was not closed*"])


def test_options_are_registered(project: pytest.Pytester) -> None:
    result = project.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["*--shmcache-capacity*", "*--shmcache-timeout*", "*shmcache_leak_check*"])


def test_a_setting_that_is_not_a_number_is_a_usage_error(project: pytest.Pytester) -> None:
    """Before, a capacity such as "64M" failed each test with a bare ValueError from int()."""
    project.makeini("[pytest]\nshmcache_capacity_bytes = 64M\n")
    project.makepyfile(test_user="def test_config(shmcache_config):\n    pass\n")
    result = project.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*shmcache_capacity_bytes) must be of type int, got '64M'*"])


def test_an_unknown_crash_point_is_a_typed_error(shmcache_pool: ProcessPool) -> None:
    """Before: a bare ValueError."""
    with pytest.raises(InvalidConfig, match="point must be one of"):
        shmcache_pool.crash("bogus", key_of("a"))
    assert shmcache_pool.workers == []
