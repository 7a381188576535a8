"""Multi-process test helpers: a pool of spawned worker processes attached to one cache,
checkpoints to SIGKILL a worker at a chosen point, and a snapshot of kernel objects for leak checks.

The pytest plugin (`shmcache.testing.pytest_plugin`) wraps these as fixtures; they work without
pytest too. The ready-made crash workers of `ProcessPool.crash` are in crashes.py.

Worker functions are called as ``fn(cache, *args)`` in a freshly spawned interpreter with an open
`EmbeddingCache` on the pool's config; they must be importable (module-level functions).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shmcache.config import CacheConfig
from shmcache.errors import InvalidConfig
from shmcache.keys.key import EmbeddingCacheKey
from shmcache.process.cache import EmbeddingCache

__all__ = [
    "ProcessPool",
    "RemoteTraceback",
    "Worker",
    "WorkerTimeout",
    "checkpoint",
    "kernel_objects",
    "namespace_objects",
]

SHM_DIR = "/dev/shm"
_channel: Any = None  # this worker's checkpoint queue (set in spawned workers only)


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in a worker (set as its __cause__)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class WorkerTimeout(TimeoutError):
    """A worker did not finish (or reach its checkpoint) in time; it was killed."""


def kernel_objects() -> set[str]:
    """Names of shmcache objects in /dev/shm plus the ids of every SysV IPC object on the machine."""
    found = {f"shm:{name}" for name in os.listdir(SHM_DIR) if name.startswith("shmcache.")}
    for table in ("sem", "shm", "msg"):
        with open(f"/proc/sysvipc/{table}") as f:
            next(f)
            found |= {f"{table}:{line.split()[1]}" for line in f if line.strip()}
    return found


def namespace_objects(namespace: str) -> set[str]:
    """The /dev/shm objects of one namespace of this user (safe to compare under pytest-xdist)."""
    prefix = f"shmcache.{os.geteuid()}.{namespace}."
    return {name for name in os.listdir(SHM_DIR) if name.startswith(prefix)}


def checkpoint(point: str, *, pause: bool = False) -> None:
    """In a pool worker: report reaching `point` to the parent (no-op elsewhere). With `pause`,
    block there forever, for the parent to SIGKILL this process at exactly that point."""
    if _channel is not None:
        _channel.put(("checkpoint", point))
    if pause:
        while True:
            time.sleep(3600)


def _worker_main(config: CacheConfig, fn: Callable[..., Any], args: tuple[Any, ...], channel: Any) -> None:
    global _channel
    _channel = channel
    try:
        with EmbeddingCache(config) as cache:
            result = fn(cache, *args)
        channel.put(("ok", result))
    except BaseException as exc:  # reported to the parent, with the traceback as text
        text = "".join(traceback.format_exception(exc))
        try:
            channel.put(("error", exc, text))
        except Exception:  # the exception itself does not pickle
            channel.put(("error", RuntimeError(f"{type(exc).__name__}: {exc}"), text))


@dataclass
class Worker:
    """One spawned worker process."""

    process: mp.process.BaseProcess
    channel: Any
    checkpoints: list[str] = field(default_factory=list)
    outcome: tuple[Any, ...] | None = None

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def _poll(self, timeout: float) -> None:
        message = self.channel.get(timeout=timeout)
        if message[0] == "checkpoint":
            self.checkpoints.append(message[1])
        else:
            self.outcome = message

    def wait_checkpoint(self, point: str, timeout: float) -> None:
        """Block until the worker reports `point` (WorkerTimeout after `timeout`)."""
        deadline = time.monotonic() + timeout
        while point not in self.checkpoints:
            if self.outcome is not None:
                raise AssertionError(
                    f"worker {self.pid} finished without reaching {point!r}: {self.outcome[:2]}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeout(f"worker {self.pid} did not reach {point!r} within {timeout}s")
            try:
                self._poll(min(left, 0.5))
            except Exception:  # queue.Empty: keep waiting
                if not self.process.is_alive() and self.outcome is None:
                    raise AssertionError(f"worker {self.pid} died (exit {self.process.exitcode})") from None

    def result(self, timeout: float) -> Any:
        """The worker's return value; re-raises its exception with the remote traceback as cause."""
        deadline = time.monotonic() + timeout
        while self.outcome is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeout(f"worker {self.pid} did not finish within {timeout}s")
            try:
                self._poll(min(left, 0.5))
            except Exception:
                if not self.process.is_alive() and self.outcome is None:
                    try:
                        self._poll(0.1)
                        continue
                    except Exception:
                        raise AssertionError(
                            f"worker {self.pid} died without a result (exit {self.process.exitcode})"
                        ) from None
        self.process.join(10)
        if self.outcome[0] == "ok":
            return self.outcome[1]
        exc, text = self.outcome[1], self.outcome[2]
        raise exc from RemoteTraceback(f'\n"""\n{text}"""')

    def kill(self) -> None:
        """SIGKILL the worker and reap it."""
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)


class ProcessPool:
    """Spawned workers attached to one cache. Always reaps its processes on `shutdown`."""

    def __init__(self, config: CacheConfig, timeout: float = 60.0) -> None:
        self.config = config
        self.timeout = timeout
        self.workers: list[Worker] = []
        self._ctx = mp.get_context("spawn")

    def spawn(self, fn: Callable[..., Any], *args: Any) -> Worker:
        """Start `fn(cache, *args)` in a new process; returns at once."""
        channel = self._ctx.Queue()
        process = self._ctx.Process(target=_worker_main, args=(self.config, fn, args, channel), daemon=True)
        process.start()
        worker = Worker(process, channel)
        self.workers.append(worker)
        return worker

    def run(
        self, fn: Callable[..., Any], *args: Any, processes: int = 1, timeout: float | None = None
    ) -> list[Any]:
        """Run `fn(cache, *args)` in `processes` workers at once; their results, in order.

        The first worker exception is re-raised here with its remote traceback; a worker still
        running after `timeout` (default: the pool's) is killed and `WorkerTimeout` raised.
        """
        workers = [self.spawn(fn, *args) for _ in range(processes)]
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            return [w.result(max(0.0, deadline - time.monotonic())) for w in workers]
        except BaseException:
            for worker in workers:
                worker.kill()
            raise

    def kill_at(self, worker: Worker, point: str, timeout: float | None = None) -> None:
        """Wait until `worker` reaches checkpoint `point`, then SIGKILL it."""
        worker.wait_checkpoint(point, self.timeout if timeout is None else timeout)
        worker.kill()

    def crash(self, point: str, key: EmbeddingCacheKey, timeout: float | None = None) -> Worker:
        """Start a worker that stops at `point` on `key` ("computing", "reserved" or
        "holding-view"; see `shmcache.testing.crashes.POINTS`), SIGKILL it there, and return it."""
        from shmcache.testing.crashes import CRASH_AT, POINTS  # they call back into checkpoint()

        if point not in CRASH_AT:
            raise InvalidConfig(f"point must be one of {POINTS}, got {point!r}")
        worker = self.spawn(CRASH_AT[point], key)
        self.kill_at(worker, point, timeout)
        return worker

    def shutdown(self) -> None:
        """Kill and reap every worker still running."""
        for worker in self.workers:
            worker.kill()
        self.workers.clear()

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
