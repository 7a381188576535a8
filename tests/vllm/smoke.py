"""Smoke test of the vLLM harness: real vLLM (CPU) on the tiny LLaVA, each engine in its own process.

(a) one engine, no connector, two requests with the same image and a third with another: vLLM's own
    in-process encoder cache serves the second, so the encoder runs once per distinct image (2);
(b) two engines one after the other with vLLM's ``ECExampleConnector`` (``ec_both``, a shared
    folder): the first encodes and saves, the second loads, runs the encoder 0 times and returns
    the first's tokens and logprobs exactly. The second runs in multiprocess mode (EngineCore and
    worker in their own processes), the others in-process, so the probe is exercised in both.

The engines run one after the other (two at once on 2 cores take longer than in turn). Run it with
``python -m tests.vllm.smoke`` (``--keep`` keeps the work directory). It is not part of the test
suite (about 2 minutes); tests/test_vllm_engines.py runs the harness with shmcache's connector.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.vllm.engine import EngineResult, EngineRun, ImageRequest, spawn_engine

# Two requests with the same image, then one with another (which must change the logprobs).
REQUESTS = (ImageRequest(image_seed=1), ImageRequest(image_seed=1), ImageRequest(image_seed=2))


def example_connector_config(folder: Path, role: str = "ec_both") -> dict[str, Any]:
    """`ec_transfer_config` for vLLM's ECExampleConnector (one safetensors file per item in `folder`)."""
    return {
        "ec_connector": "ECExampleConnector",
        "ec_role": role,
        "ec_buffer_device": "cpu",
        "ec_connector_extra_config": {"shared_storage_path": str(folder)},
    }


@dataclass
class SmokeReport:
    no_connector: EngineResult
    first: EngineResult
    second: EngineResult
    saved_files: list[str]
    wall_s: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def engine(r: EngineResult) -> dict[str, Any]:
            return {
                "encoder_runs": r.encoder_runs,
                "startup_vision_tower_images": r.startup_vision_tower_images,
                "startup_s": round(r.startup_s, 1),
                "generate_s": round(r.generate_s, 2),
                "latency_s": [round(q.latency_s, 3) for q in r.requests],
                "ttft_s": [round(q.ttft_s, 3) if q.ttft_s is not None else None for q in r.requests],
            }

        return {
            "a_no_connector": engine(self.no_connector),
            "b_first": engine(self.first),
            "b_second": engine(self.second),
            "saved_files": len(self.saved_files),
            "wall_s": {k: round(v, 1) for k, v in self.wall_s.items()},
        }


def run_smoke(
    work_dir: Path, model_dir: Path | None = None, *, multiprocess: bool = True, timeout: float = 300.0
) -> SmokeReport:
    """Run (a) and (b) (see the module docstring) under `work_dir`; the model is built if needed.

    `multiprocess=False` runs the second engine of (b) in-process too (~30 s less on 2 cores)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    model = str(model_dir or work_dir / "tiny-llava")
    folder = work_dir / "ec-shared"
    folder.mkdir(exist_ok=True)
    config = example_connector_config(folder)
    wall: dict[str, float] = {}

    start = time.perf_counter()
    run = EngineRun(model, str(work_dir / "a.json"), REQUESTS, build_model=True)
    no_connector = spawn_engine(run, timeout)
    wall["a_no_connector"] = time.perf_counter() - start

    start = time.perf_counter()
    run = EngineRun(model, str(work_dir / "b1.json"), REQUESTS, ec_transfer_config=config)
    first = spawn_engine(run, timeout)
    wall["b_first"] = time.perf_counter() - start

    start = time.perf_counter()
    run = EngineRun(
        model, str(work_dir / "b2.json"), REQUESTS, ec_transfer_config=config, multiprocess=multiprocess
    )
    second = spawn_engine(run, timeout)
    wall["b_second"] = time.perf_counter() - start
    saved = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    return SmokeReport(no_connector, first, second, saved, wall)


def verify(report: SmokeReport) -> None:
    """The smoke test's claims; raises AssertionError with what differs."""
    a, first, second = report.no_connector, report.first, report.second
    assert a.encoder_runs == 2, f"(a) encoder ran {a.encoder_runs} times for 2 distinct images, want 2"
    assert len(set(a.encoded_mm_hashes)) == 2, f"(a) encoded {a.encoded_mm_hashes}"
    assert a.requests[0].logprobs == a.requests[1].logprobs, "(a) same image, different logprobs"
    assert a.requests[0].logprobs != a.requests[2].logprobs, "(a) the image does not move the logprobs"
    assert first.encoder_runs == 2, f"(b) first engine encoded {first.encoder_runs} times, want 2"
    assert len(report.saved_files) == 2, f"(b) saved {report.saved_files}, want 2 files"
    assert second.startup_vision_tower_images >= 1, "(b) the probe is silent in the second engine"
    assert second.encoder_runs == 0, f"(b) second engine encoded {second.encoder_runs} times, want 0"
    for one, two in zip(first.requests, second.requests, strict=True):
        assert one.token_ids == two.token_ids, "(b) second engine generated other tokens"
        assert one.logprobs == two.logprobs, "(b) second engine's logprobs differ"
        assert one.top_logprobs == two.top_logprobs, "(b) second engine's top logprobs differ"
    for one, two in zip(a.requests, first.requests, strict=True):
        assert one.logprobs == two.logprobs, "the connector changed the logprobs"


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--work-dir", type=Path, help="default: a new temporary directory")
    parser.add_argument("--model-dir", type=Path, help="tiny model location (built if missing)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--in-process", action="store_true", help="second engine of (b) in-process too")
    args = parser.parse_args(argv)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="vllm-smoke-"))
    shm_before = shm_entries()
    start = time.perf_counter()
    try:
        report = run_smoke(work_dir, args.model_dir, multiprocess=not args.in_process)
        report.wall_s["total"] = time.perf_counter() - start
        print(json.dumps(report.summary(), indent=1))
        verify(report)
        leaked = shm_entries() - shm_before
        assert not leaked, f"left in /dev/shm: {sorted(leaked)}"
    finally:
        if not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
    print("smoke OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
