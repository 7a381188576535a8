"""Pulls straight into node memory (a node with its own Mooncake segment): no staging copy, an
extent sized by the last entry of the key's kind (no size lookup), and a transfer that hangs sets
its memory aside until it can no longer write there (freed once the late transfer completes)."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmcache import CacheConfig, EmbeddingCache
from shmcache.node.slots import SlotState
from shmcache.remote.answers import Transfer
from shmcache.remote.bridge import RemoteBridge
from shmcache.remote.setaside import SetAside
from shmcache.remote.store import RemoteStore, remote_key
from shmcache.testing import MooncakeMaster
from tests.helpers import InterruptAtLine, kill, spawn, stop, wait_for
from tests.test_remote import assert_pulled_in_place, remote_config
from tests.test_remote_recovery import _available
from tests.workers import expected_value, fingerprint, key_of, pull_until_interrupted_then_stay

SIZE = 1 << 21  # bf16 elements: 4 MiB


def publisher(config: CacheConfig, name: str, numel: int, ready: Any, done: Any) -> None:
    """Node A: compute and publish `name` (`numel` elements), then stay (its segment holds the
    store's copy)."""
    with EmbeddingCache(config) as cache:
        cache.put(key_of(name), expected_value(name, numel))
        while cache.stats()["remote_publishes"] < 1:
            time.sleep(0.01)
        ready.set()
        done.wait(120)


@contextlib.contextmanager
def published(
    master: str, node_a: str, node_b: str, name: str, remote_timeout_s: float, numel: int = SIZE
) -> Iterator[tuple[CacheConfig, mp.process.BaseProcess]]:
    """Node A publishes `name` (`numel` bf16 elements, 4 MiB by default) and stays. Yields (node
    B's config: room for 3 entries and `remote_timeout_s`; node A's process); node A is resumed
    and stopped afterwards."""
    config_a = remote_config(node_a, master)
    nbytes = 2 * SIZE + 4096  # an entry of SIZE bf16 elements, with its header
    config_b = dataclasses.replace(
        config_a, namespace=node_b, capacity_bytes=3 * nbytes, remote_timeout_s=remote_timeout_s
    )
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    proc = spawn(publisher, config_a, name, numel, ready, done)
    try:
        assert ready.wait(60), "node A did not publish"
        yield config_b, proc
    finally:
        if proc.is_alive() and proc.pid is not None:  # (a killed waiter would hang `done.set()`)
            os.kill(proc.pid, signal.SIGCONT)  # first: a stopped process would hold up `done.set()`
            done.set()
            proc.join(30)
        if proc.is_alive():
            kill(proc)


@contextlib.contextmanager
def stopped_publisher(
    master: str, node_a: str, node_b: str, numel: int = SIZE
) -> Iterator[tuple[CacheConfig, int]]:
    """Node A publishes "shared" (`numel` bf16 elements, 4 MiB by default) and is SIGSTOPped: its
    segment serves nothing, so a pull of it hangs mid-transfer. Yields (node B's config, room for
    3 entries and a 1 s remote timeout; node A's pid, to SIGCONT it)."""
    with published(master, node_a, node_b, "shared", 1.0, numel) as (config_b, proc):
        assert proc.pid is not None
        stop(proc.pid)
        yield config_b, proc.pid


def test_a_pull_lands_in_node_memory_without_a_staging_copy(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str
) -> None:
    node_a = remote_config(shmcache_namespace, shmcache_mooncake.address)
    with EmbeddingCache(node_a) as a:
        a.put(key_of("frame"), expected_value("frame", SIZE))
        wait_for(lambda: a.stats()["remote_publishes"] == 1, what="the publish")
        with EmbeddingCache(dataclasses.replace(node_a, namespace=other_namespace)) as b:
            assert_pulled_in_place(b, "frame", SIZE)


def test_a_pull_sizes_its_extent_by_a_steady_size_of_its_kind(
    shmcache_mooncake: MooncakeMaster,
    shmcache_namespace: str,
    other_namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once two entries of a kind had one size, node B pulls the next without asking the store
    for its size: an object smaller than the guess gets its extent cut to its size; one larger is
    refused before any transfer, then pulled after a size lookup. A size that just changed is
    not a guess."""
    numels = {"large 1": SIZE, "large 2": SIZE, "small 1": SIZE // 4, "small 2": SIZE // 4, "large 3": SIZE}
    node_a = remote_config(shmcache_namespace, shmcache_mooncake.address)  # all: image keys of raw bytes
    looked_up: list[str] = []
    size_of = RemoteStore.size_of

    def counted(store: RemoteStore, name: str) -> int | None:
        looked_up.append(name)
        return size_of(store, name)

    with EmbeddingCache(node_a) as a:
        for name, numel in numels.items():
            a.put(key_of(name), expected_value(name, numel))
        wait_for(lambda: a.stats()["remote_publishes"] == len(numels), what="the publishes")
        monkeypatch.setattr(RemoteStore, "size_of", counted)
        with EmbeddingCache(dataclasses.replace(node_a, namespace=other_namespace)) as b:
            for name, numel in numels.items():
                value = b.get_or_compute(key_of(name), lambda: pytest.fail("node B computed"))
                assert fingerprint(value) == fingerprint(expected_value(name, numel))
                del value
            stats = b.stats()
            assert stats["hits_remote"] == 5 and stats["remote_set_aside"] == stats["remote_errors"] == 0
            assert stats["bytes"] == a.stats()["bytes"]  # each extent cut to its entry, as on node A
    prefix = node_a.remote_key_prefix
    sized = ("large 1", "large 2", "small 2", "large 3")  # "small 1" guessed large, "large 3" small
    assert looked_up == [remote_key(prefix, key_of(name)) for name in sized]


def test_a_miss_gives_the_extent_of_its_guess_back_to_the_compute(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str
) -> None:
    """A node miss the store does not have either: the extent made for the guess goes back before
    the compute, so a node with room for one entry stores the value computed."""
    node_a = remote_config(shmcache_namespace, shmcache_mooncake.address)
    entry_bytes = 2 * SIZE + 4096
    node_b = dataclasses.replace(node_a, namespace=other_namespace, capacity_bytes=entry_bytes * 3 // 2)
    with EmbeddingCache(node_a) as a:
        for name in ("seen 1", "seen 2"):
            a.put(key_of(name), expected_value(name, SIZE))
        wait_for(lambda: a.stats()["remote_publishes"] == 2, what="the publishes")
        with EmbeddingCache(node_b) as b:
            for name in ("seen 1", "seen 2"):  # a steady size: the next pull of the kind guesses it
                seen = b.get_or_compute(key_of(name), lambda: pytest.fail("node B computed"))
                del seen
                b.flush_releases()  # unpinned: the next allocation can evict it
            value = b.get_or_compute(key_of("new"), lambda: expected_value("new", SIZE))
            assert fingerprint(value) == fingerprint(expected_value("new", SIZE))
            del value
            stats = b.stats()
            assert stats["hits_remote"] == 2 and stats["computes"] == 1 and stats["uncacheable"] == 0, stats
            cached = b.get(key_of("new"))
            assert cached is not None and fingerprint(cached) == fingerprint(expected_value("new", SIZE))
            del cached


def test_a_guessed_pull_on_a_hung_master_gets_its_memory_back_when_the_late_call_fails(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str
) -> None:
    """Node B's third pull of a kind guesses its extent and goes straight to `get_into`. The
    master is hung (SIGSTOP), so the call outlives its wait: the extent is set aside and the value
    computed. When the master dies the late call answers an RPC failure (no transfer ran), and
    the memory comes back then, not at B's close."""
    node_a = remote_config(shmcache_namespace, shmcache_mooncake.address)
    node_b = dataclasses.replace(node_a, namespace=other_namespace, remote_timeout_s=1.0)
    names = ("one", "two", "three")
    with EmbeddingCache(node_a) as a:
        for name in names:
            a.put(key_of(name), expected_value(name, SIZE))
        wait_for(lambda: a.stats()["remote_publishes"] == len(names), what="the publishes")
        with EmbeddingCache(node_b) as b:
            for name in names[:2]:  # a steady size: the next pull of the kind guesses it
                pulled = b.get_or_compute(key_of(name), lambda: pytest.fail("node B computed"))
                del pulled
            stop(shmcache_mooncake.process.pid)
            try:
                value = b.get_or_compute(key_of("three"), lambda: expected_value("three", SIZE))
                assert fingerprint(value) == fingerprint(expected_value("three", SIZE))
                del value
                stats = b.stats()
                assert (stats["remote_set_aside"], stats["stale"], stats["computes"]) == (1, 1, 1), stats
            finally:
                shmcache_mooncake.kill()  # a stopped process dies too: its connections reset
            wait_for(lambda: b.stats()["stale"] == 0, timeout=60, what="the late call's answer")


def test_an_interrupted_pull_gets_its_memory_back_when_the_late_call_ends(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str, tmp_path: Path
) -> None:
    """A process's guessed pull waits on a hung master and is interrupted (SIGINT): the extent is
    set aside, and the call it stopped waiting for is still watched, so when the master dies and
    the call answers (no transfer ran) the memory comes back while the process lives on."""
    node_a = remote_config(shmcache_namespace, shmcache_mooncake.address)
    node_b = dataclasses.replace(node_a, namespace=other_namespace, remote_timeout_s=60.0)
    names = ("one", "two", "three")
    go, out = tmp_path / "go", tmp_path / "out"
    with EmbeddingCache(node_a) as a:
        for name in names:
            a.put(key_of(name), expected_value(name, SIZE))
        wait_for(lambda: a.stats()["remote_publishes"] == len(names), what="the publishes")
        steady = list(names[:2])
        puller = spawn(pull_until_interrupted_then_stay, node_b, steady, "three", SIZE, str(go), str(out))
        try:
            wait_for(Path(f"{go}.ready").exists, timeout=60, what="node B's pulls of a steady size")
            with EmbeddingCache(dataclasses.replace(node_b, remote_master=None)) as b:
                stop(shmcache_mooncake.process.pid)
                try:
                    go.touch()
                    slots = b._node.slots.array  # read only: the puller's reservation gets its extent
                    wait_for(
                        lambda: bool(((slots["state"] == SlotState.RESERVED) & (slots["size"] > 0)).any()),
                        what="the puller's extent",
                    )
                    time.sleep(0.5)  # its get_into, called right after, waits on the hung master
                    assert puller.pid is not None
                    os.kill(puller.pid, signal.SIGINT)
                    wait_for(out.exists, what="the puller's interruption")
                    assert out.read_text() == "interrupted"
                    assert b.stats()["stale"] == 1  # set aside: the call may still write there
                finally:
                    shmcache_mooncake.kill()  # the late call answers an RPC failure
                wait_for(lambda: b.stats()["stale"] == 0, timeout=60, what="the late call's answer")
                assert puller.is_alive()  # not the detach: the late call gave the memory back
        finally:
            Path(f"{go}.stop").touch()
            puller.join(60)
            if puller.is_alive():
                kill(puller)
    assert puller.exitcode == 0


def _held(slots: np.ndarray) -> set[tuple[int, int]]:
    """(slot, gen) of the extents out of the allocator's hands: reserved or set aside."""
    state = slots["state"]
    mask = ((state == SlotState.RESERVED) & (slots["size"] > 0)) | (state == SlotState.STALE)
    return {(int(slot), int(slots["gen"][slot])) for slot in mask.nonzero()[0]}


def _hung(local: dict[str, Any]) -> bool:
    """In `_write_in_place`: its transfer's answer is read, and it hung (TAINTED)."""
    fetched = local.get("fetched")
    return fetched is not None and fetched.outcome is Transfer.TAINTED


def test_an_interrupt_anywhere_after_a_failed_transfer_never_frees_its_memory(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str
) -> None:
    """A guessed pull on a hung master outlives its wait (the transfer may still write its extent);
    an interrupt at each line from the reading of that answer to the end of the set-aside in turn.
    Each time the extent stays out of the allocator's hands (set aside, or still reserved by us),
    whereas giving the reservation back there would free memory a transfer may still write."""
    numel = 1 << 15  # 64 KiB entries
    node_a = remote_config(shmcache_namespace, shmcache_mooncake.address)
    node_b = dataclasses.replace(node_a, namespace=other_namespace, remote_timeout_s=0.5)
    names = [f"item-{i}" for i in range(32)]
    with EmbeddingCache(node_a) as a:
        for name in names:
            a.put(key_of(name), expected_value(name, numel))
        wait_for(lambda: a.stats()["remote_publishes"] == len(names), what="the publishes")
        with EmbeddingCache(node_b) as b:
            slots = b._node.slots.array  # read only: which extents are held

            for name in names[:2]:  # a steady size: the next pulls of the kind guess it
                pulled = b.get_or_compute(key_of(name), lambda: pytest.fail("node B computed"))
                del pulled
            master = shmcache_mooncake.process.pid
            answered = {
                # from the reading of a transfer that hung (a quiet answer, at once, is no case)
                RemoteBridge._write_in_place.__code__: _hung,
                SetAside.set_aside.__code__: None,
            }
            at, quiet = 0, 0
            for name in names[2:]:
                before, set_aside = _held(slots), b.stats()["remote_set_aside"]
                interrupter = InterruptAtLine(at, answered)
                stop(master)
                try:
                    with interrupter.tracing(), contextlib.suppress(KeyboardInterrupt):
                        value = b.get_or_compute(key_of(name), lambda n=name: expected_value(n, numel))
                    counted = b.stats()["remote_set_aside"] - set_aside
                    if not (counted or interrupter.fired or interrupter.seen):
                        # no transfer hung (the master's connection closed under the call: RPC_FAIL,
                        # answered at once, nothing in flight): nothing was set aside, no line of
                        # the set-aside ran; the same line again, with the next name
                        assert fingerprint(value) == fingerprint(expected_value(name, numel))
                        del value
                        quiet += 1
                        assert quiet <= 3, "the pulls never reached a hung transfer"
                    else:
                        assert counted == 1 or (counted == 0 and interrupter.fired), counted  # never twice
                        if not interrupter.fired:  # past the set-aside: it looked again and computed
                            assert fingerprint(value) == fingerprint(expected_value(name, numel))
                            del value
                            assert at > 5 and interrupter.seen == at, at  # every line interrupted once
                            break
                        new = _held(slots) - before  # (an earlier pull's late call may free its extent)
                        assert len(new) == 1, f"interrupted at line {at}: its extent was freed"
                        at += 1
                finally:
                    os.kill(master, signal.SIGCONT)
                wait_for(lambda: _available(b), timeout=30, what="the master to be seen again")
            else:
                pytest.fail("the pull never got past the interrupts")


def test_a_transfer_that_hangs_sets_its_memory_aside_until_it_ends(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str
) -> None:
    with stopped_publisher(shmcache_mooncake.address, shmcache_namespace, other_namespace) as (
        node_b,
        node_a,
    ):
        reader_config = dataclasses.replace(node_b, remote_master=None)
        with EmbeddingCache(node_b) as b, EmbeddingCache(reader_config) as reader:
            value = b.get_or_compute(key_of("shared"), lambda: expected_value("shared", SIZE))
            assert fingerprint(value) == fingerprint(expected_value("shared", SIZE))
            stats = b.stats()
            assert stats["remote_set_aside"] == 1 and stats["computes"] == 1 and stats["hits_remote"] == 0
            assert stats["misses"] == 1, stats  # one lookup: counted twice before (the look again)
            del value
            fillers = [f"filler-{i}" for i in range(4)]
            for name in fillers:  # they evict each other, never the memory set aside (first fit: 0);
                # put node-locally: a publish of b's to A's stopped segment pinned its entry for long
                reader.put(key_of(name), expected_value(name, SIZE))
            assert b.stats()["stale"] == 1  # the memory set aside
            os.kill(node_a, signal.SIGCONT)  # the transfer goes on, into the memory set aside
            wait_for(lambda: b.stats()["stale"] == 0, timeout=60, what="the late transfer's end")
            b.close()  # freed when the transfer completed, not only at the detach
            present = [name for name in fillers if reader.get(key_of(name)) is not None]
            assert present == fillers[-2:], present  # 2 of 3 entries' room: 1 was set aside
            for name in present:
                assert fingerprint(reader.get(key_of(name))) == fingerprint(expected_value(name, SIZE))
            assert reader.stats()["corrupt_records"] == 0
            held = [reader.get_or_compute(key_of(n), lambda n=n: expected_value(n, SIZE)) for n in "xyz"]
            assert reader.stats()["uncacheable"] == 0  # all 3 fit: the memory set aside is free again
            del held


def set_aside_and_stay(config: CacheConfig, name: str, ready: Any) -> None:
    """Node B's victim: a pull that hangs (node A is stopped) sets its memory aside; the value is
    computed instead; then stay, the memory still set aside, until killed."""
    with EmbeddingCache(config) as cache:
        value = cache.get_or_compute(key_of(name), lambda: expected_value(name, SIZE))
        assert fingerprint(value) == fingerprint(expected_value(name, SIZE))
        assert cache.stats()["remote_set_aside"] == 1
        ready.set()
        time.sleep(600)


def test_memory_set_aside_by_a_process_that_dies_comes_back_to_the_node(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str
) -> None:
    victim_ready = mp.get_context("spawn").Event()
    with (
        stopped_publisher(shmcache_mooncake.address, shmcache_namespace, other_namespace) as (node_b, _),
        EmbeddingCache(dataclasses.replace(node_b, remote_master=None)) as survivor,
    ):
        victim = spawn(set_aside_and_stay, node_b, "shared", victim_ready)
        try:
            assert victim_ready.wait(60), "the victim did not set its pull's memory aside"
            assert survivor.stats()["stale"] == 1  # the memory set aside, pinned by the victim
        finally:
            kill(victim)  # its transfer died with it: nothing can write that memory any more
        survivor.gc()  # reaps the dead client: its pin no longer counts
        stats = survivor.stats()
        assert stats["stale"] == 0 and stats["references"] == 0 and stats["clients"] == 1, stats
        shared = survivor.get(key_of("shared"))  # what the victim computed stays served
        assert fingerprint(shared) == fingerprint(expected_value("shared", SIZE))
        del shared
        survivor.flush_releases()
        held = [survivor.get_or_compute(key_of(n), lambda n=n: expected_value(n, SIZE)) for n in "xyz"]
        assert survivor.stats()["uncacheable"] == 0  # all 3 fit: the memory set aside is free again
        for n, value in zip("xyz", held, strict=True):
            assert fingerprint(value) == fingerprint(expected_value(n, SIZE))
        del held, value
