"""Cross-node single flight: nodes (separate processes and namespaces, one Mooncake master) that
miss the same key at the same time run one compute between them; the lease holder SIGKILLed
mid-compute costs one takeover, and every node still gets the value."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from shmcache import CacheConfig, EmbeddingCache, ShmCacheError, destroy_namespace
from shmcache.remote import lease
from shmcache.remote.lease import LEASE_SUFFIX
from shmcache.remote.store import RemoteStore, remote_key
from shmcache.testing import MooncakeHolder, MooncakeMaster
from tests import workers
from tests.helpers import finished, kill, running, spawn, wait_for
from tests.test_remote import remote_config
from tests.workers import expected_value, fingerprint, key_of

NODES = 3


def node(
    config: CacheConfig, name: str, start: Any, results: Any, marks: str, slow_s: float, batch: bool
) -> None:
    """One node's worker: miss `name` together with the others; report (computed?, fingerprint).
    `batch`: as the encoder hook does, `try_reserve_many` first, then wait on the blocking path."""
    with EmbeddingCache(config) as cache:
        computed = []

        def compute() -> Any:
            computed.append(True)
            Path(marks, f"computing.{os.getpid()}").touch()
            time.sleep(slow_s)  # a slow encoder: the others are waiting meanwhile
            return expected_value(name, 1 << 16)

        start.wait(60)
        [res] = cache.try_reserve_many([key_of(name)]) if batch else [None]
        if res is not None and res.value is not None:
            value = res.value
        elif res is not None:
            with res:
                value = res.commit(compute())
        else:
            value = cache.get_or_compute(key_of(name), compute)
        results.put((os.getpid(), bool(computed), fingerprint(value)))
        while computed and not _publish_settled(cache.stats()):
            time.sleep(0.05)  # a node that computed stays until its publish is over


def _publish_settled(stats: dict[str, int]) -> bool:
    """Our one publish is over: stored, or failed (two nodes that took a lease over together
    both publish; the store keeps the first, and the second may fail), or dropped."""
    return stats["remote_publishes"] + stats["remote_errors"] + stats["remote_publish_drops"] >= 1


def _nodes(
    master: MooncakeMaster, tmp_path: Path, slow_s: float, batch: bool = False, **extra: Any
) -> tuple[list[mp.process.BaseProcess], Any, list[str], Any]:
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(NODES), ctx.Queue()
    prefix = f"sf-{uuid.uuid4().hex[:8]}"
    namespaces = [f"sf-node-{i}-{uuid.uuid4().hex[:8]}" for i in range(NODES)]
    procs = [
        spawn(
            node,
            remote_config(ns, master.address, remote_key_prefix=prefix, **extra),
            "shared",
            start,
            results,
            str(tmp_path),
            slow_s,
            batch,
        )
        for ns in namespaces
    ]
    return procs, results, namespaces, start  # the barrier must outlive the children's start


@pytest.mark.parametrize("batch", [False, True], ids=["get_or_compute", "try_reserve_many"])
def test_three_nodes_that_miss_together_compute_once(
    shmcache_mooncake: MooncakeMaster, tmp_path: Path, batch: bool
) -> None:
    procs, results, namespaces, _start = _nodes(shmcache_mooncake, tmp_path, slow_s=1.0, batch=batch)
    try:
        got = [results.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(60)
        assert [proc.exitcode for proc in procs] == [0] * NODES
        assert sum(computed for _, computed, _ in got) == 1
        assert {fp for _, _, fp in got} == {fingerprint(expected_value("shared", 1 << 16))}
    finally:
        for ns in namespaces:
            destroy_namespace(ns)


def test_the_lease_holder_killed_mid_compute_costs_one_takeover(
    shmcache_mooncake: MooncakeMaster, tmp_path: Path
) -> None:
    procs, results, namespaces, _start = _nodes(
        shmcache_mooncake, tmp_path, slow_s=4.0, compute_timeout_s=3.0
    )
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("computing.*")):
            assert time.monotonic() < deadline, "nobody started computing"
            time.sleep(0.02)
        holder_pid = int(next(tmp_path.glob("computing.*")).suffix[1:])
        holder = next(p for p in procs if p.pid == holder_pid)
        kill(holder)  # mid-compute: its lease stays until its deadline (or its segment goes)
        got = [results.get(timeout=240) for _ in range(NODES - 1)]
        for proc in procs:
            proc.join(60)
        assert sorted(proc.exitcode for proc in procs) == [-9, 0, 0]  # none left waiting
        assert 1 <= sum(computed for _, computed, _ in got) <= NODES - 1
        assert {fp for _, _, fp in got} == {fingerprint(expected_value("shared", 1 << 16))}
        assert len(list(tmp_path.glob("computing.*"))) == 1 + sum(c for _, c, _ in got)
    finally:
        for ns in namespaces:
            destroy_namespace(ns)


def test_single_flight_can_be_switched_off(shmcache_mooncake: MooncakeMaster, tmp_path: Path) -> None:
    procs, results, namespaces, _start = _nodes(
        shmcache_mooncake, tmp_path, slow_s=1.0, remote_single_flight=False
    )
    try:
        got = [results.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(60)
        assert [proc.exitcode for proc in procs] == [0] * NODES
        assert sum(computed for _, computed, _ in got) == NODES  # each node computes on its own
    finally:
        for ns in namespaces:
            destroy_namespace(ns)


def test_a_dropped_publish_gives_the_lease_up_at_once(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str
) -> None:
    import dataclasses
    import threading

    config = remote_config(
        shmcache_namespace, shmcache_mooncake.address, remote_publish_queue=1, compute_timeout_s=60.0
    )
    other = dataclasses.replace(config, namespace=f"sf-other-{uuid.uuid4().hex[:8]}")
    try:
        with EmbeddingCache(config) as a, EmbeddingCache(other) as b:
            assert a._bridge is not None
            assert a.stats()["remote_outages"] == 0, "the master did not answer: nothing below is tested"
            busy = threading.Event()
            for _ in range(2):  # both publisher threads stuck, as two slow transfers would be
                a._bridge.store._publisher.workers.submit(busy.wait, 60)
            a.put(key_of("filler"), expected_value("filler"))  # takes the one queue slot
            a.get_or_compute(key_of("k"), lambda: expected_value("k"))  # holds the lease; publish dropped
            assert a.stats()["remote_publish_drops"] == 1
            started = time.monotonic()
            value = b.get_or_compute(key_of("k"), lambda: expected_value("k"))
            waited = time.monotonic() - started
            busy.set()
            assert fingerprint(value) == fingerprint(expected_value("k")) and b.stats()["computes"] == 1
            assert waited < 20, waited  # not the holder's 60 s deadline: the lease was given up
            del value
    finally:
        destroy_namespace(other.namespace)


def lease_in_store(cache: EmbeddingCache, name: str) -> bytes | None:
    """The lease of `name` as the store holds it now (None: no lease)."""
    bridge = cache._bridge
    assert bridge is not None
    return bridge.store.get_bytes(remote_key(cache.config.remote_key_prefix, key_of(name)) + LEASE_SUFFIX)


@pytest.mark.parametrize(
    ("fail", "giver_withdraws"),
    [(False, False), (True, False), (False, True)],
    ids=["adopter-publishes", "adopter-fails", "giver-withdraws-after-adoption"],
)
def test_a_lease_goes_with_the_reservation_handed_over(
    shmcache_mooncake: MooncakeMaster,
    shmcache_mooncake_holder: MooncakeHolder,
    shmcache_namespace: str,
    other_namespace: str,
    tmp_path: Path,
    fail: bool,
    giver_withdraws: bool,
) -> None:
    """A scheduler process takes the node reservation and the cross-node lease, and hands both to
    its worker process: the worker's publish, or its failure, removes the lease at once (another
    node waits for no deadline); the scheduler forgets it once the worker adopted, and its
    withdraw (an engine closing) then leaves it alone."""
    import dataclasses

    config = remote_config(
        shmcache_namespace,
        shmcache_mooncake.address,
        compute_timeout_s=60.0,
        remote_holder=shmcache_mooncake_holder.address,
    )
    with (
        EmbeddingCache(config) as a,
        EmbeddingCache(dataclasses.replace(config, namespace=other_namespace, remote_holder=None)) as b,
    ):
        [res] = a.try_reserve_many([key_of("k")])
        assert res is not None and res.owned
        token = lease_in_store(a, "k")
        assert token is not None  # the lease is ours
        ticket = res.hand_over()
        assert ticket.lease is not None and ticket.lease.token == token
        adopted, go = tmp_path / "adopted", tmp_path / "go"
        with running(workers.adopt_then, config, ticket, "k", str(adopted), str(go), fail) as adopter:
            wait_for(adopted.exists, what="the adoption")
            assert adopted.read_text() == "adopted"
            if giver_withdraws:
                res.withdraw()  # fenced: the worker's reservation and lease stay
            assert res.let_go()
            assert a._bridge is not None and a._bridge.leases.of(res) is None  # forgotten here
            assert lease_in_store(a, "k") == token  # still held: by the worker now
            go.touch()
            assert finished(adopter)
        assert lease_in_store(a, "k") is None  # removed by the worker, not left to its deadline
        started = time.monotonic()
        value = b.get_or_compute(key_of("k"), lambda: expected_value("k"))
        assert time.monotonic() - started < 20  # not the 60 s deadline
        assert fingerprint(value) == fingerprint(expected_value("k"))
        assert b.stats()["computes" if fail else "hits_remote"] == 1
        del value


def test_a_handed_over_reservation_abandoned_before_its_adoption_removes_its_lease(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str
) -> None:
    with EmbeddingCache(remote_config(shmcache_namespace, shmcache_mooncake.address)) as a:
        [res] = a.try_reserve_many([key_of("k")])
        assert res is not None and res.owned and lease_in_store(a, "k") is not None
        res.hand_over()
        res.abandon("the worker never came")  # nobody adopted it: it ends here, and its lease
        assert lease_in_store(a, "k") is None


@pytest.mark.parametrize(
    ("batch", "take"),
    [(False, True), (True, True), (True, False)],
    ids=["get_or_compute", "try_reserve_many", "try_reserve_many-without-lease"],
)
def test_a_lease_our_node_took_is_taken_over_at_once_when_its_taker_died(
    shmcache_mooncake: MooncakeMaster,
    shmcache_mooncake_holder: MooncakeHolder,
    shmcache_namespace: str,
    tmp_path: Path,
    batch: bool,
    take: bool,
) -> None:
    """A process of our node that held a key's node reservation and lease is SIGKILLed (the lease
    lives on in the holder's segment): the node's next process takes over the reservation and,
    seeing our own node's tag on the lease, the lease too, at once, not at its 60 s deadline.
    One that takes no lease (an `ec_consumer` engine) removes the orphan: other nodes would
    otherwise wait for its deadline."""
    config = remote_config(
        shmcache_namespace,
        shmcache_mooncake.address,
        compute_timeout_s=60.0,
        remote_holder=shmcache_mooncake_holder.address,
    )
    ready = tmp_path / "ready"
    with EmbeddingCache(config) as cache:  # attached throughout, as another engine or `shmcache hold`
        victim = spawn(workers.reserve_then_wait, config, "k", batch, str(ready))
        try:
            wait_for(ready.exists, what="the victim's reservation and lease")
        finally:
            kill(victim)
        assert lease_in_store(cache, "k") is not None  # the dead process's lease outlived it
        started = time.monotonic()
        if batch:
            [res] = cache.try_reserve_many([key_of("k")], lease=take)
            assert res is not None and res.owned  # not given back as another node's compute
            if not take:
                assert lease_in_store(cache, "k") is None  # the orphan is gone
            value = res.commit(expected_value("k"))
        else:
            value = cache.get_or_compute(key_of("k"), lambda: expected_value("k"))
        assert time.monotonic() - started < 20  # not the lease's 60 s deadline
        assert fingerprint(value) == fingerprint(expected_value("k"))
        assert cache.stats()["takeovers"] == 1 and cache.stats()["puts"] == 1
        del value


def test_a_lease_near_its_deadline_is_left_to_expire(shmcache_mooncake: MooncakeMaster) -> None:
    """Mooncake has no compare-and-remove: between the holder's read of its lease and its remove,
    a waiter past the deadline may put its own lease there, and the remove would take that one
    away (a third node would then compute too). A lease within `RELEASE_MARGIN_S` of its deadline
    is left to expire; one further off is removed."""
    store = RemoteStore(remote_config("unused", shmcache_mooncake.address), lambda counter, n: None)
    try:
        near = lease.try_hold(store, "near", lease.RELEASE_MARGIN_S / 2, "our-node", {})
        far = lease.try_hold(store, "far", 60.0, "our-node", {})
        assert near is not None and far is not None
        lease.release(store, lease.Lease("near", near))
        lease.release(store, lease.Lease("far", far))
        assert store.get_bytes("near" + LEASE_SUFFIX) == near  # a waiter takes it over at its deadline
        assert store.get_bytes("far" + LEASE_SUFFIX) is None
    finally:
        store.close()


def another_nodes_lease(cache: EmbeddingCache, name: str) -> None:
    """Put another node's live lease of `name`, 60 s from its deadline (a hung holder, a clock ahead)."""
    bridge = cache._bridge
    assert bridge is not None
    token = f"{uuid.uuid4().hex[:16]}|another-node|{time.time() + 60:.3f}"
    assert bridge.store.put_bytes(
        remote_key(cache.config.remote_key_prefix, key_of(name)) + LEASE_SUFFIX, token.encode()
    )


