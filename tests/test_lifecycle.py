"""A cache's kernel objects over its life: owner-only and named by uid, removed by the last
close (or later, when the last view dies), removed under attached users by `destroy`, never
touched from a forked child."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import stat

import pytest
import torch

from shmcache import CacheClosed, CacheConfig, EmbeddingCache
from shmcache.format import _arrays
from shmcache.kernel.lockfile import bootstrap_lock
from shmcache.kernel.namespace import list_namespaces, object_names
from tests.helpers import kernel_objects, wait_for
from tests.workers import key_of


def test_objects_are_owner_only_and_named_by_uid(config: CacheConfig) -> None:
    with EmbeddingCache(config):
        names = object_names(config.namespace)
        for path in (f"/dev/shm{names.index}", f"/dev/shm{names.arena}", names.lock_path):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            assert f".{os.geteuid()}." in path
        assert config.namespace in list_namespaces()


def test_last_close_removes_everything(config: CacheConfig) -> None:
    before = kernel_objects()
    first = EmbeddingCache(config)
    second = EmbeddingCache(config)
    first.put(key_of("x"), torch.ones(1))
    during = kernel_objects()
    assert len(during - before) == 4  # index, arena, lock file, one semaphore set
    first.close()
    assert kernel_objects() == during
    held = second.get(key_of("x"))
    second.close()  # a live view defers the detach until it is collected
    assert kernel_objects() == during
    del held
    wait_for(lambda: kernel_objects() == before, 10, "the deferred detach")
    with pytest.raises(CacheClosed):
        second.get(key_of("x"))


def test_destroy_removes_the_namespace_under_attached_users(config: CacheConfig) -> None:
    before = kernel_objects()
    user = EmbeddingCache(config)
    user.put(key_of("x"), torch.ones(1))
    user.put(key_of("z"), torch.ones(2))
    held = user.get(key_of("z"))
    admin = EmbeddingCache(config)
    admin.destroy()
    assert kernel_objects() == before
    with pytest.raises(CacheClosed):
        user.get_or_compute(key_of("y"), lambda: torch.ones(1))
    x, z = key_of("x"), key_of("z")  # z: a repeat hit of the live view `held`
    # hits touch no kernel object that destroy removes: the index itself says it was destroyed
    for call, arg in ((user.get, x), (user.get, z), (user.get_many, [x]), (user.contains, x)):
        with pytest.raises(CacheClosed, match="destroyed"):
            call(arg)
    assert torch.equal(held, torch.ones(2))  # a view taken before stays readable
    del held
    user.close()
    assert kernel_objects() == before


def test_a_cache_is_refused_in_a_forked_child(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        cache.put(key_of("x"), torch.ones(1))
        pid = os.fork()
        if pid == 0:  # the child: each call refuses, nothing is touched; it never returns to pytest
            refused = 0
            try:
                for call in (
                    lambda: cache.get(key_of("x")),
                    lambda: cache.put(key_of("y"), torch.ones(1)),
                ):
                    try:
                        call()
                    except CacheClosed:
                        refused += 1
            finally:
                os._exit(0 if refused == 2 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert cache.get(key_of("x")) is not None  # the parent's cache is untouched


def test_a_forked_child_never_ends_its_parents_reservation(config: CacheConfig) -> None:
    """A child dropping its copy of the parent's reservation, then flushing: the withdraw queued
    by its deallocator ran with the parent's client record (the parent's commit: ReservationLost)."""
    with EmbeddingCache(config) as cache:
        res = cache.try_reserve(key_of("f"))
        assert res is not None and res.owned
        pid = os.fork()
        if pid == 0:  # the child: never returns to pytest
            try:
                del res
                gc.collect()
                cache.flush_releases()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        value = res.commit(torch.ones(2))
        assert torch.equal(value, torch.ones(2))
        del value


def test_a_delivery_failing_after_close_finishes_the_detach(
    config: CacheConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `get` whose view was made when another thread closed the cache, and whose delivery then
    failed, gives the view back: it was the last live view, so the detach happens there and then
    (before, nothing was left to release and the namespace stayed until the interpreter exited)."""
    before = kernel_objects()
    reader = EmbeddingCache(config)
    with EmbeddingCache(config) as writer:
        writer.put(key_of("x"), torch.ones(4))
    during = kernel_objects()

    def close_then_fail(*args: object, **kwargs: object) -> object:
        reader.close()  # as another thread would, while this delivery holds the only live view
        assert kernel_objects() == during  # that view defers the detach
        raise MemoryError("building the value failed")

    monkeypatch.setattr(_arrays, "deliver", close_then_fail)  # the step that builds the value
    with pytest.raises(MemoryError):
        reader.get(key_of("x"))
    assert kernel_objects() == before  # detached by the failed delivery itself: the last one out
    with pytest.raises(CacheClosed):
        reader.get(key_of("x"))


def test_a_detach_failing_there_leaves_the_delivery_its_own_error(
    config: CacheConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same, with the detach failing (the namespace's bootstrap lock held past the lock
    timeout): the caller gets the delivery's own error, the detach's failure is logged, and the
    next flush, the lock free again, detaches."""
    before = kernel_objects()
    reader = EmbeddingCache(dataclasses.replace(config, lock_timeout_s=0.5))
    with EmbeddingCache(config) as writer:
        writer.put(key_of("x"), torch.ones(4))

    def close_then_fail(*args: object, **kwargs: object) -> object:
        reader.close()
        raise MemoryError("building the value failed")

    monkeypatch.setattr(_arrays, "deliver", close_then_fail)  # the step that builds the value
    with (
        bootstrap_lock(object_names(config.namespace), config.mode, 10.0),
        caplog.at_level(logging.WARNING, logger="shmcache"),
        pytest.raises(MemoryError),
    ):
        reader.get(key_of("x"))
    assert "detaching after the last view failed" in caplog.text
    assert kernel_objects() != before  # still attached
    reader.flush_releases()  # the lock is free now: the detach, the last one out
    assert kernel_objects() == before
