"""`EncoderPreprocessingConfig.from_processor` on real Hugging Face processors built offline:
every field comes from the processor and the encoder config, any single setting changed changes
the key, and two processes derive the same key."""

from __future__ import annotations

import copy
import enum
import multiprocessing as mp
from typing import Any

import pytest

from shmcache import ConfigTypeError, EmbeddingCacheKey, EncoderPreprocessingConfig, InvalidConfig
from tests.helpers import spawn

REVISION = "0123abcd"


def _processor(name: str) -> tuple[Any, Any, str]:
    """(processor, encoder config, modality) built offline from transformers' defaults."""
    import transformers as tf

    return {
        "clip": lambda: (tf.CLIPImageProcessor(), tf.CLIPVisionConfig(), "image"),
        "siglip": lambda: (tf.SiglipImageProcessor(), tf.SiglipVisionConfig(), "image"),
        "qwen2-vl": lambda: (tf.Qwen2VLImageProcessor(), tf.CLIPVisionConfig(), "video"),
        "whisper": lambda: (tf.WhisperFeatureExtractor(), tf.WhisperConfig(), "audio"),
    }[name]()


def _config(processor: Any, encoder_config: Any, modality: str) -> EncoderPreprocessingConfig:
    return EncoderPreprocessingConfig.from_processor(
        processor,
        encoder_config,
        modality=modality,
        model_revision=REVISION,
        model_id="org/model",
        input_dtype="bfloat16",
    )


def _key(config: EncoderPreprocessingConfig) -> EmbeddingCacheKey:
    return EmbeddingCacheKey.from_raw_bytes(b"the same image bytes", config, modality="image")


def test_clip_fields_come_from_its_processor() -> None:
    processor, encoder, modality = _processor("clip")
    config = _config(processor, encoder, modality)
    assert (config.resize_mode, config.image_size, config.crop_mode) == ("bicubic", (224,), "center 224x224")
    assert config.normalize_mean == tuple(processor.image_mean) and config.normalize_std == tuple(
        processor.image_std
    )
    assert config.audio_sample_rate == 0 and config.video_frame_stride == 0
    assert config.model_revision == REVISION and config.input_dtype == "bfloat16"
    assert "transformers" in config.processor_version and len(config.processor_config_hash) == 64


def test_whisper_and_video_fields() -> None:
    whisper = _config(*_processor("whisper"))
    assert whisper.audio_sample_rate == 16000 and whisper.image_size == () and whisper.resize_mode == ""
    frames = _config(*_processor("qwen2-vl"))
    assert frames.video_frame_stride == 2 and frames.image_size == (3136, 1003520)


def _changed(value: Any) -> Any:
    """A different value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, enum.Enum):
        return next(member for member in type(value) if member != value)
    if isinstance(value, int | float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, dict):
        first = next(iter(value))
        return {**value, first: _changed(value[first])}
    if isinstance(value, list | tuple):
        return type(value)([_changed(value[0]), *value[1:]]) if value else type(value)([1])
    if value is None:
        return 1
    raise AssertionError(f"no change for {value!r}")


@pytest.mark.parametrize("name", ["clip", "siglip", "qwen2-vl", "whisper"])
def test_any_single_setting_changed_changes_the_key(name: str) -> None:
    processor, encoder, modality = _processor(name)
    base = _key(_config(processor, encoder, modality))
    settings = processor.to_dict()
    changed = 0
    for setting, value in settings.items():
        other = copy.deepcopy(processor)
        setattr(other, setting, _changed(value))
        if other.to_dict()[setting] == value:
            assert setting.endswith("_type"), setting  # only the class name is not a setting
            continue
        assert _key(_config(other, encoder, modality)) != base, setting
        changed += 1
    assert changed == len(settings) - 1
    other_encoder = copy.deepcopy(encoder)
    other_encoder.hidden_size = encoder.to_dict().get("hidden_size", 1) + 1
    assert _key(_config(processor, other_encoder, modality)) != base
    assert (
        _key(
            EncoderPreprocessingConfig.from_processor(
                processor,
                encoder,
                modality=modality,
                model_revision="another",
                model_id="org/model",
                input_dtype="bfloat16",
            )
        )
        != base
    )


def derive(name: str, results: Any) -> None:
    """Another process: the key of the same processor, built there."""
    results.put(_key(_config(*_processor(name))).hex)


@pytest.mark.parametrize("name", ["clip", "whisper"])
def test_two_processes_derive_the_same_key(name: str) -> None:
    results = mp.get_context("spawn").Queue()
    proc = spawn(derive, name, results)
    theirs = results.get(timeout=120)
    proc.join(30)
    assert theirs == _key(_config(*_processor(name))).hex


def test_a_composite_processor_gives_the_component_of_the_modality() -> None:
    import transformers as tf

    class Composite:
        image_processor = tf.CLIPImageProcessor()
        feature_extractor = tf.WhisperFeatureExtractor()

    audio = _config(Composite(), tf.WhisperConfig(), "audio")
    assert audio == _config(tf.WhisperFeatureExtractor(), tf.WhisperConfig(), "audio")
    assert _config(Composite(), tf.CLIPVisionConfig(), "image").image_size == (224,)


def test_what_cannot_be_derived_is_a_typed_error() -> None:
    import transformers as tf

    processor, encoder = tf.CLIPImageProcessor(), tf.CLIPVisionConfig()
    with pytest.raises(InvalidConfig, match="pass model_id"):
        EncoderPreprocessingConfig.from_processor(
            processor, encoder, modality="image", model_revision="r", input_dtype="float16"
        )
    with pytest.raises(InvalidConfig, match="pass input_dtype"):
        EncoderPreprocessingConfig.from_processor(
            processor, encoder, modality="image", model_revision="r", model_id="m"
        )
    with pytest.raises(InvalidConfig, match="modality"):
        _config(processor, encoder, "smell")
    with pytest.raises(ConfigTypeError, match="to_dict"):
        _config(object(), encoder, "image")
    odd = copy.deepcopy(processor)
    odd.size = object()  # shown by its address: no two processes would agree
    with pytest.raises(InvalidConfig, match="no stable representation"):
        _config(odd, encoder, "image")
