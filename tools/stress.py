"""Randomised multi-process stress with random SIGKILLs, and a checker.

Workers mix get_or_compute / get / put / cleanup_request over a small key set (`--workload
mixed`), or do nothing but batched reads, `get_many` and `contains_many` (`--workload reads`: the
native hit path, killed inside its calls; a miss is filled with `put`); they hold views for a
while and re-verify them before dropping them, and fail computes at random. The parent SIGKILLs a
random worker every `kill_every` seconds and starts a new one. The checker verifies every value
returned (and every held view, again later) against the expected bytes, and counts concurrent
computes of one key on the node (there must be none: one forward per key per node).

    python -m tools.stress --seconds 300 --workers 6      # a long run; tests run it for ~20 s
    python -m tools.stress --workload reads --workers 8 --kill-every 0.3
"""

from __future__ import annotations

import argparse
import enum
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

from shmcache import (
    CacheConfig,
    CapacityError,
    ComputeFailed,
    ComputeTimeout,
    EmbeddingCache,
    EmbeddingCacheKey,
    destroy_namespace,
)
from shmcache.testing import sample_preprocessing


class Workload(enum.Enum):
    """What the stress workers do."""

    MIXED = "mixed"  # get_or_compute, get, put, cleanup_request
    READS = "reads"  # get_many and contains_many of batches (a miss is filled with put)


def key(i: int) -> EmbeddingCacheKey:
    return EmbeddingCacheKey.from_raw_bytes(f"input-{i}".encode(), sample_preprocessing(), modality="image")


def expected(i: int) -> torch.Tensor:
    """Input i's 'embedding': 1 KiB to 128 KiB of int32 that depend on i."""
    numel = 256 << (i % 8)
    return torch.arange(numel, dtype=torch.int32) * (i + 1) + i


def _alive(pid: int) -> bool:
    """True if `pid` runs (a zombie, killed but not yet reaped, is not alive)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class _Worker:
    """One stress process's state: its random stream, the views it holds and where it reports."""

    def __init__(self, n_keys: int, seed: int, report: str, owners: Any, workload: Workload) -> None:
        self.rng = random.Random(seed)
        self.workload = workload
        self.pid = os.getpid()
        self.n_keys, self.report, self.owners = n_keys, report, owners
        self.held: list[tuple[int, torch.Tensor]] = []

    def violation(self, kind: str, detail: str) -> None:
        with open(self.report, "a") as f:
            f.write(json.dumps({"pid": self.pid, "kind": kind, "detail": detail}) + "\n")

    def compute(self, i: int) -> torch.Tensor:
        """Input i's forward: records this process as its computer while it runs, and checks that no
        other live process computes it at the same time."""
        other = self.owners[i]
        if other and other != self.pid and _alive(other):
            time.sleep(0.2)  # a SIGKILLed owner releases its reservation before it is a zombie
            if _alive(other):
                self.violation("concurrent-compute", f"key {i}: pid {other} was computing it too")
        self.owners[i] = self.pid
        time.sleep(self.rng.uniform(0, 0.05))
        self.owners[i] = 0
        if self.rng.random() < 0.05:
            raise ValueError("injected compute failure")
        return expected(i)

    def call(
        self, cache: EmbeddingCache, i: int, request: str | None
    ) -> list[tuple[int, torch.Tensor | None]]:
        """One random call on key i (MIXED: get_or_compute, get or put), or on a batch from i
        (READS): the values returned, by key."""
        roll = self.rng.random()
        if self.workload is Workload.READS:
            batch = [(i + n) % self.n_keys for n in range(self.rng.randrange(1, 17))]
            if roll < 0.2:
                cache.contains_many([key(j) for j in batch])
                return []
            found = list(zip(batch, cache.get_many([key(j) for j in batch], request_id=request), strict=True))
            for j, value in found:
                if value is None:
                    cache.put(key(j), expected(j))
            return found
        if roll < 0.7:
            return [(i, cache.get_or_compute(key(i), lambda: self.compute(i), request_id=request))]
        if roll < 0.85:
            return [(i, cache.get(key(i), request_id=request))]
        cache.put(key(i), expected(i), request_id=request)
        return []

    def step(self, cache: EmbeddingCache) -> None:
        rng = self.rng
        i = rng.randrange(16) if rng.random() < 0.5 else rng.randrange(self.n_keys)  # a hot set
        request = f"r{rng.randrange(3)}" if rng.random() < 0.5 else None
        try:
            found = self.call(cache, i, request)
        except (ComputeFailed, ValueError, ComputeTimeout, CapacityError):
            return
        for j, value in found:
            if value is None:
                continue
            if not torch.equal(value, expected(j)):
                self.violation("wrong-value", f"key {j}")
            if rng.random() < 0.3:
                self.held.append((j, value))
        if len(self.held) > 8 or (self.held and rng.random() < 0.2):
            j, view = self.held.pop(rng.randrange(len(self.held)))
            if not torch.equal(view, expected(j)):
                self.violation("view-changed", f"key {j}: a held view's memory was reused")
        if request is not None and rng.random() < 0.2:
            cache.cleanup_request(request)


