"""`EncoderPreprocessingConfig`: every setting that can change an encoder's output, frozen."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from shmcache.errors import ConfigTypeError, InvalidConfig
from shmcache.keys.framing import Frameable, frame
from shmcache.keys.text import utf8

__all__ = ["EncoderPreprocessingConfig"]


@dataclass(frozen=True)
class EncoderPreprocessingConfig:
    """Every field that can change encoder output. All fields are required.

    Fields that do not apply to a modality take their empty value ("" , 0 or ()): an audio
    encoder passes image_size=(), an image encoder passes audio_codec_version="".
    Lists are normalised to tuples; a wrong type raises `ConfigTypeError` (a TypeError) naming the field,
    a value out of range (an int beyond 64 bits, a non-finite or huge float, a string with a lone
    surrogate) `InvalidConfig` (a ValueError).
    """

    cache_schema_version: int
    model_id: str
    model_revision: str
    encoder_config_hash: str
    processor_version: str
    processor_config_hash: str
    resize_mode: str
    image_size: tuple[int, ...]
    crop_mode: str
    normalize_mean: tuple[float, ...]
    normalize_std: tuple[float, ...]
    audio_sample_rate: int
    audio_codec_version: str
    audio_codec_config_hash: str
    video_frame_stride: int
    input_dtype: str

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            object.__setattr__(self, field.name, _checked(field.name, field.type, value))
        if self.cache_schema_version < 0:
            raise InvalidConfig("cache_schema_version must be >= 0")

    @classmethod
    def from_processor(
        cls,
        processor: Any,
        encoder_config: Any,
        *,
        modality: str,
        model_revision: str,
        model_id: str | None = None,
        input_dtype: str | None = None,
    ) -> EncoderPreprocessingConfig:
        """Every field read from a Hugging Face processor (or the component of a composite one
        that prepares `modality`) and the encoder's transformers config, plus a digest of the
        processor's complete settings; `model_revision` names the weights (a config does not).
        See `shmcache.keys.processors`."""
        from shmcache.keys.processors import preprocessing_from_processor

        return preprocessing_from_processor(
            processor,
            encoder_config,
            modality=modality,
            model_revision=model_revision,
            model_id=model_id,
            input_dtype=input_dtype,
        )

    def framed(self) -> bytes:
        """The framed (unambiguous) bytes of every field name and value, in declaration order.

        Computed once per instance (the instance is frozen) and kept outside the dataclass fields.
        """
        cached: bytes | None = self.__dict__.get("_framed")
        if cached is None:
            items: tuple[Frameable, ...] = tuple(
                (f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
            )
            cached = frame(items)
            object.__setattr__(self, "_framed", cached)
        return cached


_INT64 = 1 << 63


def _checked_int(name: str, value: int) -> int:
    if not -_INT64 <= value < _INT64:
        raise InvalidConfig(f"{name} must fit in 64 bits")
    return int(value)


def _checked_float(name: str, value: float) -> float:
    try:
        item = float(value)
    except OverflowError:  # an int too large for a float
        raise InvalidConfig(f"{name} must hold finite values, got a huge int") from None
    if not math.isfinite(item):
        raise InvalidConfig(f"{name} must hold finite values, got {item!r}")
    return item


def _checked(name: str, annotation: Any, value: Any) -> Any:
    """Validate one field against its annotation (a string under postponed evaluation)."""
    if annotation in ("int", int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigTypeError(f"{name} must be int, got {type(value).__name__}")
        return _checked_int(name, value)
    if annotation in ("str", str):
        if not isinstance(value, str):
            raise ConfigTypeError(f"{name} must be str, got {type(value).__name__}")
        utf8(value, name, InvalidConfig)
        return value
    element = {"tuple[int, ...]": int, "tuple[float, ...]": float}.get(str(annotation))
    if element is None:
        raise AssertionError(f"unhandled annotation {annotation!r} for {name}")
    if not isinstance(value, tuple | list):
        raise ConfigTypeError(f"{name} must be a tuple of {element.__name__}, got {type(value).__name__}")
    items = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | float):
            raise ConfigTypeError(f"{name} must hold {element.__name__} values, got {type(item).__name__}")
        if element is float:
            items.append(_checked_float(name, item))
        elif isinstance(item, int):
            items.append(_checked_int(name, item))
        else:
            raise ConfigTypeError(f"{name} must hold int values, got float {item!r}")
    return tuple(items)
