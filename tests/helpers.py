"""Test helpers: kernel-object snapshots and spawned worker processes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any

SHM_DIR = "/dev/shm"


def kernel_objects() -> set[str]:
    """Names of shmcache objects in /dev/shm plus the ids of every SysV IPC object."""
    found = {f"shm:{n}" for n in os.listdir(SHM_DIR) if n.startswith("shmcache.")}
    for table in ("sem", "shm", "msg"):
        with open(f"/proc/sysvipc/{table}") as f:
            next(f)
            found |= {f"{table}:{line.split()[1]}" for line in f if line.strip()}
    return found


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
