"""Fuzzing keys, configs and values with hypothesis: every outcome is a valid result or one of our
typed errors (a `ShmCacheError`, with a short message), never a bare TypeError, ValueError,
OverflowError, UnicodeError or a dependency's own error.

Inputs mix valid parts with odd ones: other types, unhashable containers, lone surrogates, huge
and non-finite numbers, 0-d, object and string arrays, meta and nested tensors.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shmcache import CacheConfig, EmbeddingCacheKey, EncoderPreprocessingConfig, HiddenStatePrefix
from shmcache.errors import ShmCacheError
from shmcache.format.decode import decode
from shmcache.format.values import encode
from shmcache.keys.key import HASH_ALGORITHMS, KEY_KINDS, MODALITIES
from shmcache.testing import sample_preprocessing

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

texts = st.text(alphabet=st.characters(exclude_categories=()), max_size=12)  # lone surrogates too
numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(1 << 200), max_value=1 << 200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.just(10**400),
)
odd = st.one_of(
    st.none(),
    st.booleans(),
    numbers,
    texts,
    st.binary(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(texts, st.integers(), max_size=2),
    st.sets(st.integers(), max_size=2),
    st.tuples(st.integers(), texts),
    st.builds(bytearray, st.binary(max_size=4)),
    st.builds(object),
)

hashable = st.one_of(st.none(), texts, numbers, st.binary(max_size=4), st.tuples(st.integers(), texts))


def _tensors() -> st.SearchStrategy[Any]:
    shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)
    dtypes = st.sampled_from(["float32", "float64", "int8", "uint16", "bool", "complex64", ">f4", "<U3", "O"])
    arrays = st.builds(lambda shape, dtype: np.zeros(shape, dtype=dtype), shapes, dtypes)
    torch_dtypes = st.sampled_from(
        [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn]
    )
    tensors = st.builds(lambda shape, dtype: torch.zeros(shape, dtype=dtype), shapes, torch_dtypes)
    exotic = st.sampled_from(["meta", "nested", "sparse", "0d", "noncontig", "conj"]).map(_exotic)
    return st.one_of(arrays, tensors, exotic, st.builds(np.array, numbers), odd)


def _exotic(kind: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "meta": lambda: torch.empty(2, device="meta"),
            "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            "sparse": lambda: torch.eye(3).to_sparse(),
            "0d": lambda: torch.tensor(1.5),
            "noncontig": lambda: torch.arange(12.0).reshape(3, 4).t(),
            "conj": lambda: torch.ones(2, dtype=torch.complex64).conj(),
        }[kind]()


def _either(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, odd)


modalities = _either(st.sampled_from(MODALITIES))
algorithms = _either(st.sampled_from(HASH_ALGORITHMS))
salts = st.one_of(st.none(), texts, st.binary(max_size=8), odd)
pconfigs = st.one_of(st.just(sample_preprocessing()), odd)


def _outcome(make: Callable[[], Any]) -> Any:
    """The result of `make()`, or None if it raised one of our typed errors with a short message."""
    try:
        return make()
    except ShmCacheError as exc:
        assert len(str(exc)) < 400, f"a {len(str(exc))}-character message"
        return None


def _check_key(key: Any) -> None:
    if key is None:
        return
    assert isinstance(key, EmbeddingCacheKey)
    assert key.algorithm in HASH_ALGORITHMS and key.modality in MODALITIES and key.kind in KEY_KINDS
    assert pickle.loads(pickle.dumps(key)) == key  # the validating constructor accepts it back


@FUZZ
@given(data=st.one_of(st.binary(max_size=16), odd), modality=modalities, algorithm=algorithms, salt=salts)
def test_fuzz_raw_keys(data: Any, modality: Any, algorithm: Any, salt: Any) -> None:
    _check_key(
        _outcome(
            lambda: EmbeddingCacheKey.from_raw_bytes(
                data, sample_preprocessing(), modality=modality, algorithm=algorithm, tenant_salt=salt
            )
        )
    )


@FUZZ
@given(tensor=_tensors(), modality=modalities, algorithm=algorithms, salt=salts, config=pconfigs)
def test_fuzz_tensor_keys(tensor: Any, modality: Any, algorithm: Any, salt: Any, config: Any) -> None:
    _check_key(
        _outcome(
            lambda: EmbeddingCacheKey.from_decoded_tensor(
                tensor, config, modality=modality, algorithm=algorithm, tenant_salt=salt
            )
        )
    )


@FUZZ
@given(
    tokens=st.one_of(st.lists(numbers, max_size=4), st.lists(st.integers(-(1 << 63), (1 << 63) - 1)), odd),
    parent=st.one_of(st.none(), st.binary(max_size=40), odd),
    modality=modalities,
    algorithm=algorithms,
)
def test_fuzz_token_prefix_keys(tokens: Any, parent: Any, modality: Any, algorithm: Any) -> None:
    _check_key(
        _outcome(
            lambda: EmbeddingCacheKey.from_token_prefix(
                tokens, sample_preprocessing(), parent=parent, modality=modality, algorithm=algorithm
            )
        )
    )


@FUZZ
@given(
    algorithm=algorithms,
    digest=st.one_of(st.binary(min_size=15, max_size=33), odd),
    modality=modalities,
    kind=_either(st.sampled_from(KEY_KINDS)),
)
def test_fuzz_the_key_constructor(algorithm: Any, digest: Any, modality: Any, kind: Any) -> None:
    _check_key(_outcome(lambda: EmbeddingCacheKey(algorithm, digest, modality, kind)))


PREPROCESSING_FIELDS = [f.name for f in dataclasses.fields(EncoderPreprocessingConfig)]
CACHE_FIELDS = [f.name for f in dataclasses.fields(CacheConfig)]


def _field_values(names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Changes to a config: mostly one field (so its check is the one that runs), sometimes more."""
    value = st.one_of(odd, texts, st.lists(numbers, max_size=3), st.tuples(numbers, numbers))
    one = st.builds(lambda name, v: {name: v}, st.sampled_from(names), value)
    return st.one_of(one, one, one, st.dictionaries(st.sampled_from(names), value, max_size=3))


