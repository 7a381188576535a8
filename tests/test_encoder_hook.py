"""`CachedEncoder` on real transformers encoders (tiny random weights): a batched call looks
every item up at once, encodes only the missing ones (once per node, across processes), and
joins the outputs in order, bit-identical to the unwrapped encoder on the whole batch."""

from __future__ import annotations

import dataclasses
import enum
import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from shmcache import (
    ArgumentTypeError,
    CacheConfig,
    ComputeReentered,
    ConfigTypeError,
    EmbeddingCache,
    EncoderPreprocessingConfig,
    InvalidKey,
    KeyTypeError,
)
from shmcache.integrations.encoder import BatchedItems, CachedEncoder, PackedItems
from shmcache.integrations.encoder.context import call_context
from tests.encoders import batch, build
from tests.helpers import spawn

ENCODERS = ["clip", "siglip", "whisper", "qwen2-vl"]


def batch_invariant() -> None:
    """One intra-op thread and no oneDNN: then these encoders' outputs for an item do not depend
    on the other items of the batch (with several threads the CPU matmul kernels may split rows
    differently, and oneDNN's convolutions differ between batch sizes). Measured here: even so,
    a Qwen2-VL item of 8 patch rows comes out ~1 ulp apart alone and in a batch, so the packed
    items of these tests have 16 rows or more; on an Intel Xeon build machine (2026-12-06) even
    those came out 1 ulp apart (two tests, once each), so an item computed in another batch is
    compared within 1e-5. Batch invariance is the encoder's property: the hook returns exactly
    what the encoder computed for each item, in whichever call it ran."""
    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False


@pytest.fixture(autouse=True)
def invariant_kernels() -> Iterator[None]:
    threads, onednn = torch.get_num_threads(), torch.backends.mkldnn.enabled
    batch_invariant()
    yield
    torch.set_num_threads(threads)
    torch.backends.mkldnn.enabled = onednn


def _hooked(cache: EmbeddingCache, name: str) -> tuple[Any, CachedEncoder]:
    encoder = build(name)
    hook = CachedEncoder(
        cache, encoder, items=encoder.items, preprocessing=encoder.preprocessing(), modality=encoder.modality
    )
    return encoder, hook


@pytest.mark.parametrize("name", ENCODERS)
def test_only_missing_items_are_encoded_and_the_output_is_the_whole_batchs(
    config: CacheConfig, name: str
) -> None:
    with EmbeddingCache(config) as cache:
        encoder, hook = _hooked(cache, name)
        args, kwargs = batch(name, [1, 2, 1, 3])  # item 2 repeats item 0
        want = encoder(*args, **kwargs)
        encoder.encoded.clear()
        first_args, first_kwargs = batch(name, [2])
        hook(*first_args, **first_kwargs)  # item 1 is cached before the batch comes
        got = hook(*args, **kwargs)
        assert encoder.encoded == [1, 2]  # then one call over the two new distinct items
        assert got.dtype == want.dtype and torch.equal(got, want)
        again = hook(*args, **kwargs)
        assert encoder.encoded == [1, 2] and torch.equal(again, want)  # all hits
        del got, again
        cache.flush_releases()
        stats = cache.stats()
        assert stats["entries"] == stats["puts"] == 3 and stats["references"] == 0
        # each lookup counted once: 1 (the first call) + 3 (items 0, 2, 3: the batch's get_many)
        assert stats["misses"] == 4, stats


def encode_after(config: CacheConfig, name: str, seeds: list[int], start: Any, results: Any) -> None:
    """Another process: the same hooked encoder over `seeds`, started together with the others."""
    batch_invariant()
    with EmbeddingCache(config) as cache:
        encoder, hook = _hooked(cache, name)
        args, kwargs = batch(name, seeds)
        start.wait(60)
        got = hook(*args, **kwargs)
        encoded = sum(encoder.encoded)
        results.put((encoded, got.numpy(), encoder(*args, **kwargs).numpy()))


