"""Repeat hits: a key this process holds a live view of, served from that view's mapping
(`mappings.py`) after one lock-free native check that the entry is still sealed and unexpired;
no lock unless a request's reference is taken."""

from __future__ import annotations

import numpy as np

from shmcache.errors import ViewMutated
from shmcache.format import decode, entry
from shmcache.format.values import Value
from shmcache.gpu.side import DeviceSide
from shmcache.keys.key import EmbeddingCacheKey
from shmcache.node.index import NodeIndex
from shmcache.node.layout import Counter
from shmcache.process.mappings import Mappings
from shmcache.process.requests import RequestRefs
from shmcache.process.reservation import RequestId

__all__ = ["RepeatHits"]


class RepeatHits:
    """Serves repeat hits from this process's live mappings."""

    def __init__(
        self,
        node: NodeIndex,
        device: DeviceSide,
        requests: RequestRefs,
        mappings: Mappings,
        check_views: bool,
    ) -> None:
        self._node, self._device, self._requests = node, device, requests
        self._mappings, self._local, self._check_views = mappings, mappings.local, check_views

    def hit(
        self, needle: bytes, key: EmbeddingCacheKey, request_id: RequestId | None, *, count: bool = True
    ) -> Value | None:
        """A repeat hit served from this process's live mapping: no lock unless a ref is taken."""
        found = self._local.get(needle)
        holder = found.holder() if found is not None else None
        if found is None or holder is None:
            return None
        node, slot, gen = self._node, found.sealed.slot, found.sealed.gen
        template, ops = None, found.aliasing
        if (aliased := found.template) is not None and ops is not None:
            template = aliased()
            if template is not None and ops.signature(template) != found.signature:
                template = None  # its holder changed it in place: not aliased
        if found.parsed.on_device and self._device.reader() is not None:
            if template is None:
                return None  # a GPU entry's device arrays are made by a full delivery (its route)
            if found.aliases is not None and not self._device.still_aliasable(slot, found.aliases):
                return None  # its exporter died or withdrew it: no new aliases of that memory
        if self._check_views:
            self._check_unmodified(needle, key, holder)
        # the hit is counted in the same native call unless a request's ref may still fail it
        if not node.lookups.repeat_hit(slot, gen, counted=count and request_id is None):
            return None
        if request_id is not None and not self._ref_repeat(slot, gen, request_id, count):
            return None
        if template is not None and ops is not None:
            return ops.alias(template)
        return decode.materialize(holder, found.parsed, False, entry.ENTRY_HEADER_SIZE)

    def _ref_repeat(self, slot: int, gen: int, request_id: RequestId, count: bool) -> bool:
        """Reference a repeat hit's entry for `request_id` (and count the hit); False if it left."""
        if not self._node.add_ref(slot, gen):
            return False
        self._requests.add(request_id, slot, gen)
        if count:
            self._node.count(Counter.HITS_PROCESS)
        return True

    def _check_unmodified(self, needle: bytes, key: EmbeddingCacheKey, holder: np.ndarray) -> None:
        """(Debug mode) `ViewMutated` if a view this process was given of `key` was written to
        (the write stayed in this process's copy-on-write mapping; the next get maps afresh)."""
        if not entry.checksum_matches(holder.data):
            self._mappings.forget(needle)
            raise ViewMutated(
                f"{key!r}: a view returned in this process was written to (the node's copy is intact)"
            )
