"""The RFC's TTS voice-reference case (vllm-project/vllm-omni#3427, open question 4 and its
review: "A long synthesis runs past the TTL, so `ref_count` needs to be acquired on `get` and
released in `cleanup_request`, not only at insert"): a voice reference used by a long streaming
generation keeps `ref_count > 0` while the request lives, survives TTL expiry and eviction
pressure from another process, and is released by the end of the request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from shmcache import CacheConfig, EmbeddingCache, EmbeddingCacheKey
from shmcache.testing import sample_preprocessing
from tests.helpers import inspect_show, spawn, wait_for

VOICE = torch.arange(64 * 1024, dtype=torch.int32).to(torch.uint8)  # 64 KiB of codec features
TOKENS = [[101, 7, 7, 42], [9, 9, 13], [5, 81]]  # the reference audio's codec-token blocks


def voice_key() -> EmbeddingCacheKey:
    """The key of the whole voice reference: the last block of its token-prefix chain."""
    key = None
    for block in TOKENS:
        key = EmbeddingCacheKey.from_token_prefix(block, sample_preprocessing(), parent=key)
    assert key is not None
    return key


def fill(config: CacheConfig, count: int, done: str) -> None:
    """Another process on the node: put `count` x 64 KiB entries, slowly (eviction pressure)."""
    with EmbeddingCache(config) as cache:
        for i in range(count):
            cache.put(
                EmbeddingCacheKey.from_raw_bytes(
                    f"filler-{i}".encode(), sample_preprocessing(), modality="image"
                ),
                torch.full((64 * 1024,), i, dtype=torch.uint8),
            )
            time.sleep(0.02)
    Path(done).touch()


def _voice_entry(namespace: str) -> dict[str, Any]:
    entries = [
        e for e in inspect_show(namespace)["entries"] if e["key"] == voice_key().hex[:16]
    ]  # 16 hex digits
    assert len(entries) == 1, entries
    entry: dict[str, Any] = entries[0]
    return entry


def test_a_voice_reference_outlives_ttl_and_eviction_while_its_synthesis_streams(
    namespace: str, tmp_path: Path
) -> None:
    config = CacheConfig(
        enable_embedding_cache=True,
        namespace=namespace,
        capacity_bytes=1 << 20,
        max_entries=16,
        ways=16,
        ttl_s=0.5,
    )
    with EmbeddingCache(config) as tts:
        voice = tts.get_or_compute(voice_key(), lambda: VOICE.clone(), request_id="tts-1")
        assert _voice_entry(namespace)["references"] >= 1
        time.sleep(0.6)  # the synthesis runs past the TTL
        done = tmp_path / "filled"
        filler = spawn(fill, config, 40, str(done))  # 40 x 64 KiB through a 1 MiB arena
        for _chunk in range(20):  # stream: every chunk reads the voice reference
            assert torch.equal(voice, VOICE)
            time.sleep(0.05)
        wait_for(done.exists, what="the other process's puts")
        filler.join(30)
        assert tts.get(voice_key()) is None  # a new request is not given the expired entry
        entry = _voice_entry(namespace)
        assert entry["state"] == "stale" and entry["references"] >= 1  # expired, still held
        stats = tts.stats()
        assert stats["evictions_lru"] > 0 and stats["stale"] == 1
        assert torch.equal(voice, VOICE)  # the request's own reference still reads it intact
        assert tts.cleanup_request("tts-1") == 1  # the end of the request
        del voice
        tts.flush_releases()
        stats = tts.stats()
        assert stats["stale"] == 0 and stats["references"] == 0 and stats["evictions_ttl"] >= 1
