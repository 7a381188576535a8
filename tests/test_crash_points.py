"""One crash test per row of the crash-point table (shmcache/node/crashpoints.py), and scenario.

A real spawned process arms the row's named hook and runs a workload that passes every point; it
SIGKILLs itself there. The survivor then finds what the table says is left behind, and must get
every value right, without a hang, with the index passing its audit and no counter lost or doubled;
the leak check of conftest.py then proves that nothing is left in /dev/shm or the IPC tables.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shmcache import CacheConfig, EmbeddingCache
from shmcache.node import counters
from shmcache.node.audit import audit
from shmcache.node.crashpoints import CRASH_POINTS, CrashPoint, CrashRow, Survivor
from shmcache.node.layout import needle_of
from shmcache.testing import sample_cache_config
from tests import workers
from tests.helpers import kill, spawn, stopped, wait_for
from tests.workers import expected_value, fingerprint, key_of

CASES = [
    pytest.param(row, survivor, id=f"{row.point.value}-{survivor.name.lower()}")
    for row in CRASH_POINTS
    for survivor in row.survivors
]


def _die_at(config: CacheConfig, row: CrashRow) -> None:
    victim = spawn(workers.crash_at, config, row.point.value)
    victim.join(60)
    assert victim.exitcode == -9, f"{row.point.value} was not reached (exit code {victim.exitcode})"


def _check(cache: EmbeddingCache, names: list[str]) -> None:
    """Every value right (first as the survivor finds the index, then after gc), index audited."""
    for _ in range(2):
        for name in names:
            value = cache.get_or_compute(key_of(name), lambda name=name: expected_value(name))  # type: ignore[misc]
            assert fingerprint(value) == fingerprint(expected_value(name))
        cache.gc()
        assert audit(cache._node) == []


@pytest.mark.parametrize(("row", "survivor"), CASES)
def test_a_process_killed_at_each_crash_point(
    row: CrashRow, survivor: Survivor, config: CacheConfig, tmp_path: Path
) -> None:
    if survivor is Survivor.ARRIVES_AFTER:
        _die_at(config, row)
        with EmbeddingCache(config) as cache:
            _check(cache, ["a"])
            assert cache.stats()["puts"] == 1  # the dead namespace was wiped, not trusted
        return
    with EmbeddingCache(config) as cache:
        cache.put(key_of("h"), expected_value("h"))
        ready = tmp_path / "ready"
        holder = spawn(workers.hold_view_and_ref, config, "h", str(ready))
        wait_for(ready.exists, what="the holder's pins")
        kill(holder)  # a dead client with pins, for the victim's attach to reap
        _die_at(config, row)
        _check(cache, ["h", "a"])
        cache.flush_releases()  # the views _check took are gone: their pins go back now
        stats = cache.stats()
        # one seal each for "h" and "a" (and one more for a dropped entry): no counter lost or doubled
        assert stats["puts"] == 2 + row.drops_an_entry
        assert row.evidence is None or stats[row.evidence.label] >= 1, stats
        assert stats["references"] == 0 and stats["clients"] == 1


def test_a_retire_killed_while_another_waits_for_the_node_lock_is_replayed(
    config: CacheConfig, tmp_path: Path
) -> None:
    """The kernel hands a dead holder's lock to the waiter a moment before it drops the dead
    process's liveness (undone when its last thread is gone): the journal replay waits for that
    instead of taking the row for a live client's (which dropped the journal as damage and
    counted the dead process's counters twice)."""
    with EmbeddingCache(config) as cache:
        cache.put(key_of("s"), expected_value("s"))
        ready = tmp_path / "ready"
        victim = spawn(workers.die_retiring_while_another_waits, config, "v", str(ready))
        try:
            wait_for(ready.exists, what="the victim inside the node section")
            cache.gc()  # waits for the node lock; gets it when the victim dies in its retire
        finally:
            kill(victim)
        assert victim.exitcode == -9
        cache.gc()
        stats = cache.stats()
        assert stats["corrupt_records"] == 0 and stats["repairs"] >= 1
        assert stats["puts"] == 2 and stats["clients"] == 1  # the victim's put counted once
        assert audit(cache._node) == []


