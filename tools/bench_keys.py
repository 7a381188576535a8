"""Key construction speed versus raw xxh3-128 of the same buffer (target: >= 90%, issue #15).

python -m tools.bench_keys [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import xxhash

from shmcache import EmbeddingCacheKey
from shmcache.testing import sample_preprocessing

CONFIG = sample_preprocessing()  # the preprocessing config of every tool's keys (bench_node, stress, ...)


def _rates(fns: list[Callable[[], object]], nbytes: int, rounds: int = 60) -> list[float]:
    """Median bytes/s of each function, measured in alternating batches (so drift hits all alike)."""
    calls = max(1, int(5e7 // max(nbytes, 1)))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, samples, strict=True):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append(nbytes * calls / (time.perf_counter() - t0))
    return [statistics.median(s) for s in samples]


def run() -> list[dict[str, float | int]]:
    rows = []
    for size in (200 * 1024, 8 << 20):
        data = os.urandom(size)

        def raw_hash(data: bytes = data) -> object:
            return xxhash.xxh3_128_digest(data)

        def make_key(data: bytes = data) -> object:
            return EmbeddingCacheKey.from_raw_bytes(data, CONFIG, modality="image")

        raw, key = _rates([raw_hash, make_key], size)
        rows.append({"bytes": size, "raw_gbps": raw / 1e9, "key_gbps": key / 1e9, "ratio": key / raw})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = run()
    print("| input | raw xxh3-128 | EmbeddingCacheKey.from_raw_bytes | ratio |")
    print("|---|---|---|---|")
    for row in rows:
        print(
            f"| {int(row['bytes']) // 1024} KiB | {row['raw_gbps']:.1f} GB/s | {row['key_gbps']:.1f} GB/s "
            f"| {row['ratio']:.0%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
