"""The remote layer against a real mooncake_master on loopback (the shmcache_mooncake fixture)."""

from __future__ import annotations

import dataclasses
import threading
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmcache import CacheConfig, EmbeddingCache
from shmcache.errors import RemoteUnavailable
from shmcache.node.layout import Counter
from shmcache.remote.answers import (
    MOONCAKE_WAIT_S,
    REPLICA_IS_NOT_READY,
    TIMED_OUT,
    TRANSFER_FAIL,
    CallStart,
    Transfer,
    batch_clean,
    get_into_outcome,
    taints,
)
from shmcache.remote.store import RemoteStore, remote_key
from shmcache.testing import MooncakeMaster, ProcessPool
from tests.helpers import spawn, wait_for
from tests.workers import expected_value, fingerprint, key_of


def remote_config(namespace: str, master: str, **extra: object) -> CacheConfig:
    fields: dict[str, object] = dict(
        enable_embedding_cache=True,
        namespace=namespace,
        capacity_bytes=64 << 20,
        remote_master=master,
        remote_segment_bytes=64 << 20,
        remote_buffer_bytes=16 << 20,
        remote_key_prefix=f"test-{uuid.uuid4().hex[:8]}",
    )
    fields.update(extra)
    return CacheConfig(**fields)  # type: ignore[arg-type]


def assert_pulled_in_place(cache: EmbeddingCache, name: str, size: int) -> None:
    """`cache` gets `name` (of `size` elements, published by another node) from the store, into
    node memory without a staging buffer (tracemalloc sees no allocation of its size)."""
    tracemalloc.start()
    try:
        value = cache.get_or_compute(key_of(name), lambda: expected_value(name, size))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cache.stats()["hits_remote"] == 1 and cache.stats()["computes"] == 0
    assert fingerprint(value) == fingerprint(expected_value(name, size))
    assert peak < 1 << 20, f"a {size * 2} byte pull allocated {peak} bytes: it went through a buffer"


def compute_marked(cache: EmbeddingCache, name: str) -> tuple[bytes, int]:
    """Pool worker on node B: get_or_compute, failing loudly if it has to compute."""
    value = cache.get_or_compute(key_of(name), lambda: pytest.fail("node B computed instead of pulling"))
    return fingerprint(value), cache.stats()["hits_remote"]


def test_node_b_pulls_once_for_four_processes(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str
) -> None:
    node_a = remote_config(shmcache_namespace, shmcache_mooncake.address)
    node_b = dataclasses.replace(node_a, namespace=other_namespace)
    with EmbeddingCache(node_a) as a:
        value = a.get_or_compute(key_of("shared"), lambda: expected_value("shared", 1 << 20))
        wait_for(lambda: a.stats()["remote_publishes"] == 1, what="the publish")
        with EmbeddingCache(node_b) as b, ProcessPool(node_b) as pool:
            results = pool.run(compute_marked, "shared", processes=4)
            assert {fp for fp, _ in results} == {fingerprint(value)}
            stats = b.stats()
            assert stats["hits_remote"] == 1 and stats["computes"] == 0  # one pull for the node
            assert stats["coalesced_waits"] + stats["hits_node"] >= 3
        assert a.stats()["computes"] == 1


def test_master_killed_mid_run_degrades_without_losing_node_entries(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str
) -> None:
    with EmbeddingCache(remote_config(shmcache_namespace, shmcache_mooncake.address)) as cache:
        cache.get_or_compute(key_of("before"), lambda: expected_value("before"))
        wait_for(lambda: cache.stats()["remote_publishes"] == 1, what="the publish")
        shmcache_mooncake.kill()
        assert fingerprint(cache.get(key_of("before"))) == fingerprint(expected_value("before"))
        value = cache.get_or_compute(key_of("after"), lambda: expected_value("after"))
        assert fingerprint(value) == fingerprint(expected_value("after"))
        time.sleep(0.5)
        assert cache.get(key_of("after")) is not None and cache.get(key_of("before")) is not None


