"""shmcache-inspect and the metrics, against live multi-process caches."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import torch

from shmcache import CacheConfig, EmbeddingCache
from shmcache.kernel.namespace import object_names
from shmcache.ops.inspect import main as inspect_main
from shmcache.ops.records import json_schema
from shmcache.testing import ProcessPool
from tests import workers
from tests.helpers import finished, kernel_objects, kill, running, spawn, wait_for
from tests.workers import expected_value, key_of


def run_inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = inspect_main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def hold_view(cache: EmbeddingCache, name: str) -> None:
    """Pool worker: hold a view of `name` with a request reference until killed."""
    from shmcache.testing import checkpoint

    view = cache.get(key_of(name), request_id="inspect-test")
    assert view is not None
    checkpoint("holding-view", pause=True)


def test_show_lists_entries_references_and_holders(
    shmcache_config: CacheConfig, shmcache_pool: ProcessPool, capsys: pytest.CaptureFixture[str]
) -> None:
    with EmbeddingCache(shmcache_config) as cache:
        cache.put(key_of("a"), expected_value("a", 1000))
        cache.put(key_of("b"), torch.zeros(3, 4, dtype=torch.float16))
        holder = shmcache_pool.spawn(hold_view, "a")
        holder.wait_checkpoint("holding-view", 60)
        code, out, _ = run_inspect(capsys, "show", shmcache_config.namespace, "--json")
        assert code == 0
        snap = json.loads(out)
        jsonschema.validate(snap, json_schema())
        by_key = {e["key"]: e for e in snap["entries"]}
        a, b = by_key[key_of("a").hex[:16]], by_key[key_of("b").hex[:16]]
        assert a["references"] == 2 and a["holder_pids"] == [holder.pid]  # its view pin and its request ref
        assert a["arrays"] == [{"dtype": "bfloat16", "shape": [1000]}] and a["state"] == "sealed"
        assert b["references"] == 0 and b["holder_pids"] == [] and b["arrays"][0]["shape"] == [3, 4]
        assert snap["stats"]["clients"] == 2 and snap["live"]
        assert {c["pid"] for c in snap["clients"]} >= {holder.pid}
        code, out, _ = run_inspect(capsys, "show", shmcache_config.namespace)
        assert (
            code == 0 and key_of("a").hex[:16] in out and str(holder.pid) in out and "bfloat16[1000]" in out
        )
        code, out, _ = run_inspect(capsys, "list")
        assert shmcache_config.namespace in out and "live" in out
        holder.kill()


def test_owner_killed_mid_compute_is_shown_dead_and_gc_reaps_it(
    shmcache_config: CacheConfig, shmcache_pool: ProcessPool, capsys: pytest.CaptureFixture[str]
) -> None:
    with EmbeddingCache(shmcache_config) as cache:
        dead = shmcache_pool.crash("computing", key_of("k"))
        code, out, _ = run_inspect(capsys, "show", shmcache_config.namespace, "--json")
        snap = json.loads(out)
        assert snap["reservations"] == [
            {
                "slot": snap["reservations"][0]["slot"],
                "key": key_of("k").hex[:16],
                "generation": 1,
                "owner_pid": dead.pid,
                "owner_alive": False,
            }
        ]
        assert any(c["pid"] == dead.pid and not c["alive"] for c in snap["clients"])
        code, out, _ = run_inspect(capsys, "show", shmcache_config.namespace)
        assert "DEAD" in out
        code, out, _ = run_inspect(capsys, "gc", shmcache_config.namespace)
        assert code == 0 and "reaped 1 dead process record(s), freed 1 dead reservation(s)" in out
        snap = json.loads(run_inspect(capsys, "show", shmcache_config.namespace, "--json")[1])
        assert snap["reservations"] == [] and all(c["alive"] for c in snap["clients"])
        assert cache.stats()["reaped_clients"] == 1


def test_read_only_commands_do_not_change_the_cache(
    shmcache_config: CacheConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    with EmbeddingCache(shmcache_config) as cache:
        cache.put(key_of("x"), expected_value("x", 10))
        before = bytes(cache._segments.index)
        for args in (
            ("list",),
            ("show", shmcache_config.namespace),
            ("show", shmcache_config.namespace, "--json"),
        ):
            assert run_inspect(capsys, *args)[0] == 0
        assert bytes(cache._segments.index) == before


def test_a_snapshot_keeps_no_mapping_of_the_index(shmcache_config: CacheConfig) -> None:
    from shmcache.ops.snapshot import take_snapshot

    def index_mappings() -> int:
        with open("/proc/self/maps") as f:
            return sum(f"{shmcache_config.namespace}.index" in line for line in f)

    with EmbeddingCache(shmcache_config) as cache:
        cache.put(key_of("x"), expected_value("x", 10))
        before = index_mappings()
        snap = take_snapshot(shmcache_config.namespace)
        assert index_mappings() == before and snap.stats["entries"] == 1


@pytest.mark.parametrize("command", [["show"], ["destroy"], ["destroy", "--force"]])
def test_unknown_namespace_is_a_clear_error(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Before, `destroy --force` of a name that does not exist printed "destroyed" with rc 0."""
    code, out, err = run_inspect(capsys, *command, "no-such-namespace-here")
    assert code == 1 and "does not exist" in err and "destroyed" not in out


