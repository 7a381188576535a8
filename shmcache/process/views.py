"""Views: turning a pinned entry into the value returned to the caller, and repeat hits.

Per process there is one live mapping per entry: a holder array made straight from the arena
mapping (every returned array derives from it, so its mapping is given back only after the last
view dies, and then enqueues the release of the view pin) and the parsed value format. A repeat
hit of the same key reuses it without a lock after a lock-free check that (slot, gen) is still
sealed and unexpired. After the views of an entry died, the parsed head stays: delivering that very
entry (slot, gen) again skips the head check and the parse. The newest `REMEMBERED` such dead
mappings are kept (live ones always), so a process that sees ever new keys holds bounded memory.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

import numpy as np

from shmcache.config import CacheConfig
from shmcache.errors import CorruptValue, PinLimitReached, ViewMutated
from shmcache.format import _arrays, decode, entry
from shmcache.format.values import Value
from shmcache.gpu.record import GpuRecord
from shmcache.gpu.side import DeviceSide
from shmcache.kernel.namespace import Segments
from shmcache.keys.key import EmbeddingCacheKey
from shmcache.node.index import NodeIndex
from shmcache.node.layout import Counter, needle_of
from shmcache.node.slots import SealedEntry
from shmcache.process.releases import Releases
from shmcache.process.requests import RequestRefs
from shmcache.process.reservation import RequestId

__all__ = ["Views"]

log = logging.getLogger("shmcache")

REMEMBERED: Final = 4096  # dead views' mappings a process remembers (newest first) for re-delivery


class _Mapping(NamedTuple):
    """This process's live zero-copy mapping of one entry and the value returned over it, which
    repeat hits alias while it is alive and unchanged (a NamedTuple: made on every delivery, by
    position in `arrays.c`'s `deliver` for a one-array value)."""

    sealed: SealedEntry  # the entry whose head was parsed: (slot, gen) and where it lies in the arena
    holder: weakref.ref[np.ndarray]  # the entry's bytes; alive while any returned view is
    parsed: decode.ParsedValue
    template: weakref.ref[Any] | None  # the value returned; None: never aliased (`decode.aliasing`)
    signature: tuple[Any, ...]  # the template's signature when it was returned
    aliasing: decode.Aliasing | None  # how to check the template again and alias it
    aliases: GpuRecord | None  # the template aliases this exporter's device memory


class Views:
    """Builds returned values over the arena and serves repeat hits from live mappings."""

    def __init__(
        self,
        node: NodeIndex,
        segments: Segments,
        config: CacheConfig,
        device: DeviceSide,
        requests: RequestRefs,
        releases: Releases,
    ) -> None:
        self._node, self._arena, self._device = node, segments.arena_views, device
        self._shared = memoryview(segments.arena)  # entry heads are checked here: no fault in a view
        self._requests, self._releases = requests, releases
        self._clone = config.return_mode == "clone"
        self._check_views = config.debug_check_views
        self._local: dict[bytes, _Mapping] = {}
        self._bound = REMEMBERED  # `_local`'s size that makes `_keep` forget dead mappings
        self._lock = threading.Lock()
        view_pin = int(not self._clone)
        self._pins = (max(view_pin, 1), view_pin + 1)  # `pins_for` without, with a request

    def pins_for(self, request_id: RequestId | None) -> int:
        """Pins a delivery takes: a view pin in view mode, plus a request ref. In clone mode
        without a request, one pin covers the copy and is released right after it."""
        return self._pins[request_id is not None]

    def pin_late(self, sealed: SealedEntry, request_id: RequestId | None, pins: int) -> SealedEntry | None:
        """For a seal that found this process out of pin records (`sealed.pinned` False): take the
        `pins` it asked for now (`add_ref` releases the dead views' pins first); the entry pinned,
        or None (the caller keeps its own value) if it left meanwhile or, without a request, there
        are still none. `PinLimitReached` if a request asked to hold it and there are none."""
        try:
            if self._node.add_ref(sealed.slot, sealed.gen, pins):
                return sealed._replace(pinned=True)
        except PinLimitReached:
            if request_id is not None:
                raise
        return None

    def commit_pins(self, request_id: RequestId | None, *, view: bool) -> int:
        """The pins a commit takes: a delivery's when it returns the cached view, else a request
        ref (the caller keeps its own value)."""
        return self.pins_for(request_id) if view else int(request_id is not None)

    def hand_out(
        self,
        key: EmbeddingCacheKey,
        request_id: RequestId | None,
        value: Value,
        sealed: SealedEntry,
        *,
        view: bool,
    ) -> Value:
        """What a commit returns for the entry it sealed: the cached view (`view`), else `value`;
        a request's reference taken either way."""
        if not sealed.pinned:  # stored for everyone; this process was out of pin records
            try:
                pinned = self.pin_late(sealed, request_id, self.commit_pins(request_id, view=view))
            except PinLimitReached as exc:
                exc.value = value  # the caller keeps what it computed
                raise
            if pinned is None:
                return value  # it keeps its own value
            sealed = pinned
        if not view:
            if request_id is not None:
                self._requests.add(request_id, sealed.slot, sealed.gen)
            return value
        result = self.deliver(key, needle_of(key), sealed, request_id)
        return value if result is None else result

    def forget(self) -> None:
        """Drop every live mapping (detach)."""
        with self._lock:
            self._local.clear()

    def lookup(self, key: EmbeddingCacheKey, needle: bytes, request_id: RequestId | None) -> Value | None:
        """`get`: a repeat hit, else a node lookup delivered as a new view; None for a miss."""
        value = self.repeat_hit(needle, key, request_id)
        if value is not None:
            return value
        sealed = self._node.lookups.lookup(needle, self.pins_for(request_id), counted=True)
        return None if sealed is None else self.deliver(key, needle, sealed, request_id)

    def lookup_many(
        self, keys: Sequence[EmbeddingCacheKey], needles: list[bytes], request_id: RequestId | None
    ) -> list[Value | None]:
        """`lookup` of every key, in order: repeat hits first, the rest in one native lookup,
        their views made (and watched) in one call."""
        out = [self.repeat_hit(needle, key, request_id) for key, needle in zip(keys, needles, strict=True)]
        todo = [i for i, value in enumerate(out) if value is None]
        node, pins = self._node, self.pins_for(request_id)
        found = node.lookups.lookup_many([needles[i] for i in todo], pins, node.release)
        try:  # from here on every hit's pins are given back if anything fails
            hits = [(i, sealed) for i, sealed in zip(todo, found, strict=True) if sealed is not None]
            holders = self._views([sealed for _, sealed in hits])
        except BaseException:  # no view was made: all or none
            node.release(
                [(sealed.slot, sealed.gen) for sealed in found if sealed is not None for _ in range(pins)]
            )
            raise
        kept: dict[bytes, _Mapping] = {}
        try:
            for n, ((i, sealed), holder) in enumerate(zip(hits, holders, strict=True)):
                try:
                    out[i] = self._deliver(keys[i], needles[i], sealed, request_id, holder, kept)
                except BaseException:  # the hits not yet delivered give their pins back
                    for (_, hit), left in zip(hits[n + 1 :], holders[n + 1 :], strict=True):
                        self._give_back(hit, left, pins)
                    raise
        finally:
            self._keep(kept)  # once for the batch: one lock
        return out

    def hold(self, needle: bytes, request_id: RequestId) -> bool:
        """Reference the sealed entry of `needle` for `request_id`, without a view; False if none."""
        sealed = self._node.lookups.lookup(needle, 1)
        if sealed is None:
            return False
        self._requests.add(request_id, sealed.slot, sealed.gen)
        return True

    def deliver(
        self,
        key: EmbeddingCacheKey,
        needle: bytes,
        sealed: SealedEntry,
        request_id: RequestId | None,
        checked: decode.ParsedValue | None = None,
    ) -> Value | None:
        """Turn an entry pinned `pins_for(request_id)` times into the returned value; None (pins given
        back, entry dropped) if it fails verification. `checked`: its head as verified here (a pull)."""
        kept: dict[bytes, _Mapping] = {}
        try:
            return self._deliver(key, needle, sealed, request_id, None, kept, checked)
        finally:
            self._keep(kept)

    def _views(self, entries: list[SealedEntry]) -> list[np.ndarray]:
        """A view of each pinned entry, in one call; in view mode each one's death enqueues the
        release of its view pin, watched from the moment it is made."""
        extents = [(sealed.offset, sealed.size) for sealed in entries]
        if self._clone:  # the copy is returned: the pins are given back right after it
            return self._arena.view_many(extents)
        return self._arena.watched_views(extents, self._releases.enqueue, [(e.slot, e.gen) for e in entries])

    def _view(self, sealed: SealedEntry) -> np.ndarray:
        """`_views` of one entry."""
        if self._clone:
            return self._arena.view(sealed.offset, sealed.size)
        return self._arena.watched_view(
            sealed.offset, sealed.size, self._releases.enqueue, (sealed.slot, sealed.gen)
        )

    def _give_back(self, sealed: SealedEntry, holder: np.ndarray | None, pins: int) -> None:
        """Release the `pins` of an entry not delivered after all, its view's pin included (the
        view's death then releases nothing); a closed cache that this left idle detaches."""
        if holder is not None:
            self._arena.disarm(holder)
        self._node.release([(sealed.slot, sealed.gen)] * pins)
        self._releases.disarmed()  # after `close`, the last live view may have been this one

    def _deliver(
        self,
        key: EmbeddingCacheKey,
        needle: bytes,
        sealed: SealedEntry,
        request_id: RequestId | None,
        holder: np.ndarray | None,
        kept: dict[bytes, _Mapping],
        checked: decode.ParsedValue | None = None,
    ) -> Value | None:
        """`deliver` over `holder` (its view made by `_views`, or None: made here); the mapping's
        record goes into `kept`, for the caller's `_keep`."""
        node, slot, gen = self._node, sealed.slot, sealed.gen
        # a copy-on-write mapping of the entry (no write reaches the node's copy), made straight
        # as an array (not sliced from another), so that every array derived from it keeps it as
        # its base: its mapping's death then releases the view pin
        try:
            if holder is None:
                holder = self._view(sealed)
            value, mapping = self._build(key, needle, holder, sealed, checked)
        except CorruptValue as exc:
            node.count(Counter.CORRUPT_RECORDS)
            log.warning("shmcache: dropping entry %r: %s", key, str(exc))
            node.drop(slot, gen)  # before the give-back, which may detach a closed cache
            self._give_back(sealed, holder, self.pins_for(request_id))
            return None
        except BaseException:  # ViewMutated, MemoryError, ...: give the pins back, then report it
            self._give_back(sealed, holder, self.pins_for(request_id))
            raise
        if request_id is not None:
            self._requests.add(request_id, slot, gen)
        if mapping is None:  # clone mode
            if request_id is None:
                node.release([(slot, gen)])  # the pin only covered the copy
            return value
        kept[needle] = mapping
        return value

    def _keep(self, kept: dict[bytes, _Mapping]) -> None:
        """Remember each delivered view's mapping as the newest of its needle. Past the bound, the
        oldest dead mappings go down to `REMEMBERED`, and the next sweep waits until twice as many
        are held (each sweep is paid for by the deliveries since the last)."""
        with self._lock:
            local = self._local
            for needle, mapping in kept.items():
                local.pop(needle, None)  # to the end: dicts keep insertion order
                local[needle] = mapping
            if len(local) > self._bound:
                excess = len(local) - REMEMBERED
                for old in [n for n, m in local.items() if m.holder() is None][:excess]:
                    del local[old]
                self._bound = max(REMEMBERED, 2 * len(local))

    def _build(
        self,
        key: EmbeddingCacheKey,
        needle: bytes,
        holder: np.ndarray,
        sealed: SealedEntry,
        checked: decode.ParsedValue | None,
    ) -> tuple[Value, _Mapping | None]:
        """(value, the mapping's record; None in clone mode). A one-array value is made with its
        record in one native call."""
        # the head checked at the last delivery of `needle` here, if of this very (slot, gen, extent,
        # attachment): a sealed entry never changes, a new reservation is a new gen (a repair's too)
        parsed = checked
        if parsed is None and (before := self._local.get(needle)) is not None and before.sealed == sealed:
            parsed = before.parsed
        if parsed is None:
            # the head is checked in the shared mapping (the same bytes: the entry is pinned), so
            # the view's pages are first touched by the consumer, if at all
            body = entry.verify(self._shared[sealed.offset : sealed.offset + sealed.size], key, sealed.gen)
            parsed = decode.parse(body)
        if self._check_views and not entry.checksum_matches(holder.data):
            raise CorruptValue("the node's copy does not match its checksum")
        if parsed.native is not None and not self._clone:
            value, mapping = _arrays.deliver(
                holder, entry.ENTRY_HEADER_SIZE, parsed.native, _Mapping, sealed, parsed
            )
            return value, mapping
        return _made_in_python(self._device, self._clone, holder, sealed, parsed)

    def _check_unmodified(self, needle: bytes, key: EmbeddingCacheKey, holder: np.ndarray) -> None:
        """(Debug mode) `ViewMutated` if a view this process was given of `key` was written to
        (the write stayed in this process's copy-on-write mapping; the next get maps afresh)."""
        if not entry.checksum_matches(holder.data):
            with self._lock:
                self._local.pop(needle, None)
            raise ViewMutated(
                f"{key!r}: a view returned in this process was written to (the node's copy is intact)"
            )

    def repeat_hit(
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


def _made_in_python(
    device: DeviceSide, clone: bool, holder: np.ndarray, sealed: SealedEntry, parsed: decode.ParsedValue
) -> tuple[Value, _Mapping | None]:
    """`Views._build` of a value not delivered in one native call: any value in clone mode (a
    copy: no record), a value of several arrays or one born on a GPU."""
    on_device = device.materialize(holder, sealed, parsed, copy=clone) if parsed.on_device else None
    value, aliased = on_device or (decode.materialize(holder, parsed, clone, entry.ENTRY_HEADER_SIZE), False)
    if clone:
        return value, None
    ops = decode.aliasing(value)
    template, signature = (None, ()) if ops is None else (weakref.ref(value), ops.signature(value))
    record = GpuRecord.from_attachment(sealed.attachment) if aliased else None
    return value, _Mapping(sealed, weakref.ref(holder), parsed, template, signature, ops, record)