def test_corrupt_or_foreign_remote_values_are_rejected(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str
) -> None:
    config = remote_config(shmcache_namespace, shmcache_mooncake.address)
    writer = RemoteStore(
        CacheConfig(
            remote_master=shmcache_mooncake.address,
            remote_segment_bytes=32 << 20,
            remote_buffer_bytes=8 << 20,
            remote_publish_queue=4,
            store_unavailable_mode="strict",
        ),
        lambda counter, n: None,
    )
    try:
        import numpy as np

        garbage = np.frombuffer(b"SHME" + bytes(200), dtype=np.uint8).copy()
        writer.register(garbage.ctypes.data, garbage.nbytes)
        name = remote_key(config.remote_key_prefix, key_of("evil"))
        assert writer._client.put_from(name, garbage.ctypes.data, garbage.nbytes) == 0
        with EmbeddingCache(config) as cache:
            value = cache.get_or_compute(key_of("evil"), lambda: expected_value("evil"))
            assert fingerprint(value) == fingerprint(expected_value("evil"))
            stats = cache.stats()
            # rejected at the pull, and again at the look after the lease was won (single flight)
            assert stats["remote_rejected"] == 2 and stats["hits_remote"] == 0 and stats["computes"] == 1
    finally:
        writer.close()


def test_a_requests_misses_are_pulled_in_one_batch(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str
) -> None:
    node_a = remote_config(shmcache_namespace, shmcache_mooncake.address)
    names = [f"item-{i}" for i in range(8)] + ["large"]  # "large" is over a batch item's room
    sizes = {name: 2000 for name in names} | {"large": 100_000}
    with EmbeddingCache(node_a) as a:
        for name in names:
            a.get_or_compute(key_of(name), lambda name=name: expected_value(name, sizes[name]))
        wait_for(lambda: a.stats()["remote_publishes"] == len(names), what="the publishes")
        with EmbeddingCache(dataclasses.replace(node_a, namespace=other_namespace)) as b:
            claims = b.try_reserve_many([key_of(name) for name in [*names, "nowhere"]])
            *pulled, nowhere = claims
            assert all(res is not None and res.value is not None for res in pulled)
            got = [fingerprint(res.value) for res in pulled if res is not None]
            assert got == [fingerprint(expected_value(name, sizes[name])) for name in names]
            assert nowhere is not None and nowhere.owned  # not in the store: ours to compute
            nowhere.abandon("test")
            stats = b.stats()
            assert stats["hits_remote"] == len(names) and stats["computes"] == 0
            del claims, pulled, got


def test_a_failed_transfer_frees_its_memory_only_when_every_slice_ended() -> None:
    """TRANSFER_FAIL leaves nothing writing only on TCP and well before Mooncake's own wait (timed
    on the wall clock) ran out (answers.py); a call we stopped waiting for may always still write."""
    now = CallStart.now()
    assert not taints(TRANSFER_FAIL, failure_settled=now.failure_settled(True))
    assert get_into_outcome(TRANSFER_FAIL, 4096, failure_settled=True).outcome is Transfer.QUIET
    assert taints(TRANSFER_FAIL, failure_settled=now.failure_settled(False))  # RDMA: posted reads may land
    waited = CallStart(time.monotonic() - MOONCAKE_WAIT_S, time.time() - MOONCAKE_WAIT_S)
    assert not waited.failure_settled(True)  # its wait ran out
    jumped = CallStart(time.monotonic(), time.time() - MOONCAKE_WAIT_S)  # the wall clock leapt ahead
    assert not jumped.failure_settled(True)
    assert taints(TIMED_OUT, failure_settled=True)
    assert batch_clean([100, TRANSFER_FAIL], failure_settled=True)
    assert not batch_clean([100, TRANSFER_FAIL], failure_settled=False)


