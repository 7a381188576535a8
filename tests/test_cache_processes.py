"""Real spawned processes: exactly-once compute, failures, timeouts and SIGKILL at every stage."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shmcache import CacheConfig, ComputeFailed, ComputeTimeout, EmbeddingCache
from shmcache.testing import namespace_objects
from tests import workers
from tests.helpers import arena_page, file_offset, kernel_objects, kill, physical_page, spawn, wait_for
from tests.workers import expected_value, fingerprint, key_of


def _ctx():  # type: ignore[no-untyped-def]
    import multiprocessing as mp

    return mp.get_context("spawn")


def _drain(results: object, count: int, timeout: float = 60.0) -> list[tuple[object, ...]]:
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < count:
        out.append(results.get(timeout=max(0.1, deadline - time.monotonic())))  # type: ignore[attr-defined]
    return out


def test_exactly_one_compute_for_8_processes_x_4_threads(config: CacheConfig, tmp_path: Path) -> None:
    ctx = _ctx()
    start, results = ctx.Barrier(8), ctx.Queue()
    log = tmp_path / "computes.log"
    procs = [
        spawn(workers.exactly_once, config, "shared-image", 4, str(log), start, results) for _ in range(8)
    ]
    got = _drain(results, 32)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert {outcome for outcome, _ in got} == {"ok"}, got
    assert {fp for _, fp in got} == {fingerprint(expected_value("shared-image"))}
    assert len(log.read_text().splitlines()) == 1  # counted outside the cache


def test_waiter_takes_over_when_the_computing_process_is_killed(config: CacheConfig, tmp_path: Path) -> None:
    started = tmp_path / "started"
    with EmbeddingCache(config) as observer:  # keeps the namespace live throughout
        owner = spawn(workers.compute_forever, config, "k", str(started))
        wait_for(started.exists, what="the owner to start computing")
        results = _ctx().Queue()
        waiter = spawn(workers.get_or_compute_report, config, "k", results)
        wait_for(lambda: observer.stats()["coalesced_waits"] == 1, what="the waiter to block")
        t0 = time.monotonic()
        kill(owner)
        outcome, fp, takeovers = results.get(timeout=30)
        assert time.monotonic() - t0 < 10
        waiter.join(10)
        assert outcome == "ok" and fp == fingerprint(expected_value("k")) and takeovers == 1
        assert fingerprint(observer.get(key_of("k"))) == fp


def test_waiters_get_the_cause_of_a_failed_compute_and_the_key_is_free(
    config: CacheConfig, tmp_path: Path
) -> None:
    started = tmp_path / "started"
    with EmbeddingCache(config) as cache:
        owner = spawn(workers.compute_then_fail, config, "k", str(started), str(tmp_path / "go"))
        wait_for(started.exists, what="the owner to start computing")
        results = _ctx().Queue()
        waiters = [spawn(workers.get_or_compute_report, config, "k", results) for _ in range(2)]
        wait_for(lambda: cache.stats()["coalesced_waits"] == 2, what="both waiters to block")
        (tmp_path / "go").touch()
        got = _drain(results, 2)
        owner.join(10)
        for w in waiters:
            w.join(10)
        assert {g[0] for g in got} == {"ComputeFailed"}, got
        assert all("decoder exploded on frame 17" in str(g[1]) for g in got)
        # the key is free: a retry computes normally
        assert torch.equal(
            cache.get_or_compute(key_of("k"), lambda: expected_value("k")), expected_value("k")
        )
    assert issubclass(ComputeFailed, RuntimeError)


def test_compute_timeout_bounds_the_wait(config: CacheConfig, tmp_path: Path) -> None:
    started = tmp_path / "started"
    owner = spawn(workers.compute_forever, config, "slow", str(started))
    try:
        wait_for(started.exists, what="the owner to start computing")
        with EmbeddingCache(dataclasses.replace(config, compute_timeout_s=0.3)) as cache:
            t0 = time.monotonic()
            with pytest.raises(ComputeTimeout, match=f"pid {owner.pid}"):
                cache.get_or_compute(key_of("slow"), lambda: pytest.fail("must wait, not compute"))
            assert time.monotonic() - t0 < 5
            assert cache.stats()["timeouts"] == 1
    finally:
        kill(owner)


def test_dead_process_pins_and_refs_are_reaped(config: CacheConfig, tmp_path: Path) -> None:
    with EmbeddingCache(dataclasses.replace(config, return_mode="clone")) as cache:
        cache.put(key_of("held"), expected_value("held"))
        ready = tmp_path / "ready"
        holder = spawn(workers.hold_view_and_ref, config, "held", str(ready))
        wait_for(ready.exists, what="the holder to take its view")
        assert cache.stats()["references"] == 2  # its view pin and its request reference
        kill(holder)
        assert cache.gc() == 1
        stats = cache.stats()
        assert stats["references"] == 0 and stats["reaped_clients"] == 1 and stats["clients"] == 1


def test_dead_pins_do_not_block_eviction(namespace: str, tmp_path: Path) -> None:
    config = CacheConfig(
        enable_embedding_cache=True,
        namespace=namespace,
        capacity_bytes=1 << 20,
        max_entries=16,
        ways=16,
        return_mode="clone",
    )
    with EmbeddingCache(config) as cache:
        cache.put(key_of("held"), expected_value("held", 300_000))
        ready = tmp_path / "ready"
        holder = spawn(workers.hold_view_and_ref, config, "held", str(ready))
        wait_for(ready.exists, what="the holder to take its view")
        kill(holder)
        # 600 KB fits only in the memory of the dead process's entry: its pins are reaped on demand
        cache.put(key_of("big"), torch.zeros(600_000, dtype=torch.uint8))
        assert cache.get(key_of("held")) is None
        assert cache.stats()["reaped_clients"] == 1


def test_cross_process_hits_are_zero_copy(config: CacheConfig, tmp_path: Path) -> None:
    """A value written by another process is read in place: the view's pages are the arena's own
    physical pages (compared through /proc/self/pagemap), for a small and a 64 MiB value."""
    big = dataclasses.replace(config, capacity_bytes=160 << 20)
    path = f"/dev/shm/shmcache.{os.geteuid()}.{config.namespace}.arena"
    with EmbeddingCache(big) as cache:
        for name, numel in (("small", 256), ("large", 32 << 20)):  # 512 B and 64 MiB of bf16
            done = tmp_path / name
            writer = spawn(workers.put_value, big, name, numel, str(done))
            wait_for(done.exists, what="the writer")
            (tmp_path / f"{name}.stop").touch()
            writer.join(30)
        shared = np.frombuffer(cache._segments.arena, dtype=np.uint8)
        for name, numel in (("small", 256), ("large", 32 << 20)):
            value = cache.get(key_of(name))
            assert fingerprint(value) == fingerprint(expected_value(name, numel))  # reads every page
            for address in (value.data_ptr(), value[-1:].data_ptr()):
                assert physical_page(address) == arena_page(shared, file_offset(address, path)) != 0
            del value
        del shared


def test_concurrent_first_attach_creates_once(config: CacheConfig) -> None:
    ctx = _ctx()
    start, results = ctx.Barrier(6), ctx.Queue()
    procs = [spawn(workers.attach_and_report, config, start, results) for _ in range(6)]
    got = _drain(results, 6)
    for p in procs:
        p.join(30)
    assert all(g[0] == "ok" for g in got), got


def test_first_attacher_after_everyone_died_wipes_stale_objects(config: CacheConfig, tmp_path: Path) -> None:
    before = kernel_objects()
    procs = []
    for i in range(2):
        ready = tmp_path / f"ready{i}"
        procs.append(spawn(workers.attach_and_die, config, str(ready)))
        wait_for(ready.exists, what="the worker to attach")
    for p in procs:
        kill(p)
    stale = kernel_objects() - before
    assert len(stale) == 4  # index, arena, lock file, semaphore set: left by the dead
    with EmbeddingCache(config) as cache:
        assert cache.get(key_of("orphan")) is None  # wiped, not trusted
        assert cache.stats()["clients"] == 1
        old_semaphores = {o for o in stale if o.startswith("sem:")}
        assert old_semaphores and not old_semaphores & kernel_objects()  # the dead set was removed
    assert kernel_objects() == before


def test_a_never_written_index_is_stale_not_corrupt(namespace: str) -> None:
    index = Path(f"/dev/shm/shmcache.{os.geteuid()}.{namespace}.index")
    index.write_bytes(bytes(8192))  # a creator killed right after creating the file
    index.chmod(0o600)  # as the creator makes it (wider modes are refused as foreign)
    with EmbeddingCache(
        CacheConfig(enable_embedding_cache=True, namespace=namespace, capacity_bytes=8 << 20)
    ) as cache:
        cache.put(key_of("x"), expected_value("x", 16))
        assert cache.get(key_of("x")) is not None


def test_a_fenced_off_owner_releases_its_reservation(config: CacheConfig) -> None:
    from shmcache import ReservationLost

    with EmbeddingCache(config) as cache:
        res = cache.reserve(key_of("fenced"))
        assert res.owned
        node = cache._node
        slot = res.slot
        node.slots.array["offset"][slot] = 64  # damage the record: the next section quarantines it
        with pytest.raises(ReservationLost):
            res.commit(expected_value("fenced", 16))
        assert node.reservations.held() == {}  # the semaphore was released, not kept by a live owner
        t0 = time.monotonic()
        value = cache.get_or_compute(key_of("fenced"), lambda: expected_value("fenced", 16))
        assert fingerprint(value) == fingerprint(expected_value("fenced", 16))
        assert time.monotonic() - t0 < 5


def test_the_last_client_record_keeps_the_namespace_alive(config: CacheConfig, tmp_path: Path) -> None:
    """A detaching process must see a live process in the last client record (it once dropped
    that record from the check, and removed the namespace under it)."""
    two = dataclasses.replace(config, max_clients=2)
    first = EmbeddingCache(two)
    ready = tmp_path / "ready"
    second = spawn(workers.attach_and_die, two, str(ready))  # takes record 1, the last one
    try:
        wait_for(ready.exists, what="the second process to attach")
        first.close()
        assert namespace_objects(two.namespace), "the namespace was removed under a live process"
        with EmbeddingCache(two) as third:
            assert third.get(key_of("orphan")) is not None  # the second process's entry is still there
    finally:
        kill(second)
    with EmbeddingCache(two):
        pass  # the first attacher after everyone died wipes what the second left