@pytest.mark.parametrize(
    "args",
    [
        ["show", "any", "--entries", "-1"],
        ["show", "any", "--watch", "-1"],
        ["show", "any", "--watch", "0"],  # it read as no --watch at all
        ["show", "any", "--watch", "inf"],
        ["serve-metrics", "--port", "70000"],
    ],
)
def test_a_count_out_of_range_is_a_usage_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Before, `--entries -1` silently dropped the last entry, `--watch -1` raised ValueError,
    `--watch inf` and `--port 70000` OverflowError."""
    with pytest.raises(SystemExit) as exited:
        run_inspect(capsys, *args)
    assert exited.value.code == 2 and re.search(r"must be 0(\.01)? or more", capsys.readouterr().err)


def test_serve_metrics_on_loopback(shmcache_config: CacheConfig) -> None:
    """On --port 0 it says the port it bound (it printed 0 before)."""
    with EmbeddingCache(shmcache_config) as cache:
        cache.get_or_compute(key_of("m"), lambda: expected_value("m", 64))
        cache.get(key_of("m"))
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmcache",
                "inspect",
                "serve-metrics",
                shmcache_config.namespace,
                "--port",
                "0",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            said = server.stdout.readline() if server.stdout else ""
            assert said.startswith("serving shmcache metrics on http://127.0.0.1:"), said
            port = int(said.rsplit(":", 1)[1].split("/")[0])
            assert port > 0
            text = ""
            for _ in range(50):
                try:
                    text = (
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                    )
                    break
                except OSError:
                    time.sleep(0.1)
            samples = _samples(text)
            ns = shmcache_config.namespace
            assert samples[("shmcache_computes_total", (("namespace", ns),))] == 1
            assert samples[("shmcache_hits_total", (("layer", "node"), ("namespace", ns)))] == 1
            assert samples[("shmcache_entries", (("namespace", ns),))] == 1
            assert samples[("shmcache_gpu_bytes", (("namespace", ns),))] == 0  # no device copy
            with open("/proc/net/tcp") as f:  # listening only on 127.0.0.1
                listening = [line.split()[1] for line in f if line.split()[3] == "0A"]
            assert f"0100007F:{port:04X}" in listening
        finally:
            server.terminate()
            server.wait(10)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_collector_inside_a_process(shmcache_config: CacheConfig) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from shmcache.ops.metrics import ShmCacheCollector

    with EmbeddingCache(shmcache_config) as cache:
        cache.put(key_of("c"), expected_value("c", 8))
        registry = CollectorRegistry()
        registry.register(ShmCacheCollector([shmcache_config.namespace, "absent-namespace"]))
        text = generate_latest(registry).decode()
        assert _samples(text)[("shmcache_puts_total", (("namespace", shmcache_config.namespace),))] == 1
        assert "absent-namespace" not in text


@pytest.mark.parametrize(
    "command", [["show"], ["show", "--watch", "1"], ["gc"], ["destroy"], ["serve-metrics"]]
)
def test_a_bad_namespace_name_is_a_clear_error(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--watch` keeps watching only a namespace absent or being created, not a name that cannot be one."""
    code, _, err = run_inspect(capsys, command[0], "../escape", *command[1:])
    assert code == 1 and "namespace must be 1 to 64" in err


