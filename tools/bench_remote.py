"""Cross-node hits through Mooncake Store against a raw Mooncake `get_into` and against recomputing.

    python -m tools.bench_remote [--rounds 5]

Node A (one namespace) computes and publishes `rounds + 1` entries of 8 MiB and of 100 MiB. Node B
(another namespace, one process, room for about two entries) gets them one after the other: each a
node miss, one pull from the store under the reservation, verification and the seal. The first
pull is not timed (it opens B's connection to A's segment and faults B's arena pages in); each
later one reuses the memory of the one before, as a node in steady state does. "raw get_into" is a
bare Mooncake client reading the same objects into registered, warm memory. "recompute" is a CPU
matmul forward with the same output size. Then a request of 64 small items (4 KiB each) on a fresh
node B: one `try_reserve_many` (one batch pull) against 64 `get_or_compute` calls (64 single
pulls). Everything runs on loopback against a real mooncake_master.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import numpy as np
import torch

from shmcache import CacheConfig, EmbeddingCache, destroy_namespace
from shmcache.remote.store import RemoteStore, remote_key
from shmcache.testing import MooncakeMaster
from tools.bench_node import key

SIZES = {"8 MiB": 8 << 20, "100 MiB": 100 << 20}


def _config(namespace: str, master: str, prefix: str, capacity: int, segment: int) -> CacheConfig:
    return CacheConfig(
        enable_embedding_cache=True,
        namespace=namespace,
        capacity_bytes=capacity,
        remote_master=master,
        remote_segment_bytes=segment,
        remote_buffer_bytes=16 << 20,
        remote_key_prefix=prefix,
        store_unavailable_mode="strict",
    )


def _forward(nbytes: int) -> torch.Tensor:
    rows = nbytes // (1024 * 4)
    x = torch.randn(rows, 1024)
    w = torch.randn(1024, 1024)
    return x @ w


def _publish(a: EmbeddingCache, names: list[str], nbytes: int) -> None:
    """A computes and publishes each of `names` (one at a time: its arena holds about one)."""
    for i, name in enumerate(names):
        published = a.stats()["remote_publishes"]
        a.put(key(name), torch.full((nbytes - 4096,), i % 251, dtype=torch.uint8))
        deadline = time.monotonic() + 60
        while a.stats()["remote_publishes"] == published:
            assert time.monotonic() < deadline, "node A did not publish"
            time.sleep(0.01)


def _raw_ms(raw: RemoteStore, prefix: str, names: list[str]) -> float:
    """Median time of a bare `get_into` of each name into registered, warm memory."""
    sizes = [raw.size_of(remote_key(prefix, key(name))) or 0 for name in names]
    target = np.zeros(max(sizes), dtype=np.uint8)
    raw.register(target.ctypes.data, target.nbytes)
    times = []
    for name, size in zip(names, sizes, strict=True):
        t0 = time.perf_counter()
        assert raw._client.get_into(remote_key(prefix, key(name)), target.ctypes.data, size) == size
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def _pull_ms(master: str, prefix: str, names: list[str], nbytes: int) -> float:
    """Median time of node B's `get_or_compute` of each name (a node miss, a pull), after one
    untimed pull; B has room for about two entries, so each pull reuses the last one's memory."""
    node_b = _config(f"bench-b-{uuid.uuid4().hex[:6]}", master, prefix, nbytes * 5 // 2, 16 << 20)
    times = []
    try:
        with EmbeddingCache(node_b) as b:
            for name in names:
                t0 = time.perf_counter()
                value = b.get_or_compute(key(name), lambda: None)
                times.append(time.perf_counter() - t0)
                assert value is not None
                del value
            assert b.stats()["hits_remote"] == len(names)
    finally:
        destroy_namespace(node_b.namespace)
    return statistics.median(times[1:]) * 1e3


def run(rounds: int) -> list[dict[str, float | str]]:
    master = MooncakeMaster()
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    largest = max(SIZES.values())
    node_a = _config(
        f"bench-a-{uuid.uuid4().hex[:6]}",
        master.address,
        prefix,
        largest * 3 // 2,
        (rounds + 2) * largest * len(SIZES),
    )
    rows: list[dict[str, float | str]] = []
    try:
        with EmbeddingCache(node_a) as a:
            raw = RemoteStore(
                CacheConfig(
                    remote_master=master.address,
                    remote_segment_bytes=16 << 20,
                    remote_buffer_bytes=16 << 20,
                    remote_publish_queue=1,
                    store_unavailable_mode="strict",
                ),
                lambda counter, n: None,
            )
            for label, nbytes in SIZES.items():
                names = [f"{label}-{i}" for i in range(rounds + 1)]
                _publish(a, names, nbytes)
                raw_ms = _raw_ms(raw, prefix, names)
                pull_ms = _pull_ms(master.address, prefix, names, nbytes)
                compute_times = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    _forward(nbytes)
                    compute_times.append(time.perf_counter() - t0)
                rows.append(
                    {
                        "size": label,
                        "raw_get_into_ms": raw_ms,
                        "cross_node_hit_ms": pull_ms,
                        "speed_vs_raw": raw_ms / pull_ms,
                        "recompute_ms": statistics.median(compute_times) * 1e3,
                    }
                )
            raw.close()
            rows.append(_batch(a, master.address, prefix, rounds))
    finally:
        master.kill()
        destroy_namespace(node_a.namespace)
    return rows


BATCH = 64


def _batch(a: EmbeddingCache, master: str, prefix: str, rounds: int) -> dict[str, float | str]:
    """64 small items pulled by a fresh node in one batch call, and one by one."""
    keys = [key(f"small-{i}") for i in range(BATCH)]
    published = a.stats()["remote_publishes"]
    for i, k in enumerate(keys):
        a.put(k, torch.full((4096 - 256,), i % 251, dtype=torch.uint8))
    deadline = time.monotonic() + 60
    while a.stats()["remote_publishes"] < published + BATCH and time.monotonic() < deadline:
        time.sleep(0.05)
    batch_times: list[float] = []
    single_times: list[float] = []
    for _ in range(rounds):
        for times, batched in ((batch_times, True), (single_times, False)):
            node_b = _config(f"bench-b-{uuid.uuid4().hex[:6]}", master, prefix, 64 << 20, 16 << 20)
            with EmbeddingCache(node_b) as b:
                t0 = time.perf_counter()
                if batched:
                    got = [res.value if res is not None else None for res in b.try_reserve_many(keys)]
                else:
                    got = [b.get_or_compute(k, lambda: None) for k in keys]
                times.append(time.perf_counter() - t0)
                assert all(v is not None for v in got) and b.stats()["hits_remote"] == BATCH
                del got
            destroy_namespace(node_b.namespace)
    batch_ms, single_ms = statistics.median(batch_times) * 1e3, statistics.median(single_times) * 1e3
    return {"size": f"{BATCH} x 4 KiB", "batch_ms": batch_ms, "singles_ms": single_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    rows = run(args.rounds)
    print(
        "| value | raw get_into | cross-node hit (miss, pull, verify, seal) | vs raw | recompute (matmul) |"
    )
    print("|---|---|---|---|---|")
    for r in rows[:-1]:
        print(
            f"| {r['size']} | {r['raw_get_into_ms']:.1f} ms | {r['cross_node_hit_ms']:.1f} ms "
            f"| {r['speed_vs_raw']:.2f}x | {r['recompute_ms']:.1f} ms |"
        )
    batch = rows[-1]
    print("\n| request | one batch pull (try_reserve_many) | single pulls (get_or_compute each) |")
    print("|---|---|---|")
    print(f"| {batch['size']} | {batch['batch_ms']:.1f} ms | {batch['singles_ms']:.1f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
