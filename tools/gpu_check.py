"""Device check of GPU entries, for a machine with a CUDA GPU (a few minutes at most).

    python3 tools/gpu_check.py [--json FILE]

In real spawned processes sharing one namespace, it checks:

1. zero copy: a reader on the exporter's GPU gets an alias (route `alias`, its own counters),
   allocates no device memory for it, and sees the exporter's in-place change of its copy;
2. bf16 and fp16 values come back bit-identical through every route: alias, host copy in a
   process without CUDA, and host-to-device copy after the exporter is SIGKILLed (the dead
   exporter counted, the entry alive); a repeat hit on an alias held across the kill takes the
   host copy;
3. 4 threads exporting 64 values at once under a small export limit (withdrawals and sweeps
   racing the exports): every value bit-identical;
4. fences: GPU work queued on a released alias finishes before the exporter may reuse the memory;
5. latency: p50 of an 8 MiB GPU hit against one device-to-device copy and one host-to-device
   copy of 8 MiB (pageable and pinned);
6. the peer route, where the machine has two GPUs with peer access (else reported as not run).

Exit status 0 when every check passed. On the lent device machine the image lacks posix_ipc and
blake3: docs/gpu.md says how to carry their wheels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import xxhash

from shmcache import CacheConfig, EmbeddingCache, destroy_namespace
from tools.bench_node import key as key_of

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
VALUE_BYTES = 8 << 20
_TIMEOUT_S = 120.0


def fingerprint(value: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(value.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())


def _value(name: str, nbytes: int = VALUE_BYTES) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(int(xxhash.xxh32_intdigest(name.encode())))
    dtype = DTYPES.get(name, torch.bfloat16)
    return torch.randn(nbytes // 2, generator=generator, device="cuda").to(dtype)


def concurrent_exporter(
    config: CacheConfig, threads: int, per_thread: int, commands: Any, replies: Any
) -> None:
    """Threads put distinct small CUDA values at once (exports racing sweeps and withdrawals)."""
    cache = EmbeddingCache(config)
    names = [[f"c{t}-{i}" for i in range(per_thread)] for t in range(threads)]

    def put_all(batch: list[str]) -> None:
        for name in batch:
            cache.put(key_of(name), _value(name, 64 << 10))
            cache.flush_releases()

    workers = [threading.Thread(target=put_all, args=(batch,)) for batch in names]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    replies.put({name: fingerprint(_value(name, 64 << 10)) for batch in names for name in batch})
    commands.get()  # stay alive (exporting) until the parent is done


def exporter(config: CacheConfig, commands: Any, replies: Any) -> None:
    """Put one 8 MiB value per dtype from CUDA memory, then follow the parent's commands."""
    cache = EmbeddingCache(config)
    originals = {name: _value(name) for name in DTYPES}
    for name, value in originals.items():
        cache.put(key_of(name), value)
    own: dict[str, torch.Tensor] = {}
    for name in DTYPES:
        mine = cache.get(key_of(name))
        assert isinstance(mine, torch.Tensor) and mine.is_cuda, "the exporter reads its own copy"
        own[name] = mine
    replies.put({name: fingerprint(value) for name, value in originals.items()})
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
    """Export "fence-a"; on command, put "fence-b", which withdraws "fence-a" (the export limit
    holds one value) and, once unreferenced, frees it: its block is likely reused at once."""
    cache = EmbeddingCache(config)
    first = torch.ones(VALUE_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    cache.put(key_of("fence-a"), first)
    replies.put(first.float().sum().item())
    commands.get()
    cache.put(key_of("fence-b"), torch.full_like(first, -3.0))
    torch.cuda.synchronize()
    replies.put(cache.stats()["gpu_export_skips"])
    commands.get()


def reader(config: CacheConfig, device: int | None, commands: Any, replies: Any) -> None:
    """Follow the parent's commands: get values, peek at held ones, time hits, report stats.
    With `device`, this process uses CUDA on that device; without, it never initialises CUDA."""
    use_cuda = device is not None
    if device is not None:
        torch.cuda.set_device(device)
        torch.zeros(1, device="cuda")
    cache = EmbeddingCache(config)
    held: dict[str, Any] = {}
    while True:
        command, name = commands.get()
        if command == "get":
            before = torch.cuda.memory_allocated() if use_cuda else 0
            value = cache.get(key_of(name))
            assert value is not None, f"{name}: miss"
            held[name] = value
            replies.put(
                {
                    "device": str(value.device),
                    "fingerprint": fingerprint(value),
                    "allocated": (torch.cuda.memory_allocated() - before) if use_cuda else 0,
                }
            )
        elif command == "peek":
            replies.put(held[name].view(torch.int16)[:16].cpu().tolist())
        elif command == "drop":
            held.clear()
            cache.flush_releases()
            replies.put("dropped")
        elif command == "bench":
            replies.put(_bench(cache, name))
        elif command == "fence":  # queue ~1 s of GPU work on an alias, then release the alias
            alias = cache.get(key_of(name))
            assert alias is not None
            torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]
            held["sum"] = alias.float().sum()
            del alias
            started = time.monotonic()
            cache.flush_releases()  # must wait for the queued sum before the pin goes
            replies.put(time.monotonic() - started)
        elif command == "sum":
            replies.put(held.pop("sum").item())
        elif command == "stats":
            replies.put(cache.stats())
        elif command == "stop":
            cache.close()
            replies.put("stopped")
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
    """p50 of a GPU hit (the mapping already open, as after the first), a repeat hit, and copies."""
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


