"""A vLLM-Omni deploy config's `embedding_cache:` blocks, turned into vLLM engine arguments.

vLLM-Omni (0.30) reads a deploy YAML whose `stages:` entries are flat mappings of engine
arguments (`stage_id`, `devices`, `gpu_memory_utilization`, ...; nested `engine_args:`,
`runtime:` and `engine_extras:` blocks are merged in) and hands every key it does not know to
vLLM's `EngineArgs`. A stage opts in to the node cache with the RFC's block::

    stages:
      - stage_id: 0
        embedding_cache:
          enable_embedding_cache: true
          namespace: qwen-omni
          capacity_bytes: 8589934592

`stage_with_embedding_cache` replaces that block with the `ec_transfer_config` of shmcache's
vLLM connector (the stage's engine runs its encoders through it); a disabled block is removed
and the stage is left as it was. The block holds `CacheConfig` fields plus the connector's
`key_salt`; an unknown or mistyped field is a typed error naming the stage and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from shmcache.errors import ConfigTypeError, InvalidConfig, ShmCacheError
from shmcache.integrations.vllm.settings import ConnectorSettings

__all__ = ["BLOCK", "deploy_with_embedding_cache", "stage_with_embedding_cache"]

BLOCK: Final = "embedding_cache"
_SWITCH: Final = "enable_embedding_cache"
_NESTED: Final = ("engine_args", "runtime", "engine_extras")  # blocks vLLM-Omni merges into the engine args


def stage_with_embedding_cache(stage: Mapping[str, Any]) -> dict[str, Any]:
    """`stage` without its `embedding_cache` block, plus the connector's `ec_transfer_config`
    when the block enables the cache. A stage without the block is returned unchanged (a copy)."""
    if not isinstance(stage, Mapping):
        raise ConfigTypeError(f"a stage must be a mapping, got {type(stage).__name__}")
    result = dict(stage)
    block = result.pop(BLOCK, None)
    if block is None:
        return result
    where = f"stage {stage.get('stage_id', '?')!r} {BLOCK}"
    try:
        extra = _connector_extra_config(block)
    except ShmCacheError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    if extra is None:
        return result
    if _has_ec_config(result):
        raise InvalidConfig(f"{where}: the stage also sets ec_transfer_config; keep one of the two")
    result["ec_transfer_config"] = {
        "ec_connector": "ShmCacheECConnector",
        "ec_connector_module_path": "shmcache.integrations.vllm",
        "ec_role": "ec_both",
        "ec_connector_extra_config": extra,
    }
    return result


def deploy_with_embedding_cache(deploy: Mapping[str, Any]) -> dict[str, Any]:
    """A whole deploy config with every stage's block turned into engine arguments: the
    `stages:` list and each platform's `stages:` override (`platforms: {npu: {stages: [...]}}`)."""
    if not isinstance(deploy, Mapping):
        raise ConfigTypeError(f"a deploy config must be a mapping, got {type(deploy).__name__}")
    if "stage_args" in deploy:
        raise InvalidConfig("this is the removed `stage_args` schema; vLLM-Omni reads `stages:` now")
    result = dict(deploy)
    if "stages" in result:
        result["stages"] = _stages(result["stages"], "stages")
    platforms = result.get("platforms")
    if platforms is not None:
        if not isinstance(platforms, Mapping):
            raise ConfigTypeError(f"platforms must be a mapping, got {type(platforms).__name__}")
        result["platforms"] = {name: _platform(name, platform) for name, platform in platforms.items()}
    return result


def _platform(name: Any, platform: Any) -> Any:
    if not isinstance(platform, Mapping) or "stages" not in platform:
        return platform
    return {**platform, "stages": _stages(platform["stages"], f"platforms.{name}.stages")}


def _stages(stages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(stages, list):
        raise ConfigTypeError(f"{where} must be a list of stages, got {type(stages).__name__}")
    return [stage_with_embedding_cache(stage) for stage in stages]


def _connector_extra_config(block: Any) -> dict[str, Any] | None:
    """The connector's extra config for `block`, validated; None if the block disables the cache."""
    if not isinstance(block, Mapping):
        raise ConfigTypeError(f"must be a mapping, got {type(block).__name__}")
    if _SWITCH not in block:
        raise InvalidConfig(f"must say {_SWITCH}: true or false")
    settings = ConnectorSettings.from_extra_config(block)  # every field checked, named on error
    if not settings.cache.enable_embedding_cache:
        return None
    return {name: value for name, value in block.items() if name != _SWITCH}


def _has_ec_config(stage: Mapping[str, Any]) -> bool:
    nested = [stage[name] for name in _NESTED if isinstance(stage.get(name), Mapping)]
    return any("ec_transfer_config" in part for part in (stage, *nested))
