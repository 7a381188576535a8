"""`EncoderPreprocessingConfig` derived from a Hugging Face processor and the encoder's config,
so that it cannot be filled in wrongly (the RFC's top risk: a false hit from an incomplete config).

Every field is read from the objects themselves, and `processor_config_hash` is a digest of the
processor's complete settings (`to_dict()`), so a setting the dataclass has no field for still
changes the key. Per modality (the component of a composite processor is picked by modality):

- image (`image_processor`): `resize_mode` the resampling filter ("none" without resizing),
  `image_size` the `size` values (height, width; or the shortest/longest edge, pixel bounds),
  `crop_mode` "center HxW" or "none", `normalize_mean`/`_std` (empty without normalizing);
- audio (`feature_extractor`): `audio_sample_rate`;
- video (`video_processor`, or an image processor used for frames): as image, plus
  `video_frame_stride` from `temporal_patch_size` (frames per temporal patch).

`encoder_config_hash` digests the encoder config's `to_dict()`; `processor_version` names the
processor class and the transformers version; `input_dtype` is the config's dtype unless given.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from typing import Any, Final

from shmcache.errors import ConfigTypeError, InvalidConfig
from shmcache.keys.preprocessing import EncoderPreprocessingConfig

__all__ = ["preprocessing_from_processor", "settings_digest"]

SCHEMA_VERSION: Final = 1
_COMPONENTS: Final = {"image": "image_processor", "audio": "feature_extractor", "video": "video_processor"}


def settings_digest(settings: Mapping[str, Any], what: str) -> str:
    """sha256 (hex) of `settings` as canonical JSON; `InvalidConfig` for a value that has no
    stable text (an object shown by address would make every process derive another key)."""
    try:
        text = json.dumps(settings, sort_keys=True, default=_stable, allow_nan=False)
    except ValueError as exc:
        raise InvalidConfig(f"{what}: a setting has no stable representation: {str(exc)[:120]}") from None
    return hashlib.sha256(text.encode()).hexdigest()


def _stable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    text = repr(value)
    if " at 0x" in text:
        raise ValueError(f"{type(value).__name__} is shown by its address")
    return f"{type(value).__name__}:{text}"


def _component(processor: Any, modality: str) -> Any:
    """The part of a (possibly composite) processor that prepares `modality`."""
    name = _COMPONENTS.get(modality)
    if name is None:
        raise InvalidConfig(f"modality must be one of {sorted(_COMPONENTS)}, got {modality!r}")
    part = getattr(processor, name, None)
    if part is None and modality == "video":
        part = getattr(processor, "image_processor", None)
    part = processor if part is None else part
    if not callable(getattr(part, "to_dict", None)):
        raise ConfigTypeError(f"expected a Hugging Face processor with to_dict(), got {type(part).__name__}")
    return part


_SIZE_KEYS: Final = (
    "height",
    "width",
    "shortest_edge",
    "longest_edge",
    "max_height",
    "max_width",
    "min_pixels",
    "max_pixels",
)


def _size(size: Any) -> tuple[int, ...]:
    """The set values of a size (a dict, transformers' `SizeDict`, an int or a pair), in a fixed order."""
    if size is None:
        return ()
    if isinstance(size, int):
        return (size,)
    if isinstance(size, list | tuple):
        return tuple(int(v) for v in size)
    found = (size.get(k) if isinstance(size, Mapping) else getattr(size, k, None) for k in _SIZE_KEYS)
    return tuple(int(v) for v in found if v is not None)


def _image_fields(part: Any) -> dict[str, Any]:
    if not hasattr(part, "image_mean") and not hasattr(part, "resample"):
        return {
            "resize_mode": "",
            "image_size": (),
            "crop_mode": "",
            "normalize_mean": (),
            "normalize_std": (),
        }
    resample = getattr(part, "resample", None)
    resize = getattr(part, "do_resize", True)
    crop = getattr(part, "do_center_crop", False) and getattr(part, "crop_size", None)
    normalize = getattr(part, "do_normalize", True)
    return {
        "resize_mode": (getattr(resample, "name", str(resample)).lower() if resize else "none"),
        "image_size": _size(getattr(part, "size", None)) if resize else (),
        "crop_mode": "center " + "x".join(map(str, _size(crop))) if crop else "none",
        "normalize_mean": tuple(getattr(part, "image_mean", None) or ()) if normalize else (),
        "normalize_std": tuple(getattr(part, "image_std", None) or ()) if normalize else (),
    }


def _dtype(encoder_config: Any, input_dtype: str | None) -> str:
    if input_dtype is not None:
        return input_dtype
    found = getattr(encoder_config, "dtype", None) or getattr(encoder_config, "torch_dtype", None)
    if found is None:
        raise InvalidConfig(
            "the encoder config names no dtype: pass input_dtype (the dtype the encoder runs in)"
        )
    return str(found).removeprefix("torch.")


def preprocessing_from_processor(
    processor: Any,
    encoder_config: Any,
    *,
    modality: str,
    model_revision: str,
    model_id: str | None = None,
    input_dtype: str | None = None,
) -> EncoderPreprocessingConfig:
    """See `EncoderPreprocessingConfig.from_processor`."""
    import transformers

    part = _component(processor, modality)
    settings = part.to_dict()
    if not callable(getattr(encoder_config, "to_dict", None)):
        raise ConfigTypeError(f"expected a transformers config, got {type(encoder_config).__name__}")
    name = model_id if model_id is not None else getattr(encoder_config, "_name_or_path", "")
    if not name:
        raise InvalidConfig("the encoder config names no model: pass model_id")
    stride = getattr(part, "temporal_patch_size", 0) if modality == "video" else 0
    return EncoderPreprocessingConfig(
        cache_schema_version=SCHEMA_VERSION,
        model_id=name,
        model_revision=model_revision,
        encoder_config_hash=settings_digest(encoder_config.to_dict(), "the encoder config"),
        processor_version=f"{type(part).__name__} (transformers {transformers.__version__})",
        processor_config_hash=settings_digest(settings, type(part).__name__),
        **_image_fields(part),
        audio_sample_rate=int(getattr(part, "sampling_rate", 0) or 0) if modality == "audio" else 0,
        audio_codec_version="",
        audio_codec_config_hash="",
        video_frame_stride=int(stride or 0),
        input_dtype=_dtype(encoder_config, input_dtype),
    )
