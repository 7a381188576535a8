"""`shmcache hold`: a namespace outlives the processes that use it while the holder runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shmcache import EmbeddingCache
from shmcache.testing import namespace_objects, sample_cache_config
from tests.helpers import wait_for
from tests.workers import expected_value, fingerprint, key_of


def _hold(config_fields: dict[str, object], ready: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "shmcache",
        "hold",
        "--config",
        json.dumps(config_fields),
        "--ready",
        str(ready),
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_held_namespace_outlives_its_users_and_goes_with_the_holder(namespace: str, tmp_path: Path) -> None:
    config = sample_cache_config(namespace)
    fields = {
        "namespace": namespace,
        "capacity_bytes": config.capacity_bytes,
        "max_entries": config.max_entries,
    }
    fields |= {"ways": config.ways, "max_clients": config.max_clients}
    fields["max_pins_per_process"] = config.max_pins_per_process
    fields["key_salt"] = "deployment-1"  # the connector's JSON as it is (before: refused, exit 2)
    ready = tmp_path / "ready"
    holder = _hold(fields, ready)
    try:
        wait_for(lambda: ready.exists() or holder.poll() is not None, what="the holder")
        assert holder.poll() is None, holder.communicate()
        with EmbeddingCache(config) as cache:
            cache.put(key_of("kept"), expected_value("kept"))
        assert namespace_objects(namespace)  # the last user left; the holder keeps it
        with EmbeddingCache(config) as cache:
            value = cache.get(key_of("kept"))
            assert value is not None and fingerprint(value) == fingerprint(expected_value("kept"))
            del value
    finally:
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(30) == 0
    assert not namespace_objects(namespace)  # the holder was the last one: everything removed


@pytest.mark.parametrize(
    ("fields", "said"),
    [({"namespce": "x"}, b"namespce"), ({"enable_embedding_cache": False}, b"nothing to hold")],
    ids=["unknown-setting", "disabled"],  # disabled: before, it said "holding" and held nothing
)
def test_a_bad_hold_config_is_refused(fields: dict[str, object], said: bytes, tmp_path: Path) -> None:
    holder = _hold(fields, tmp_path / "ready")
    try:
        _out, err = holder.communicate(timeout=60)
    finally:
        holder.kill()  # a holder that did not refuse holds until killed
    assert holder.returncode == 2 and said in err and not (tmp_path / "ready").exists()


def test_a_ready_file_that_cannot_be_made_is_a_clear_error(namespace: str, tmp_path: Path) -> None:
    """Before: a FileNotFoundError traceback. The namespace it opened is closed again."""
    holder = _hold({"namespace": namespace}, tmp_path / "missing" / "ready")
    try:
        _out, err = holder.communicate(timeout=60)
    finally:
        holder.kill()
    assert holder.returncode == 1 and b"No such file or directory" in err and b"Traceback" not in err


def test_a_namespace_destroyed_under_the_holder_ends_it_with_rc_1(namespace: str, tmp_path: Path) -> None:
    """`destroy --force` of a held namespace: the holder went on holding nothing (engines then
    made the namespace anew without it); now it says so and ends with rc 1."""
    ready = tmp_path / "ready"
    holder = _hold({"namespace": namespace, "capacity_bytes": 8 << 20}, ready)
    try:
        wait_for(ready.exists, timeout=60, what="the holder")
        destroy = [sys.executable, "-m", "shmcache", "inspect", "destroy", namespace, "--force"]
        assert subprocess.run(destroy, capture_output=True, check=False).returncode == 0
        _, err = holder.communicate(timeout=30)
    finally:
        holder.kill()
        holder.wait()
    assert holder.returncode == 1 and b"was destroyed under it" in err, (holder.returncode, err)
    assert not namespace_objects(namespace)


@pytest.mark.parametrize("text", ["null", "[]", '"qwen-omni"', "{bad json"])
def test_a_config_that_is_no_json_object_is_a_usage_error(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from shmcache.ops.hold import main

    assert main(["--config", text]) == 2
    assert "shmcache hold: bad --config" in capsys.readouterr().err


def test_shmcache_without_a_command_prints_its_usage_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    from shmcache.ops.cli import main

    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: shmcache COMMAND")
    assert main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage: shmcache COMMAND")
