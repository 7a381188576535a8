"""Only a proven-dead namespace is wiped; a failed open leaves no lock file behind.

A live namespace (held open by a real second process) whose header fields are damaged is
`CorruptSegment` for a new attacher: nothing is wiped, created or leaked, and the live process
keeps working with its data intact. A dead namespace with a damaged header is not wiped either.
"""

from __future__ import annotations

import dataclasses
import mmap
import multiprocessing as mp
import os
import secrets
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from shmcache import CacheConfig, EmbeddingCache
from shmcache.errors import CacheClosed, CapacityError, CorruptSegment, LayoutMismatch
from shmcache.kernel.lockfile import bootstrap_lock
from shmcache.kernel.namespace import create, mark_destroyed, object_names
from shmcache.kernel.semaphores import KEY_LIMIT, SemaphoreSet
from shmcache.node.layout import LAYOUT_VERSION, Header
from shmcache.testing import kernel_objects, namespace_objects, sample_cache_config
from tests.helpers import kill, spawn
from tests.workers import expected_value, fingerprint, key_of

NAMES = [f"held-{i}" for i in range(8)]


def holder(config: CacheConfig, commands: Any, results: Any) -> None:
    """A live process: puts NAMES, then on each command checks all of them and puts one more."""
    with EmbeddingCache(config) as cache:
        for name in NAMES:
            cache.put(key_of(name), expected_value(name, 256))
        results.put("ready")
        while (command := commands.get()) != "stop":
            bad = [
                name
                for name in NAMES
                if (v := cache.get(key_of(name))) is None
                or fingerprint(v) != fingerprint(expected_value(name, 256))
            ]
            cache.put(key_of(command), torch.full((4,), 7.0))
            again = cache.get(key_of(command))
            results.put(("checked", bad, again is not None and torch.equal(again, torch.full((4,), 7.0))))
    results.put("closed")


@contextmanager
def live_holder(config: CacheConfig) -> Iterator[tuple[Any, Any]]:
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    proc = spawn(holder, config, commands, results)
    try:
        assert results.get(timeout=60) == "ready"
        yield commands, results
        commands.put("stop")
        assert results.get(timeout=60) == "closed"
        proc.join(30)
    finally:
        if proc.is_alive():
            kill(proc)