@pytest.mark.parametrize("name", ["clip", "qwen2-vl"])
def test_two_processes_with_the_same_items_encode_each_once(config: CacheConfig, name: str) -> None:
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(2), ctx.Queue()
    procs = [spawn(encode_after, config, name, seeds, start, results) for seeds in ([5, 6, 7], [7, 6, 5])]
    got = [results.get(timeout=180) for _ in procs]
    for proc in procs:
        proc.join(30)
    assert sum(encoded for encoded, _, _ in got) == 3  # three distinct items, one forward each
    for _, output, unwrapped in got:  # an item computed in the other process's batch: see below
        np.testing.assert_allclose(output, unwrapped, rtol=1e-5, atol=1e-6)


def test_references_follow_the_request_in_scope(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        _, hook = _hooked(cache, "clip")
        args, kwargs = batch("clip", [1, 2, 3])
        with cache.request("req-1"):
            out = hook(*args, **kwargs)
        del out
        cache.flush_releases()
        assert cache.stats()["references"] == 3  # held for the request, not for the output
        assert cache.cleanup_request("req-1") == 3
        hook(*args, **kwargs)
        cache.flush_releases()
        assert cache.stats()["references"] == 0  # no request in scope: nothing held


def _nothing_kept_then_encoded(
    cache: EmbeddingCache, hook: CachedEncoder, encoder: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """After a call that failed: no reservation and no entry left, and `hook` encodes the batch."""
    stats = cache.stats()
    assert stats["reserved"] == 0 and stats["entries"] == 0
    assert torch.equal(hook(*args, **kwargs), encoder(*args, **kwargs))


def test_a_failing_encoder_abandons_its_items_and_the_next_call_encodes_them(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        encoder, hook = _hooked(cache, "whisper")
        args, kwargs = batch("whisper", [1, 2])
        broken = CachedEncoder(
            cache,
            lambda *a, **k: 1 / 0,
            items=encoder.items,
            preprocessing=encoder.preprocessing(),
            modality="audio",
        )
        with pytest.raises(ZeroDivisionError):
            broken(*args, **kwargs)
        _nothing_kept_then_encoded(cache, hook, encoder, args, kwargs)


def test_the_same_patch_rows_under_another_grid_are_another_item(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        encoder, hook = _hooked(cache, "qwen2-vl")
        rows = torch.ones(16, 96)
        wide = hook(rows, grid_thw=torch.tensor([[1, 2, 8]]))
        square = hook(rows, grid_thw=torch.tensor([[1, 4, 4]]))
        assert encoder.encoded == [1, 1]  # no false hit: the grid is part of the key
        assert torch.equal(square, encoder(rows, grid_thw=torch.tensor([[1, 4, 4]])))
        assert not torch.equal(wide, square)


def test_calls_without_the_layout_are_typed_errors(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        _, hook = _hooked(cache, "qwen2-vl")
        with pytest.raises(ArgumentTypeError, match="grid_thw"):
            hook(torch.ones(16, 96))
        with pytest.raises(ArgumentTypeError, match="describes 32 rows"):
            hook(torch.ones(16, 96), grid_thw=torch.tensor([[2, 4, 4]]))
        with pytest.raises(ArgumentTypeError, match="callable"):
            CachedEncoder(
                cache, "visual", items=hook.items, preprocessing=hook.preprocessing, modality="image"
            )  # type: ignore[arg-type]
        bad: list[tuple[type[Exception], str, dict[str, Any]]] = [
            (ArgumentTypeError, "ItemLayout", {"items": "grid_thw"}),
            (ConfigTypeError, "EncoderPreprocessingConfig", {"preprocessing": {}}),
            (InvalidKey, "modality", {"modality": "smell"}),
            (KeyTypeError, "modality must be a str", {"modality": 3}),
            (KeyTypeError, "modality must be a str", {"modality": ["image"]}),
        ]
        for error, message, wrong in bad:
            arguments: dict[str, Any] = {
                "items": hook.items,
                "preprocessing": hook.preprocessing,
                "modality": "image",
                **wrong,
            }
            with pytest.raises(error, match=message):
                CachedEncoder(cache, hook.encoder, **arguments)


def test_a_packed_table_given_as_a_list_or_positionally_is_the_same_call(config: CacheConfig) -> None:
    """vLLM's Qwen-VL towers are called `visual(x, grid_thw=list_of_rows)` and `visual(x,
    grid_thw)`: the same items, the same keys, and the encoder gets its table back in the form
    and place it was given (before: `ArgumentTypeError` for both)."""
    with EmbeddingCache(config) as cache:
        encoder = build("qwen2-vl")
        given: list[Any] = []

        def tower(pixels: torch.Tensor, grid_thw: Any) -> torch.Tensor:
            given.append(grid_thw)
            return encoder(pixels, grid_thw=torch.as_tensor(grid_thw))

        hook = CachedEncoder(
            cache, tower, items=encoder.items, preprocessing=encoder.preprocessing(), modality="image"
        )
        (pixels,), kwargs = batch("qwen2-vl", [1, 2])
        grid = kwargs["grid_thw"]
        want = encoder(pixels, grid_thw=grid)
        encoder.encoded.clear()
        assert torch.equal(hook(pixels, grid_thw=grid.tolist()), want)
        assert given == [grid.tolist()] and encoder.encoded == [2]
        assert torch.equal(hook(pixels, grid), want) and encoder.encoded == [2]  # positional: hits
        (more,), more_kwargs = batch("qwen2-vl", [1, 3])  # item 1 cached, item 3 new
        got = hook(more, tuple(more_kwargs["grid_thw"].tolist()))
        # item 1 was computed in the batch [1, 2], here it is in [1, 3]: a batch's rows change the
        # matmul's blocking, so the last bits may differ (seen once in CI), the items may not
        torch.testing.assert_close(got, encoder(more, grid_thw=more_kwargs["grid_thw"]), rtol=1e-5, atol=1e-6)
        assert given[-1] == (more_kwargs["grid_thw"].tolist()[1],)  # a tuple of the new item's row
        with pytest.raises(ArgumentTypeError, match="integer rows"):
            hook(pixels, grid_thw=[["a", 4, 4], [1, 4, 8]])
        with pytest.raises(ArgumentTypeError, match="position"):
            PackedItems("grid_thw", output_rows=lambda g: 1, position=0)


def test_the_calls_other_arguments_are_in_every_items_key(
    config: CacheConfig, pconfig: EncoderPreprocessingConfig
) -> None:
    """The same rows called with another argument, or with other rows of a per-item argument, are
    other items (before: they hit the outputs of the first call, a false hit); an argument that
    cannot be digested exactly runs the call without the cache."""
    with EmbeddingCache(config) as cache:
        computed: list[int] = []

        def encoder(x: torch.Tensor, scale: Any = 1.0, mask: Any = None) -> torch.Tensor:
            computed.append(x.shape[0])
            out = x * float(scale) if not isinstance(scale, Opaque) else x
            return out if mask is None else out * mask[:, None]

        items = BatchedItems(per_item=("mask",))
        hook = CachedEncoder(cache, encoder, items=items, preprocessing=pconfig, modality="image")
        x = torch.arange(8.0).reshape(2, 4)
        assert torch.equal(hook(x), x) and computed == [2]
        assert torch.equal(hook(x, scale=2.0), 2 * x) and computed == [2, 2]
        assert torch.equal(hook(x, scale=2.0), 2 * x) and computed == [2, 2]  # hits
        assert torch.equal(hook(x, mask=torch.tensor([1.0, 0.0])), x * torch.tensor([[1.0], [0.0]]))
        assert computed == [2, 2, 2]
        assert torch.equal(hook(x, mask=torch.tensor([1.0, 1.0])), x)
        assert computed == [2, 2, 2, 1]  # row 0 with mask 1: a hit
        assert torch.equal(hook(x, mask=None), x) and computed[-1] == 2  # None: no rows (was TypeError)
        entries = cache.stats()["entries"]
        assert torch.equal(hook(x, scale=Opaque()), x) and computed[-1] == 2
        assert cache.stats()["entries"] == entries  # not cached: its key could not cover it


def test_dtypes_devices_and_enum_members_are_digested_by_name() -> None:
    """`dtype=torch.float16` or `device=...` in a call keeps it cacheable, and they tell calls
    apart (they were opaque: every such call ran without the cache)."""
    half, single = call_context((), {"dtype": torch.float16}), call_context((), {"dtype": torch.float32})
    assert half is not None and single is not None and half != single
    cpu = call_context((torch.device("cpu"), np.dtype("float32"), Modality.IMAGE), {})
    assert cpu is not None and cpu != call_context(
        (torch.device("meta"), np.dtype("float32"), Modality.IMAGE), {}
    )
    assert call_context((), {"scale": Opaque()}) is None


class Modality(enum.Enum):
    IMAGE = "image"


class Opaque:
    """An argument the hook cannot digest exactly (its repr would leave its state out)."""


def test_install_routes_a_modules_own_calls_and_uninstall_undoes_it(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        encoder = build("qwen2-vl")
        tower = encoder.module  # returns one tensor, as vLLM's `visual` does
        args, kwargs = batch("qwen2-vl", [1, 2])
        with torch.no_grad():
            want = tower(*args, **kwargs)
            CachedEncoder.install(
                tower, cache, items=encoder.items, preprocessing=encoder.preprocessing(), modality="image"
            )
            assert torch.equal(tower(*args, **kwargs), want)  # as the thinker calls self.visual(...)
            assert cache.stats()["entries"] == 2
            CachedEncoder.uninstall(tower)
            assert "forward" not in tower.__dict__ and torch.equal(tower(*args, **kwargs), want)


def test_installing_again_replaces_the_hook(config: CacheConfig) -> None:
    """A second install (a plug-in set up twice) wraps the module's own forward, not the first
    hook: otherwise the inner hook would wait on the items the outer one reserved."""
    with EmbeddingCache(dataclasses.replace(config, compute_timeout_s=20)) as cache:
        encoder = build("qwen2-vl")
        tower, own = encoder.module, encoder.module.forward
        args, kwargs = batch("qwen2-vl", [1, 2])
        settings: dict[str, Any] = {"items": encoder.items, "preprocessing": encoder.preprocessing()}
        with torch.no_grad():
            want = tower(*args, **kwargs)
            CachedEncoder.install(tower, cache, modality="image", **settings)
            hook = CachedEncoder.install(tower, cache, modality="image", **settings)
            assert tower.forward is hook and hook.encoder == own
            assert torch.equal(tower(*args, **kwargs), want)
            assert cache.stats()["entries"] == 2
            CachedEncoder.uninstall(tower)
            assert "forward" not in tower.__dict__


def test_a_hook_around_a_hook_of_the_same_items_fails_at_once(config: CacheConfig) -> None:
    """The inner hook is asked for the items the outer one is computing, in the same thread:
    `ComputeReentered` at once (not a wait on itself until compute_timeout_s); nothing is kept."""
    with EmbeddingCache(dataclasses.replace(config, compute_timeout_s=20)) as cache:
        encoder, inner = _hooked(cache, "clip")
        outer = CachedEncoder(
            cache, inner, items=encoder.items, preprocessing=inner.preprocessing, modality="image"
        )
        args, kwargs = batch("clip", [1, 2])
        with pytest.raises(ComputeReentered):
            outer(*args, **kwargs)
        _nothing_kept_then_encoded(cache, inner, encoder, args, kwargs)


def test_a_disabled_cache_calls_the_encoder_as_is(config: CacheConfig) -> None:
    with EmbeddingCache(dataclasses.replace(config, enable_embedding_cache=False)) as cache:
        encoder, hook = _hooked(cache, "clip")
        args, kwargs = batch("clip", [1, 1])
        assert torch.equal(hook(*args, **kwargs), encoder(*args, **kwargs))
        assert encoder.encoded == [2, 2]
