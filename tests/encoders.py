"""Real encoder modules from transformers with tiny random weights, built offline and the same in
every process (seeded), for the encoder-hook tests; each counts the items it encodes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from shmcache import EncoderPreprocessingConfig
from shmcache.integrations.encoder import BatchedItems, ItemLayout, PackedItems

MERGE = 2  # the Qwen2-VL tower's spatial merge: 2 x 2 patches per output row


@dataclass
class Encoder:
    """An encoder function over a batch, the layout of its calls, and how many items it encoded."""

    name: str
    module: torch.nn.Module
    items: ItemLayout
    modality: str
    encoded: list[int] = field(default_factory=list)  # items per call

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.no_grad():
            out = self.module(*args, **kwargs)
        self.encoded.append(_items(self.items, args, kwargs))
        return out if isinstance(out, torch.Tensor) else out.last_hidden_state

    def preprocessing(self) -> EncoderPreprocessingConfig:
        return EncoderPreprocessingConfig(
            cache_schema_version=1,
            model_id=f"tiny-{self.name}",
            model_revision="seed-0",
            encoder_config_hash=self.name,
            processor_config_hash="",
            processor_version="",
            resize_mode="",
            image_size=(),
            crop_mode="",
            normalize_mean=(),
            normalize_std=(),
            audio_sample_rate=0,
            audio_codec_version="",
            audio_codec_config_hash="",
            video_frame_stride=0,
            input_dtype="float32",
        )


def _items(items: ItemLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    return items.split(args, kwargs).count


def build(name: str) -> Encoder:
    """One of "clip", "siglip", "whisper", "qwen2-vl" (seeded: the same weights everywhere)."""
    torch.manual_seed(0)
    builders: dict[str, Callable[[], Encoder]] = {
        "clip": _clip,
        "siglip": _siglip,
        "whisper": _whisper,
        "qwen2-vl": _qwen2_vl,
    }
    return builders[name]()


def batch(name: str, seeds: list[int]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batched call of encoder `name` over the items made from `seeds` (equal seeds, equal items)."""

    def item(seed: int, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    if name in ("clip", "siglip"):
        return (torch.stack([item(s, 3, 32, 32) for s in seeds]),), {}
    if name == "whisper":
        return (torch.stack([item(s, 16, 100) for s in seeds]),), {}
    grids = [(1, 4, 4) if s % 2 else (1, 4, 8) for s in seeds]  # >= 16 rows: see test_encoder_hook
    rows = [item(s, t * h * w, 3 * 2 * 4 * 4) for s, (t, h, w) in zip(seeds, grids, strict=True)]
    return (torch.cat(rows),), {"grid_thw": torch.tensor(grids)}


_TINY_VISION: Final = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 32,
    "patch_size": 8,
}


def _clip() -> Encoder:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    model = CLIPVisionModel(CLIPVisionConfig(**_TINY_VISION))
    return Encoder("clip", model.eval(), BatchedItems(), "image")


def _siglip() -> Encoder:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    model = SiglipVisionModel(SiglipVisionConfig(**_TINY_VISION))
    return Encoder("siglip", model.eval(), BatchedItems(), "image")


def _whisper() -> Encoder:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=50,
        decoder_layers=1,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
    )
    return Encoder("whisper", WhisperEncoder(config).eval(), BatchedItems(), "audio")


def _qwen2_vl() -> Encoder:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = Qwen2VLVisionConfig(
        depth=2,
        embed_dim=32,
        hidden_size=32,
        num_heads=4,
        mlp_ratio=2,
        patch_size=4,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        in_channels=3,
    )
    tower = Qwen2VisionTransformerPretrainedModel._from_config(config).eval()
    items = PackedItems("grid_thw", output_rows=lambda g: g[0] * g[1] * g[2] // MERGE**2)
    return Encoder("qwen2-vl", MergedEmbeddings(tower).eval(), items, "image")


class MergedEmbeddings(torch.nn.Module):
    """The tower as vLLM's Qwen2-VL `visual` is called: one tensor of merged patch embeddings
    (transformers' tower returns them as `pooler_output` of a model output)."""

    def __init__(self, tower: torch.nn.Module) -> None:
        super().__init__()
        self.tower = tower

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        merged: torch.Tensor = self.tower(pixel_values, grid_thw=grid_thw).pooler_output
        return merged
