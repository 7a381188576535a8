"""The worker processes of `tools.gpu_check` (spawned: importable by module name): an exporter
of CUDA values, readers on a GPU or without CUDA, and the exporters of the racing and fence checks.
Each follows commands from a queue and answers on another.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xxhash

from shmcache import CacheConfig, EmbeddingCache
from shmcache.node.layout import Counter
from tools.benchkit import key as key_of

__all__ = [
    "DTYPES",
    "VALUE_BYTES",
    "concurrent_exporter",
    "exporter",
    "fence_exporter",
    "fingerprint",
    "reader",
    "sample_value",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
VALUE_BYTES = 8 << 20
_PR_SET_PDEATHSIG = 1


def fingerprint(value: Any) -> str:
    """A digest of the value's bytes: a torch tensor (any device), a numpy or a cupy array."""
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().cpu().view(torch.uint8).numpy()
    elif isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value).view(np.uint8)
    else:
        import cupy

        data = np.ascontiguousarray(cupy.asnumpy(value)).view(np.uint8)
    return xxhash.xxh3_128_hexdigest(data.tobytes())


def _describe(value: Any) -> dict[str, Any]:
    library = type(value).__module__.split(".")[0]
    if library == "numpy":
        return {"library": library, "device": "cpu"}
    return {
        "library": library,
        "device": str(value.device) if library == "torch" else f"cuda:{value.device.id}",
    }


