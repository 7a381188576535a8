"""Smoke test of tools/bench: every system at a tiny size, checking the output schema (no timings)."""

from __future__ import annotations

import json
from pathlib import Path

from tools import bench

ROW_KEYS = {
    "system",
    "processes",
    "hit_p50_ms",
    "hit_p99_ms",
    "hit_p50_ms_by_size",
    "miss_p50_ms",
    "encoder_forwards",
    "node_bytes",
    "requests_per_s",
}


def test_bench_runs_every_system_and_writes_its_outputs(tmp_path: Path) -> None:
    assert bench.main(["--quick", "--processes", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report) == {"machine", "workload", "results", "skipped"}
    systems = {row["system"] for row in report["results"]}
    assert systems | set(report["skipped"]) == set(bench.SYSTEMS)
    assert {"none", "lru", "shmcache", "memcpy"} <= systems
    for row in report["results"]:
        assert set(row) == ROW_KEYS
    by_system = {row["system"]: row for row in report["results"] if row["processes"] == 1}
    requests, distinct = report["workload"]["requests_per_process"], report["workload"]["distinct_inputs"]
    assert by_system["none"]["encoder_forwards"] == requests  # no cache: every request encodes
    assert 1 <= by_system["shmcache"]["encoder_forwards"] <= distinct  # once per distinct input
    assert "| shmcache |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
