"""The bounds of the cross-node lease (`shmcache/remote/lease.py`), each found by an independent
review: a caller that only looks waits for another node's lease no longer than the batch path
does; successive holders share one wait; a lease won and then left by a raising pull is removed;
the batch path does not wait on a lease in a dead segment; a lease an outage kept from removal
goes once the store answers; the batch path looks for the value once more after winning a lease,
and removes the leases it won when that look raises; the tokens of other nodes' leases a process
remembers stay bounded when it only looks."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from shmcache import EmbeddingCache
from shmcache.remote import lease
from shmcache.remote.lease import LEASE_SUFFIX
from shmcache.remote.store import RemoteStore, remote_key
from shmcache.testing import MooncakeMaster
from tests.helpers import kill, running, stop, wait_for
from tests.test_remote import remote_config
from tests.test_remote_in_place import SIZE
from tests.test_remote_single_flight import another_nodes_lease, lease_in_store
from tests.workers import expected_value, key_of


def _far_token(node: str = "another-node") -> bytes:
    """Another node's live lease token, 60 s from its deadline (a hung holder, a clock ahead)."""
    return f"{uuid.uuid4().hex[:16]}|{node}|{time.time() + 60:.3f}".encode()


def test_a_caller_that_only_looks_waits_for_another_nodes_lease_at_most_half_its_timeout(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str
) -> None:
    """A vLLM `ec_consumer` engine (`lease=False`) deferred a key for as long as another node's
    lease lived (60 s here, without a bound for a foreign token); now for half of its
    compute_timeout_s (1 s), as the batch path that takes leases."""
    config = remote_config(shmcache_namespace, shmcache_mooncake.address, compute_timeout_s=2.0)
    with EmbeddingCache(config) as cache:
        another_nodes_lease(cache, "looked")
        assert cache.try_reserve_many([key_of("looked")], lease=False) == [None]
        time.sleep(1.2)
        [res] = cache.try_reserve_many([key_of("looked")], lease=False)
        assert res is not None and res.owned  # computes for itself now
        res.commit(expected_value("looked"))


class _RacedStore(RemoteStore):
    """A real store where, at each of our first `races` takeovers, another node's takeover lands
    right after ours (its far-off token is what we read back)."""

    def __init__(self, *args: Any, races: int) -> None:
        super().__init__(*args)
        self.races = races

    def upsert_bytes(self, name: str, data: bytes) -> bool:
        ours = super().upsert_bytes(name, data)
        if self.races > 0:
            self.races -= 1
            assert super().upsert_bytes(name, _far_token())
        return ours


def test_successive_holders_share_one_wait_of_half_the_timeout(shmcache_mooncake: MooncakeMaster) -> None:
    """Each takeover lost to another node's (three in a row) started a fresh wait of half the
    timeout: 4 x 1 s here, while the node's own waiters time out after 2 s. Now one wait."""
    store = _RacedStore(remote_config("unused", shmcache_mooncake.address), lambda counter, n: None, races=3)
    name = f"raced-{uuid.uuid4().hex}"
    try:
        assert store.put_bytes(name + LEASE_SUFFIX, _far_token())
        started = time.monotonic()
        token, value = lease.hold_or_wait(store, name, 2.0, "our-node", lambda: None)
        waited = time.monotonic() - started
        assert token is not None and value is None  # we compute
        assert waited < 2.0, waited  # the code before: 4 s
    finally:
        store.close()


def test_a_lease_won_then_left_by_a_raising_pull_is_removed(shmcache_mooncake: MooncakeMaster) -> None:
    """The last look for the value after winning the lease raised (a lock timeout, an interrupt):
    nobody computes under that lease, so it is removed and other nodes take over at once instead
    of waiting half their timeout."""
    store = RemoteStore(remote_config("unused", shmcache_mooncake.address), lambda counter, n: None)
    name = f"left-{uuid.uuid4().hex}"

    def pull() -> None:
        raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            lease.hold_or_wait(store, name, 60.0, "our-node", pull)
        assert store.get_bytes(name + LEASE_SUFFIX) is None
    finally:
        store.close()


def put_a_lease_then_wait(master: str, name: str, ready: str) -> None:
    """Another node: put a live lease of `name` into its own segment, say so, then wait to die."""
    store = RemoteStore(remote_config("unused", master), lambda counter, n: None)
    assert store.put_bytes(name + LEASE_SUFFIX, _far_token())
    Path(ready).touch()
    time.sleep(600)


def test_the_batch_path_does_not_wait_on_a_lease_in_a_dead_segment(
    shmcache_mooncake: MooncakeMaster, tmp_path: Path
) -> None:
    """The lease of a node that died sits in its dead segment until the master drops it
    (~`client_ttl`, 10 s): Mooncake answers empty meanwhile. The batch path (a vLLM scheduler
    step) looked again for 2 s per such key; now for `BATCH_READ_S`, then computes."""
    name = f"dead-{uuid.uuid4().hex}"
    ready = tmp_path / "ready"
    with running(put_a_lease_then_wait, shmcache_mooncake.address, name, str(ready)) as other:
        wait_for(ready.exists, timeout=60, what="the other node's lease")
        kill(other)
    store = RemoteStore(remote_config("unused", shmcache_mooncake.address), lambda counter, n: None)
    try:
        assert store.get_bytes(name + LEASE_SUFFIX) is None, "the lease is readable: nothing here is tested"
        started = time.monotonic()
        token = lease.try_hold(store, name, 60.0, "our-node", {})
        took = time.monotonic() - started
        assert token is not None  # we compute
        assert took < 1.5, took  # the code before: 2 s and more
    finally:
        store.close()


