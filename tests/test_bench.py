"""Smoke test of tools/bench: every system at a tiny size, checking the output schema (no timings)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tools import bench, bench_backends

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


def test_an_unknown_system_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.main(["--quick", "--systems", "shmcache,plasma", "--out", str(tmp_path / "out")])
    assert exited.value.code == 2 and "unknown systems: plasma" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _listening(pids: list[int]) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of the TCP sockets `pids` listen on."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if (link := os.readlink(fd)).startswith("socket:["):
                        inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.append(fields[1].rsplit(":", 1)[0])
    return found


_RAY_CLIENT = """
import sys, torch
from tools.bench_backends import RayPlasma
client = RayPlasma(sys.argv[1])
client.get(1, lambda: torch.ones(1 << 18))  # a miss: stored by the directory actor
value, computed = client.get(1, lambda: None)  # a hit
assert not computed and value.numel() == 1 << 18
print("ready", flush=True)
sys.stdin.read()
client.close()
"""


def test_the_ray_head_listens_on_loopback_only_and_its_stop_leaves_nothing() -> None:
    """Ray's servers (GCS, raylet, agents, client server, the directory actor) and a bench
    client's own servers bind 127.0.0.1 only, and the stop ends every process of the head's
    session and removes its files."""
    pytest.importorskip("ray")
    binary = Path(sys.executable).parent / "ray"
    head = bench_backends.RayHead(binary, 128 << 20)
    try:
        with subprocess.Popen(
            [sys.executable, "-c", _RAY_CLIENT, head.address],
            cwd=Path(__file__).parents[1],  # `tools` importable
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        ) as client:
            assert client.stdout is not None and client.stdin is not None
            assert client.stdout.readline() == b"ready\n"
            addresses = _listening([*bench_backends._session(head.session), client.pid])
            client.stdin.close()
            assert client.wait(timeout=60) == 0
        assert addresses, "no Ray server listens"
        loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::ffff:127.0.0.1
        assert set(addresses) <= loopback, addresses
    finally:
        head.send_signal(signal.SIGKILL)
        head.wait()
    assert bench_backends._session(head.session) == [] and not Path(head.temp).exists()
