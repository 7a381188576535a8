"""`shmcache demo`: encoder and prefill processes sharing one node cache on a repeated workload.

The request stream is dealt round-robin to the processes. Encoder processes encode the images of
their requests (a real small ViT-style forward: patch embedding + transformer layers); prefill
processes consume the embeddings of theirs, computing them themselves when no encoder has got
there yet. All of them go through one node cache, so each distinct image is encoded once on the
node, whoever gets there first, and every process reads the one shared copy.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import time
import uuid
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from shmcache.config import CacheConfig
from shmcache.kernel.namespace import destroy_namespace
from shmcache.keys.key import EmbeddingCacheKey
from shmcache.node.layout import Counter
from shmcache.ops.argtypes import at_least
from shmcache.process.cache import EmbeddingCache
from shmcache.testing.samples import sample_preprocessing

__all__ = ["main", "run"]

IMAGE_SIZE = 224
PATCH = 16
WIDTH = 256

# The sample config (shmcache.testing.samples), with what describes this demo's encoder and its input:
# patch size and width, 224x224 uint8 pixels, no resize or crop, normalised by (x - 0.5) / 0.5.
PREPROCESSING = sample_preprocessing(
    model_id="shmcache-demo/tiny-vit",
    encoder_config_hash=f"patch{PATCH}-width{WIDTH}-layers2",
    resize_mode="none",
    image_size=(IMAGE_SIZE, IMAGE_SIZE),
    crop_mode="none",
    normalize_mean=(0.5, 0.5, 0.5),
    normalize_std=(0.5, 0.5, 0.5),
    input_dtype="uint8",
)


def image_bytes(index: int) -> bytes:
    """The raw bytes of demo image `index` (a deterministic 224x224 RGB picture)."""
    rng = np.random.default_rng(index)
    yy, xx = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE]
    base = (np.sin(xx / (7 + index % 13)) + np.cos(yy / (5 + index % 11))) * 60 + 128
    noise = rng.integers(0, 24, size=(3, IMAGE_SIZE, IMAGE_SIZE))
    return bytes(np.clip(base[None] + noise, 0, 255).astype(np.uint8).tobytes())


def build_encoder(seed: int = 0) -> Any:
    """A tiny ViT-style image encoder (random weights, same in every process)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    layer = nn.TransformerEncoderLayer(d_model=WIDTH, nhead=4, dim_feedforward=2 * WIDTH, batch_first=True)
    model = nn.Sequential()
    model.patch = nn.Conv2d(3, WIDTH, kernel_size=PATCH, stride=PATCH)
    model.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    return model.eval()


