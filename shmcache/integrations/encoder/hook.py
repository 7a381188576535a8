"""`CachedEncoder`: an encoder whose batched calls compute each item once per node.

A call is cut into items (`items.py`); every item is keyed by its input tensor and the
encoder's `EncoderPreprocessingConfig`, and looked up in one `get_many`. The misses are
reserved without waiting (`try_reserve_many`: the remote copies there are pulled in one
batch instead of computed); the encoder runs once on the items this process reserved (or that could not be
cached), and each output is committed, which wakes the other processes waiting for it. Items
another process was computing are then waited for one by one, after ours are committed, so two
processes that each reserved some items of the other's batch never wait on each other. The
outputs are joined in item order.

References are taken for the request in scope (`cache.request(rid)`, `shmcache.process.scope`)
and released by `cleanup_request(rid)`. The result is the encoder's own output for every item it
computed here; an item found in the cache is the output of the call that computed it, so the
joined result is bit-identical to calling the encoder on the whole batch when the encoder's
output for an item does not depend on the other items of its batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from shmcache.errors import (
    ArgumentTypeError,
    CapacityError,
    ConfigTypeError,
    InvalidKey,
    KeyTypeError,
    PinLimitReached,
)
from shmcache.format.values import Value
from shmcache.integrations.encoder.context import opaque
from shmcache.integrations.encoder.items import ItemCall, ItemLayout
from shmcache.keys.key import MODALITIES, EmbeddingCacheKey, Modality
from shmcache.keys.preprocessing import EncoderPreprocessingConfig
from shmcache.keys.text import short_repr
from shmcache.process.arguments import check_callable
from shmcache.process.cache import EmbeddingCache
from shmcache.process.reservation import RequestId, Reservation
from shmcache.process.scope import current_request

__all__ = ["CachedEncoder"]


log = logging.getLogger("shmcache")


_pins_warned = threading.Event()  # set once the warning below was given


_opaque_warned = threading.Event()  # set once the warning below was given


def _opaque_warning(kind: str) -> None:
    """Warn once per process that calls with an argument that cannot be digested exactly (it
    may change the outputs, so it must be in their keys) run without the cache."""
    if not _opaque_warned.is_set():
        _opaque_warned.set()
        log.warning(
            "shmcache: encoder calls with an argument of type %s run without the cache (only tensors, "
            "arrays, numbers, strings, None, dtypes, devices, enum members and lists, tuples and dicts "
            "of them can be in a key)",
            kind,
        )


def _pins_warning() -> None:
    """Warn once per process that items went out without their request's reference: the process
    holds pins on `max_pins_per_process` entries."""
    if not _pins_warned.is_set():
        _pins_warned.set()
        log.warning(
            "shmcache: encoder outputs returned without their request's reference: this process holds "
            "pins on max_pins_per_process entries (raise it, or clean requests up sooner)"
        )


class CachedEncoder:
    """`encoder` (a module or function over a batch of items) behind the node cache."""

    def __init__(
        self,
        cache: EmbeddingCache,
        encoder: Callable[..., Any],
        *,
        items: ItemLayout,
        preprocessing: EncoderPreprocessingConfig,
        modality: Modality,
    ) -> None:
        check_callable("encoder", encoder)
        if not all(callable(getattr(items, step, None)) for step in ("split", "subset", "cut", "join")):
            raise ArgumentTypeError(
                f"items must be an ItemLayout (BatchedItems, PackedItems), got {type(items).__name__}"
            )
        if not isinstance(preprocessing, EncoderPreprocessingConfig):
            raise ConfigTypeError(
                f"preprocessing must be an EncoderPreprocessingConfig, got {type(preprocessing).__name__}"
            )
        if not isinstance(modality, str):
            raise KeyTypeError(f"modality must be a str, got {type(modality).__name__}")
        if modality not in MODALITIES:
            raise InvalidKey(f"modality must be one of {MODALITIES}, got {short_repr(modality)}")
        self.cache, self.encoder, self.items = cache, encoder, items
        self.preprocessing, self.modality = preprocessing, modality

    @classmethod
    def install(
        cls,
        module: Any,
        cache: EmbeddingCache,
        *,
        items: ItemLayout,
        preprocessing: EncoderPreprocessingConfig,
        modality: Modality,
    ) -> CachedEncoder:
        """Route `module`'s calls (`module(x, ...)`, as its owner makes them) through the cache,
        by setting its instance's `forward`; `uninstall(module)` undoes it. Installing again
        replaces the hook installed before (a hook around a hook would run the encoder under
        reservations its inner hook then waits on)."""
        installed = module.__dict__.get("forward")
        encoder = installed.encoder if isinstance(installed, CachedEncoder) else module.forward
        hook = cls(cache, encoder, items=items, preprocessing=preprocessing, modality=modality)
        module.forward = hook
        return hook

    @staticmethod
    def uninstall(module: Any) -> None:
        """Give `module` its own `forward` back."""
        if isinstance(module.__dict__.get("forward"), CachedEncoder):
            del module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.items.split(args, kwargs)
        if not self.cache.config.enable_embedding_cache or call.count == 0:
            return self.encoder(*args, **kwargs)
        if any(context is None for context in call.contexts):
            _opaque_warning(opaque(args[1:], kwargs))
            return self.encoder(*args, **kwargs)
        keys = [
            self.cache.key_from_decoded_tensor(tensor, self._configured(context), modality=self.modality)
            for tensor, context in zip(call.keys, call.contexts, strict=True)
        ]
        request_id = current_request()
        try:
            outputs: list[Value | None] = list(self.cache.get_many(keys, request_id))
        except PinLimitReached:  # nothing is held yet: this forward runs without the cache
            _pins_warning()
            return self.encoder(*args, **kwargs)
        missing = [i for i, value in enumerate(outputs) if value is None]
        if missing:
            self._fill(call, keys, outputs, missing, request_id)
        return self.items.join(outputs)

    def _configured(self, context: bytes | None) -> EncoderPreprocessingConfig:
        """The preprocessing config of an item's key, with the digest of what else its call passed."""
        if not context:
            return self.preprocessing
        prior = self.preprocessing.processor_config_hash
        return dataclasses.replace(self.preprocessing, processor_config_hash=f"{prior}|call:{context.hex()}")

    def _fill(
        self,
        call: ItemCall,
        keys: Sequence[EmbeddingCacheKey],
        outputs: list[Value | None],
        missing: Sequence[int],
        request_id: RequestId | None,
    ) -> None:
        """Fill `outputs[i]` for every missing item: computed here, pulled, or waited for."""
        ours: dict[int, Reservation] = {}
        elsewhere = []
        # one batch pull; the misses were counted by get_many
        claims = self.cache.try_reserve_many([keys[i] for i in missing], request_id, counted=False)
        for i, res in zip(missing, claims, strict=True):
            if res is None:
                elsewhere.append(i)
            elif res.value is not None:
                outputs[i] = res.value
            else:
                ours[i] = res  # owned, or uncached (no room): computed here either way
        if ours:
            self._compute(call, ours, outputs)
        for i in elsewhere:  # computed by another process: wait for it (or take it over)
            try:
                outputs[i] = self.cache.get_or_compute(
                    keys[i], functools.partial(self._one, call, i), request_id
                )
            except PinLimitReached as exc:  # a request is never failed by the cache
                _pins_warning()
                outputs[i] = exc.value if exc.value is not None else self._one(call, i)

    def _compute(self, call: ItemCall, ours: dict[int, Reservation], outputs: list[Value | None]) -> None:
        """One encoder call over the items reserved here; each output committed as computed. On
        any error every reservation not committed yet is abandoned (its waiters are told)."""
        items = list(ours)
        with contextlib.ExitStack() as stack:
            for res in ours.values():
                stack.enter_context(res)
                stack.enter_context(res.computing())
            args, kwargs = self.items.subset(call, items)
            results = self.items.cut(self.encoder(*args, **kwargs), call, items)
            for i, result in zip(items, results, strict=True):
                try:
                    outputs[i] = ours[i].commit(result, view=False)
                except CapacityError as exc:  # too large to cache, or not held: returned all the same
                    if isinstance(exc, PinLimitReached):
                        _pins_warning()
                    outputs[i] = result

    def _one(self, call: ItemCall, i: int) -> Any:
        """Item `i` computed alone (the process that was computing it failed or died)."""
        args, kwargs = self.items.subset(call, [i])
        return self.items.cut(self.encoder(*args, **kwargs), call, [i])[0]
