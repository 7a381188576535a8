"""Device check of GPU entries, for a machine with a CUDA GPU (about two minutes).

    python3 tools/gpu_check.py [--json FILE]

In real spawned processes sharing one namespace, it checks:

1. zero copy: a reader on the exporter's GPU gets an alias (route `alias`, by its own counters),
   allocates no device memory for it, and sees the exporter's in-place change of its copy;
2. bf16 and fp16 values come back bit-identical through every route: alias, host copy in a
   process without CUDA, and host-to-device copy after the exporter is SIGKILLed (the dead
   exporter counted, the entry alive); a repeat hit on an alias held across the kill takes the
   host copy;
3. the other inputs: a cupy array (read back as cupy on a GPU, numpy on a CPU reader), a value
   from `get_or_compute` whose compute returns a CUDA tensor, and keys of CUDA tensors (equal to
   the keys of their CPU copies);
4. 4 threads exporting 64 values at once under a small export limit (withdrawals and sweeps
   racing the exports): every value bit-identical, some read through aliases;
5. fences: a reader queues ~1 s of GPU work on an alias and drops it; its pin must outlast that
   work, and the exporter then frees and reuses the memory; the reader's result must be right;
6. latency: p50 of an 8 MiB GPU hit against one device-to-device copy and one host-to-device
   copy of 8 MiB (pageable and pinned);
7. the peer route, where the machine has two GPUs with peer access (else reported as not run).

Each check is printed as it ends; exit status 0 when every check passed, 1 otherwise, 2 without
CUDA. Workers die with this process (even on SIGKILL of it). On the lent device machine the image
lacks blake3: docs/gpu.md says how to carry its wheel. The worker processes
are in tools/gpu_check_workers.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from shmcache import CacheConfig, EmbeddingCacheKey, destroy_namespace
from tools.bench_keys import CONFIG as PCONFIG
from tools.gpu_check_workers import (
    DTYPES,
    VALUE_BYTES,
    concurrent_exporter,
    exporter,
    fence_exporter,
    reader,
    sample_value,
)

_REPLY_TIMEOUT_S = 60.0


class _Process:
    """A spawned worker with a command queue and a reply queue."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.name = target.__name__
        self.proc = ctx.Process(target=target, args=(*args, self.commands, self.replies), daemon=True)
        self.proc.start()

    def ask(self, command: str, name: str = "") -> Any:
        self.commands.put((command, name))
        return self.reply()

    def reply(self) -> Any:
        """The next reply; raises at once if the worker died, or after `_REPLY_TIMEOUT_S`."""
        deadline = time.monotonic() + _REPLY_TIMEOUT_S
        while True:
            try:
                return self.replies.get(timeout=1.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"{self.name} exited with {self.proc.exitcode}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no reply from {self.name} within {_REPLY_TIMEOUT_S}s") from None

    def kill(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before.get(name, 0) for name in after}


@dataclasses.dataclass
class Report:
    """What the checks found so far (kept when a later check breaks off)."""

    checks: dict[str, bool] = dataclasses.field(default_factory=dict)
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def check(self, name: str, passed: bool) -> None:
        self.checks[name] = bool(passed)
        print(f"{'PASS' if passed else 'FAIL'}  {name}", flush=True)

    def failed(self) -> list[str]:
        return [name for name, passed in self.checks.items() if not passed]


