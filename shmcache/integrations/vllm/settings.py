"""The connector's settings: `ec_connector_extra_config` read into a `CacheConfig` plus the key
settings, with the same typed errors as the rest of shmcache, and the keys of vLLM's identifiers."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from shmcache.config import CacheConfig
from shmcache.errors import ConfigTypeError
from shmcache.keys.key import MODALITIES, EmbeddingCacheKey
from shmcache.keys.preprocessing import EncoderPreprocessingConfig

__all__ = ["KEY_SOURCE", "ConnectorSettings", "KeyMaker", "preprocessing_of"]

KEY_SOURCE: Final = "vllm-mm-hash"
_CONNECTOR_FIELDS: Final = ("key_salt",)  # connector-only settings, beside the CacheConfig fields


@dataclass(frozen=True)
class ConnectorSettings:
    """What `ec_connector_extra_config` configures: the cache, and an optional key salt (a
    deployment's own name for anything else that changes encoder outputs)."""

    cache: CacheConfig
    key_salt: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Read the extra config; the cache is enabled unless it says `enable_embedding_cache:
        false`. Unknown or mistyped fields raise `InvalidConfig` / `ConfigTypeError`, naming them."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigTypeError(f"ec_connector_extra_config must be a mapping, got {type(extra).__name__}")
        cache_fields = {name: value for name, value in extra.items() if name not in _CONNECTOR_FIELDS}
        cache_fields.setdefault("enable_embedding_cache", True)
        salt = extra.get("key_salt", "")
        if not isinstance(salt, str):
            raise ConfigTypeError(f"key_salt must be a str, got {type(salt).__name__}")
        return cls(CacheConfig.from_stage_config(cache_fields), salt)


# The engine's settings that change encoder outputs and that vLLM's `mm_hash` does not cover: it
# hashes a request's own processor and media kwargs, and the engine's are merged in after hashing
# (two engines with different `--mm-processor-kwargs` gave the same mm_hash for other outputs).
_ENGINE_MM_SETTINGS: Final = (
    "mm_processor_kwargs",
    "media_io_kwargs",
    "mm_device_do_normalize",
    "mm_encoder_attn_dtype",
    "video_pruning_rate",
    "video_pruning_method",
)


def _digest(settings: Any) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def preprocessing_of(vllm_config: Any, key_salt: str) -> EncoderPreprocessingConfig:
    """What vLLM's `mm_hash` does not cover, as the preprocessing config of every key: the model
    and its revision, a digest of its whole Hugging Face config (encoder settings included), the
    engine's multimodal settings and quantization, the dtype, the vLLM and transformers versions,
    and the deployment's salt. The media and a request's own kwargs are in the `mm_hash`."""
    import transformers
    import vllm

    model = vllm_config.model_config
    hf_config = model.hf_config
    multimodal = getattr(model, "multimodal_config", None)
    engine = {name: getattr(multimodal, name, None) for name in _ENGINE_MM_SETTINGS}
    engine["quantization"] = getattr(model, "quantization", None)
    return EncoderPreprocessingConfig(
        cache_schema_version=1,
        model_id=str(model.model),
        model_revision=str(model.revision or ""),
        encoder_config_hash=_digest(hf_config.to_dict() if hasattr(hf_config, "to_dict") else {}),
        processor_version=f"vllm {vllm.__version__}; transformers {transformers.__version__}; {key_salt}",
        processor_config_hash=_digest(engine),
        resize_mode="",
        image_size=(),
        crop_mode="",
        normalize_mean=(),
        normalize_std=(),
        audio_sample_rate=0,
        audio_codec_version="",
        audio_codec_config_hash="",
        video_frame_stride=0,
        input_dtype=str(model.dtype).removeprefix("torch."),
    )


@dataclass(frozen=True)
class KeyMaker:
    """Keys of vLLM identifiers for one model and cache."""

    preprocessing: EncoderPreprocessingConfig
    cache: CacheConfig

    def __call__(self, identifier: str, modality: str) -> EmbeddingCacheKey:
        """The key of vLLM's `identifier` of an item of `modality` (modalities shmcache does not
        name, e.g. embeddings passed in, are folded into the identifier)."""
        known = modality in MODALITIES
        return EmbeddingCacheKey.from_external_id(
            identifier if known else f"{modality}:{identifier}",
            self.preprocessing,
            source=KEY_SOURCE,
            modality=modality if known else "image",  # type: ignore[arg-type]
            **self.cache.key_settings,
        )
