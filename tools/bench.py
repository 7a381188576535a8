"""One workload, every alternative: no cache, per-process LRU (the RFC), Redis, Mooncake Store alone,
Ray's object store (plasma), shmcache (node layer), shmcache with its remote layer, and a plain
memcpy as the copying floor.

    python -m tools.bench                         # P = 1, 4, 8 processes; writes bench-out/
    python -m tools.bench --quick                 # seconds: what the smoke test runs
    python -m tools.bench --systems ray,shmcache  # some of the columns only

P processes issue requests over a Zipf-distributed set of inputs whose values range from 1 KiB to
64 MiB (the largest sizes only outside --quick); a miss runs a real torch forward (a linear layer
producing the value). After a warm-up pass, each process measures its own requests. Output per
system: hit p50/p99, miss p50, encoder forwards, node memory, requests/s, and ratios against
shmcache: a markdown table, a JSON file and a PNG plot in --out.
Redis (`redis-server`, Debian), Mooncake (`shmcache[mooncake]`) and a Ray head (`shmcache[bench]`)
are started and stopped here on 127.0.0.1; a system whose server is not installed is reported as
skipped. Each system's client and servers are in tools/bench_backends.py.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from tools.bench_backends import WIDTH, client_for, start_servers

SYSTEMS = ("none", "lru", "redis", "mooncake", "ray", "shmcache", "shmcache+remote", "memcpy")
FULL_SIZES = (1 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20)
QUICK_SIZES = (1 << 10, 64 << 10, 256 << 10)


def _value_size(index: int, sizes: tuple[int, ...]) -> int:
    return sizes[index % len(sizes)]


def _encoder(width: int) -> Any:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    return torch.nn.Linear(width, width).eval()


def _forward(model: Any, index: int, nbytes: int) -> Any:
    import torch

    rows = max(1, nbytes // (4 * WIDTH))
    generator = torch.Generator().manual_seed(index)
    with torch.inference_mode():
        return model(torch.randn(rows, WIDTH, generator=generator)).contiguous()


def _worker(
    system: str, setup: dict[str, Any], stream: list[int], sizes: tuple[int, ...], start: Any, out: Any
) -> None:
    model = _encoder(WIDTH)
    client = client_for(system, setup)
    warm = len(stream) // 4
    hits: list[tuple[int, float]] = []
    misses: list[float] = []
    forwards = 0
    start.wait()
    t_start = time.perf_counter()
    for n, index in enumerate(stream):
        t0 = time.perf_counter()
        value, computed = client.get(
            index, lambda index=index: _forward(model, index, _value_size(index, sizes))
        )
        elapsed = time.perf_counter() - t0
        forwards += computed
        if n >= warm:
            if computed:
                misses.append(elapsed)
            else:
                hits.append((_value_size(index, sizes), elapsed))
        del value
    wall = time.perf_counter() - t_start
    node_bytes = client.node_bytes()
    client.close()
    out.put(
        {
            "hits": hits,
            "misses": misses,
            "forwards": forwards,
            "wall": wall,
            "requests": len(stream),
            "node_bytes": node_bytes,
        }
    )


def _configure_shmcache(system: str, setup: dict[str, Any], capacity: int) -> str | None:
    """For a shmcache system, put its `CacheConfig` in `setup` and return its new namespace; else None."""
    if not system.startswith("shmcache"):
        return None
    from shmcache import CacheConfig

    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    extra: dict[str, Any] = {}
    if system == "shmcache+remote":
        extra = {"remote_master": setup["master"], "remote_segment_bytes": 512 << 20}
    setup["config"] = CacheConfig(
        enable_embedding_cache=True, namespace=namespace, capacity_bytes=capacity, **extra
    )
    return namespace


def _p_ms(seconds: list[float], q: float) -> float | None:
    """The q-th percentile of `seconds`, in milliseconds (None if there are none)."""
    return float(np.percentile(seconds, q)) * 1e3 if seconds else None


def _summarise(
    system: str, processes: int, sizes: tuple[int, ...], reports: list[dict[str, Any]]
) -> dict[str, Any]:
    """One result row from the workers' reports."""
    hits = [h for r in reports for _, h in r["hits"]]
    by_size = {
        str(size): _p_ms(found, 50)
        for size in sizes
        if (found := [h for r in reports for s, h in r["hits"] if s == size])
    }
    misses = [m for r in reports for m in r["misses"]]
    per_process = system in ("lru", "mooncake", "memcpy")  # copies held (or placed) by each process
    node_total = (
        sum(r["node_bytes"] for r in reports) if per_process else max(r["node_bytes"] for r in reports)
    )
    return {
        "system": system,
        "processes": processes,
        "hit_p50_ms": _p_ms(hits, 50),
        "hit_p99_ms": _p_ms(hits, 99),
        "hit_p50_ms_by_size": by_size,
        "miss_p50_ms": _p_ms(misses, 50),
        "encoder_forwards": sum(r["forwards"] for r in reports),
        "node_bytes": node_total,
        "requests_per_s": sum(r["requests"] for r in reports) / max(r["wall"] for r in reports),
    }


