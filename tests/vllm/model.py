"""A tiny random-weight LLaVA that real vLLM (CPU) serves, built offline and deterministically.

CLIP vision tower (hidden 64, 2 layers, 28x28 images, 14x14 patches: 4 image tokens after the CLS
token is dropped), a one-layer Llama text model (hidden 64, head_dim 32: vLLM's CPU attention needs
>= 32), a `tokenizers` WordLevel tokenizer with ``<image>`` as a special token, and a
``LlavaProcessor`` with the PIL CLIP image processor (no torchvision). Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

RECIPE = "tiny-llava-v1"  # bump when anything below changes: cached builds are rebuilt
SEED = 1234
IMAGE_SIZE = 28
PATCH_SIZE = 14
HIDDEN = 64
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
# fmt: off
WORDS = [
    "USER:", "ASSISTANT:", "describe", "the", "image", ".", "what", "is", "in", "this", "a", "photo",
    "picture", "of", "and", "color", "red", "green", "blue", "cat", "dog", "tree", "sky", "yes", "no",
    "one", "two", "three", "big", "small",
]
# fmt: on
VOCAB_SIZE = 64
_COMPLETE = ".complete"


def _vocab() -> dict[str, int]:
    tokens = SPECIAL_TOKENS + WORDS
    tokens += [f"w{i}" for i in range(VOCAB_SIZE - len(tokens))]
    return {token: index for index, token in enumerate(tokens)}


def _save_processor(out: Path, vocab: dict[str, int]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
        model_max_length=128,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    processor = LlavaProcessor(  # type: ignore[no-untyped-call]
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
    )
    processor.save_pretrained(out)


def _save_model(out: Path, vocab: dict[str, int]) -> None:
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=HIDDEN,
    )
    text = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=vocab["<image>"],
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
    )
    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(config)  # float32, the default dtype
    model.train(False)
    with torch.no_grad():  # a larger spread than the default init, so the image moves the logits
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(out)
    _rename_vision_weights(out)


def _vllm_weight_name(name: str) -> str:
    head, sep, tail = name.partition("vision_tower.")
    if sep and not tail.startswith("vision_model."):
        return f"{head}vision_tower.vision_model.{tail}"
    return name


def _rename_vision_weights(out: Path) -> None:
    """transformers 5 saves ``vision_tower.embeddings...``; vLLM loads ``vision_tower.vision_model...``."""
    from safetensors.torch import load_file, save_file

    for file in sorted(out.glob("*.safetensors")):
        tensors = {_vllm_weight_name(k): v.contiguous() for k, v in load_file(file).items()}
        save_file(tensors, file, metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {_vllm_weight_name(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2, sort_keys=True))


def build_tiny_llava(path: Path) -> Path:
    """Build the tiny LLaVA into `path` (or reuse the one already there) and return `path`.

    Deterministic (fixed seed, no download) and cached: a directory holding a complete build of this
    recipe is returned at once. Safe against concurrent builders: each builds in its own temporary
    sibling directory and renames it into place.
    """
    path = Path(path)
    if (path / _COMPLETE).is_file() and (path / _COMPLETE).read_text() == RECIPE:
        return path
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    staging = path.with_name(f".{path.name}.build-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        vocab = _vocab()
        _save_model(staging, vocab)
        _save_processor(staging, vocab)
        (staging / _COMPLETE).write_text(RECIPE)
        if path.exists() and not ((path / _COMPLETE).is_file() and (path / _COMPLETE).read_text() == RECIPE):
            shutil.rmtree(path)  # an incomplete or older build
        with contextlib.suppress(FileExistsError, OSError):
            staging.rename(path)  # fails only if a concurrent builder got there first
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not (path / _COMPLETE).is_file():
        raise RuntimeError(f"building the tiny LLaVA in {path} failed")
    return path
