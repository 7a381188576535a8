"""The remote layer survives store outages: a master SIGKILLed and restarted on the same port, or
hung (SIGSTOP), never fails a call in degrade mode, never makes one wait longer than
`remote_timeout_s`, and publishes and pulls resume by themselves, without restarting anything."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shmcache import CacheConfig, EmbeddingCache, RemoteUnavailable, destroy_namespace
from shmcache.remote.answers import MASTER_GONE, OBJECT_NOT_FOUND
from shmcache.remote.connection import free_port
from shmcache.remote.store import RemoteStore
from shmcache.testing import MooncakeMaster
from tests import workers
from tests.helpers import longest_stall, spawn, stop, wait_for
from tests.test_remote import assert_pulled_in_place, remote_config
from tests.workers import expected_value, fingerprint, key_of

SIZE_4MIB = 1 << 21  # bf16 elements: 4 MiB


@pytest.fixture
def node_b() -> Iterator[str]:
    name = f"node-b-{uuid.uuid4().hex[:10]}"
    yield name
    destroy_namespace(name)


def _available(cache: EmbeddingCache) -> bool:
    bridge = cache._bridge
    return bridge is not None and bridge.store.available


def _value(cache: EmbeddingCache, name: str) -> bytes:
    return fingerprint(cache.get_or_compute(key_of(name), lambda: expected_value(name)))


def test_a_master_restarted_on_its_port_brings_publishes_and_pulls_back(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, node_b: str, caplog: pytest.LogCaptureFixture
) -> None:
    config_a = remote_config(shmcache_namespace, shmcache_mooncake.address)
    config_b = dataclasses.replace(config_a, namespace=node_b)
    with (
        caplog.at_level(logging.WARNING, logger="shmcache"),
        EmbeddingCache(config_a) as a,
        EmbeddingCache(config_b) as b,
    ):
        assert _value(a, "before") == fingerprint(expected_value("before"))
        wait_for(lambda: a.stats()["remote_publishes"] == 1, what="the first publish")
        shmcache_mooncake.kill()
        # the outage: every call answers, every value is right, nothing raises
        for name in ("before", "during"):
            assert _value(a, name) == _value(b, name) == fingerprint(expected_value(name))
        assert not _available(a) and not _available(b)
        # what each computed in the outage was not published, and is counted as dropped
        assert a.stats()["remote_publish_drops"] == 1 and b.stats()["remote_publish_drops"] == 2
        shmcache_mooncake.restart()  # an empty master on the same port
        wait_for(
            lambda: _available(a) and _available(b), timeout=30, what="both nodes to see the master again"
        )
        assert _value(a, "after") == fingerprint(expected_value("after"))
        wait_for(lambda: a.stats()["remote_publishes"] >= 2, timeout=30, what="publishes to resume")
        b.get_or_compute(key_of("after"), lambda: pytest.fail("node B computed what node A published"))
        assert b.stats()["hits_remote"] == 1  # pulls resumed too
        assert a.stats()["remote_outages"] == 1 and b.stats()["remote_outages"] == 1
    unavailable = [r for r in caplog.records if "unavailable, node-local only" in r.message]
    back = [r for r in caplog.records if "answers again after" in r.message]
    assert len(unavailable) == 2 and len(back) == 2  # one warning per outage and process, one notice


def test_a_hung_master_costs_one_bounded_wait_then_none(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str
) -> None:
    config = remote_config(shmcache_namespace, shmcache_mooncake.address, remote_timeout_s=0.5)
    with EmbeddingCache(config) as cache:
        assert _value(cache, "warm") == fingerprint(expected_value("warm"))
        stop(shmcache_mooncake.process.pid)  # answers nothing; Mooncake's RPCs wait 30 s
        try:
            started = time.monotonic()
            assert _value(cache, "first") == fingerprint(expected_value("first"))  # its pull timed out
            first = time.monotonic() - started
            started = time.monotonic()
            for i in range(5):
                assert _value(cache, f"next-{i}") == fingerprint(expected_value(f"next-{i}"))
            after = time.monotonic() - started
        finally:
            os.kill(shmcache_mooncake.process.pid, signal.SIGCONT)
        assert first < 10, first  # bounded by remote_timeout_s, not by Mooncake's 30 s
        assert after < 10, after  # during the outage no call asks the store
        assert cache.stats()["remote_outages"] == 1
        wait_for(lambda: _available(cache), timeout=30, what="the master to be seen again")


def test_closing_on_a_hung_master_asks_it_once_and_does_not_wait_on_it(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str
) -> None:
    """Mooncake's own close unmounts the segment over RPC and waited 60 s on a stopped master;
    the close first asks the master (bounded by remote_timeout_s) and leaves the client to
    process exit when it does not answer."""
    cache = EmbeddingCache(remote_config(shmcache_namespace, shmcache_mooncake.address, remote_timeout_s=0.5))
    stop(shmcache_mooncake.process.pid)
    try:
        started = time.monotonic()
        cache.close()
        took = time.monotonic() - started
    finally:
        os.kill(shmcache_mooncake.process.pid, signal.SIGCONT)
    assert took < 10, took


def test_an_open_against_a_hung_master_does_not_wait_on_it(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str
) -> None:
    """A stopped master accepts connections (the kernel does) and answers nothing: Mooncake's
    set-up waited 30 s on it, holding the GIL, in every open. The open now asks it for an answer
    first (bounded by remote_timeout_s): degrade opens node-local at once and picks the master up
    when it runs again; strict fails at once with the typed error."""
    config = remote_config(shmcache_namespace, shmcache_mooncake.address, remote_timeout_s=0.5)
    gc.collect()  # an earlier test's client left to exit: its destructor waits ~11 s on a hung master
    stop(shmcache_mooncake.process.pid)
    try:
        started = time.monotonic()
        with pytest.raises(RemoteUnavailable, match=r"did not answer in 0\.5 s"):
            EmbeddingCache(dataclasses.replace(config, store_unavailable_mode="strict"))
        refused = time.monotonic() - started
        started = time.monotonic()
        cache = EmbeddingCache(config)
        opened = time.monotonic() - started
    finally:
        os.kill(shmcache_mooncake.process.pid, signal.SIGCONT)
    with cache:
        assert not _available(cache) and cache.stats()["remote_outages"] == 1
        assert _value(cache, "x") == fingerprint(expected_value("x"))
        wait_for(lambda: _available(cache), timeout=60, what="the master to be picked up")
    assert refused < 5 and opened < 5, (refused, opened)  # each was 30 s


def _set_up_children() -> list[int]:
    """This process's children running the prober's child set-up (`remote/connection.py`)."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread or child that ended meanwhile
            for child in (task / "children").read_text().split():
                if b"MooncakeDistributedStore" in Path(f"/proc/{child}/cmdline").read_bytes():
                    pids.append(int(child))
    return pids


