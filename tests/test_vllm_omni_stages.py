"""The RFC's per-stage opt-in: a vLLM-Omni deploy config's `embedding_cache:` blocks become the
engine arguments that load shmcache's connector in real vLLM; bad blocks are typed errors that
name the stage and the field."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shmcache import ConfigTypeError, InvalidConfig
from shmcache.integrations.vllm.settings import ConnectorSettings
from shmcache.integrations.vllm_omni import deploy_with_embedding_cache, stage_with_embedding_cache

DEPLOY = Path(__file__).parent / "vllm_omni" / "qwen2_5_omni.yaml"


def _deploy() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(DEPLOY.read_text())
    return loaded


def test_an_enabled_stage_gets_the_connector_and_the_others_stay_as_they_were() -> None:
    source = _deploy()
    out = deploy_with_embedding_cache(source)
    thinker, talker, code2wav = out["stages"]
    ec = thinker.pop("ec_transfer_config")
    assert ec == {
        "ec_connector": "ShmCacheECConnector",
        "ec_connector_module_path": "shmcache.integrations.vllm",
        "ec_role": "ec_both",
        "ec_connector_extra_config": {
            "namespace": "qwen-omni",
            "capacity_bytes": 8589934592,
            "ttl_s": 600,
            "key_salt": "deployment-a",
        },
    }
    expected = {k: v for k, v in source["stages"][0].items() if k != "embedding_cache"}
    assert thinker == expected
    assert talker == {k: v for k, v in source["stages"][1].items() if k != "embedding_cache"}
    assert code2wav == source["stages"][2]
    npu = out["platforms"]["npu"]["stages"][0]["ec_transfer_config"]
    assert npu["ec_connector_extra_config"] == {"namespace": "qwen-omni-npu"}
    assert _deploy() == source  # the input is not modified


def test_real_vllm_takes_the_generated_config_and_finds_the_connector() -> None:
    from vllm.config import ECTransferConfig

    ec = deploy_with_embedding_cache(_deploy())["stages"][0]["ec_transfer_config"]
    config = ECTransferConfig(**ec)
    assert config.is_ec_producer and config.ec_role == "ec_both"
    module = importlib.import_module(config.ec_connector_module_path)
    assert getattr(module, config.ec_connector).__name__ == "ShmCacheECConnector"
    settings = ConnectorSettings.from_extra_config(config.ec_connector_extra_config)
    assert settings.cache.enable_embedding_cache and settings.cache.namespace == "qwen-omni"
    assert settings.cache.ttl_s == 600 and settings.key_salt == "deployment-a"


@pytest.mark.parametrize(
    ("block", "error", "names"),
    [
        ({"enable_embedding_cache": True, "capacity": 1}, InvalidConfig, "capacity"),
        ({"enable_embedding_cache": True, "ttl_s": "long"}, ConfigTypeError, "ttl_s"),
        ({"enable_embedding_cache": "yes"}, ConfigTypeError, "enable_embedding_cache"),
        ({"enable_embedding_cache": True, "key_salt": 3}, ConfigTypeError, "key_salt"),
        ({"namespace": "x"}, InvalidConfig, "enable_embedding_cache: true or false"),
        ({"enable_embedding_cache": True, "namespace": "a/b"}, InvalidConfig, "namespace"),
        ("on", ConfigTypeError, "mapping"),
    ],
)
def test_a_bad_block_is_a_typed_error_naming_the_stage_and_the_field(
    block: Any, error: type[Exception], names: str
) -> None:
    with pytest.raises(error, match=f"stage 7 embedding_cache: .*{names}"):
        stage_with_embedding_cache({"stage_id": 7, "embedding_cache": block})


@pytest.mark.parametrize(
    "stage",
    [
        {"ec_transfer_config": {"ec_connector": "ECExampleConnector"}},
        {"engine_args": {"ec_transfer_config": {"ec_connector": "ECExampleConnector"}}},
        {"runtime": {"ec_transfer_config": {"ec_connector": "ECExampleConnector"}}},
        {"engine_extras": {"ec_transfer_config": {"ec_connector": "ECExampleConnector"}}},
    ],
)
def test_a_stage_with_its_own_ec_config_and_the_block_is_refused(stage: dict[str, Any]) -> None:
    with pytest.raises(InvalidConfig, match="keep one of the two"):
        stage_with_embedding_cache(
            {"stage_id": 0, **stage, "embedding_cache": {"enable_embedding_cache": True}}
        )


def test_other_shapes_are_refused_with_their_reason() -> None:
    with pytest.raises(InvalidConfig, match="stage_args"):
        deploy_with_embedding_cache({"stage_args": []})
    with pytest.raises(ConfigTypeError, match="stages must be a list"):
        deploy_with_embedding_cache({"stages": {"stage_id": 0}})
    with pytest.raises(ConfigTypeError, match="a stage must be a mapping"):
        deploy_with_embedding_cache({"stages": ["thinker"]})
    assert deploy_with_embedding_cache({"stages": [{"stage_id": 0}]}) == {"stages": [{"stage_id": 0}]}


def test_the_command_writes_the_deploy_yaml_vllm_omni_reads(tmp_path: Path) -> None:
    out = tmp_path / "deploy.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "shmcache", "omni-deploy", str(DEPLOY), "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(out.read_text()) == deploy_with_embedding_cache(_deploy())
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - stage_id: 0\n    embedding_cache: {enable_embedding_cache: true, size: 1}\n")
    failed = subprocess.run(
        [sys.executable, "-m", "shmcache", "omni-deploy", str(bad)], capture_output=True, text=True
    )
    assert failed.returncode == 1 and "stage 0 embedding_cache: unknown" in failed.stderr
    assert "size" in failed.stderr and not failed.stdout
    unwritable = tmp_path / "no-such-dir" / "out.yaml"  # before: a FileNotFoundError traceback
    failed = subprocess.run(
        [sys.executable, "-m", "shmcache", "omni-deploy", str(DEPLOY), "-o", str(unwritable)],
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 1 and f"cannot write {unwritable}: No such file" in failed.stderr
    assert "Traceback" not in failed.stderr


def test_the_stage_module_does_not_import_vllm() -> None:
    probe = "import sys, shmcache.integrations.vllm_omni; print('vllm' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "False"
