"""The extent of a pull that failed: given back at once when nothing can write it any more (a
publisher that died); kept, ours, when a transfer that outlived its wait may still write it and
its reservation could not be set aside (no pin record to spare: another thread of the process
took the last ones; `shmcache/remote/setaside.py`). Found by an independent review: the process
then waited on its own reservation for `compute_timeout_s`, and every caller of the node did the
same for that key until the process closed."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from shmcache import EmbeddingCache
from shmcache.node.index import NodeIndex
from shmcache.testing import MooncakeMaster
from tests.helpers import kill, wait_for
from tests.test_remote_in_place import SIZE, published, stopped_publisher
from tests.workers import expected_value, fingerprint, key_of


def test_a_reservation_kept_for_a_hung_transfer_blocks_nobody_and_ends_with_the_transfer(
    shmcache_mooncake: MooncakeMaster,
    shmcache_namespace: str,
    other_namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with stopped_publisher(shmcache_mooncake.address, shmcache_namespace, other_namespace) as (
        node_b,
        node_a,
    ):
        config = dataclasses.replace(node_b, compute_timeout_s=20.0)
        with EmbeddingCache(config) as b:
            monkeypatch.setattr(NodeIndex, "set_aside", lambda index, slot, gen: False)  # out of pins
            started = time.monotonic()
            value = b.get_or_compute(key_of("shared"), lambda: expected_value("shared", SIZE))
            took = time.monotonic() - started
            assert fingerprint(value) == fingerprint(expected_value("shared", SIZE))
            del value
            stats = b.stats()
            assert took < 15.0, took  # the code before: its own reservation's compute_timeout_s
            assert stats["reserved"] == 1 and stats["uncacheable"] == 1 and stats["remote_set_aside"] == 1, (
                stats
            )
            [res] = b.try_reserve_many([key_of("shared")])  # a vLLM scheduler step: computed uncached
            assert res is not None and not res.owned and res.value is None  # before: None at every step
            with res:
                value = res.commit(expected_value("shared", SIZE))
            assert fingerprint(value) == fingerprint(expected_value("shared", SIZE))
            del value
            assert b.stats()["reserved"] == 1  # still kept: its transfer may still write it
            assert b.stats()["coalesced_waits"] == 0  # nothing waited on: it was counted as a wait
            os.kill(node_a, signal.SIGCONT)  # the transfer goes on and ends
            wait_for(lambda: b.stats()["reserved"] == 0, timeout=60, what="the kept reservation to end")
            value = b.get_or_compute(key_of("shared"), lambda: expected_value("shared", SIZE))
            assert fingerprint(value) == fingerprint(expected_value("shared", SIZE))
            assert b.stats()["entries"] == 1  # the key is the node's again: stored this time
            del value


def test_a_pull_from_a_publisher_that_died_gives_its_memory_back_at_once(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str
) -> None:
    """Node A published and was SIGKILLed; the master still lists its copy (for `client_ttl`).
    B's pull cannot reach A's segment: TRANSFER_FAIL at once, after every slice ended (none
    started), so the extent goes back to the arena (it was set aside until B's detach before)."""
    master, a_ns, b_ns = shmcache_mooncake.address, shmcache_namespace, other_namespace
    with published(master, a_ns, b_ns, "gone", remote_timeout_s=10.0) as (config_b, a):  # 10 s: a
        kill(a)  # slow answer would be TIMED_OUT, and its memory set aside whatever it said
        with EmbeddingCache(config_b) as b:
            value = b.get_or_compute(key_of("gone"), lambda: expected_value("gone", SIZE))
            assert fingerprint(value) == fingerprint(expected_value("gone", SIZE))
            stats = b.stats()
            served = stats["hits_remote"] == 1  # its copy still served (once in CI, 2026-12-07)
            got = stats["computes"], stats["hits_remote"], stats["remote_set_aside"], stats["stale"]
            assert got == ((0, 1, 0, 0) if served else (1, 0, 0, 0)), stats
            assert served or stats["remote_errors"] >= 1, stats
            held = [b.get_or_compute(key_of(n), lambda n=n: expected_value(n, SIZE)) for n in "xy"]
            assert b.stats()["uncacheable"] == 0  # three entries fit in B's room for three
            del value, held