class RaisingGetInto:
    """A real Mooncake client whose `get_into` raises instead of answering a code."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_into(self, name: str, address: int, size: int) -> int:
        raise RuntimeError("get_into raised")


def test_a_transfer_call_that_raised_leaves_its_memory_tainted(shmcache_mooncake: MooncakeMaster) -> None:
    """What a call that raised did to its memory is unknown: it is treated as a failed transfer
    (set aside), counted and warned, and no outage begins (it read as "no transfer ran" before)."""
    counted: list[Counter] = []
    config = CacheConfig(
        remote_master=shmcache_mooncake.address,
        remote_segment_bytes=16 << 20,
        remote_buffer_bytes=16 << 20,
        store_unavailable_mode="strict",
    )
    store = RemoteStore(config, lambda counter, n: counted.append(counter))
    try:
        memory = np.zeros(4096, dtype=np.uint8)
        store.register(int(memory.ctypes.data), memory.nbytes)
        store._client = RaisingGetInto(store._client)
        fetched = store.fetch_into("absent", int(memory.ctypes.data), memory.nbytes)
        assert fetched.outcome is Transfer.TAINTED
        assert counted == [Counter.REMOTE_ERRORS] and store.available
    finally:
        store.close()


class OverrunningBatch:
    """A real Mooncake client whose `batch_get_into` answers its first item with one byte more
    than the room it was given (Mooncake never did so far), the others as they came."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def batch_get_into(self, names: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        rcs = list(self._client.batch_get_into(names, addresses, sizes))
        return [sizes[0] + 1, *rcs[1:]]


def test_a_batch_item_answered_past_its_room_makes_the_whole_batch_a_miss(
    shmcache_mooncake: MooncakeMaster,
) -> None:
    """A batch gives each item `cap` bytes of one buffer, side by side: an item answered with
    more may have written into the next one's room, so no item is returned (counted, warned).
    Before, the other items were returned, their bytes possibly overwritten."""
    counted: list[Counter] = []
    config = CacheConfig(remote_master=shmcache_mooncake.address, remote_segment_bytes=16 << 20)
    store = RemoteStore(config, lambda counter, n: counted.append(counter))
    try:
        names = [f"overrun-{uuid.uuid4().hex}-{i}" for i in range(3)]
        for i, name in enumerate(names):
            assert store.put_bytes(name, bytes([i + 1]) * 1000)

        def fetched() -> tuple[list[bytes | None], list[int]]:
            found, larger = store.fetch_many(names, 4096)
            return [None if data is None else bytes(data) for data in found], larger

        assert fetched() == ([bytes([i + 1]) * 1000 for i in range(3)], []) and counted == []
        store._client = OverrunningBatch(store._client)
        assert fetched() == ([None, None, None], []) and counted == [Counter.REMOTE_ERRORS]
        assert store.available  # not an outage
    finally:
        store.close()


