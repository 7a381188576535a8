"""Randomised multi-process stress with random SIGKILLs, and a checker.

Workers mix get_or_compute / get / put / cleanup_request over a small key set, hold views for a
while and re-verify them before dropping them, and fail computes at random. The parent SIGKILLs a
random worker every `kill_every` seconds and starts a new one. The checker verifies every value
returned (and every held view, again later) against the expected bytes, and counts concurrent
computes of one key on the node (there must be none: one forward per key per node).

    python -m tools.stress --seconds 300 --workers 6      # a long run; tests run it for ~20 s
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
import uuid
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
from tools.bench_keys import CONFIG as PCONFIG


def key(i: int) -> EmbeddingCacheKey:
    return EmbeddingCacheKey.from_raw_bytes(f"input-{i}".encode(), PCONFIG, modality="image")


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


def worker(config: CacheConfig, n_keys: int, seed: int, deadline: float, report: str, owners: Any) -> None:
    """One stress process. Appends violations (one JSON object a line) to `report`."""
    rng = random.Random(seed)
    pid = os.getpid()

    def violation(kind: str, detail: str) -> None:
        with open(report, "a") as f:
            f.write(json.dumps({"pid": pid, "kind": kind, "detail": detail}) + "\n")

    cache = EmbeddingCache(config)
    held: list[tuple[int, torch.Tensor]] = []
    while time.time() < deadline:
        i = rng.randrange(16) if rng.random() < 0.5 else rng.randrange(n_keys)  # a hot set
        request = f"r{rng.randrange(3)}" if rng.random() < 0.5 else None

        def compute(i: int = i) -> torch.Tensor:
            other = owners[i]
            if other and other != pid and _alive(other):
                time.sleep(0.2)  # a SIGKILLed owner releases its reservation before it is a zombie
                if _alive(other):
                    violation("concurrent-compute", f"key {i}: pid {other} was computing it too")
            owners[i] = pid
            time.sleep(rng.uniform(0, 0.05))
            owners[i] = 0
            if rng.random() < 0.05:
                raise ValueError("injected compute failure")
            return expected(i)

        try:
            roll = rng.random()
            if roll < 0.7:
                value = cache.get_or_compute(key(i), compute, request_id=request)
            elif roll < 0.85:
                value = cache.get(key(i), request_id=request)
            else:
                cache.put(key(i), expected(i), request_id=request)
                value = None
        except (ComputeFailed, ValueError, ComputeTimeout, CapacityError):
            continue
        if value is not None:
            if not torch.equal(value, expected(i)):
                violation("wrong-value", f"key {i}")
            if rng.random() < 0.3:
                held.append((i, value))
        if len(held) > 8 or (held and rng.random() < 0.2):
            j, view = held.pop(rng.randrange(len(held)))
            if not torch.equal(view, expected(j)):
                violation("view-changed", f"key {j}: a held view's memory was reused")
        if request is not None and rng.random() < 0.2:
            cache.cleanup_request(request)
    held.clear()
    cache.close()


def run(seconds: float, workers: int, kill_every: float, n_keys: int = 400, seed: int = 0) -> dict[str, Any]:
    """Run the stress test; returns a summary with the violations found (empty when all is well)."""
    ctx = mp.get_context("spawn")
    namespace = f"stress-{uuid.uuid4().hex[:8]}"
    config = CacheConfig(
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
    rng = random.Random(seed)
    owners = ctx.Array("i", n_keys, lock=False)
    report = Path(tempfile.mkdtemp()) / "violations.jsonl"
    report.touch()
    deadline = time.time() + seconds
    observer = EmbeddingCache(config)  # keeps the namespace alive across kills
    procs = []
    started: dict[int, float] = {}

    def start() -> None:
        args = (config, n_keys, rng.randrange(1 << 30), deadline, str(report), owners)
        proc = ctx.Process(target=worker, args=args, daemon=True)
        proc.start()
        procs.append(proc)
        started[proc.pid or 0] = time.time()

    for _ in range(workers):
        start()
    kills = 0
    try:
        while time.time() < deadline - 1.0:
            time.sleep(max(0.0, min(rng.uniform(0.5, 1.5) * kill_every, deadline - 1.0 - time.time())))
            # victims are workers past start-up (spawn + imports take seconds here)
            alive = [p for p in procs if p.is_alive() and time.time() - started[p.pid or 0] > 3.0]
            if alive:
                victim = rng.choice(alive)
                os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
                victim.join(10)
                kills += 1
                start()
        for proc in procs:
            proc.join(max(1.0, deadline - time.time() + 30))
        observer.gc()
        stats = observer.stats()
        lines = report.read_text().splitlines()
        violations = [json.loads(line) for line in lines if line.strip()]
        if stats["references"] or stats["reserved"]:
            violations.append({"kind": "leftover", "detail": f"after every worker left: {stats}"})
        return {"kills": kills, "stats": stats, "violations": violations}
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        observer.close()
        destroy_namespace(namespace)
        report.unlink(missing_ok=True)
        report.parent.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kill-every", type=float, default=1.0, help="mean seconds between SIGKILLs")
    parser.add_argument("--keys", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    summary = run(args.seconds, args.workers, args.kill_every, args.keys, args.seed)
    print(json.dumps(summary, indent=2, default=str))
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