class _Process:
    """A spawned worker with a command queue and a reply queue."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=target, args=(*args, self.commands, self.replies), daemon=True)
        self.proc.start()

    def ask(self, command: str, name: str = "") -> Any:
        self.commands.put((command, name))
        return self.reply()

    def reply(self) -> Any:
        try:
            return self.replies.get(timeout=_TIMEOUT_S)
        except queue.Empty:
            state = "alive" if self.proc.is_alive() else f"exited with {self.proc.exitcode}"
            raise RuntimeError(f"no reply within {_TIMEOUT_S}s from a worker ({state})") from None

    def kill(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


def _gpu_counts(worker: _Process) -> dict[str, int]:
    return {k: v for k, v in worker.ask("stats").items() if k.startswith("gpu_")}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before.get(name, 0) for name in after}


def run_checks() -> dict[str, Any]:
    """Run every check; returns {"checks": {name: passed}, "figures": {...}, "notes": [...]}."""
    namespace = f"gpu-check-{os.getpid()}"
    config = CacheConfig(enable_embedding_cache=True, namespace=namespace, capacity_bytes=256 << 20)
    checks: dict[str, bool] = {}
    figures: dict[str, Any] = {}
    notes: list[str] = []
    workers: list[_Process] = []
    try:
        export = _Process(exporter, config)
        workers.append(export)
        truth = export.reply()
        gpu_reader = _Process(reader, config, 0)
        cpu_reader = _Process(reader, config, None)
        workers += [gpu_reader, cpu_reader]
        counts = _gpu_counts(gpu_reader)
        for name in DTYPES:
            got = gpu_reader.ask("get", name)
            checks[f"alias {name} bit-identical"] = (
                got["fingerprint"] == truth[name] and got["device"] == "cuda:0"
            )
            checks[f"alias {name} allocates no device memory"] = got["allocated"] == 0
            host = cpu_reader.ask("get", name)
            checks[f"host copy {name} bit-identical on CPU"] = (
                host["fingerprint"] == truth[name] and host["device"] == "cpu"
            )
        delta = _delta(_gpu_counts(gpu_reader), counts)
        checks["the GPU reader's two reads took the alias route, the CPU reader's none"] = (
            delta["gpu_hits_alias"] == 2 and delta["gpu_hits_host_copy"] == 0
        )
        before = gpu_reader.ask("peek", "bf16")
        export.ask("mutate", "bf16")
        during = gpu_reader.ask("peek", "bf16")
        export.ask("restore", "bf16")
        after = gpu_reader.ask("peek", "bf16")
        checks["zero copy: the reader sees the exporter's in-place change"] = (
            during == [12345] * 16 and before == after != during
        )
        gpu_reader.ask("drop")
        figures.update(gpu_reader.ask("bench", "bf16"))
        checks.update(_peer(config, truth, notes))
        gpu_reader.ask("drop")
        gpu_reader.ask("get", "bf16")  # an alias held (and its repeat-hit template) across the kill
        export.kill()
        counts = _gpu_counts(gpu_reader)
        repeat = gpu_reader.ask("get", "bf16")
        delta = _delta(_gpu_counts(gpu_reader), counts)
        checks["after the exporter's SIGKILL: a repeat hit takes the host copy, not a new alias"] = (
            repeat["fingerprint"] == truth["bf16"] and delta["gpu_hits_host_copy"] == 1
        )
        late = _Process(reader, config, 0)
        workers.append(late)
        counts = _gpu_counts(late)
        for name in DTYPES:
            got = late.ask("get", name)
            checks[f"after the exporter's SIGKILL: {name} from the host copy, bit-identical"] = (
                got["fingerprint"] == truth[name] and got["device"] == "cuda:0"
            )
        delta = _delta(_gpu_counts(late), counts)
        checks["after the exporter's SIGKILL: host-to-device route, dead exporter counted"] = (
            delta["gpu_hits_host_copy"] == 2 and delta["gpu_dead_exporter"] >= 2
        )
        checks["4 threads exporting 64 values at once (withdrawing all along): bit-identical"] = _racing(
            config, late, workers
        )
        checks["a released alias's queued kernel finishes before its memory is reused"] = _fence(
            namespace, figures, workers
        )
        for worker in (gpu_reader, cpu_reader, late):
            worker.ask("stop")
    finally:
        for worker in workers:
            worker.kill()
        destroy_namespace(namespace)
    return {"checks": checks, "figures": figures, "notes": notes}


def _racing(config: CacheConfig, reader_process: _Process, workers: list[_Process]) -> bool:
    """Exports race sweeps and withdrawals (a 256 KiB export limit for 64 KiB values)."""
    racing = _Process(concurrent_exporter, dataclasses.replace(config, gpu_export_bytes=256 << 10), 4, 16)
    workers.append(racing)
    expected = racing.reply()
    got = {name: reader_process.ask("get", name)["fingerprint"] for name in expected}
    racing.commands.put(("stop", ""))
    return bool(got == expected)


def _fence(namespace: str, figures: dict[str, Any], workers: list[_Process]) -> bool:
    """A reader queues ~1 s of work on an alias and drops it; the exporter then withdraws and
    frees that copy and writes another value, likely into the same block. The sum must be right."""
    config = CacheConfig(
        enable_embedding_cache=True,
        namespace=namespace + "-fence",
        capacity_bytes=64 << 20,
        gpu_export_bytes=VALUE_BYTES + (1 << 20),
    )
    try:
        export = _Process(fence_exporter, config)
        fence_reader = _Process(reader, config, 0)
        workers += [export, fence_reader]
        expected = export.reply()
        figures["fence_release_wait_s"] = round(fence_reader.ask("fence", "fence-a"), 3)
        export.commands.put(("overwrite", ""))
        export.reply()
        total = fence_reader.ask("sum")
        export.commands.put(("stop", ""))
        fence_reader.ask("stop")
        return bool(total == expected)
    finally:
        destroy_namespace(config.namespace)


def _peer(config: CacheConfig, truth: dict[str, str], notes: list[str]) -> dict[str, bool]:
    """A reader on GPU 1 gets the exporter's GPU 0 values through the peer route."""
    if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(1, 0):
        notes.append(f"peer route not run: {torch.cuda.device_count()} GPU(s) visible, no peer pair")
        return {}
    peer = _Process(reader, config, 1)
    try:
        got = {name: peer.ask("get", name) for name in DTYPES}
        stats = peer.ask("stats")
        peer.ask("stop")
    finally:
        peer.kill()
    return {
        "peer route: on GPU 1, bit-identical": all(
            got[name]["fingerprint"] == truth[name] and got[name]["device"] == "cuda:1" for name in DTYPES
        ),
        "peer route taken": stats["gpu_hits_peer"] >= 2,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing was checked")
        return 2
    started = time.monotonic()
    try:
        report = run_checks()
    except Exception as exc:  # a worker died or hung: a failed check, with the reason
        report = {
            "checks": {f"the checks ran to the end ({type(exc).__name__}: {exc})": False},
            "figures": {},
            "notes": [],
        }
    report["device"] = torch.cuda.get_device_name(0)
    report["seconds"] = round(time.monotonic() - started, 1)
    for name, passed in report["checks"].items():
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
    for name, figure in report["figures"].items():
        print(f"      {name}: {figure if isinstance(figure, dict) else f'{figure:.1f}'}")
    for note in report["notes"]:
        print(f"note  {note}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