@pytest.mark.parametrize("end", ["continued", "killed", "waited for"])
def test_counters_read_during_a_retire_count_its_client_once(
    config: CacheConfig, end: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stats and metrics read the counters without a lock. Caught inside a retire (the leaving
    client's counters folded into the retired totals, its record not zeroed yet), a read counted
    that client twice (puts 6 for 3), and a Prometheus counter that then went back down read as
    a reset. Now reads wait for the retire, or read through its journal when it does not end."""
    with EmbeddingCache(config) as cache:
        names = ["r1", "r2", "r3"]
        retiring = spawn(workers.stop_retiring, config, names)
        try:
            wait_for(lambda: stopped(retiring.pid), what="the retirer to stop inside its retire")
            if end == "waited for":  # the sequence path: a read that waits out the retire
                monkeypatch.setattr(counters, "RETIRE_WAIT_S", 60.0)  # no journal read
                read: list[int] = []
                reader = threading.Thread(target=lambda: read.append(cache.stats()["puts"]))
                reader.start()
                time.sleep(0.3)
                assert reader.is_alive()  # it waits while the sequence is odd
                os.kill(retiring.pid, signal.SIGCONT)
                reader.join(30)
                assert read == [3]
                retiring.join(30)
            else:
                assert cache.stats()["puts"] == 3  # read through the journal (6 before)
            if end == "continued":
                os.kill(retiring.pid, signal.SIGCONT)
                retiring.join(30)
                assert retiring.exitcode == 0
            else:
                kill(retiring)
                assert cache.stats()["puts"] == 3  # a retire killed inside: the same journal
                cache.gc()  # takes the node section: the journal is replayed, the sequence ends
        finally:
            kill(retiring)
        assert cache._node.native.retire_seq(False) % 2 == 0
        assert cache.stats()["puts"] == 3 and cache.stats()["clients"] == 1


@pytest.mark.parametrize("stop", [CrashPoint.RESERVED, CrashPoint.UNSEALED_PAYLOAD], ids=["extent", "seal"])
def test_a_put_in_a_stripe_whose_holder_died_inside_repairs_it_then_goes_on(
    config: CacheConfig, stop: CrashPoint
) -> None:
    """A put stopped after its claim (its allocation next) or after its write (its seal next)
    while another process dies inside the key's stripe: the native step hands the stripe to the
    locked path, which repairs it and runs the same step. The entry is sealed, once."""
    with EmbeddingCache(config) as cache:
        putter = spawn(workers.put_stopping_at, config, stop.value)
        assert putter.pid is not None
        wait_for(lambda: stopped(putter.pid), what="the putter to stop")  # type: ignore[arg-type]
        victim = spawn(workers.crash_at, config, CrashPoint.IN_STRIPE_SECTION.value)
        victim.join(60)
        assert victim.exitcode == -9  # inside the stripe of "a" (its put's lookup)
        repairs = cache.stats()["repairs"]
        os.kill(putter.pid, signal.SIGCONT)
        putter.join(60)
        assert putter.exitcode == 0
        assert cache.stats()["repairs"] == repairs + 1  # by the step's locked path
        assert torch.equal(cache.get(key_of("a")), expected_value("a"))
        cache.gc()
        assert audit(cache._node) == []


def test_a_claim_in_a_stripe_whose_holder_died_inside_repairs_it_then_reserves(config: CacheConfig) -> None:
    """The native get-or-reserve hands a stripe whose last holder died inside to the locked path,
    which repairs it, looks up and claims there: one compute, the stripe clean."""
    with EmbeddingCache(config) as cache:
        victim = spawn(workers.crash_at, config, CrashPoint.IN_STRIPE_SECTION.value)
        victim.join(60)
        assert victim.exitcode == -9  # inside the stripe of "a" (its put's claim)
        before = cache.stats()
        value = cache.get_or_compute(key_of("a"), lambda: expected_value("a"))
        after = cache.stats()
        assert torch.equal(value, expected_value("a"))
        assert (after["repairs"], after["computes"]) == (before["repairs"] + 1, before["computes"] + 1)
        cache.gc()
        assert audit(cache._node) == []


def test_an_eviction_in_a_stripe_whose_holder_died_inside_repairs_it_then_evicts(namespace: str) -> None:
    """The allocator's eviction of the least recently used entry ("a"), whose stripe's last
    holder died inside: the native step hands it to the locked path, which repairs the stripe
    and evicts there."""
    config = sample_cache_config(namespace, capacity_bytes=1 << 20, return_mode="clone")
    value = np.ones(300 << 10, dtype=np.uint8)  # three fit: a fourth evicts "a"
    with EmbeddingCache(config) as cache:
        node = cache._node
        names = [
            "a",
            *(
                n
                for n in (f"k{i}" for i in range(64))
                if node.stripe_of(needle_of(key_of(n))) != node.stripe_of(needle_of(key_of("a")))
            ),
        ]
        for name in names[:3]:
            cache.put(key_of(name), value)
            time.sleep(0.002)  # "a" is the least recently used
        victim = spawn(workers.crash_at, config, CrashPoint.IN_STRIPE_SECTION.value)
        victim.join(60)
        assert victim.exitcode == -9  # inside the stripe of "a" (its put's lookup)
        before = cache.stats()
        cache.put(key_of(names[3]), value)
        after = cache.stats()
        assert (after["repairs"], after["evictions_lru"]) == (
            before["repairs"] + 1,
            before["evictions_lru"] + 1,
        )
        assert [cache.contains(key_of(n)) for n in names[:4]] == [False, True, True, True]
        cache.gc()
        assert audit(node) == []