def run_checks(report: Report | None = None) -> Report:
    """Run every check into `report` (a new one if None) and return it."""
    report = report or Report()
    namespace = f"gpu-check-{os.getpid()}"
    config = CacheConfig(enable_embedding_cache=True, namespace=namespace, capacity_bytes=256 << 20)
    report.figures["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    _keys(report)
    workers: list[_Process] = []
    try:
        export = _Process(exporter, config)
        gpu_reader = _Process(reader, config, 0)
        cpu_reader = _Process(reader, config, None)
        workers += [export, gpu_reader, cpu_reader]
        put = export.reply()
        truth = put["truth"]
        report.figures["exporter counters"] = put["counts"]
        _inputs(report, put, gpu_reader, cpu_reader)
        before = gpu_reader.ask("peek", "bf16")
        export.ask("mutate", "bf16")
        during = gpu_reader.ask("peek", "bf16")
        export.ask("restore", "bf16")
        after = gpu_reader.ask("peek", "bf16")
        report.check(
            "zero copy: the reader sees the exporter's in-place change",
            during == [12345] * 16 and before == after != during,
        )
        report.check("the reader's mappings all close with its last aliases", gpu_reader.ask("drop") == 0)
        report.figures.update(gpu_reader.ask("bench", "bf16"))
        _peer(report, config, truth)
        late = _exporter_killed(report, config, truth, export, gpu_reader, workers)
        _racing(report, config, late, workers)
        _fence(report, namespace, workers)
        readers = {"GPU reader": gpu_reader, "CPU reader": cpu_reader, "late GPU reader": late}
        for label, worker in readers.items():
            report.figures[f"{label} counters"] = worker.ask("stop")
    finally:
        for worker in workers:
            worker.kill()
        destroy_namespace(namespace)
    return report


def _exporter_killed(
    report: Report,
    config: CacheConfig,
    truth: dict[str, str],
    export: _Process,
    gpu_reader: _Process,
    workers: list[_Process],
) -> _Process:
    """SIGKILL the exporter while `gpu_reader` holds an alias; then a repeat hit and a new GPU
    reader (returned, its views dropped) must get bit-identical host copies."""
    gpu_reader.ask("drop")
    gpu_reader.ask("get", "bf16")  # an alias held (and its repeat-hit template) across the kill
    export.kill()
    counts = gpu_reader.ask("counts")
    repeat = gpu_reader.ask("get", "bf16")
    delta = _delta(gpu_reader.ask("counts"), counts)
    report.check(
        "after the exporter's SIGKILL: a repeat hit takes the host copy, not a new alias",
        repeat["fingerprint"] == truth["bf16"] and delta["gpu_hits_host_copy"] == 1,
    )
    late = _Process(reader, config, 0)
    workers.append(late)
    counts = late.ask("counts")
    for name in DTYPES:
        got = late.ask("get", name)
        report.check(
            f"after the exporter's SIGKILL: {name} from the host copy, bit-identical",
            got["fingerprint"] == truth[name] and got["device"] == "cuda:0",
        )
    delta = _delta(late.ask("counts"), counts)
    report.check(
        "after the exporter's SIGKILL: host-to-device route, dead exporter counted",
        delta["gpu_hits_host_copy"] == 2 and delta["gpu_dead_exporter"] >= 2 and delta["gpu_hits_alias"] == 0,
    )
    late.ask("drop")
    return late


def _keys(report: Report) -> None:
    """Keys of CUDA tensors equal the keys of their CPU copies (dtype, shape and bytes hashed)."""
    value = sample_value("key", 1 << 16).reshape(128, 256)
    pairs = [(value, value.cpu()), (value.t(), value.t().cpu()), (value.half(), value.half().cpu())]
    report.check(
        "keys of CUDA tensors (bf16, non-contiguous, fp16) equal their CPU copies' keys",
        all(
            EmbeddingCacheKey.from_decoded_tensor(gpu, PCONFIG, modality="image")
            == EmbeddingCacheKey.from_decoded_tensor(cpu, PCONFIG, modality="image")
            for gpu, cpu in pairs
        ),
    )


def _inputs(report: Report, put: dict[str, Any], gpu_reader: _Process, cpu_reader: _Process) -> None:
    """Every input the exporter put, through the alias route and the host route."""
    truth = put["truth"]
    counts = gpu_reader.ask("counts")
    for name in truth:
        got = gpu_reader.ask("get", name)
        host = cpu_reader.ask("get", name)
        library = "cupy" if name == "cupy" else "torch"
        report.check(
            f"{name}: alias bit-identical, a {library} array on cuda:0",
            got["fingerprint"] == truth[name] and (got["library"], got["device"]) == (library, "cuda:0"),
        )
        report.check(f"{name}: the alias allocates no device memory", got["allocated"] == 0)
        host_library = "numpy" if name == "cupy" else "torch"
        report.check(
            f"{name}: host copy bit-identical on a CPU reader, as {host_library}",
            host["fingerprint"] == truth[name] and (host["library"], host["device"]) == (host_library, "cpu"),
        )
    if "cupy" not in truth:
        report.notes.append("cupy input not run: cupy did not work in the exporter (its output says why)")
    delta = _delta(gpu_reader.ask("counts"), counts)
    report.check(
        f"the GPU reader's {len(truth)} reads all took the alias route",
        delta["gpu_hits_alias"] == len(truth) and delta["gpu_hits_host_copy"] == 0,
    )
    report.check(
        "get_or_compute: one compute on the GPU, its result a CUDA tensor of the exporter's",
        put["computes"] == 1
        and put["computed"]["fingerprint"] == truth["computed"]
        and put["computed"]["device"] == "cuda:0",
    )
    report.check(
        "every value was exported (no export skipped)",
        put["counts"]["gpu_exports"] == len(truth) and put["counts"]["gpu_export_skips"] == 0,
    )


def _racing(report: Report, config: CacheConfig, reader_process: _Process, workers: list[_Process]) -> None:
    """Exports race sweeps and withdrawals (a 256 KiB export limit for 64 KiB values)."""
    racing = _Process(concurrent_exporter, dataclasses.replace(config, gpu_export_bytes=256 << 10), 4, 16)
    workers.append(racing)
    done = racing.reply()
    report.figures["racing exporter counters"] = done["counts"]
    counts = reader_process.ask("counts")
    got = {name: reader_process.ask("get", name)["fingerprint"] for name in done["truth"]}
    delta = _delta(reader_process.ask("counts"), counts)
    reader_process.ask("drop")
    racing.commands.put(("stop", ""))
    report.check(
        "4 threads exporting 64 values at once (withdrawing all along): bit-identical, some aliased",
        not done["failures"]
        and got == done["truth"]
        and delta["gpu_hits_alias"] > 0
        and delta["gpu_hits_alias"] + delta["gpu_hits_host_copy"] == len(got),
    )


def _fence(report: Report, namespace: str, workers: list[_Process]) -> None:
    """A reader queues ~1 s of work on an alias and drops it; the exporter waits until the entry is
    unreferenced, then frees and reuses that copy. The pin must have outlasted the work (the
    wait), the memory must have been reused (an export, no skip), and the sum must be right."""
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
        counts = fence_reader.ask("counts")
        fence_reader.ask("fence", "fence-a")
        export.commands.put(("overwrite", ""))
        overwrite = export.reply()
        total = fence_reader.ask("sum")
        aliased = _delta(fence_reader.ask("counts"), counts)["gpu_hits_alias"]
        export.commands.put(("stop", ""))
        fence_reader.ask("stop")
        report.figures["fence: pin held after the drop (s)"] = round(overwrite["waited_s"], 3)
        report.check(
            "fence: a released alias's queued kernel finishes before its memory is freed and reused",
            aliased == 1
            and overwrite["waited_s"] > 0.3
            and overwrite["gpu_exports"] == 1
            and overwrite["gpu_export_skips"] == 0
            and total == expected,
        )
    finally:
        destroy_namespace(config.namespace)


def _peer(report: Report, config: CacheConfig, truth: dict[str, str]) -> None:
    """A reader on GPU 1 gets the exporter's GPU 0 values through the peer route."""
    if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(1, 0):
        report.notes.append(f"peer route not run: {torch.cuda.device_count()} GPU(s) visible, no peer pair")
        return
    peer = _Process(reader, config, 1)
    try:
        got = {name: peer.ask("get", name) for name in DTYPES}
        counts = peer.ask("stop")
    finally:
        peer.kill()
    report.check(
        "peer route: on GPU 1, bit-identical",
        all(got[name]["fingerprint"] == truth[name] and got[name]["device"] == "cuda:1" for name in DTYPES),
    )
    report.check("peer route taken", counts["gpu_hits_peer"] == len(DTYPES))


class _Terminated(Exception):
    """SIGTERM (e.g. from `timeout`): end the checks, clean up, and still write the report."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated("terminated by SIGTERM")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing was checked")
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    report = Report()
    try:
        run_checks(report)
    except Exception as exc:  # a worker died or hung, or SIGTERM: a failed check, with the reason
        report.check(f"the checks ran to the end ({type(exc).__name__}: {exc})", False)
    summary = {
        "device": torch.cuda.get_device_name(0),
        "seconds": round(time.monotonic() - started, 1),
        **dataclasses.asdict(report),
    }
    for name, figure in report.figures.items():
        print(f"      {name}: {figure if not isinstance(figure, float) else f'{figure:.1f}'}")
    for note in report.notes:
        print(f"note  {note}")
    passed = len(report.checks) - len(report.failed())
    print(f"{passed}/{len(report.checks)} checks passed in {summary['seconds']} s")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if report.checks and not report.failed() else 1


if __name__ == "__main__":
    raise SystemExit(main())
