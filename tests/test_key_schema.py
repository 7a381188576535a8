"""The key schema: digests pinned across versions, and the memo of key headers (a memoised header
never skips a check a cold one makes)."""

from __future__ import annotations

import pytest
import torch

from shmcache import EmbeddingCacheKey
from shmcache.errors import UnsupportedValue
from shmcache.testing import sample_preprocessing


def test_digests_are_pinned_across_versions() -> None:
    """Keys are shared between processes, nodes and releases: the framing of KEY_SCHEMA_VERSION 1
    must give these digests forever (a change to them is a schema change, with a new version)."""
    config = sample_preprocessing()
    made = [
        EmbeddingCacheKey.from_raw_bytes(b"abc", config, modality="image"),
        EmbeddingCacheKey.from_raw_bytes(
            b"abc", config, modality="audio", algorithm="sha256", tenant_salt="t"
        ),
        EmbeddingCacheKey.from_decoded_tensor(torch.arange(6).reshape(2, 3), config, modality="image"),
        EmbeddingCacheKey.from_token_prefix([1, 2, 3], config, parent=b"p"),
        EmbeddingCacheKey.from_external_id("id", config, source="vllm", modality="image"),
    ]
    assert [key.hex for key in made] == [
        "073ec4c8f23b174346115504c0492f38",
        "b6168dec664100b1f8b1fe1d98bad59253e0a1281fc903f53c424a4f02c4bac0",
        "99b8af58a8030d0d2ab27fa417ac3925",
        "dad876823269d01ea973eba9fa803c12",
        "32f55c7c2be33e436600c85cee0ff14e",
    ]


def test_a_salt_is_checked_whether_or_not_a_header_is_memoised() -> None:
    config = sample_preprocessing()
    made = EmbeddingCacheKey.from_raw_bytes(b"x", config, modality="image", tenant_salt=b"s")
    with pytest.raises(UnsupportedValue):  # equal to b"s", and still not a salt
        EmbeddingCacheKey.from_raw_bytes(b"x", config, modality="image", tenant_salt=memoryview(b"s"))
    assert EmbeddingCacheKey.from_raw_bytes(b"x", config, modality="image", tenant_salt="s") == made
