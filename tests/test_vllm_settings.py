"""The connector's settings and keys, without an engine (tests/test_vllm_engines.py runs engines)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from shmcache import ConfigTypeError, EmbeddingCacheKey, InvalidConfig
from shmcache.integrations.vllm.settings import ConnectorSettings, KeyMaker
from shmcache.testing import sample_preprocessing


def test_extra_config_becomes_an_enabled_cache_config() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"namespace": "omni", "capacity_bytes": 8 << 20, "ttl_s": 60.0}
    )
    assert settings.cache.enable_embedding_cache and settings.cache.namespace == "omni"
    assert settings.cache.capacity_bytes == 8 << 20 and settings.cache.ttl_s == 60.0
    assert not ConnectorSettings.from_extra_config(
        {"enable_embedding_cache": False}
    ).cache.enable_embedding_cache
    assert ConnectorSettings.from_extra_config(None).cache.namespace == "default"


@pytest.mark.parametrize(
    ("extra", "error", "names"),
    [
        ({"namespce": "x"}, InvalidConfig, "namespce"),
        ({"capacity_bytes": "1GB"}, ConfigTypeError, "capacity_bytes"),
        ({"namespace": "a/b"}, InvalidConfig, "namespace"),
        ({"key_salt": 3}, ConfigTypeError, "key_salt"),
        ([("namespace", "x")], ConfigTypeError, "mapping"),
    ],
)
def test_bad_extra_config_is_a_typed_error_naming_the_field(extra: object, error: type, names: str) -> None:
    with pytest.raises(error, match=names):
        ConnectorSettings.from_extra_config(extra)  # type: ignore[arg-type]


def test_keys_of_identifiers_cover_the_model_and_are_their_own_namespace() -> None:
    settings = ConnectorSettings.from_extra_config({})
    keys = KeyMaker(sample_preprocessing(), settings.cache)
    other_revision = KeyMaker(sample_preprocessing(model_revision="other"), settings.cache)
    assert keys("abc", "image") == keys("abc", "image")
    assert keys("abc", "image") != keys("abd", "image")
    assert keys("abc", "image") != other_revision("abc", "image")  # what mm_hash does not cover
    assert keys("abc", "image") != keys("abc", "audio")
    assert keys("abc", "image_embeds") != keys("abc", "image")  # unknown modalities stay apart
    raw = EmbeddingCacheKey.from_raw_bytes(b"abc", sample_preprocessing(), modality="image")
    assert keys("abc", "image") != raw