def test_a_lease_an_outage_kept_from_removal_goes_once_the_store_answers(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str
) -> None:
    """Our compute ended while the store did not answer (the master hung a moment): the publish
    is dropped and the lease cannot be removed then. It stayed until its deadline (other nodes
    waited half their compute timeout for it); now it goes at this process's next remote step
    once the store answers."""
    config = remote_config(shmcache_namespace, shmcache_mooncake.address, remote_timeout_s=0.5)
    master = shmcache_mooncake.process.pid
    assert master is not None
    with EmbeddingCache(config) as cache:
        assert cache._bridge is not None
        store = cache._bridge.store
        held = remote_key(config.remote_key_prefix, key_of("k")) + LEASE_SUFFIX

        def compute() -> Any:
            assert store.get_bytes(held) is not None  # we hold the lease
            stop(master)
            try:
                store.size_of("anything")  # no answer within remote_timeout_s: the outage begins
            finally:
                os.kill(master, signal.SIGCONT)
            assert not store.available
            return expected_value("k")

        cache.get_or_compute(key_of("k"), compute)
        assert cache.stats()["remote_publish_drops"] == 1
        wait_for(lambda: store.available, timeout=30, what="the store to answer again")
        assert store.get_bytes(held) is not None  # nothing removed it yet
        cache.get_or_compute(key_of("other"), lambda: expected_value("other"))  # a remote step
        assert store.get_bytes(held) is None


def test_the_batch_path_looks_once_more_after_winning_a_lease(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str
) -> None:
    """Node A computes, publishes and removes its lease between node B's batch pull (a miss) and
    B's lease (won, A's is gone). B pulled nothing more and computed the key a second time; now
    it looks once more, as the blocking path does, finds A's value, and gives its lease back."""
    config_a = remote_config(shmcache_namespace, shmcache_mooncake.address)
    config_b = dataclasses.replace(config_a, namespace=other_namespace)
    with EmbeddingCache(config_a) as a, EmbeddingCache(config_b) as b:
        bridge = b._bridge
        assert bridge is not None
        lease_now = bridge.lease_now

        def after_a_published(*args: Any, **kwargs: Any) -> bool:  # B between its pull and its lease
            a.get_or_compute(key_of("k"), lambda: expected_value("k"))
            wait_for(lambda: a.stats()["remote_publishes"] == 1, what="A's publish")
            wait_for(lambda: lease_in_store(a, "k") is None, what="A's lease removed")
            return lease_now(*args, **kwargs)

        bridge.lease_now = after_a_published  # type: ignore[method-assign]
        [res] = b.try_reserve_many([key_of("k")])
        assert res is not None and res.value is not None  # the code before: B's reservation, B computes
        assert (b.stats()["hits_remote"], b.stats()["computes"], a.stats()["computes"]) == (1, 0, 1)
        assert lease_in_store(b, "k") is None  # B's lease given back
        del res


def test_the_batch_paths_won_leases_go_when_its_last_look_raises(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str
) -> None:
    """Node A stores the key between node B's batch pull and B's lease; B's look after winning
    the lease is interrupted once its transfer into node memory returned, before its answer was
    read: the reservation is set aside, so its fenced withdraw ends nothing and only forgot the
    lease, which stayed in the store for other nodes to wait on. Now it is removed."""
    config_a = remote_config(shmcache_namespace, shmcache_mooncake.address)
    config_b = dataclasses.replace(config_a, namespace=other_namespace)
    with EmbeddingCache(config_a) as a, EmbeddingCache(config_b) as b:
        bridge = b._bridge
        assert bridge is not None
        lease_now, fetch_into = bridge.lease_now, bridge.store.fetch_into

        def then_a_stores(*args: Any, **kwargs: Any) -> bool:
            won = lease_now(*args, **kwargs)
            a.put(key_of("k"), expected_value("k", SIZE))  # no lease: a put stores what it has
            wait_for(lambda: a.stats()["remote_publishes"] == 1, what="A's publish")
            return won

        def interrupted_after_the_transfer(*args: Any, **kwargs: Any) -> Any:
            fetch_into(*args, **kwargs)
            raise KeyboardInterrupt

        bridge.lease_now = then_a_stores  # type: ignore[method-assign]
        bridge.store.fetch_into = interrupted_after_the_transfer  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            b.try_reserve_many([key_of("k")])
        assert b.stats()["remote_set_aside"] == 1, b.stats()
        assert lease_in_store(b, "k") is None  # the code before: left for the others to wait on


def test_an_engine_that_only_looks_forgets_old_lease_tokens(shmcache_mooncake: MooncakeMaster) -> None:
    """The tokens of other nodes' leases a process saw are dropped a whole timeout after it first
    saw them; a caller that only looks (an `ec_consumer` engine) kept every one it ever saw."""
    store = RemoteStore(remote_config("unused", shmcache_mooncake.address), lambda counter, n: None)
    name = f"looked-{uuid.uuid4().hex}"
    try:
        assert store.put_bytes(name + LEASE_SUFFIX, _far_token())
        seen = {b"an old token": time.monotonic() - 100.0}
        assert lease.held_elsewhere(store, name, "our-node", 60.0, seen)
        assert b"an old token" not in seen and len(seen) == 1
    finally:
        store.close()