def test_a_lease_held_elsewhere_is_waited_for_at_most_half_our_compute_timeout(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str
) -> None:
    """Another node holds the lease with a deadline 60 s off (a hung holder, a clock ahead): our
    node's owner waited for that deadline while the node's other callers, waiting on its node
    reservation for compute_timeout_s (6 s) each, got `ComputeTimeout`. Now the owner takes over
    after 3 s, and every caller of the node gets the value."""
    config = remote_config(shmcache_namespace, shmcache_mooncake.address, compute_timeout_s=6.0)
    with EmbeddingCache(config) as cache:
        another_nodes_lease(cache, "slow")
        got: dict[str, str] = {}

        def slow() -> Any:
            time.sleep(1.0)
            return expected_value("slow")

        def caller(role: str) -> None:
            try:
                value = cache.get_or_compute(key_of("slow"), slow)
                got[role] = "value" if fingerprint(value) == fingerprint(expected_value("slow")) else "wrong"
            except ShmCacheError as exc:
                got[role] = type(exc).__name__

        owner = threading.Thread(target=caller, args=("owner",))
        owner.start()
        time.sleep(0.3)
        waiter = threading.Thread(target=caller, args=("waiter",))
        waiter.start()
        owner.join(90)
        waiter.join(90)
        assert got == {"owner": "value", "waiter": "value"}, got
        assert cache.stats()["computes"] == 1


def test_a_lease_held_elsewhere_defers_a_batch_for_at_most_half_our_compute_timeout(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str
) -> None:
    """The batch path (a vLLM scheduler asks at every step): another node's lease, 60 s from its
    deadline, deferred the key until then; now for half of our compute_timeout_s (1 s)."""
    config = remote_config(shmcache_namespace, shmcache_mooncake.address, compute_timeout_s=2.0)
    with EmbeddingCache(config) as cache:
        another_nodes_lease(cache, "batched")
        assert cache.try_reserve_many([key_of("batched")]) == [None]  # another node computes it
        time.sleep(1.2)
        [res] = cache.try_reserve_many([key_of("batched")])
        assert res is not None and res.owned  # taken over
        res.commit(expected_value("batched"))
