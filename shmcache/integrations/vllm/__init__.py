"""shmcache as vLLM's encoder-cache (EC) connector, loaded out of tree by configuration alone::

    --ec-transfer-config '{"ec_connector": "ShmCacheECConnector",
                           "ec_connector_module_path": "shmcache.integrations.vllm",
                           "ec_role": "ec_both",
                           "ec_connector_extra_config": {"namespace": "qwen-omni", ...}}'

See docs/vllm.md. This module imports vLLM; the rest of shmcache does not need it.
"""

from shmcache.integrations.vllm.connector import ShmCacheECConnector

__all__ = ["ShmCacheECConnector"]