@contextlib.contextmanager
def _answers_only_the_probe(port: int) -> Iterator[None]:
    """On 127.0.0.1:`port`, a master stopped right after it answered `Connection`'s probe: it
    closes a connection whose first byte is 0 (the probe's, as Mooncake's RPC server does) and
    never answers anything else."""
    server, ending, held = socket.create_server(("127.0.0.1", port)), threading.Event(), []
    server.settimeout(0.05)

    def serve() -> None:
        while not ending.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = server.accept()
                conn.settimeout(1.0)
                with contextlib.suppress(OSError):
                    if conn.recv(1) == b"\0":
                        conn.close()
                        continue
                held.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        ending.set()
        thread.join()
        for conn in [*held, server]:
            conn.close()


def test_the_probers_child_set_up_goes_with_the_close(shmcache_namespace: str) -> None:
    """Down at open, then back, answering the probe but not the set-up: the prober's set-up in a
    child process waits on it (Mooncake: 30 s). The close ends that child; before, it outlived
    the close by up to 30 s."""
    port = free_port()
    cache = EmbeddingCache(remote_config(shmcache_namespace, f"127.0.0.1:{port}"))
    with _answers_only_the_probe(port):
        wait_for(lambda: bool(_set_up_children()), timeout=30, what="the prober's child set-up")
        cache.close()
        assert _set_up_children() == []


def test_a_master_down_at_open_is_picked_up_when_it_starts_and_never_stalls_the_process(
    shmcache_namespace: str,
) -> None:
    """Down at open (its port closed), then back but hung (SIGSTOP), then answering: the open and
    every recovery probe meanwhile leave the process running (before: the prober's set-up froze
    it for 4.3 s per probe, 30 s against the hung master); the late master is picked up."""
    master = MooncakeMaster()
    master.kill()  # its port is known and free: an operator starts the master later
    try:
        started = time.monotonic()
        with EmbeddingCache(remote_config(shmcache_namespace, master.address)) as cache:
            opened = time.monotonic() - started
            assert _value(cache, "x") == fingerprint(expected_value("x"))  # node-local meanwhile
            down = longest_stall(3.0)  # probes at 0.25, 0.5, 1 and 2 s (a stalled one: 4.3 s)
            master.restart()
            stop(master.process.pid)
            try:
                hung = longest_stall(4.5)  # the next probe comes at 7.75 s
            finally:
                os.kill(master.process.pid, signal.SIGCONT)
            wait_for(lambda: _available(cache), timeout=60, what="the late master to be picked up")
            assert _value(cache, "y") == fingerprint(expected_value("y"))
            wait_for(lambda: cache.stats()["remote_publishes"] >= 1, timeout=30, what="a publish")
        assert opened < 3.0 and down < 2.0 and hung < 2.0, (opened, down, hung)
    finally:
        master.kill()


