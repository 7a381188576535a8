"""`shmcache-inspect destroy`: refused while a process is attached, and for a namespace being
created; without --force, whether a process is attached is decided under the bootstrap lock."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shmcache import CacheConfig, EmbeddingCache, ShmCacheError
from shmcache.kernel.namespace import destroy_namespace
from tests.helpers import finished, running, stopped, wait_for
from tests.test_inspect import run_inspect
from tests.workers import expected_value, key_of


def test_destroy_refuses_while_attached(
    shmcache_config: CacheConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = EmbeddingCache(shmcache_config)
    code, _, err = run_inspect(capsys, "destroy", shmcache_config.namespace)
    assert code == 1 and "refusing" in err
    code, out, _ = run_inspect(capsys, "destroy", shmcache_config.namespace, "--force")
    assert code == 0 and "destroyed" in out
    cache.close()


def create_stopping_inside(config: CacheConfig, result: str, go: str) -> None:
    """Another process: create the namespace, stopping itself (SIGSTOP, a named crash point) with
    its header written and the bootstrap lock held; once continued, put a value, and when `go`
    appears write whether the value is still there."""
    from shmcache.node import crashpoints

    crashpoints.arm(crashpoints.CrashPoint.CREATING_NAMESPACE, stop=True)
    with EmbeddingCache(config) as cache:
        cache.put(key_of("kept"), expected_value("kept"))
        wait_for(lambda: Path(go).exists(), what="the test's go")
        try:
            Path(result).write_text("kept" if cache.contains(key_of("kept")) else "lost")
        except ShmCacheError as exc:
            Path(result).write_text(f"{type(exc).__name__}: {exc}")


def test_destroy_leaves_a_namespace_being_created(shmcache_config: CacheConfig, tmp_path: Path) -> None:
    """Caught between its header and its arena, a namespace read as stale (no client yet):
    `destroy` without --force waited for the creator's lock, then removed it under the engine
    that had just attached (CacheClosed). Now it is "being created", and whether a process is
    attached is decided under the lock."""
    result, go = tmp_path / "result", tmp_path / "go"
    with running(create_stopping_inside, shmcache_config, str(result), str(go)) as creator:
        assert creator.pid is not None
        pid = creator.pid
        wait_for(lambda: stopped(pid), what="the creator to stop inside the creation")
        command = [sys.executable, "-m", "shmcache", "inspect", "destroy", shmcache_config.namespace]
        destroy = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with contextlib.suppress(subprocess.TimeoutExpired):  # it refuses, or polls the lock (10 s)
            destroy.wait(8)
        os.kill(pid, signal.SIGCONT)
        _, err = destroy.communicate(timeout=30)
        go.touch()
        assert finished(creator)
    assert destroy.returncode == 1 and b"being created" in err, err
    assert result.read_text() == "kept"


def test_whether_a_process_is_attached_is_decided_under_the_bootstrap_lock(
    shmcache_config: CacheConfig, tmp_path: Path
) -> None:
    """`destroy_namespace(unless_attached=True)` (destroy without --force) called while a creator
    holds the lock: it waits, then finds the creator attached and removes nothing."""
    result, go = tmp_path / "result", tmp_path / "go"
    answers: list[bool] = []
    with running(create_stopping_inside, shmcache_config, str(result), str(go)) as creator:
        pid = creator.pid
        assert pid is not None
        wait_for(lambda: stopped(pid), what="the creator to stop inside the creation")
        name = shmcache_config.namespace
        destroy = threading.Thread(
            target=lambda: answers.append(destroy_namespace(name, unless_attached=True))
        )
        destroy.start()
        time.sleep(0.5)  # to be polling the lock by then (whenever it gets there, it finds the creator)
        os.kill(pid, signal.SIGCONT)
        destroy.join(30)
        go.touch()
        assert finished(creator)
    assert answers == [False] and result.read_text() == "kept"