@contextmanager
def mapped_index(namespace: str) -> Iterator[mmap.mmap]:
    fd = os.open(object_names(namespace).index_path, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as index:
            yield index
    finally:
        os.close(fd)


def _damage(header: Header, field: str) -> tuple[int, bytes]:
    """(offset, bytes) that damage one field of `header` (offsets of node/layout.py's header)."""
    u32 = struct.Struct("<I")
    return {
        "magic": (0, b"garbage!"),
        "ready-out-of-range": (12, u32.pack(7)),
        "ready-cleared": (12, u32.pack(0)),
        "stripes": (16, u32.pack(header.stripes + 1)),
        "ways": (20, u32.pack(0)),
        "clients": (24, u32.pack(header.clients * 2)),
        "pins": (28, u32.pack(1 << 20)),
        "capacity": (32, struct.pack("<Q", header.capacity * 2)),
        "semid": (40, struct.pack("<i", header.semid + 977)),
        "signature": (44, u32.pack(header.signature ^ 0x155)),
        "algorithm": (64, u32.pack(200)),
        "ttl": (48, struct.pack("<d", float("nan"))),
        "mode": (76, u32.pack(0o4777)),
    }[field]


FIELDS = [
    "magic",
    "ready-out-of-range",
    "ready-cleared",
    "stripes",
    "ways",
    "clients",
    "pins",
    "capacity",
    "semid",
    "signature",
    "algorithm",
    "ttl",
    "mode",
]


@pytest.mark.parametrize("field", FIELDS)
def test_a_damaged_header_of_a_live_namespace_is_corrupt_not_stale(config: CacheConfig, field: str) -> None:
    with live_holder(config) as (commands, results):
        before = kernel_objects()
        with mapped_index(config.namespace) as index:
            offset, damage = _damage(Header.read(index), field)
            original = bytes(index[offset : offset + len(damage)])
            index[offset : offset + len(damage)] = damage
            try:
                with pytest.raises(CorruptSegment) as raised:
                    EmbeddingCache(config)
                assert len(str(raised.value)) < 300
                assert kernel_objects() == before  # nothing wiped, created or left behind
            finally:
                index[offset : offset + len(damage)] = original
        commands.put(f"after-{field}")
        assert results.get(timeout=60) == ("checked", [], True)  # the live process and its data are fine


def test_a_damaged_header_of_a_dead_namespace_is_not_wiped_either(config: CacheConfig) -> None:
    names = object_names(config.namespace)
    with bootstrap_lock(names, config.mode, 10.0):
        ours = create(names, config)  # nobody attached: stale, were it not damaged
    try:
        ours.index[16:20] = struct.pack("<I", 3)  # stripes
        before = kernel_objects()
        with pytest.raises(CorruptSegment, match="damaged header"):
            EmbeddingCache(config)
        assert kernel_objects() == before
        ours.index[16:20] = struct.pack("<I", config.n_stripes)
    finally:
        ours.index.close()
        ours.arena.close()
    with EmbeddingCache(config) as cache:  # restored: an intact dead namespace is wiped and recreated
        assert cache.stats()["puts"] == 0


def test_a_dead_namespace_whose_set_is_gone_is_wiped(config: CacheConfig) -> None:
    """A wiper killed between removing the set and unlinking the index leaves an index naming no
    set; with no process alive in its client table it is proven dead, not corrupt."""
    before = kernel_objects()
    names = object_names(config.namespace)
    with bootstrap_lock(names, config.mode, 10.0):
        ours = create(names, config)
    ours.sems.remove()
    ours.index.close()
    ours.arena.close()
    with EmbeddingCache(config) as cache:
        cache.put(key_of("fresh"), torch.ones(2))
        assert cache.get(key_of("fresh")) is not None
    assert kernel_objects() == before


def test_the_version_field_is_a_layout_mismatch(config: CacheConfig) -> None:
    with live_holder(config) as (commands, results), mapped_index(config.namespace) as index:
        index[8:12] = struct.pack("<I", 99)
        try:
            with pytest.raises(LayoutMismatch, match="layout version 99"):
                EmbeddingCache(config)
        finally:
            index[8:12] = struct.pack("<I", LAYOUT_VERSION)
        commands.put("after-version")
        assert results.get(timeout=60) == ("checked", [], True)


def test_a_failed_open_leaves_no_lock_file(namespace: str) -> None:
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    before = kernel_objects()
    too_big = sample_cache_config(namespace, capacity_bytes=free + (1 << 30))
    with pytest.raises(CapacityError):
        EmbeddingCache(too_big)
    assert not namespace_objects(namespace), namespace_objects(namespace)
    assert kernel_objects() == before


def test_a_failed_open_of_a_live_namespace_keeps_its_lock_file(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        objects = namespace_objects(config.namespace)
        with pytest.raises(LayoutMismatch):
            EmbeddingCache(sample_cache_config(config.namespace, ttl_s=5.0))
        assert namespace_objects(config.namespace) == objects  # the live namespace keeps its lock
        cache.put(key_of("still"), torch.ones(2))
    with EmbeddingCache(config):  # and the next attach after the last close works
        pass


def test_a_lock_file_left_by_a_failed_open_of_a_stale_namespace_is_removed(namespace: str) -> None:
    """The namespace existed (a dead one: its lock file was not ours to create), the open wiped it
    and then failed: with no index left, its lock file goes too."""
    small = sample_cache_config(namespace)
    names = object_names(namespace)
    with bootstrap_lock(names, small.mode, 10.0):
        ours = create(names, small)
    ours.index.close()
    ours.arena.close()
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(CapacityError):
        EmbeddingCache(sample_cache_config(namespace, capacity_bytes=free + (1 << 30)))
    assert not namespace_objects(namespace)


def test_a_destroy_killed_after_marking_the_index_is_finished_by_the_next_attach(config: CacheConfig) -> None:
    """destroy_namespace marks the index destroyed first; a destroyer killed right after that leaves
    every object in place: the next attach wipes them (not CorruptSegment), and a process still
    attached gets CacheClosed."""
    user = EmbeddingCache(config)
    user.put(key_of("x"), expected_value("x"))
    fd = os.open(object_names(config.namespace).index_path, os.O_RDWR)
    try:
        mark_destroyed(fd)  # the destroyer's first step; it dies here
    finally:
        os.close(fd)
    with EmbeddingCache(config) as fresh:
        assert fresh.get(key_of("x")) is None and fresh.stats()["puts"] == 0
    with pytest.raises(CacheClosed, match="destroyed"):
        user.get(key_of("x"))
    user.close()


def _unfinish(index: mmap.mmap, semkey: int) -> None:
    """Make `index` the header of a creator killed right after it made its set under `semkey`:
    every field written, the set's id not yet (-1), the magic and `ready` not yet."""
    header = dataclasses.replace(Header.read(index), ready=0, semid=-1, semkey=semkey)
    index[: len(header.pack())] = bytes(8) + header.pack()[8:]


def test_an_unfinished_header_leaves_another_namespaces_set_under_its_key(config: CacheConfig) -> None:
    """The set under an unfinished header's key is removed only if it carries the header's
    signature or none: a set signed by another namespace (that drew the key later) is kept."""
    other = sample_cache_config(f"{config.namespace}-other")
    with EmbeddingCache(other) as live:
        live.put(key_of("kept"), torch.ones(3))
        with mapped_index(other.namespace) as index:
            theirs = Header.read(index)
        names = object_names(config.namespace)
        with bootstrap_lock(names, config.mode, 10.0):
            ours = create(names, config)
        ours.sems.remove()  # the victim's own set: never made
        _unfinish(ours.index, theirs.semkey)
        ours.index.close()
        ours.arena.close()
        before = kernel_objects()
        with EmbeddingCache(config) as cache:  # the unfinished namespace is wiped and made afresh
            assert cache.stats()["puts"] == 0
        assert f"sem:{theirs.semid}" in kernel_objects()
        assert kernel_objects() <= before | {f"shm:{n}" for n in namespace_objects(config.namespace)}
        assert torch.equal(live.get(key_of("kept")), torch.ones(3))  # the other namespace is intact


def test_a_key_another_set_holds_is_drawn_again(config: CacheConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    before = kernel_objects()
    squatter = SemaphoreSet.create(0x5C0DE, 1)
    draws = iter([0x5C0DE - 1, 0x5C0DF - 1])  # the squatter's key first, then a free one
    real = secrets.randbelow
    monkeypatch.setattr(secrets, "randbelow", lambda n: next(draws) if n == KEY_LIMIT - 1 else real(n))
    try:
        with EmbeddingCache(config) as cache, mapped_index(config.namespace) as index:
            assert Header.read(index).semkey == 0x5C0DF
            cache.put(key_of("x"), torch.ones(2))
    finally:
        squatter.remove()
    assert kernel_objects() == before
