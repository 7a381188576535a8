"""Test helpers: kernel-object snapshots and spawned worker processes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from shmcache.node.slots import SlotState
from shmcache.testing import kernel_objects

__all__ = ["kernel_objects", "kill", "sealed_slot", "spawn", "wait_for"]


def spawn(target: Callable[..., Any], *args: Any) -> mp.process.BaseProcess:
    """Start `target(*args)` in a freshly spawned interpreter."""
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def kill(proc: mp.process.BaseProcess) -> None:
    """SIGKILL a process and reap it."""
    assert proc.pid is not None
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `predicate` (tests only) until true or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def sealed_slot(cache: Any) -> int:
    """The slot of the only sealed entry of `cache` (for tests that damage it on purpose)."""
    states = cache._node.slots.array["state"]
    sealed = [int(s) for s in range(cache._node.layout.slots) if states[s] == SlotState.SEALED]
    assert len(sealed) == 1, sealed
    return sealed[0]
