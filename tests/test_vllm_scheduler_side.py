"""The connector's scheduler side without an engine: a real node cache and vLLM's own records of a
request's items (tests/test_vllm_engines.py runs whole engines)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

from shmcache import CacheConfig, EmbeddingCache
from shmcache.integrations.vllm import ShmCacheECConnector
from shmcache.integrations.vllm.scheduler import SchedulerSide
from shmcache.integrations.vllm.settings import KeyMaker, preprocessing_of
from shmcache.remote.lease import LEASE_SUFFIX
from shmcache.remote.store import remote_key
from shmcache.testing import MooncakeMaster, sample_preprocessing
from tests.test_remote import remote_config
from tests.vllm.engine import SITE_DIR
from tests.vllm.model import build_tiny_llava
from tests.workers import expected_value


@dataclass
class _Request:
    """The two fields of vLLM's `Request` the scheduler side reads."""

    request_id: str
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)


def _request(request_id: str, *identifiers: str) -> _Request:
    features = [
        MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset=10 * i, length=4))
        for i, identifier in enumerate(identifiers)
    ]
    return _Request(request_id, features)


def test_a_request_with_the_same_image_twice_reserves_it_once_and_is_not_deferred(
    config: CacheConfig,
) -> None:
    with EmbeddingCache(config) as cache:
        side = SchedulerSide(cache, KeyMaker(sample_preprocessing(), config))
        request = _request("r1", "img", "img", "other")
        assert side.ensure(request, 0)  # before the fix: deferred at every step (its own reservation)
        assert side.ensure(request, 0)
        assert cache.stats()["reserved"] == 2  # "img" and "other", once each
        side.finished(request)
        assert cache.stats()["reserved"] == 0


def test_a_reservation_vllm_does_not_allocate_in_its_step_is_given_back(config: CacheConfig) -> None:
    """vLLM found the item in its own encoder cache (or did not schedule the request): no
    `after_alloc` follows `ensure`. Before the fix the reservation was kept until the request
    finished, every other engine of the node deferred on that key, and it was never stored."""
    keys = KeyMaker(sample_preprocessing(), config)
    with EmbeddingCache(config) as cache, EmbeddingCache(config) as other:
        side = SchedulerSide(cache, keys)
        request = _request("r1", "x")
        assert side.ensure(request, 0) and cache.stats()["reserved"] == 1
        side.build()  # the step ends without `after_alloc`
        assert cache.stats()["reserved"] == 0
        theirs = other.try_reserve(keys("x", "image"))  # another engine is not made to wait
        assert theirs is not None and theirs.owned
        theirs.withdraw()
        assert side.ensure(request, 0)  # the next step reserves it again, and allocates it
        side.after_alloc(request, 0)
        step = side.build()
        assert [(item.identifier, item.ticket is not None) for item in step.saves] == [("x", True)]
        assert cache.stats()["reserved"] == 1  # handed over to the worker, not given back
        side.finished(request)
        assert cache.stats()["reserved"] == 0
        side.close()


