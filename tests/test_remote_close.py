"""Closing a cache while another thread's pull is still transferring: the Mooncake client is not
closed under the running call (that crashed the process with SIGSEGV when the transfer went on)."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

from shmcache import CacheConfig, EmbeddingCache, ShmCacheError
from shmcache.testing import MooncakeMaster
from tests.helpers import running, wait_for
from tests.test_remote_in_place import SIZE, stopped_publisher
from tests.workers import expected_value, fingerprint, key_of


def close_while_pulling(config: CacheConfig, closing: str, out: str) -> None:
    """Node B: pull "shared" in a thread (its transfer hangs: node A is stopped), close the cache
    meanwhile, and write what the pull got."""
    cache = EmbeddingCache(config)
    outcome: list[str] = []

    def pull() -> None:
        try:
            value = cache.get_or_compute(key_of("shared"), lambda: expected_value("shared", SIZE))
            right = fingerprint(value) == fingerprint(expected_value("shared", SIZE))
            outcome.append("value" if right else "a wrong value")
        except ShmCacheError as exc:  # closed under it: a typed error is an answer too
            outcome.append(type(exc).__name__)

    puller = threading.Thread(target=pull)
    puller.start()
    time.sleep(2.0)  # the pull's transfer is running by then (node A answers nothing)
    Path(closing).touch()
    cache.close()
    puller.join(120)
    Path(out).write_text(",".join(outcome) or "no answer")


def test_closing_while_a_pull_transfers_waits_for_it_instead_of_crashing(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str, tmp_path: Path
) -> None:
    closing, out = tmp_path / "closing", tmp_path / "out"
    with stopped_publisher(shmcache_mooncake.address, shmcache_namespace, other_namespace) as (
        node_b,
        node_a,
    ):
        patient = dataclasses.replace(node_b, remote_timeout_s=30.0)  # the call has not timed out at close
        with running(close_while_pulling, patient, str(closing), str(out)) as worker:
            wait_for(closing.exists, timeout=60, what="node B to close")
            time.sleep(1.0)
            os.kill(node_a, signal.SIGCONT)  # the transfer goes on
            worker.join(120)
            assert worker.exitcode == 0, f"node B ended with {worker.exitcode} (-11: SIGSEGV)"
    assert out.read_text() in ("value", "CacheClosed"), out.read_text()
