"""Keys: framed, full-width, stable across interpreters, sensitive to every preprocessing field."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from shmcache import ConfigTypeError, EmbeddingCacheKey, EncoderPreprocessingConfig, InvalidConfig, InvalidKey
from shmcache.errors import KeyTypeError, ShmCacheError, UnsupportedValue
from shmcache.keys.framing import frame
from shmcache.keys.key import HASH_ALGORITHMS, MODALITIES, RECORD_SIZE
from shmcache.testing import sample_preprocessing


def all_key_hexes() -> list[str]:
    """Keys for every modality, both key modes, token prefixes and every algorithm."""
    config = sample_preprocessing()
    tensor = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(torch.bfloat16)
    out = []
    for algorithm in HASH_ALGORITHMS:
        for modality in MODALITIES:
            out.append(
                EmbeddingCacheKey.from_raw_bytes(
                    b"\x89PNG...",
                    config,
                    modality=modality,
                    algorithm=algorithm,  # type: ignore[arg-type]
                ).hex
            )
            out.append(
                EmbeddingCacheKey.from_decoded_tensor(
                    tensor,
                    config,
                    modality=modality,
                    algorithm=algorithm,  # type: ignore[arg-type]
                ).hex
            )
        first = EmbeddingCacheKey.from_token_prefix([1, 2, 3], config, algorithm=algorithm)  # type: ignore[arg-type]
        out.append(first.hex)
        out.append(EmbeddingCacheKey.from_token_prefix([4, 5], config, parent=first, algorithm=algorithm).hex)  # type: ignore[arg-type]
        salted = EmbeddingCacheKey.from_raw_bytes(
            b"x",
            config,
            modality="image",
            tenant_salt="tenant-a",
            algorithm=algorithm,  # type: ignore[arg-type]
        )
        out.append(salted.hex)
    return out


@pytest.mark.parametrize("hash_seed", ["1", "2"])
def test_keys_identical_in_separate_interpreters(hash_seed: str) -> None:
    here = all_key_hexes()
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    code = "import json; from tests.test_keys import all_key_hexes; print(json.dumps(all_key_hexes()))"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=_root()
    )
    assert json.loads(result.stdout.strip().splitlines()[-1]) == here
    assert len(set(here)) == len(here)  # every key differs from every other


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _changed(value: object) -> object:
    if isinstance(value, bool):
        raise AssertionError("no bool fields expected")
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, tuple):
        if not value:
            return (1,)
        first = value[0]
        return (first + 1 if isinstance(first, int) else first + 0.001, *value[1:])
    raise AssertionError(f"unhandled field type {type(value)}")


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(EncoderPreprocessingConfig)])
def test_each_config_field_changes_every_kind_of_key(field: str) -> None:
    base = sample_preprocessing()
    other = dataclasses.replace(base, **{field: _changed(getattr(base, field))})
    tensor = torch.ones(4, 4)
    assert EmbeddingCacheKey.from_raw_bytes(
        b"img", base, modality="image"
    ) != EmbeddingCacheKey.from_raw_bytes(b"img", other, modality="image")
    assert EmbeddingCacheKey.from_decoded_tensor(
        tensor, base, modality="video"
    ) != EmbeddingCacheKey.from_decoded_tensor(tensor, other, modality="video")
    assert EmbeddingCacheKey.from_token_prefix([1, 2], base) != EmbeddingCacheKey.from_token_prefix(
        [1, 2], other
    )


def test_raw_and_tensor_namespaces_differ(pconfig: EncoderPreprocessingConfig) -> None:
    tensor = torch.arange(16, dtype=torch.uint8)
    raw = EmbeddingCacheKey.from_raw_bytes(tensor.numpy().tobytes(), pconfig, modality="image")
    decoded = EmbeddingCacheKey.from_decoded_tensor(tensor, pconfig, modality="image")
    assert raw != decoded
    assert (raw.kind, decoded.kind) == ("raw", "tensor")


def test_modality_is_part_of_the_key(pconfig: EncoderPreprocessingConfig) -> None:
    keys = {EmbeddingCacheKey.from_raw_bytes(b"same", pconfig, modality=m).digest for m in MODALITIES}  # type: ignore[arg-type]
    assert len(keys) == len(MODALITIES)
    with pytest.raises(InvalidKey, match="modality"):
        EmbeddingCacheKey.from_raw_bytes(b"same", pconfig, modality="imgae")  # type: ignore[arg-type]


def test_framing_separates_sequences_that_collide_when_concatenated() -> None:
    assert frame(("ab", "c")) != frame(("a", "bc"))
    assert frame("") != frame(None)
    assert frame(()) != frame(None)
    assert frame((1, (2,))) != frame((1, 2))
    assert frame(((1, 2),)) != frame((1, 2))
    assert frame(1) != frame(True) != frame(1.0)
    assert frame(b"") != frame("")
    assert frame(-1) != frame(255)
    with pytest.raises(ValueError, match="NaN"):
        frame(float("nan"))


def test_config_fields_that_concatenate_alike_give_different_keys() -> None:
    a = sample_preprocessing(model_id="ab", model_revision="c")
    b = sample_preprocessing(model_id="a", model_revision="bc")
    assert EmbeddingCacheKey.from_raw_bytes(b"x", a, modality="image") != EmbeddingCacheKey.from_raw_bytes(
        b"x", b, modality="image"
    )
    flat = sample_preprocessing(image_size=(448, 448), normalize_mean=(0.5,))
    moved = sample_preprocessing(image_size=(448,), normalize_mean=(448.0, 0.5))
    assert EmbeddingCacheKey.from_raw_bytes(b"x", flat, modality="image") != EmbeddingCacheKey.from_raw_bytes(
        b"x", moved, modality="image"
    )


def test_content_and_config_boundary_is_framed() -> None:
    # the same bytes moved between a config field and the content must not collide
    a = sample_preprocessing(input_dtype="float16")
    b = sample_preprocessing(input_dtype="float1")
    assert EmbeddingCacheKey.from_raw_bytes(b"6img", b, modality="image") != EmbeddingCacheKey.from_raw_bytes(
        b"img", a, modality="image"
    )


def test_tenant_salt_empty_and_missing_differ(pconfig: EncoderPreprocessingConfig) -> None:
    keys = [
        EmbeddingCacheKey.from_raw_bytes(b"x", pconfig, modality="image", tenant_salt=salt)
        for salt in (None, "", b"", "tenant-a", "tenant-b")
    ]
    assert len({k.digest for k in keys}) == 4  # "" and b"" are the same salt bytes
    assert keys[1] == keys[2]


def test_tensor_keys_depend_on_dtype_and_shape(pconfig: EncoderPreprocessingConfig) -> None:
    base = torch.arange(12, dtype=torch.int32)
    same_bytes_other_dtype = base.view(torch.float32)
    reshaped = base.reshape(3, 4)

    def key(t: torch.Tensor) -> EmbeddingCacheKey:
        return EmbeddingCacheKey.from_decoded_tensor(t, pconfig, modality="image")

    assert len({key(base), key(same_bytes_other_dtype), key(reshaped)}) == 3


def test_tensor_keys_bf16_noncontiguous_and_numpy(pconfig: EncoderPreprocessingConfig) -> None:
    t = torch.randn(8, 6).to(torch.bfloat16)
    k = EmbeddingCacheKey.from_decoded_tensor(t.t(), pconfig, modality="image")
    assert k == EmbeddingCacheKey.from_decoded_tensor(t.t().contiguous(), pconfig, modality="image")
    assert k != EmbeddingCacheKey.from_decoded_tensor(t, pconfig, modality="image")
    f = torch.randn(3, 5)
    assert EmbeddingCacheKey.from_decoded_tensor(
        f, pconfig, modality="image"
    ) == EmbeddingCacheKey.from_decoded_tensor(f.numpy(), pconfig, modality="image")
    big_endian = f.numpy().astype(">f4")
    assert EmbeddingCacheKey.from_decoded_tensor(big_endian, pconfig, modality="image") == (
        EmbeddingCacheKey.from_decoded_tensor(f, pconfig, modality="image")
    )


@pytest.mark.cuda
def test_tensor_keys_from_cuda_match_cpu(pconfig: EncoderPreprocessingConfig) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA key path runs only on a GPU machine")
    t = torch.randn(4, 4).to(torch.bfloat16)
    assert EmbeddingCacheKey.from_decoded_tensor(t.cuda(), pconfig, modality="image") == (
        EmbeddingCacheKey.from_decoded_tensor(t, pconfig, modality="image")
    )


def test_algorithms_are_full_width_and_namespaced(pconfig: EncoderPreprocessingConfig) -> None:
    keys = {
        a: EmbeddingCacheKey.from_raw_bytes(b"x", pconfig, modality="image", algorithm=a)
        for a in HASH_ALGORITHMS
    }  # type: ignore[arg-type]
    assert [len(keys[a].digest) for a in HASH_ALGORITHMS] == [16, 32, 32]
    assert keys["xxh3_128"].algorithm == "xxh3_128"
    assert keys["blake3"] != keys["sha256"]
    with pytest.raises(InvalidKey):
        EmbeddingCacheKey.from_raw_bytes(b"x", pconfig, modality="image", algorithm="md5")  # type: ignore[arg-type]


def test_token_prefix_chain(pconfig: EncoderPreprocessingConfig) -> None:
    first = EmbeddingCacheKey.from_token_prefix([1, 2, 3], pconfig)
    second = EmbeddingCacheKey.from_token_prefix([4, 5], pconfig, parent=first)
    assert second == EmbeddingCacheKey.from_token_prefix(np.array([4, 5]), pconfig, parent=first.digest)
    assert second != EmbeddingCacheKey.from_token_prefix([4, 5], pconfig)
    assert EmbeddingCacheKey.from_token_prefix(
        [4, 5], pconfig, parent=b""
    ) != EmbeddingCacheKey.from_token_prefix([4, 5], pconfig)
    codec_changed = sample_preprocessing(audio_codec_version="v2")
    assert EmbeddingCacheKey.from_token_prefix([1, 2, 3], codec_changed) != first
    with pytest.raises(TypeError):
        EmbeddingCacheKey.from_token_prefix([1.5], pconfig)  # type: ignore[list-item]


def test_keys_compare_hash_pickle_and_are_immutable(pconfig: EncoderPreprocessingConfig) -> None:
    k = EmbeddingCacheKey.from_raw_bytes(b"x", pconfig, modality="audio")
    again = EmbeddingCacheKey.from_raw_bytes(bytearray(b"x"), pconfig, modality="audio")
    assert k == again and hash(k) == hash(again) and {k: 1}[again] == 1
    restored = pickle.loads(pickle.dumps(k))
    assert restored == k and restored.modality == "audio" and restored.kind == "raw"
    assert k.hex == k.digest.hex() and len(k.hex) == 32
    with pytest.raises(AttributeError):
        k._digest = b"0" * 16  # type: ignore[misc]


def test_a_key_record_is_its_algorithm_length_and_padded_digest(pconfig: EncoderPreprocessingConfig) -> None:
    for index, algorithm in enumerate(HASH_ALGORITHMS):
        k = EmbeddingCacheKey.from_raw_bytes(b"x", pconfig, modality="image", algorithm=algorithm)  # type: ignore[arg-type]
        record = k.record
        assert len(record) == RECORD_SIZE == 48 and record is k.record  # made once
        assert record[:2] == bytes([index, len(k.digest)]) and record[2:16] == bytes(14)
        assert record[16:] == k.digest.ljust(32, b"\0")
        restored = pickle.loads(pickle.dumps(k))
        assert restored.record == record  # made again after unpickling, the same
    with pytest.raises(AttributeError):
        k._record = bytes(48)  # type: ignore[misc]


def test_preprocessing_config_validation() -> None:
    with pytest.raises(ConfigTypeError, match="image_size"):
        sample_preprocessing(image_size="448")
    with pytest.raises(ConfigTypeError, match="audio_sample_rate"):
        sample_preprocessing(audio_sample_rate=True)
    with pytest.raises(ConfigTypeError, match="model_id"):
        sample_preprocessing(model_id=None)
    with pytest.raises(ConfigTypeError, match="image_size"):
        sample_preprocessing(image_size=(448.0, 448))
    with pytest.raises(InvalidConfig, match="normalize_std"):
        sample_preprocessing(normalize_std=(float("inf"),))
    normalised = sample_preprocessing(image_size=[448, 448], normalize_mean=[0, 1])
    assert normalised.image_size == (448, 448) and normalised.normalize_mean == (0.0, 1.0)
    assert normalised == sample_preprocessing(image_size=(448, 448), normalize_mean=(0.0, 1.0))
    assert pickle.loads(pickle.dumps(normalised)) == normalised
    with pytest.raises(dataclasses.FrozenInstanceError):
        normalised.model_id = "other"  # type: ignore[misc]


def test_bad_inputs_are_typed_errors(pconfig: EncoderPreprocessingConfig) -> None:
    with pytest.raises(TypeError):
        EmbeddingCacheKey.from_raw_bytes("text", pconfig, modality="image")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        EmbeddingCacheKey.from_decoded_tensor([1, 2], pconfig, modality="image")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        EmbeddingCacheKey.from_raw_bytes(b"x", {"model": "m"}, modality="image")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        EmbeddingCacheKey.from_decoded_tensor(np.array(["a"]), pconfig, modality="image")


def test_zero_d_arrays_hash_their_full_shape(pconfig: EncoderPreprocessingConfig) -> None:
    """np.array(3.0) once keyed like np.array([3.0]) (0-d promoted to 1-d): a false hit."""

    def key(value: object) -> EmbeddingCacheKey:
        return EmbeddingCacheKey.from_decoded_tensor(value, pconfig, modality="image")  # type: ignore[arg-type]

    assert key(np.array(3.0)) != key(np.array([3.0])) != key(np.array([[3.0]]))
    assert key(np.array(3.0)) == key(torch.tensor(3.0, dtype=torch.float64))  # numpy and torch agree
    assert key(np.array(3.0)) != key(np.array(3.0, dtype=np.float32))  # the dtype is hashed
    assert key(np.array([3.0])) == key(torch.tensor([3.0], dtype=torch.float64))


@pytest.mark.parametrize(
    ("parts", "error", "match"),
    [
        (("md5", b"x" * 16, "image", "raw"), InvalidKey, "hash algorithm"),
        ((["xxh3_128"], b"x" * 16, "image", "raw"), KeyTypeError, "hash algorithm"),
        (("xxh3_128", b"x" * 15, "image", "raw"), InvalidKey, "16 bytes"),
        (("sha256", b"x" * 16, "image", "raw"), InvalidKey, "32 bytes"),
        (("xxh3_128", bytearray(16), "image", "raw"), KeyTypeError, "digest"),
        (("xxh3_128", "x" * 16, "image", "raw"), KeyTypeError, "digest"),
        (("xxh3_128", b"x" * 16, "smell", "raw"), InvalidKey, "modality"),
        (("xxh3_128", b"x" * 16, {"image"}, "raw"), KeyTypeError, "modality"),
        (("xxh3_128", b"x" * 16, "image", "bogus"), InvalidKey, "key kind"),
        (("xxh3_128", b"x" * 16, "image", None), KeyTypeError, "key kind"),
    ],
)
def test_the_public_constructor_validates_every_part(
    parts: tuple, error: type[Exception], match: str
) -> None:  # type: ignore[type-arg]
    with pytest.raises(error, match=match):
        EmbeddingCacheKey(*parts)


def test_the_public_constructor_accepts_real_parts(pconfig: EncoderPreprocessingConfig) -> None:
    made = EmbeddingCacheKey.from_raw_bytes(b"x", pconfig, modality="video", algorithm="blake3")
    again = EmbeddingCacheKey(made.algorithm, made.digest, made.modality, made.kind)
    assert again == made and (again.modality, again.kind) == ("video", "raw")


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"modality": ["image"]}, KeyTypeError),
        ({"modality": {"image": 1}}, KeyTypeError),
        ({"modality": 3}, KeyTypeError),
        ({"modality": "x" * 10_000_000}, InvalidKey),
        ({"algorithm": ["sha256"]}, KeyTypeError),
        ({"algorithm": np.array(["a", "b"])}, KeyTypeError),
        ({"algorithm": None}, KeyTypeError),
        ({"tenant_salt": "bad \ud800 salt"}, InvalidKey),
        ({"tenant_salt": ["salt"]}, KeyTypeError),
        ({"tenant_salt": bytearray(b"salt")}, KeyTypeError),
    ],
)
def test_odd_key_parts_are_typed_errors_with_short_messages(
    pconfig: EncoderPreprocessingConfig,
    kwargs: dict,
    error: type[Exception],  # type: ignore[type-arg]
) -> None:
    arguments = {"modality": "image", **kwargs}
    for make in (
        lambda: EmbeddingCacheKey.from_raw_bytes(b"x", pconfig, **arguments),
        lambda: EmbeddingCacheKey.from_decoded_tensor(np.ones(2), pconfig, **arguments),
        lambda: EmbeddingCacheKey.from_token_prefix([1], pconfig, **arguments),
    ):
        with pytest.raises(error) as raised:
            make()
        assert isinstance(raised.value, ShmCacheError) and len(str(raised.value)) < 200


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("what", ["meta", "nested", "jagged"])
def test_tensors_without_data_or_one_shape_are_typed_errors(
    pconfig: EncoderPreprocessingConfig, what: str
) -> None:
    if what == "meta":
        tensor = torch.empty(4, device="meta")
    else:
        layout = torch.jagged if what == "jagged" else torch.strided
        tensor = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    with pytest.raises(UnsupportedValue, match=what.replace("jagged", "nested")):
        EmbeddingCacheKey.from_decoded_tensor(tensor, pconfig, modality="image")


def test_preprocessing_config_refuses_lone_surrogates_and_huge_numbers() -> None:
    with pytest.raises(InvalidConfig, match="model_id"):
        sample_preprocessing(model_id="bad \udcff id")
    with pytest.raises(InvalidConfig, match="normalize_mean"):
        sample_preprocessing(normalize_mean=(10**400,))
    with pytest.raises(InvalidConfig, match="normalize_std"):
        sample_preprocessing(normalize_std=(float("nan"),))
    with pytest.raises(InvalidConfig, match="audio_sample_rate"):
        sample_preprocessing(audio_sample_rate=1 << 64)
    with pytest.raises(InvalidConfig, match="image_size"):
        sample_preprocessing(image_size=(448, -(1 << 70)))


def test_framing_errors_are_typed() -> None:
    with pytest.raises(InvalidKey, match="NaN"):
        frame(float("nan"))
    with pytest.raises(InvalidKey, match="surrogate"):
        frame("\ud800")
    with pytest.raises(KeyTypeError):
        frame([1, 2])  # type: ignore[arg-type]