@FUZZ
@given(changes=_field_values(PREPROCESSING_FIELDS))
@example(changes={"normalize_mean": [10**400]})
@example(changes={"model_id": "lone \ud800"})
def test_fuzz_preprocessing_configs(changes: dict[str, Any]) -> None:
    config = _outcome(lambda: sample_preprocessing(**changes))
    if config is not None:  # a valid config makes keys
        _check_key(EmbeddingCacheKey.from_raw_bytes(b"x", config, modality="image"))


@FUZZ
@given(changes=_field_values(CACHE_FIELDS), stage=st.one_of(odd, st.dictionaries(hashable, odd, max_size=2)))
@example(changes={"namespace": "ns\n"}, stage=None)
@example(changes={"lock_timeout_s": float("inf")}, stage={"remote_buffer_bytes": -1})
def test_fuzz_cache_configs(changes: dict[str, Any], stage: Any) -> None:
    config = _outcome(lambda: CacheConfig(**changes))
    assert config is None or isinstance(config, CacheConfig)
    built = _outcome(lambda: CacheConfig.from_stage_config(stage))
    assert built is None or isinstance(built, CacheConfig)


def _values() -> st.SearchStrategy[Any]:
    tensors = _tensors()
    names = st.one_of(texts, hashable)
    return st.one_of(
        tensors,
        st.lists(st.one_of(st.integers(), odd), max_size=4),
        st.dictionaries(names, tensors, max_size=3),
        st.builds(
            HiddenStatePrefix,
            st.one_of(st.lists(st.integers(), max_size=3), odd),
            tensors,
            st.one_of(st.dictionaries(names, st.one_of(numbers, texts, st.none()), max_size=2), odd),
        ),
    )


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, HiddenStatePrefix):
        return (
            isinstance(b, HiddenStatePrefix)
            and list(a.token_ids) == b.token_ids
            and _equal(a.hidden_states, b.hidden_states)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return list(a) == b
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    a = a.resolve_conj().contiguous()
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.view(-1).view(torch.uint8).equal(b.view(-1).view(torch.uint8))
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
@FUZZ
@given(value=_values())
def test_fuzz_values(value: Any) -> None:
    encoded = _outcome(lambda: encode(value))
    if encoded is not None:
        assert _equal(value, decode(encoded))