def worker(
    config: CacheConfig, n_keys: int, seed: int, deadline: float, report: str, owners: Any, workload: Workload
) -> None:
    """One stress process. Appends violations (one JSON object a line) to `report`."""
    state = _Worker(n_keys, seed, report, owners, workload)
    cache = EmbeddingCache(config)
    Path(report).with_name(f"ready.{os.getpid()}").touch()  # attached: from now on it may be killed
    while time.time() < deadline:
        state.step(cache)
    state.held.clear()
    cache.close()


def _config(namespace: str) -> CacheConfig:
    """The stress run's cache config for `namespace`: 8 MiB, 512 entries, a 2 s TTL."""
    return CacheConfig(
        enable_embedding_cache=True,
        namespace=namespace,
        capacity_bytes=8 << 20,
        max_entries=512,
        ways=16,
        max_clients=64,
        max_pins_per_process=512,
        compute_timeout_s=30.0,
        ttl_s=2.0,
    )


def _kill_one(procs: Sequence[BaseProcess], report: Path, rng: random.Random) -> bool:
    """SIGKILL a random live worker past start-up (it attached: spawn + imports take seconds here)
    and reap it; False if there is none."""
    alive = [p for p in procs if p.is_alive() and report.with_name(f"ready.{p.pid}").exists()]
    if not alive:
        return False
    victim = rng.choice(alive)
    os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
    victim.join(10)
    return True


def _violations(report: Path, stats: dict[str, int]) -> list[dict[str, Any]]:
    """The violations the workers reported, and a `leftover` one if references or reservations remain."""
    lines = report.read_text().splitlines()
    violations = [json.loads(line) for line in lines if line.strip()]
    if stats["references"] or stats["reserved"]:
        violations.append({"kind": "leftover", "detail": f"after every worker left: {stats}"})
    return violations


def run(
    seconds: float,
    workers: int,
    kill_every: float,
    n_keys: int = 400,
    seed: int = 0,
    workload: Workload = Workload.MIXED,
) -> dict[str, Any]:
    """Run the stress test; returns a summary with the violations found (empty when all is well)."""
    ctx = mp.get_context("spawn")
    namespace = f"stress-{uuid.uuid4().hex[:8]}"
    config = _config(namespace)
    rng = random.Random(seed)
    owners = ctx.Array("i", n_keys, lock=False)
    report = Path(tempfile.mkdtemp()) / "violations.jsonl"
    report.touch()
    deadline = time.time() + seconds
    observer = EmbeddingCache(config)  # keeps the namespace alive across kills
    procs = []

    def start() -> None:
        args = (config, n_keys, rng.randrange(1 << 30), deadline, str(report), owners, workload)
        proc = ctx.Process(target=worker, args=args, daemon=True)
        proc.start()
        procs.append(proc)

    for _ in range(workers):
        start()
    kills = 0
    try:
        while time.time() < deadline - 1.0:
            time.sleep(max(0.0, min(rng.uniform(0.5, 1.5) * kill_every, deadline - 1.0 - time.time())))
            if _kill_one(procs, report, rng):
                kills += 1
                start()
        for proc in procs:
            proc.join(max(1.0, deadline - time.time() + 30))
        observer.gc()
        stats = observer.stats()
        return {"kills": kills, "stats": stats, "violations": _violations(report, stats)}
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        observer.close()
        destroy_namespace(namespace)
        shutil.rmtree(report.parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kill-every", type=float, default=1.0, help="mean seconds between SIGKILLs")
    parser.add_argument("--keys", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=[w.value for w in Workload], default=Workload.MIXED.value)
    args = parser.parse_args(argv)
    summary = run(args.seconds, args.workers, args.kill_every, args.keys, args.seed, Workload(args.workload))
    print(json.dumps(summary, indent=2, default=str))
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