def sample_value(name: str, nbytes: int = VALUE_BYTES) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(int(xxhash.xxh32_intdigest(name.encode())))
    dtype = DTYPES.get(name, torch.bfloat16)
    return torch.randn(nbytes // 2, generator=generator, device="cuda").to(dtype)


def _worker_start(device: int | None) -> None:
    """Die with the parent (so a killed check leaves nothing holding GPU memory or /dev/shm), use
    CUDA on `device` (None: never initialise it), and freeze the heap so that the `gc.collect()`
    of each `flush_releases` stays cheap."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the prctl
        os._exit(1)
    if device is not None:
        torch.cuda.set_device(device)
        torch.zeros(1, device="cuda")
    gc.freeze()


def _own_counts(cache: EmbeddingCache) -> dict[str, int]:
    """This process's own gpu_* counters (stats() sums every process)."""
    row = cache._node.counters.all[cache._node.client]
    return {counter.label: int(row[counter]) for counter in Counter if counter.label.startswith("gpu_")}


def concurrent_exporter(
    config: CacheConfig, threads: int, per_thread: int, commands: Any, replies: Any
) -> None:
    """Threads put distinct small CUDA values at once (exports racing sweeps and withdrawals)."""
    _worker_start(0)
    cache = EmbeddingCache(config)
    names = [[f"c{t}-{i}" for i in range(per_thread)] for t in range(threads)]
    failures: list[str] = []

    def put_all(batch: list[str]) -> None:
        try:
            for name in batch:
                cache.put(key_of(name), sample_value(name, 64 << 10))
                cache.flush_releases()
        except Exception as exc:  # reported to the parent
            failures.append(repr(exc))

    workers = [threading.Thread(target=put_all, args=(batch,)) for batch in names]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    truth = {name: fingerprint(sample_value(name, 64 << 10)) for batch in names for name in batch}
    replies.put({"truth": truth, "failures": failures, "counts": _own_counts(cache)})
    commands.get()  # stay alive (exporting) until the parent is done


def exporter(config: CacheConfig, commands: Any, replies: Any) -> None:
    """Put one 8 MiB CUDA value per dtype, a cupy array, and a value computed on the GPU by
    `get_or_compute`; then follow the parent's commands."""
    _worker_start(0)
    cache = EmbeddingCache(config)
    originals: dict[str, Any] = {name: sample_value(name) for name in DTYPES}
    for name, value in originals.items():
        cache.put(key_of(name), value)
    try:
        import cupy

        array = cupy.arange(1 << 16, dtype=cupy.float32) * 0.5
    except Exception as exc:  # not installed, or cannot build its kernels here
        print(f"gpu_check: no cupy input ({type(exc).__name__}: {exc})", flush=True)
    else:
        originals["cupy"] = array
        cache.put(key_of("cupy"), array)
    computed = cache.get_or_compute(key_of("computed"), lambda: sample_value("computed", 1 << 20))
    originals["computed"] = sample_value("computed", 1 << 20)
    own: dict[str, torch.Tensor] = {}
    for name in DTYPES:
        mine = cache.get(key_of(name))
        assert isinstance(mine, torch.Tensor) and mine.is_cuda, "the exporter reads its own copy"
        own[name] = mine
    replies.put(
        {
            "truth": {name: fingerprint(value) for name, value in originals.items()},
            "computed": {**_describe(computed), "fingerprint": fingerprint(computed)},
            "computes": cache.stats()["computes"],
            "counts": _own_counts(cache),
        }
    )
    saved: dict[str, torch.Tensor] = {}
    while True:
        command, name = commands.get()
        if command == "mutate":  # change our exported copy in place
            saved[name] = own[name].view(torch.int16)[:16].clone()
            own[name].view(torch.int16)[:16] = 12345
        elif command == "restore":
            own[name].view(torch.int16)[:16] = saved.pop(name)
        torch.cuda.synchronize()
        replies.put(command)


def fence_exporter(config: CacheConfig, commands: Any, replies: Any) -> None:
    """Export "fence-a"; on command, wait until nobody references it, then put "fence-b": the
    export limit holds one value, so "fence-a" is withdrawn and freed first, and "fence-b" most
    likely lands in its memory."""
    _worker_start(0)
    cache = EmbeddingCache(config)
    first = torch.ones(VALUE_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    cache.put(key_of("fence-a"), first)
    replies.put(first.float().sum().item())
    commands.get()
    started = time.monotonic()
    while cache.stats()["references"] and time.monotonic() - started < 20:
        time.sleep(0.005)
    waited = time.monotonic() - started
    before = _own_counts(cache)
    cache.put(key_of("fence-b"), torch.full_like(first, -3.0))
    torch.cuda.synchronize()
    after = _own_counts(cache)
    replies.put(
        {"waited_s": waited, **{k: after[k] - before[k] for k in ("gpu_exports", "gpu_export_skips")}}
    )
    commands.get()


def reader(config: CacheConfig, device: int | None, commands: Any, replies: Any) -> None:
    """Follow the parent's commands: get values, peek at held ones, time hits, report counters.
    With `device`, this process uses CUDA on that device; without, it never initialises CUDA."""
    _worker_start(device)
    use_cuda = device is not None
    cache = EmbeddingCache(config)
    held: dict[str, Any] = {}
    while True:
        command, name = commands.get()
        if command == "get":
            before = torch.cuda.memory_allocated() if use_cuda else 0
            value = cache.get(key_of(name))
            assert value is not None, f"{name}: miss"
            held[name] = value
            allocated = (torch.cuda.memory_allocated() - before) if use_cuda else 0
            replies.put({**_describe(value), "fingerprint": fingerprint(value), "allocated": allocated})
            del value
        elif command == "peek":
            replies.put(held[name].view(torch.int16)[:16].cpu().tolist())
        elif command == "drop":  # replies with the IPC mappings still open (none once settled)
            held.clear()
            cache.flush_releases()
            replies.put(cache._device.open_mappings)
        elif command == "bench":
            replies.put(_bench(cache, name))
        elif command == "fence":  # queue ~1 s of GPU work on an alias, then drop the alias at once
            alias = cache.get(key_of(name))
            assert alias is not None
            torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]
            held["sum"] = alias.float().sum()
            del alias
            replies.put("dropped")
        elif command == "sum":
            replies.put(held.pop("sum").item())
        elif command == "counts":
            replies.put(_own_counts(cache))
        elif command == "stop":
            held.clear()
            counts = _own_counts(cache)
            cache.close()
            replies.put(counts)
            return


def _p50_us(run: Callable[[], object], n: int = 200, between: Callable[[], object] | None = None) -> float:
    samples = []
    for _ in range(n):
        if between is not None:
            between()
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def _bench(cache: EmbeddingCache, name: str) -> dict[str, float]:
    """p50 of a GPU hit (opening the handle: no other view of it is alive), a repeat hit, and copies."""
    key = key_of(name)
    cache.get(key)
    cache.flush_releases()

    def hit() -> None:
        value = cache.get(key)
        assert value is not None and value.is_cuda

    # between hits the value is dropped and its pin released: each get is a node hit, not a repeat
    node_hit = _p50_us(hit, between=cache.flush_releases)
    held = cache.get(key)
    src = torch.empty(VALUE_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    pageable = torch.empty(VALUE_BYTES, dtype=torch.uint8)
    pinned = pageable.pin_memory()

    def copy(source: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            dst.copy_(source)
            torch.cuda.synchronize()

        return run

    result = {
        "gpu_hit_us": node_hit,
        "gpu_repeat_hit_us": _p50_us(lambda: cache.get(key)),
        "d2d_copy_us": _p50_us(copy(src)),
        "h2d_pageable_us": _p50_us(copy(pageable)),
        "h2d_pinned_us": _p50_us(copy(pinned)),
    }
    del held
    return result