def encode(model: Any, raw: bytes) -> Any:
    """Decode the raw bytes, normalise, and run the encoder: a (196, 256) float32 embedding."""
    import torch

    pixels = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(1, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.inference_mode():
        x = (pixels.float() / 255.0 - 0.5) / 0.5
        patches = model.patch(x).flatten(2).transpose(1, 2)
        return model.blocks(patches)[0].contiguous()


def _worker(
    role: str, config: CacheConfig, requests: list[int], progress: Any, forwards: Any, results: Any
) -> None:
    import torch

    model = build_encoder()
    hit_ms: list[float] = []
    miss_ms: list[float] = []
    seen: set[int] = set()
    with EmbeddingCache(config) as cache:
        for n, image in enumerate(requests):
            raw = image_bytes(image)
            key = EmbeddingCacheKey.from_raw_bytes(raw, PREPROCESSING, modality="image")
            request_id = f"{role}-{os.getpid()}-{n}"
            computed = False

            def compute(raw: bytes = raw) -> Any:
                nonlocal computed
                computed = True
                with forwards.get_lock():
                    forwards.value += 1
                return encode(model, raw)

            t0 = time.perf_counter()
            embedding = cache.get_or_compute(key, compute, request_id=request_id)
            elapsed = (time.perf_counter() - t0) * 1e3
            (miss_ms if computed else hit_ms).append(elapsed)
            if role == "prefill":
                torch.nn.functional.linear(embedding, embedding[:8]).sum()  # the prefill consumes it
            seen.add(image)
            del embedding
            cache.cleanup_request(request_id)
            with progress.get_lock():
                progress.value += 1
    results.put((role, hit_ms, miss_ms, sorted(seen)))


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


_Report = tuple[str, list[float], list[float], list[int]]  # role, hit ms, miss ms, images seen


def _request_stream(requests: int, distinct: int, seed: int) -> list[int]:
    """`requests` image indices over `distinct` images, Zipf-weighted: a few images recur a lot."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(distinct)]
    return rng.choices(range(distinct), weights=weights, k=requests)


def _collect(
    procs: Sequence[BaseProcess], progress: Any, results: Any, total: int, show_progress: bool
) -> list[_Report]:
    """Every worker's report, showing their progress; raises `RuntimeError` if a worker fails."""
    from tqdm import tqdm

    with tqdm(total=total, desc="requests", unit="req", disable=not show_progress) as bar:
        reported: list[_Report] = []
        while len(reported) < len(procs):
            time.sleep(0.1)
            bar.update(progress.value - bar.n)
            while not results.empty():
                reported.append(results.get())
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a demo worker failed")
        bar.update(progress.value - bar.n)
    return reported


def run(
    encoders: int = 2,
    prefills: int = 2,
    requests: int = 320,
    distinct: int = 40,
    seed: int = 0,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Run the demo and return its figures (also what the table prints)."""
    stream = _request_stream(requests, distinct, seed)
    namespace = f"demo-{uuid.uuid4().hex[:8]}"
    config = CacheConfig(enable_embedding_cache=True, namespace=namespace, capacity_bytes=256 << 20)
    ctx = mp.get_context("spawn")
    progress, forwards, results = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Queue()
    roles = ["encoder"] * encoders + ["prefill"] * prefills
    shares = {i: [image for n, image in enumerate(stream) if n % len(roles) == i] for i in range(len(roles))}
    total = sum(len(share) for share in shares.values())
    with EmbeddingCache(config) as observer:
        procs = [
            ctx.Process(target=_worker, args=(role, config, shares[i], progress, forwards, results))
            for i, role in enumerate(roles)
        ]
        started = time.perf_counter()
        for proc in procs:
            proc.start()
        reported = _collect(procs, progress, results, total, show_progress)
        for proc in procs:
            proc.join()
        wall = time.perf_counter() - started
        stats = observer.stats()
    destroy_namespace(namespace)
    hits = [ms for _, h, _, _ in reported for ms in h]
    misses = [ms for _, _, m, _ in reported for ms in m]
    embedding_bytes = (IMAGE_SIZE // PATCH) ** 2 * WIDTH * 4
    per_process_bytes = sum(len(seen) for _, _, _, seen in reported) * embedding_bytes
    return {
        "processes": f"{encoders} encoder + {prefills} prefill",
        "requests": total,
        "distinct_inputs": len(set(stream)),
        "encoder_forwards": forwards.value,
        "hits": len(hits),
        "hit_p50_ms": _percentile(hits, 50),
        "hit_p99_ms": _percentile(hits, 99),
        "miss_p50_ms": _percentile(misses, 50),
        "miss_p99_ms": _percentile(misses, 99),
        "coalesced_waits": stats[Counter.COALESCED_WAITS.label],
        "node_bytes": stats["bytes"],
        "per_process_cache_bytes": per_process_bytes,
        "wall_s": wall,
    }


def format_table(figures: dict[str, Any]) -> str:
    """The demo's result table."""
    mib = 2**20
    rows = [
        ("processes", figures["processes"]),
        ("requests", figures["requests"]),
        ("distinct inputs", figures["distinct_inputs"]),
        ("encoder forwards", f"{figures['encoder_forwards']}  (one per distinct input on the node)"),
        ("cache hits", figures["hits"]),
        ("waits coalesced", figures["coalesced_waits"]),
        ("hit latency p50 / p99", f"{figures['hit_p50_ms']:.3f} / {figures['hit_p99_ms']:.3f} ms"),
        (
            "miss latency p50 / p99",
            f"{figures['miss_p50_ms']:.1f} / {figures['miss_p99_ms']:.1f} ms (encode)",
        ),
        ("node memory, shmcache", f"{figures['node_bytes'] / mib:.1f} MiB (one copy per input)"),
        ("node memory, per-process caches", f"{figures['per_process_cache_bytes'] / mib:.1f} MiB"),
        ("wall time", f"{figures['wall_s']:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shmcache demo", description=__doc__)
    parser.add_argument("--encoders", type=at_least(1), default=2, help="encoder processes (default 2)")
    parser.add_argument("--prefills", type=at_least(1), default=2, help="prefill processes (default 2)")
    parser.add_argument("--requests", type=at_least(1), default=320, help="requests in all (default 320)")
    parser.add_argument(
        "--distinct",
        type=at_least(1),
        default=40,
        help="the pool the requests' images are drawn from (default 40)",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the random draw (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="print only the final table")
    args = parser.parse_args(argv)
    figures = run(args.encoders, args.prefills, args.requests, args.distinct, args.seed, not args.no_progress)
    print(format_table(figures))
    return 0 if figures["encoder_forwards"] == figures["distinct_inputs"] else 1
