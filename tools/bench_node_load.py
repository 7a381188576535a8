"""The node under load, for `tools.bench_node` (which runs and reports these): many processes
hammering a few hot keys, and the node's memory when many processes read the same entries."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import torch

from shmcache import CacheConfig, EmbeddingCache, destroy_namespace
from tools.benchkit import key, micros, node_config


def _hammer(config: CacheConfig, hot: int, start: Any, seconds: float, out: Any) -> None:
    keys = [key(f"hot-{i}") for i in range(hot)]
    samples = []
    with EmbeddingCache(config) as cache:
        start.wait()
        deadline = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            value = cache.get(keys[n % hot])
            samples.append(time.perf_counter() - t0)
            assert value is not None
            del value
            n += 1
    out.put(samples)


def hammer(processes: int = 32, hot: int = 4, seconds: float = 3.0) -> dict[str, float]:
    """`processes` processes getting `hot` keys as fast as they can (views dropped each time)."""
    ctx = mp.get_context("spawn")
    config = node_config(16 << 20, max_clients=processes + 8)
    with EmbeddingCache(config) as cache:
        for i in range(hot):
            cache.put(key(f"hot-{i}"), torch.ones(4096, dtype=torch.uint8))
        start, out = ctx.Barrier(processes), ctx.Queue()
        procs = [
            ctx.Process(target=_hammer, args=(config, hot, start, seconds, out)) for _ in range(processes)
        ]
        for proc in procs:
            proc.start()
        samples = [s for _ in procs for s in out.get(timeout=300)]
        for proc in procs:
            proc.join()
    destroy_namespace(config.namespace)
    return {"gets": len(samples), **micros(samples)}


def _shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))


def _private_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean", "Private_Dirty")))


def _reader(config: CacheConfig, count: int, done: Any, release: str) -> None:
    with EmbeddingCache(config) as cache:
        views = [cache.get(key(f"gig-{i}")) for i in range(count)]
        total = sum(int(v[::4096].sum()) for v in views if v is not None)  # touch every page
        done.put(total)
        while not Path(release).exists():
            time.sleep(0.01)
        del views


def node_memory(processes: int = 8, entries: int = 128, entry_bytes: int = 8 << 20) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    config = node_config(entries * entry_bytes + (64 << 20), return_mode="view")
    release = f"/tmp/{config.namespace}.release"
    before = _shmem_kib()
    with EmbeddingCache(config) as cache:
        for i in range(entries):
            cache.put(key(f"gig-{i}"), torch.full((entry_bytes - 256,), i % 251, dtype=torch.uint8))
        done = ctx.Queue()
        baseline = ctx.Process(target=_reader, args=(config, 0, done, release))
        baseline.start()
        done.get()
        idle_private = _private_kib(baseline.pid or 0)
        procs = [ctx.Process(target=_reader, args=(config, entries, done, release)) for _ in range(processes)]
        for proc in procs:
            proc.start()
        for _ in procs:
            done.get(timeout=300)
        shmem = _shmem_kib() - before
        private = sum(_private_kib(proc.pid or 0) - idle_private for proc in procs)
        Path(release).touch()
        for proc in [*procs, baseline]:
            proc.join()
    Path(release).unlink()
    data_gib = entries * entry_bytes / 2**30
    return {
        "entries_gib": data_gib,
        "shared_gib": shmem / 2**20,
        "readers_private_gib": private / 2**20,
        "node_total_gib": (shmem + private) / 2**20,
        "per_process_caches_gib": processes * data_gib,
    }
