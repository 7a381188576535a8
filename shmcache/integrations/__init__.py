"""Integrations with serving engines: `shmcache.integrations.vllm` (vLLM's encoder-cache
connector seam, which vLLM-Omni's stages reach through their engine arguments)."""