def test_a_request_waiting_for_another_process_holds_nothing(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache, EmbeddingCache(config) as other:
        side = SchedulerSide(cache, KeyMaker(sample_preprocessing(), config))
        keys = KeyMaker(sample_preprocessing(), config)
        busy = other.try_reserve(keys("busy", "image"))  # another engine computes "busy"
        assert busy is not None and busy.owned
        request = _request("r1", "free", "busy")
        assert not side.ensure(request, 0)  # deferred: "free", reserved in the same call, given back
        assert cache.stats()["reserved"] == 1  # only the other engine's
        busy.commit(expected_value("busy"))
        assert side.ensure(request, 0)  # "busy" is sealed now; "free" is reserved here
        assert cache.stats()["reserved"] == 1
        side.close()
        assert cache.stats()["reserved"] == 0


def test_an_engine_that_does_not_store_reserves_nothing_and_still_loads_and_waits(
    config: CacheConfig,
) -> None:
    """`ec_consumer`: its worker never stores, so a reservation taken for it would only make
    other engines wait until its request finished (before the fix: "reserved" 1)."""
    keys = KeyMaker(sample_preprocessing(), config)
    with EmbeddingCache(config) as cache, EmbeddingCache(config) as other:
        side = SchedulerSide(cache, keys, stores=False)
        sealed = other.try_reserve(keys("sealed", "image"))
        assert sealed is not None and sealed.owned
        sealed.commit(expected_value("sealed"), view=False)
        request = _request("r1", "sealed", "free")
        assert side.ensure(request, 0)  # "free" is computed by this engine alone
        assert cache.stats()["reserved"] == 0
        assert side.has_item("sealed") and not side.has_item("free")  # vLLM asks, then allocates
        side.after_alloc(request, 0)
        side.after_alloc(request, 1)
        step = side.build()
        assert [item.identifier for item in step.loads] == ["sealed"]
        assert [(item.identifier, item.ticket) for item in step.saves] == [("free", None)]
        free = other.try_reserve(keys("free", "image"))  # another engine is not made to wait
        assert free is not None and free.owned
        assert not side.ensure(_request("r2", "free"), 0)  # and this one waits for it
        assert cache.stats()["reserved"] == 1  # only the other engine's
        free.abandon()
        side.finished(request)
        side.close()


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelConfig]:
    """vLLM inspects the model class in a subprocess, which imports LLaVA: it needs the harness's
    torchvision alias as an engine process does (tests/vllm/site on PYTHONPATH), and a cache of
    its own (it passed before only where an earlier run had left its inspection in ~/.cache/vllm)."""
    work = tmp_path_factory.mktemp("tiny-llava")
    model = build_tiny_llava(work / "model")
    with pytest.MonkeyPatch.context() as env:
        paths = (str(SITE_DIR), os.environ.get("PYTHONPATH"))
        env.setenv("PYTHONPATH", os.pathsep.join(path for path in paths if path))
        env.setenv("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
        yield ModelConfig(model=str(model), max_model_len=128, dtype="float32", enforce_eager=True)


@pytest.mark.parametrize(("role", "reserved"), [("ec_consumer", 0), ("ec_both", 1), ("ec_producer", 1)])
def test_the_connector_reserves_only_for_an_engine_that_stores(
    model_config: ModelConfig, namespace: str, role: str, reserved: int
) -> None:
    extra: dict[str, Any] = {
        "enable_embedding_cache": True,
        "namespace": namespace,
        "capacity_bytes": 16 << 20,
    }
    transfer = ECTransferConfig(
        ec_connector="ShmCacheECConnector",
        ec_connector_module_path="shmcache.integrations.vllm",
        ec_role=role,
        ec_connector_extra_config=extra,
    )
    connector = ShmCacheECConnector(
        VllmConfig(model_config=model_config, ec_transfer_config=transfer), ECConnectorRole.SCHEDULER
    )
    try:
        request = _request("r1", "new")
        assert connector.ensure_cache_available(request, 0)  # type: ignore[arg-type]
        assert connector._cache.stats()["reserved"] == reserved
        connector.request_finished(request)  # type: ignore[arg-type]
        assert connector._cache.stats()["reserved"] == 0
    finally:
        connector.shutdown()


def test_an_engine_that_does_not_store_takes_no_cross_node_lease_and_waits_for_one(
    shmcache_mooncake: MooncakeMaster, shmcache_namespace: str, other_namespace: str
) -> None:
    """`ec_consumer` with a remote store: it computes its misses alone, so a lease it took would
    only make other nodes wait for it (before the fix: one taken per miss, and here left in the
    store, since a lease within `RELEASE_MARGIN_S` of its deadline is never removed)."""
    config = remote_config(shmcache_namespace, shmcache_mooncake.address, compute_timeout_s=1.0)
    keys = KeyMaker(sample_preprocessing(), config)

    with (
        EmbeddingCache(config) as cache,
        EmbeddingCache(replace(config, namespace=other_namespace, compute_timeout_s=60.0)) as other,
    ):

        def lease_of(identifier: str) -> bytes | None:
            assert cache._bridge is not None
            name = remote_key(config.remote_key_prefix, keys(identifier, "image"))
            return cache._bridge.store.get_bytes(name + LEASE_SUFFIX)

        side = SchedulerSide(cache, keys, stores=False)
        assert side.ensure(_request("r1", "free"), 0)  # computed by this engine alone
        assert lease_of("free") is None and cache.stats()["reserved"] == 0
        [busy] = other.try_reserve_many([keys("busy", "image")])  # another node computes "busy"
        assert busy is not None and busy.owned and lease_of("busy") is not None
        assert not side.ensure(_request("r2", "busy"), 0)  # this engine waits for its value
        busy.abandon()
        side.close()


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("mm_processor_kwargs", {"do_normalize": False}),
        ("media_io_kwargs", {"video": {"num_frames": 8}}),
        ("video_pruning_rate", 0.5),
        ("quantization", "fp8"),
    ],
)
def test_engine_settings_that_change_encoder_outputs_change_every_key(
    model_config: ModelConfig, setting: str, value: object
) -> None:
    """vLLM's mm_hash covers a request's own processor kwargs, not the engine's (merged in after
    hashing): two engines on a node with different `--mm-processor-kwargs` shared keys, and each
    loaded the other's outputs."""
    engine = SimpleNamespace(model_config=model_config)  # VllmConfig would check fp8 against the dtype
    before = preprocessing_of(engine, "")
    owner = model_config if setting == "quantization" else model_config.multimodal_config
    saved = getattr(owner, setting)
    object.__setattr__(owner, setting, value)
    try:
        after = preprocessing_of(engine, "")
    finally:
        object.__setattr__(owner, setting, saved)
    assert after != before
    assert preprocessing_of(engine, "") == before  # deterministic
