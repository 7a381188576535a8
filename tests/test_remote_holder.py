"""Copies that outlive their publisher: workers attach to the node's store holder (Mooncake's own
`mooncake_client`, run as `shmcache remote-holder` runs it) as thin clients, so what a worker
published is still pulled by another node long after the worker was SIGKILLed."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shmcache import CacheConfig, EmbeddingCache, destroy_namespace
from shmcache.testing import MooncakeHolder, MooncakeMaster
from tests.helpers import kill, spawn, wait_for
from tests.test_remote import remote_config
from tests.workers import expected_value, fingerprint, key_of

CLIENT_TTL_S = 10  # Mooncake drops a dead client's segment about this long after its death
AFTER_S = 2 * CLIENT_TTL_S  # how long after the publisher's death another node pulls


@pytest.fixture
def holder(shmcache_mooncake: MooncakeMaster) -> Iterator[MooncakeHolder]:
    running = MooncakeHolder(shmcache_mooncake)
    yield running
    running.kill()


def publish_and_wait(config: CacheConfig, name: str, done: str) -> None:
    """A worker: compute `name`, wait for its publish, say so, then wait to be killed."""
    with EmbeddingCache(config) as cache:
        cache.get_or_compute(key_of(name), lambda: expected_value(name, 1 << 20))
        wait_for(lambda: cache.stats()["remote_publishes"] == 1, what="the publish")
        Path(done).touch()
        time.sleep(600)


def test_a_copy_outlives_the_worker_that_published_it(
    shmcache_mooncake: MooncakeMaster, holder: MooncakeHolder, shmcache_namespace: str, tmp_path: Path
) -> None:
    node_a = remote_config(shmcache_namespace, shmcache_mooncake.address, remote_holder=holder.address)
    done = tmp_path / "published"
    worker = spawn(publish_and_wait, node_a, "voice", str(done))
    wait_for(done.exists, timeout=60, what="the worker's publish")
    kill(worker)
    destroy_namespace(node_a.namespace)  # node A's shared memory is gone too: only the store has it
    time.sleep(AFTER_S)
    node_b = dataclasses.replace(node_a, namespace=f"node-b-{uuid.uuid4().hex[:10]}", remote_holder=None)
    try:
        with EmbeddingCache(node_b) as b:
            value = b.get_or_compute(key_of("voice"), lambda: pytest.fail("node B computed what A published"))
            assert fingerprint(value) == fingerprint(expected_value("voice", 1 << 20))
            assert b.stats()["hits_remote"] == 1
            del value
    finally:
        destroy_namespace(node_b.namespace)


def test_a_thin_client_pulls_and_publishes_through_the_holder(
    shmcache_mooncake: MooncakeMaster, holder: MooncakeHolder, shmcache_namespace: str
) -> None:
    own = remote_config(shmcache_namespace, shmcache_mooncake.address)
    thin = dataclasses.replace(own, namespace=f"node-c-{uuid.uuid4().hex[:10]}", remote_holder=holder.address)
    try:
        with EmbeddingCache(own) as a, EmbeddingCache(thin) as c:
            a.get_or_compute(key_of("from-a"), lambda: expected_value("from-a", 4096))
            wait_for(lambda: a.stats()["remote_publishes"] == 1, what="A's publish")
            got: Any = c.get_or_compute(key_of("from-a"), lambda: pytest.fail("C computed"))
            assert fingerprint(got) == fingerprint(expected_value("from-a", 4096))
            c.get_or_compute(key_of("from-c"), lambda: expected_value("from-c", 4096))
            wait_for(lambda: c.stats()["remote_publishes"] == 1, what="C's publish")
            a.get_or_compute(key_of("from-c"), lambda: pytest.fail("A computed"))
            assert c.stats()["hits_remote"] == 1 and a.stats()["hits_remote"] == 1
            del got
    finally:
        destroy_namespace(thin.namespace)