def _run_system(
    system: str, processes: int, streams: list[list[int]], sizes: tuple[int, ...], capacity: int
) -> dict[str, Any] | None:
    """`system`'s result row with `processes` workers on `streams`; None if its server is not installed."""
    ctx = mp.get_context("spawn")
    setup: dict[str, Any] = {"lru_bytes": capacity}
    servers: list[Any] = []
    namespace = None
    try:
        if not start_servers(system, setup, servers):
            return None
        namespace = _configure_shmcache(system, setup, capacity)
        start, out = ctx.Barrier(processes), ctx.Queue()
        procs = [
            ctx.Process(target=_worker, args=(system, setup, streams[i], sizes, start, out))
            for i in range(processes)
        ]
        for proc in procs:
            proc.start()
        reports = [out.get(timeout=1800) for _ in procs]
        for proc in procs:
            proc.join()
    finally:
        for server in servers:
            if server.poll() is None:
                server.send_signal(signal.SIGKILL)
                server.wait()
        if namespace is not None:
            from shmcache import destroy_namespace

            destroy_namespace(namespace)
    return _summarise(system, processes, sizes, reports)


def run(
    processes: list[int],
    requests: int,
    distinct: int,
    sizes: tuple[int, ...],
    seed: int = 0,
    systems: tuple[str, ...] = SYSTEMS,
) -> dict[str, Any]:
    """Every one of `systems` on the same streams, for each process count."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(distinct)]
    capacity = max(64 << 20, 2 * sum(_value_size(i, sizes) for i in range(distinct)))
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    for count in processes:
        streams = [rng.choices(range(distinct), weights=weights, k=requests) for _ in range(count)]
        for system in systems:
            row = _run_system(system, count, streams, sizes, capacity)
            if row is None:
                skipped.append(system)
                continue
            results.append(row)
    return {
        "machine": {"cpus": os.cpu_count(), "platform": os.uname().release},
        "workload": {
            "requests_per_process": requests,
            "distinct_inputs": distinct,
            "value_sizes": list(sizes),
            "zipf": 1.0,
        },
        "results": results,
        "skipped": sorted(set(skipped)),
    }


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _largest(row: dict[str, Any]) -> float | None:
    """Hit p50 of the largest value size that had hits."""
    by_size = row["hit_p50_ms_by_size"]
    return by_size[max(by_size, key=int)] if by_size else None


def markdown(report: dict[str, Any]) -> str:
    lines = []
    for count in sorted({r["processes"] for r in report["results"]}):
        rows = [r for r in report["results"] if r["processes"] == count]
        ours = next((r for r in rows if r["system"] == "shmcache"), None)
        lines += [
            f"### {count} process(es)",
            "",
            "| system | hit p50 ms | hit p99 ms | largest-value hit p50 ms | miss p50 ms | encoder forwards "
            "| node MiB | req/s | hit p50 / shmcache's | largest-value hit / shmcache's |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            ratio = "-"
            if ours and ours["hit_p50_ms"] and r["hit_p50_ms"]:
                ratio = f"{r['hit_p50_ms'] / ours['hit_p50_ms']:.1f}x"
            hit50, hit99, miss50 = _fmt(r["hit_p50_ms"]), _fmt(r["hit_p99_ms"]), _fmt(r["miss_p50_ms"], 1)
            memory, rate = r["node_bytes"] / 2**20, r["requests_per_s"]
            largest = _largest(r)
            ours_largest = _largest(ours) if ours else None
            big_ratio = f"{largest / ours_largest:.1f}x" if largest and ours_largest else "-"
            lines.append(
                f"| {r['system']} | {hit50} | {hit99} | {_fmt(largest)} | {miss50} | {r['encoder_forwards']} "
                f"| {memory:.1f} | {rate:.0f} | {ratio} | {big_ratio} |"
            )
        lines.append("")
    if report["skipped"]:
        lines.append(f"Skipped (server not installed): {', '.join(report['skipped'])}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["processes"] for r in report["results"]})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in report["results"])]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        values = [
            next(
                (
                    r["hit_p50_ms"] or 0
                    for r in report["results"]
                    if r["system"] == system and r["processes"] == c
                ),
                0,
            )
            for c in counts
        ]
        ax.bar([c_i + i * width for c_i in range(len(counts))], values, width, label=system)
    ax.set_yscale("log")
    ax.set_xticks([c_i + width * (len(systems) - 1) / 2 for c_i in range(len(counts))])
    ax.set_xticklabels([f"{c} proc" for c in counts])
    ax.set_ylabel("hit latency p50 (ms, log)")
    ax.set_title("Cache hit latency by system (lower is better)")
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", default=None, help="comma-separated process counts (1,4,8)")
    parser.add_argument("--requests", type=int, default=200, help="requests per process")
    parser.add_argument("--distinct", type=int, default=20, help="distinct inputs")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and counts (seconds)")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of: %(default)s")
    args = parser.parse_args(argv)
    systems = tuple(args.systems.split(","))
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    processes = [int(p) for p in (args.processes or ("1,2" if args.quick else "1,4,8")).split(",")]
    requests = 20 if args.quick else args.requests
    distinct = 6 if args.quick else args.distinct
    report = run(processes, requests, distinct, sizes, systems=systems)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out / "results.md").write_text(table + "\n")
    plot(report, out / "results.png")
    print(table)
    print(f"\nwrote {out}/results.md, results.json, results.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