class RecordingGetInto:
    """A real Mooncake client that records what its `get_into` and `batch_get_into` answered."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.answers: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_into(self, name: str, address: int, size: int) -> int:
        rc = int(self._client.get_into(name, address, size))
        self.answers.append(rc)
        return rc

    def batch_get_into(self, names: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        rcs = [int(rc) for rc in self._client.batch_get_into(names, addresses, sizes)]
        self.answers += rcs
        return rcs


@pytest.mark.parametrize("call", ["get_into", "batch_get_into"])
def test_a_pull_while_the_object_is_put_is_a_miss_that_leaves_its_memory_clean(
    shmcache_mooncake: MooncakeMaster, call: str
) -> None:
    """While an object's put runs, a pull of it answers -703 (REPLICA_IS_NOT_READY: the master's
    lookup, before any transfer). That is a miss (QUIET: nothing writes its memory), nothing is
    counted. Before, it read as a failed transfer (TAINTED), and an error was counted: the bridge
    set an extent pulled into aside until the process detached, and a batch's pull buffer stayed
    lent for good (the vLLM scheduler's batch path asks again at each step, so it hits that window
    whenever another node publishes the key)."""
    counted: list[Counter] = []
    master = shmcache_mooncake.address
    config = CacheConfig(
        remote_master=master,
        remote_segment_bytes=64 << 20,
        remote_buffer_bytes=64 << 20,
        store_unavailable_mode="strict",
    )
    writer = RemoteStore(config, lambda counter, n: None)
    reader = RemoteStore(config, lambda counter, n: counted.append(counter))
    try:
        source, memory = np.ones(16 << 20, dtype=np.uint8), np.zeros(16 << 20, dtype=np.uint8)
        writer.register(int(source.ctypes.data), source.nbytes)
        reader.register(int(memory.ctypes.data), memory.nbytes)
        recording = RecordingGetInto(reader._client)
        reader._client = recording
        name, pulls = f"being-put-{uuid.uuid4().hex}", []

        def pull() -> str:
            """What one pull got: "miss", or what arrived."""
            if call == "batch_get_into":
                (found,), larger = reader.fetch_many([name], source.nbytes)
                if larger or found is None:
                    return "larger" if larger else "miss"
                return f"{found.nbytes} ones {found.min()}"
            fetched = reader.fetch_into(name, int(memory.ctypes.data), memory.nbytes)
            if fetched.outcome is Transfer.QUIET:
                return "miss"
            return f"{fetched.nbytes} {fetched.outcome.value}"

        def pull_until_it_arrives() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (not pulls or pulls[-1] == "miss"):
                pulls.append(pull())

        puller = threading.Thread(target=pull_until_it_arrives, daemon=True)
        puller.start()
        time.sleep(0.05)  # pulling: misses
        assert writer._client.put_from(name, int(source.ctypes.data), source.nbytes) == 0
        puller.join(60)
        assert REPLICA_IS_NOT_READY in recording.answers, "no pull ran while the put did: nothing tested"
        arrived = f"{source.nbytes} ones 1" if call == "batch_get_into" else f"{source.nbytes} done"
        assert pulls[-1] == arrived and set(pulls[:-1]) == {"miss"}
        assert counted == [] and reader.available
    finally:
        reader.close()
        writer.close()


def open_and_report(config: CacheConfig, out: str) -> None:
    """Open a cache with `config` and write what happened to `out` (in its own process: Mooncake's
    bind address is set once per process)."""
    try:
        with EmbeddingCache(config) as cache:
            cache.put(key_of("local"), expected_value("local"))  # node-local still works
            Path(out).write_text(f"opened, remote {cache.stats()['remote_outages']} outage(s)")
    except RemoteUnavailable as exc:
        Path(out).write_text(f"RemoteUnavailable: {exc}")


@pytest.mark.parametrize("mode", ["strict", "degrade"])
def test_a_local_host_that_is_no_address_of_this_machine_is_an_outage_not_a_crash(
    shmcache_mooncake: MooncakeMaster, namespace: str, tmp_path: Path, mode: str
) -> None:
    """remote_local_host 192.0.2.1 (TEST-NET-1: no address here; binding it fails before anything
    is sent): strict fails at open naming it, degrade opens node-local with the outage counted.
    Before: OSError from the port probe, in both modes."""
    config = remote_config(namespace, shmcache_mooncake.address, remote_local_host="192.0.2.1")
    out = tmp_path / "out"
    worker = spawn(open_and_report, dataclasses.replace(config, store_unavailable_mode=mode), str(out))
    worker.join(60)
    assert worker.exitcode == 0
    expected = "RemoteUnavailable: remote_local_host 192.0.2.1 is not an address of this machine"
    assert out.read_text().startswith(expected if mode == "strict" else "opened, remote 1 outage(s)")


def test_a_pull_buffer_that_grows_gives_its_registration_back(shmcache_mooncake: MooncakeMaster) -> None:
    """Mooncake refuses to register memory overlapping a registered range: a grown pull buffer's
    old array was dropped still registered, and once its addresses were handed out again the new
    one could not be registered, so a stored value read as a miss (3 of these 12, before)."""
    counted: list[Counter] = []
    config = CacheConfig(remote_master=shmcache_mooncake.address, remote_segment_bytes=128 << 20)
    store = RemoteStore(config, lambda counter, n: counted.append(counter))
    try:
        size = 1 << 20
        for i in range(12):
            size = size * 13 // 10
            data = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
            assert store.put_bytes(f"grown-{i}", data)
            got = store.fetch(f"grown-{i}", size)
            assert got is not None and bytes(got) == data, (i, size)
            del got
            store.remove(f"grown-{i}")
        assert counted == []
    finally:
        store.close()