def test_serving_on_a_taken_port_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: an OSError traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, _, err = run_inspect(capsys, "serve-metrics", "--port", str(taken.getsockname()[1]))
    assert code == 1 and "cannot serve on 127.0.0.1:" in err and "Address already in use" in err


def test_watch_ends_quietly_on_ctrl_c_and_when_its_reader_goes(shmcache_config: CacheConfig) -> None:
    """Before: a KeyboardInterrupt traceback (rc -2), and `show --watch --json | head` a
    BrokenPipeError traceback."""
    command = [sys.executable, "-m", "shmcache", "inspect", "show", shmcache_config.namespace]
    command += ["--watch", "0.05"]
    with EmbeddingCache(shmcache_config):
        watcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        reader_gone = subprocess.Popen([*command, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert watcher.stdout is not None and watcher.stdout.read(20)  # it runs
            watcher.send_signal(signal.SIGINT)
            _out, err = watcher.communicate(timeout=30)
            assert watcher.returncode == 0 and b"Traceback" not in err
            assert reader_gone.stdout is not None and reader_gone.stdout.read(20)
            reader_gone.stdout.close()  # as `head` does after its bytes
            assert reader_gone.wait(30) == 0
            assert reader_gone.stderr is not None and b"Traceback" not in reader_gone.stderr.read()
        finally:
            for process in (watcher, reader_gone):  # a watcher that did not end polls forever
                process.kill()
                process.wait()


def test_a_damaged_header_is_a_clear_error_and_destroy_force_removes_its_set(
    shmcache_config: CacheConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stale namespace whose header says 0 stripes: `show`, `list` and `destroy` ended in a
    ValueError traceback (the metrics scrape in HTTP 500), and `destroy --force` left its
    semaphore set behind (its size could not be read off the damaged layout)."""
    before = kernel_objects()
    ready = tmp_path / "ready"
    holder = spawn(workers.attach_and_die, shmcache_config, str(ready))
    try:
        wait_for(ready.exists, what="the holder")
    finally:
        kill(holder)
    namespace = shmcache_config.namespace
    with open(object_names(namespace).index_path, "r+b") as index:
        index.seek(16)  # the header's stripes field
        index.write(bytes(4))
    code, _, err = run_inspect(capsys, "show", namespace)
    assert code == 1 and "damaged header: stripes=0" in err
    code, out, _ = run_inspect(capsys, "list")
    assert code == 0 and "damaged header" in out
    code, _, err = run_inspect(capsys, "destroy", namespace)
    assert code == 1 and "damaged header" in err
    code, out, _ = run_inspect(capsys, "destroy", namespace, "--force")
    assert code == 0 and kernel_objects() == before  # its semaphore set too


def test_list_into_a_reader_that_went_ends_quietly(shmcache_config: CacheConfig) -> None:
    """Before: a BrokenPipeError traceback (only `show` handled it)."""
    read, write = os.pipe()
    os.close(read)  # gone before anything is written
    try:
        with EmbeddingCache(shmcache_config):
            done = subprocess.run(
                [sys.executable, "-m", "shmcache", "inspect", "list", "--json"],
                stdout=write,
                stderr=subprocess.PIPE,
                timeout=120,
            )
    finally:
        os.close(write)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr


def test_a_handed_over_reservation_is_shown_with_the_process_computing_it(
    shmcache_config: CacheConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The owner is the process the record names: the adopter. Before, the semaphore's last user
    was shown, the giver (the scheduler, not the worker computing)."""
    with EmbeddingCache(shmcache_config) as cache:
        res = cache.try_reserve(key_of("h"))
        assert res is not None and res.owned
        adopted, go = tmp_path / "adopted", tmp_path / "go"
        ticket = res.hand_over()
        with running(workers.adopt_then, shmcache_config, ticket, "h", str(adopted), str(go)) as adopter:
            wait_for(adopted.exists, what="the adoption")
            assert res.let_go()
            snap = json.loads(run_inspect(capsys, "show", shmcache_config.namespace, "--json")[1])
            [shown] = snap["reservations"]
            assert (shown["owner_pid"], shown["owner_alive"]) == (adopter.pid, True)
            go.touch()
            assert finished(adopter)


def test_a_damaged_slot_record_is_shown_damaged_and_its_size_not_counted(
    shmcache_config: CacheConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stray write into one slot's size: the entry was shown sealed with that size, and the
    namespace 'used 32768.0 GiB, free -32768.0 GiB'."""
    with EmbeddingCache(shmcache_config) as cache:
        cache.put(key_of("kept"), expected_value("kept", 64))
        cache.put(key_of("hit"), expected_value("hit", 64))
        cache.flush_releases()
        kept = json.loads(run_inspect(capsys, "show", shmcache_config.namespace, "--json")[1])
        slot = next(e["slot"] for e in kept["entries"] if e["key"] == key_of("hit").hex[:16])
        cache._node.slots.array["size"][slot] = 1 << 45  # the crc no longer verifies
        code, out, _ = run_inspect(capsys, "show", shmcache_config.namespace, "--json")
        snap = json.loads(out)
        assert code == 0
        jsonschema.validate(snap, json_schema())
        shown = {e["slot"]: e for e in snap["entries"]}
        assert (shown[slot]["state"], shown[slot]["size_bytes"]) == ("damaged", 0)
        before = {e["slot"]: e["size_bytes"] for e in kept["entries"]}
        assert snap["used_bytes"] == kept["used_bytes"] - before[slot]
        assert "damaged" in run_inspect(capsys, "show", shmcache_config.namespace)[1]


def test_an_index_not_written_yet_is_being_created_and_watch_keeps_watching(
    namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A namespace caught between its index's creation and its header (an engine restarting):
    it read as a damaged index ('bad magic'), and `show --watch` stopped with rc 1."""
    path = object_names(namespace).index_path
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        code, _, err = run_inspect(capsys, "show", namespace)
        assert code == 1 and "is being created" in err and "damaged" not in err
        command = [sys.executable, "-m", "shmcache", "inspect", "show", namespace, "--watch", "0.05"]
        watcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert watcher.stderr is not None
            said = [watcher.stderr.readline() for _ in range(2)]  # two ticks: it goes on
            assert all(b"is being created" in line for line in said), said
            assert watcher.poll() is None
            watcher.send_signal(signal.SIGINT)
            assert watcher.wait(30) == 0
        finally:
            watcher.kill()
            watcher.wait()
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.parametrize("command", [["list"], ["list", "--json"], ["show", "NS"]])
def test_a_closed_stdout_is_no_crash(shmcache_config: CacheConfig, command: list[str]) -> None:
    """`shmcache-inspect list >&-`: Python's stdout is None then; it raised AttributeError."""
    with EmbeddingCache(shmcache_config):
        args = " ".join(shmcache_config.namespace if word == "NS" else word for word in command)
        done = subprocess.run(
            f"{sys.executable} -m shmcache inspect {args} >&-", shell=True, capture_output=True, check=False
        )
    assert done.returncode == 0 and done.stderr == b"", done.stderr
