"""shmcache as vLLM's encoder-cache (EC) connector, loaded out of tree by configuration alone::

    --ec-transfer-config '{"ec_connector": "ShmCacheECConnector",
                           "ec_connector_module_path": "shmcache.integrations.vllm",
                           "ec_role": "ec_both",
                           "ec_connector_extra_config": {"namespace": "qwen-omni", ...}}'

See docs/vllm.md. The connector imports vLLM when vLLM asks for it (by this module's
attribute); the settings module and the rest of shmcache do not need vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ShmCacheECConnector"]


def __getattr__(name: str) -> Any:
    if name == "ShmCacheECConnector":
        from shmcache.integrations.vllm.connector import ShmCacheECConnector

        return ShmCacheECConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
