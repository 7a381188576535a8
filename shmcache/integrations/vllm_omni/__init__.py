"""shmcache in vLLM-Omni: the stage config's `embedding_cache:` block turned into the engine
arguments that switch the vLLM connector on for that stage (see docs/vllm-omni.md)."""

from shmcache.integrations.vllm_omni.stages import deploy_with_embedding_cache, stage_with_embedding_cache

__all__ = ["deploy_with_embedding_cache", "stage_with_embedding_cache"]