def test_a_pull_interrupted_in_one_process_lets_its_waiters_compute_not_fail(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, tmp_path: Path
) -> None:
    """A process whose pull hangs on a stopped master is interrupted (SIGINT) while this process
    waits on its node reservation: the reservation is given back unused, so the waiter reserves
    and computes the value; it is not told that a compute failed (`ComputeFailed`)."""
    config = remote_config(shmcache_namespace, shmcache_mooncake.address, remote_timeout_s=30.0)
    go, out = tmp_path / "go", tmp_path / "out"
    master = shmcache_mooncake.process.pid
    with EmbeddingCache(config) as cache:
        puller = spawn(workers.get_or_compute_until_interrupted, config, "k", str(go), str(out))
        wait_for(Path(f"{go}.ready").exists, what="the puller's cache (connected to the master)")
        stop(master)  # the puller's size lookup will wait on it
        try:
            go.touch()
            wait_for(lambda: cache.stats()["reserved"] == 1, what="the puller's reservation")

            def interrupt_then_wake() -> None:
                time.sleep(0.5)  # mid-way through this process's first 1 s wait on the reservation
                assert puller.pid is not None
                os.kill(puller.pid, signal.SIGINT)
                wait_for(out.exists, what="the puller's interruption")
                os.kill(master, signal.SIGCONT)

            waker = threading.Thread(target=interrupt_then_wake)
            waker.start()
            value = cache.get_or_compute(key_of("k"), lambda: expected_value("k"))
            waker.join()
        finally:
            os.kill(master, signal.SIGCONT)
        assert out.read_text() == "interrupted"
        assert fingerprint(value) == fingerprint(expected_value("k"))
        assert cache.stats()["computes"] == 1  # this process computed it, after the withdraw
        del value
        puller.join(60)
        assert puller.exitcode == 0


def test_a_batch_answered_by_a_gone_master_keeps_each_items_code(shmcache_mooncake: MooncakeMaster) -> None:
    """A batch call's answer names each item's fate; one item's "master gone" begins an outage but
    must not hide the others' (one may have failed mid-transfer and still write into its memory).
    A killed master answers RPC_FAIL for every item, and that list comes back whole."""
    store = RemoteStore(
        CacheConfig(
            remote_master=shmcache_mooncake.address,
            remote_segment_bytes=16 << 20,
            remote_buffer_bytes=16 << 20,
            store_unavailable_mode="strict",
            remote_timeout_s=30.0,  # a call to a killed master may retry its connection for seconds
        ),
        lambda counter, n: None,
    )
    try:
        memory = np.zeros(8192, dtype=np.uint8)
        address = int(memory.ctypes.data)
        store.register(address, memory.nbytes)
        names, addresses, sizes = ["a", "b"], [address, address + 4096], [4096, 4096]
        assert store._call("batch_get_into", names, addresses, sizes) == [OBJECT_NOT_FOUND] * 2
        shmcache_mooncake.kill()
        rcs = store._call("batch_get_into", names, addresses, sizes)
        assert isinstance(rcs, list) and len(rcs) == 2 and all(rc in MASTER_GONE for rc in rcs), rcs
        assert not store.available  # the outage began
    finally:
        shmcache_mooncake.restart()  # the client's close then unmounts at once (not after retries)
        store.close()


def test_a_node_that_opened_with_the_master_down_still_pulls_in_place(
    shmcache_namespace: str, other_namespace: str
) -> None:
    """Its arena was to be registered at open, when there was no client yet: it never was, and
    every pull went through the staging buffer and a copy (a 4 MiB allocation each, before)."""
    master = MooncakeMaster()
    master.kill()
    try:
        node_b = remote_config(other_namespace, master.address)
        with EmbeddingCache(node_b) as b:
            master.restart()
            wait_for(lambda: _available(b), timeout=60, what="B to see the master")
            with EmbeddingCache(dataclasses.replace(node_b, namespace=shmcache_namespace)) as a:
                a.put(key_of("late"), expected_value("late", SIZE_4MIB))
                wait_for(lambda: a.stats()["remote_publishes"] == 1, what="the publish")
                assert_pulled_in_place(b, "late", SIZE_4MIB)
    finally:
        master.kill()


def test_an_open_that_fails_after_the_store_started_closes_it(
    shmcache_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The master is down at open, and the open fails after the store was made (its arena's
    registration raises): the error reaches the caller, and the store's outage prober ends with
    it. Before, the prober went on and would have connected a client that nobody closes."""
    master = MooncakeMaster()
    master.kill()

    def fails(store: RemoteStore, address: int, nbytes: int) -> None:
        raise MemoryError("registering the arena")

    monkeypatch.setattr(RemoteStore, "register", fails)
    try:
        with pytest.raises(MemoryError, match="registering the arena"):
            EmbeddingCache(remote_config(shmcache_namespace, master.address))
        probers = [t for t in threading.enumerate() if t.name == "shmcache-remote-probe"]
        for prober in probers:
            prober.join(10)
        assert not any(prober.is_alive() for prober in probers)
    finally:
        master.kill()
