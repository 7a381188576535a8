"""Closing a cache while another thread's pull is still transferring: the Mooncake client is not
closed under the running call (that crashed the process with SIGSEGV when the transfer went on).
Closing one during an outage: the client left unclosed never stalls the process later. Closing
one while a transfer into a pull buffer outlived its wait: that buffer is never freed under it."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

from shmcache import CacheConfig, EmbeddingCache, ShmCacheError
from shmcache.remote.staging import Staging
from shmcache.remote.store import RemoteStore
from shmcache.testing import MooncakeMaster
from tests.helpers import kill, map_fresh, mapped_ranges, running, spawn, stop, wait_for
from tests.test_remote import remote_config
from tests.test_remote_in_place import SIZE, stopped_publisher
from tests.test_remote_recovery import _available
from tests.workers import expected_value, fingerprint, key_of


def pull_shared(cache: EmbeddingCache, outcome: list[str]) -> None:
    """`get_or_compute` of "shared": append "value", "a wrong value" or the name of the typed
    error it raised (closed under it: a typed error is an answer too)."""
    try:
        value = cache.get_or_compute(key_of("shared"), lambda: expected_value("shared", SIZE))
        right = fingerprint(value) == fingerprint(expected_value("shared", SIZE))
        outcome.append("value" if right else "a wrong value")
    except ShmCacheError as exc:
        outcome.append(type(exc).__name__)


def close_while_pulling(config: CacheConfig, closing: str, out: str) -> None:
    """Node B: pull "shared" in a thread (its transfer hangs: node A is stopped), close the cache
    meanwhile, and write what the pull got."""
    cache = EmbeddingCache(config)
    outcome: list[str] = []
    puller = threading.Thread(target=pull_shared, args=(cache, outcome))
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


def close_in_an_outage_then_collect(config: CacheConfig, killed: str, out: str) -> None:
    """Publish, wait for the file `killed` (the master is dead then), close the cache, drop it and
    collect the garbage; write how long the drop and the collection took."""
    cache = EmbeddingCache(config)
    cache.put(key_of("x"), expected_value("x"))
    deadline = time.monotonic() + 60  # (no lambda: it would hold `cache` past its `del`)
    while cache.stats()["remote_publishes"] < 1:
        assert time.monotonic() < deadline, "no publish"
        time.sleep(0.01)
    Path(f"{killed}.ready").touch()
    wait_for(Path(killed).exists, what="the master's death")
    cache.close()  # its client is left to process exit: the master does not answer
    started = time.monotonic()
    del cache
    gc.collect()
    Path(out).write_text(str(time.monotonic() - started))
    os._exit(0)  # the exit itself spends ~7 s in Mooncake's exit handler (docs/design.md)


def test_a_client_left_unclosed_in_an_outage_never_stalls_a_later_garbage_collection(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, tmp_path: Path
) -> None:
    """A cache closed while the master is dead leaves its Mooncake client unclosed, until the
    process exits. Before, the client was merely dropped: the garbage collection that freed it
    ran its destructor, which unmounts over RPC from the dead master, and stood still 6.6 s (up
    to 27 s inside the test suite, in a later test's `close`)."""
    killed, out = tmp_path / "killed", tmp_path / "out"
    closer = spawn(
        close_in_an_outage_then_collect,
        remote_config(shmcache_namespace, shmcache_mooncake.address),
        str(killed),
        str(out),
    )
    try:
        wait_for(Path(f"{killed}.ready").exists, timeout=60, what="the publish")
        shmcache_mooncake.kill()
        killed.touch()
        wait_for(out.exists, timeout=60, what="the collection")
        closer.join(30)
    finally:
        if closer.is_alive():
            kill(closer)
    assert closer.exitcode == 0
    assert float(out.read_text()) < 3.0, out.read_text()


SMALL = 16 << 10  # bf16 elements: 32 KiB, a value a batch pull brings through the pull buffer


def close_while_a_batch_pull_transfers(config: CacheConfig, closed: str, resumed: str, out: str) -> None:
    """Node B: a batch pull of "shared" whose transfer outlives its 1 s wait (node A is stopped),
    then close the cache, free it, and map fresh zeroed memory wherever memory was unmapped
    meanwhile; once node A went on, write how many bytes of that memory are no longer zero."""
    cache = EmbeddingCache(config)
    (reservation,) = cache.try_reserve_many([key_of("shared")])
    assert reservation is not None and reservation.owned, "not a miss"
    reservation.abandon()
    before = mapped_ranges()
    cache.close()
    del cache, reservation
    gc.collect()
    fresh = map_fresh(before - mapped_ranges())
    Path(closed).touch()
    wait_for(Path(resumed).exists, what="node A to go on")
    time.sleep(1.0)  # the transfer ends meanwhile (it wrote within ms)
    Path(out).write_text(str(sum(int(np.count_nonzero(memory)) for memory in fresh)))
    os._exit(0)


def test_a_pull_buffer_a_transfer_still_writes_into_outlives_the_close(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str, tmp_path: Path
) -> None:
    """A batch pull's transfer that outlived its wait writes into the pull buffer when the stopped
    holder goes on. The buffer stays alive past the close, until the process exits: before, it was
    freed with the cache, and the late transfer wrote 32 KiB into memory mapped afresh there."""
    closed, resumed, out = tmp_path / "closed", tmp_path / "resumed", tmp_path / "out"
    with (
        stopped_publisher(shmcache_mooncake.address, shmcache_namespace, other_namespace, SMALL) as (
            node_b,
            node_a,
        ),
        running(close_while_a_batch_pull_transfers, node_b, str(closed), str(resumed), str(out)) as worker,
    ):
        wait_for(closed.exists, timeout=60, what="node B to close")
        os.kill(node_a, signal.SIGCONT)
        resumed.touch()
        worker.join(60)
        assert worker.exitcode == 0, f"node B ended with {worker.exitcode}"
    assert out.read_text() == "0", f"{out.read_text()} bytes of fresh memory were written by a late transfer"


def open_as_the_master_dies_after_the_set_up(config: CacheConfig, master_pid: int, out: str) -> None:
    """Open a cache whose client's set-up succeeds and whose master dies right after it, before
    the health check (a real Mooncake client, killing the real master from its `health_check`);
    write how long the open took. Mooncake's health check may still answer 0 right after the
    master's death (seen once in two runs): a failure is then answered for it, as the check
    would a moment later."""
    import mooncake.store

    class DiesAfterTheSetUp(mooncake.store.MooncakeDistributedStore):  # type: ignore[misc]
        def health_check(self) -> int:
            os.kill(master_pid, signal.SIGKILL)
            time.sleep(0.2)  # its port closed
            return int(super().health_check()) or -1

    mooncake.store.MooncakeDistributedStore = DiesAfterTheSetUp
    started = time.monotonic()
    cache = EmbeddingCache(config)
    Path(out).write_text(str(time.monotonic() - started))
    cache.close()
    os._exit(0)


def test_a_set_up_whose_master_dies_before_its_health_check_does_not_wait_to_close_its_client(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, tmp_path: Path
) -> None:
    """The set-up succeeded, the health check failed: the client is left to process exit
    instead of closed (Mooncake's close unmounts from the dead master over RPC)."""
    out = tmp_path / "out"
    assert shmcache_mooncake.process.pid is not None
    with running(
        open_as_the_master_dies_after_the_set_up,
        remote_config(shmcache_namespace, shmcache_mooncake.address),
        shmcache_mooncake.process.pid,
        str(out),
    ) as worker:
        worker.join(120)
        assert worker.exitcode == 0
    assert float(out.read_text()) < 3.0, out.read_text()


def pull_while_closing(config: CacheConfig, closed: str, out: str) -> None:
    """Node B: close the cache, and while the close is under way (the remote store not closed
    yet) pull "shared" in another thread, whose transfer would hang (node A is stopped). Write
    what the pull got, then stay (the arena mapped, the client alive) until killed."""
    cache = EmbeddingCache(config)
    outcome: list[str] = []
    store_close = RemoteStore.close

    def close_once_a_pull_started(store: RemoteStore, drain_s: float = 0.0) -> bool:
        puller = threading.Thread(target=pull_shared, args=(cache, outcome))
        puller.start()
        time.sleep(0.5)  # its transfer, if one starts, is under way by then
        try:
            return store_close(store, drain_s)
        finally:
            puller.join(120)

    RemoteStore.close = close_once_a_pull_started  # type: ignore[method-assign]
    cache.close()
    Path(out).write_text(",".join(outcome) or "no answer")
    Path(closed).touch()
    time.sleep(600)


def test_a_pull_started_while_the_cache_closes_never_writes_memory_the_close_freed(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str, tmp_path: Path
) -> None:
    """A pull that starts while the cache closes (another thread) starts no transfer into node
    memory. Before, its transfer hung past the close, which did not wait for it (only a failed
    transfer made it wait); the detach freed its extent, another process stored an entry there,
    and the transfer, going on, overwrote that entry (found by an independent review)."""
    closed, out = tmp_path / "closed", tmp_path / "out"
    master = shmcache_mooncake.address
    with (
        stopped_publisher(master, shmcache_namespace, other_namespace) as (node_b, node_a),
        EmbeddingCache(dataclasses.replace(node_b, remote_master=None)) as other,  # keeps the namespace
        running(pull_while_closing, node_b, str(closed), str(out)),
    ):
        wait_for(closed.exists, timeout=120, what="node B to close")
        assert out.read_text() in ("value", "CacheClosed"), out.read_text()
        fillers = [f"filler-{i}" for i in range(6)]  # 3 fit: every extent is written again
        for name in fillers:
            other.put(key_of(name), expected_value(name, SIZE))
        os.kill(node_a, signal.SIGCONT)  # a transfer still running goes on
        time.sleep(1.0)  # a transfer still running writes within ms
        present = {name: other.get(key_of(name)) for name in fillers[-3:]}
        assert all(value is not None for value in present.values()), "an entry was dropped"
        for name, value in present.items():
            assert fingerprint(value) == fingerprint(expected_value(name, SIZE)), f"{name} was overwritten"
        assert other.stats()["corrupt_records"] == 0


def set_aside_then_close_on_a_stopped_master(config: CacheConfig, node_a: int, master: int, out: str) -> None:
    """Node B: a pull whose transfer hangs (node A is stopped) sets its memory aside; node A goes
    on and the late transfer ends; then, the master stopped, write how long `close` took."""
    cache = EmbeddingCache(config)
    cache.get_or_compute(key_of("shared"), lambda: expected_value("shared", SIZE))
    assert cache.stats()["remote_set_aside"] == 1, cache.stats()  # in the child's stderr
    os.kill(node_a, signal.SIGCONT)
    wait_for(lambda: cache.stats()["stale"] == 0, timeout=60, what="the late transfer's end")
    wait_for(lambda: _available(cache), timeout=60, what="the store to answer again")
    stats = cache.stats()  # reported with the close's time: a publish in flight would hold it
    stop(master)
    started = time.monotonic()
    try:
        cache.close()
    finally:
        os.kill(master, signal.SIGCONT)
    remote = {name: n for name, n in stats.items() if name.startswith("remote")}
    Path(out).write_text(json.dumps({"close_s": time.monotonic() - started, "stats": remote}))
    os._exit(0)


def test_a_close_after_a_settled_set_aside_does_not_wait_on_a_stopped_master(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str, tmp_path: Path
) -> None:
    """Memory set aside once, long since freed: a close on a stopped master waits only for
    transfers still writing node memory, and there are none. Before, any set-aside made the close
    wait up to 90 s for every call still running, its own probe of the master included (30 s;
    found by an independent review)."""
    out = tmp_path / "out"
    assert shmcache_mooncake.process.pid is not None
    with (
        stopped_publisher(shmcache_mooncake.address, shmcache_namespace, other_namespace) as (node_b, node_a),
        running(
            set_aside_then_close_on_a_stopped_master,
            dataclasses.replace(node_b, remote_single_flight=False),
            node_a,
            shmcache_mooncake.process.pid,
            str(out),
        ) as worker,
    ):
        worker.join(180)
        assert worker.exitcode == 0
    closed = json.loads(out.read_text())
    assert closed["close_s"] < 5.0, closed


def close_while_a_batch_pull_makes_its_buffer(config: CacheConfig, out: str) -> None:
    """Node B: a batch pull whose first pull buffer is made while another thread closes the cache
    (the buffer waits up to 1.5 s for the close to end); write what the pull got."""
    cache = EmbeddingCache(config)
    pull_buffer = Staging.pull_buffer
    closer = threading.Thread(target=cache.close)

    def once_closed(staging: Staging, size: int) -> np.ndarray | None:
        if not closer.is_alive() and closer.ident is None:
            closer.start()
            closer.join(1.5)  # the close is over by then unless it waits for this call
        return pull_buffer(staging, size)

    Staging.pull_buffer = once_closed  # type: ignore[method-assign]
    try:
        outcome = "reserved" if cache.try_reserve_many([key_of("absent")])[0] is not None else "None"
    except ShmCacheError as exc:
        outcome = type(exc).__name__
    closer.join(60)
    Path(out).write_text(outcome)
    os._exit(0)


def test_a_close_never_closes_the_client_under_a_pull_buffer_being_made(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, tmp_path: Path
) -> None:
    """A batch pull makes its pull buffer (registered with the Mooncake client) while another
    thread closes the cache: the close waits for it. Before, the close closed the client first,
    and registering the buffer with a closed client killed the process (SIGSEGV; suspected by an
    independent review)."""
    out = tmp_path / "out"
    config = remote_config(shmcache_namespace, shmcache_mooncake.address)
    with running(close_while_a_batch_pull_makes_its_buffer, config, str(out)) as worker:
        worker.join(120)
        assert worker.exitcode == 0, f"node B ended with {worker.exitcode} (-11: SIGSEGV)"
    assert out.read_text() in ("reserved", "None", "CacheClosed"), out.read_text()
