"""The RFC's `test_publisher.py` (vllm-project/vllm-omni#3427, L1 tests), against a real
mooncake_master on loopback. One test per case the RFC lists, named after it:

- "Queue-full path logs a warning and drops the publish without blocking."
- "Publish errors are counted in `stats()`."
- "`store_unavailable_mode="strict"` raises at init if store is unreachable; `"degrade"` logs a
  warning and continues local-only."
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from shmcache import EmbeddingCache
from shmcache.errors import RemoteUnavailable
from shmcache.remote.connection import free_port
from shmcache.testing import MooncakeMaster
from tests.helpers import wait_for
from tests.test_remote import remote_config
from tests.workers import expected_value, fingerprint, key_of


def test_queue_full_logs_a_warning_and_drops_the_publish_without_blocking(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = remote_config(shmcache_namespace, shmcache_mooncake.address, remote_publish_queue=1)
    with caplog.at_level(logging.WARNING, logger="shmcache"), EmbeddingCache(config) as cache:
        assert cache._bridge is not None
        remote = cache._bridge.store
        assert remote is not None and remote.available
        busy = threading.Event()
        for _ in range(2):  # occupy both publisher threads, as two slow transfers would
            remote._publisher.workers.submit(busy.wait, 30)
        started = time.monotonic()
        for i in range(5):
            cache.put(key_of(f"bulk-{i}"), torch.full((1 << 20,), i, dtype=torch.uint8))
        assert time.monotonic() - started < 5  # never blocked on the full queue
        assert cache.stats()["remote_publish_drops"] == 4  # one queued, four dropped
        busy.set()
        wait_for(lambda: cache.stats()["remote_publishes"] == 1, what="the queued publish")
    warnings = [r.message for r in caplog.records if "publish queue full" in r.message]
    assert len(warnings) == 1  # warned once; the counter says how many


def test_publish_errors_are_counted_in_stats(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str
) -> None:
    # the master can place at most one worker segment of 16 MiB: a 24 MiB value cannot be published
    config = remote_config(shmcache_namespace, shmcache_mooncake.address, remote_segment_bytes=16 << 20)
    with EmbeddingCache(config) as cache:
        big = torch.ones(24 << 20, dtype=torch.uint8)
        cache.put(key_of("too-big"), big)
        wait_for(lambda: cache.stats()["remote_errors"] >= 1, what="the failed publish to be counted")
        assert cache.stats()["remote_publishes"] == 0
        assert torch.equal(cache.get(key_of("too-big")), big)  # the node copy is unaffected
        small = expected_value("small")
        cache.put(key_of("small"), small)
        wait_for(lambda: cache.stats()["remote_publishes"] == 1, what="the next publish")  # not switched off


def test_strict_mode_raises_at_init_if_the_store_is_unreachable(shmcache_namespace: str) -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(RemoteUnavailable, match=address):
        EmbeddingCache(remote_config(shmcache_namespace, address, store_unavailable_mode="strict"))


def test_degrade_mode_logs_a_warning_and_continues_local_only(
    shmcache_namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = remote_config(shmcache_namespace, f"127.0.0.1:{free_port()}")
    with caplog.at_level(logging.WARNING, logger="shmcache"), EmbeddingCache(config) as cache:
        value = cache.get_or_compute(key_of("x"), lambda: expected_value("x"))
        assert fingerprint(value) == fingerprint(expected_value("x"))
        del value
        assert cache.stats()["computes"] == 1
        assert fingerprint(cache.get(key_of("x"))) == fingerprint(expected_value("x"))
    assert sum("unavailable, node-local only" in r.message for r in caplog.records) == 1
