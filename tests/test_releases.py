"""Pins that could not be released (a stripe held past `lock_timeout_s`) are kept and released
later, never forgotten and never released twice; the pins of other stripes go at once."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from shmcache import CacheConfig, EmbeddingCache
from shmcache.errors import LockTimeout
from shmcache.node.audit import audit
from tests import workers
from tests.helpers import kill, spawn, wait_for
from tests.test_native import node_of
from tests.workers import expected_value, key_of


def _later_stripe(cache: EmbeddingCache, name: str) -> str:
    """A key name whose entry lies in a stripe after `name`'s (a release takes stripes in order)."""
    node = node_of(cache)
    stripe = node.stripe_of(key_of(name).record)
    return next(f"o{i}" for i in range(1000) if node.stripe_of(key_of(f"o{i}").record) > stripe)


def test_releases_that_time_out_on_a_held_stripe_are_kept_and_done_later(
    config: CacheConfig, tmp_path: Path
) -> None:
    """A process stopped inside a stripe section: `cleanup_request` releases the references of
    the other stripes (before, those of later stripes waited with it), raises `LockTimeout` and
    keeps the one it could not release (a second call releases it: before, it was dropped from the
    request and stayed pinned until detach), and a dead view's pin waits in the release thread,
    which tries again, instead of being forgotten (before: referenced until detach)."""
    with EmbeddingCache(dataclasses.replace(config, lock_timeout_s=0.3)) as cache:
        other = _later_stripe(cache, "a")
        for name in ("a", other):
            cache.put(key_of(name), expected_value(name))
        held = [cache.get(key_of(name), request_id="r") for name in ("a", other)]
        views = [cache.get(key_of(name)) for name in ("a", other)]
        del held
        cache.flush_releases()
        assert cache.stats()["references"] == 4  # two request refs, two view pins
        ready = tmp_path / "ready"
        victim = spawn(workers.hold_stripe_section, config, "a", str(ready))
        try:
            wait_for(ready.exists, what="the victim inside the stripe section")
            with pytest.raises(LockTimeout):
                cache.cleanup_request("r")
            assert cache.stats()["references"] == 3  # the view pins, "a"'s ref: `other`'s ref went
            del views  # "a"'s pin waits for the stripe in the release thread, `other`'s goes
            wait_for(lambda: cache.stats()["references"] == 2, what="the other stripe's view pin released")
            time.sleep(1.0)  # more tries, each timing out
            assert cache.stats()["references"] == 2
        finally:
            kill(victim)
        wait_for(lambda: cache.stats()["references"] == 1, what="the view pin released after all")
        assert cache.cleanup_request("r") == 1
        assert cache.stats()["references"] == 0
        cache.gc()  # reaps the victim's client record
        assert audit(node_of(cache)) == []
