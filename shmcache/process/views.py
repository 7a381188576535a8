"""Views: turning a pinned entry into the value returned to the caller.

A delivery maps the entry's bytes copy-on-write (`kernel/cowmap.py`), checks its head (once per
entry and process: the mapping's record remembers it, `mappings.py`) and builds the value over
them; a one-array value, and a batch of them whose heads were checked before, in one native call
(`format/arrays.c`). Repeat hits of a live view are `repeats.py`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from shmcache.config import CacheConfig
from shmcache.errors import CorruptValue, PinLimitReached
from shmcache.format import _arrays, decode, entry
from shmcache.format.values import Value
from shmcache.gpu.side import DeviceSide
from shmcache.kernel.namespace import Segments
from shmcache.keys.key import EmbeddingCacheKey
from shmcache.node.index import NodeIndex
from shmcache.node.layout import Counter, needle_of
from shmcache.node.slots import SealedEntry
from shmcache.process.mappings import Mapping, Mappings, made_in_python
from shmcache.process.releases import Releases
from shmcache.process.repeats import RepeatHits
from shmcache.process.requests import RequestRefs
from shmcache.process.reservation import RequestId

__all__ = ["Views"]

log = logging.getLogger("shmcache")


class _Handed:
    """How many of a batch's hits, in order, are the caller's (their pins go with their value or
    request); the rest give their pins back if the batch fails."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class Views:
    """Builds returned values over the arena (`repeat_hit`: `repeats.RepeatHits.hit`)."""

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
        self._mappings = Mappings()
        self._local = self._mappings.local  # read without a lock
        self.repeat_hit = RepeatHits(node, device, requests, self._mappings, self._check_views).hit
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
        self._mappings.forget()

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
        their views made (and watched) in one call, then delivered (`_deliver_known`, else one
        by one)."""
        out = [self.repeat_hit(needle, key, request_id) for key, needle in zip(keys, needles, strict=True)]
        todo = [i for i, value in enumerate(out) if value is None]
        node, pins = self._node, self.pins_for(request_id)
        kept: dict[bytes, Mapping] = {}
        handed = _Handed()
        found = node.lookups.lookup_many([needles[i] for i in todo], pins, node.release)
        try:  # from here on every hit's pins are given back if anything fails
            hits = [(i, sealed) for i, sealed in zip(todo, found, strict=True) if sealed is not None]
            holders = self._views([sealed for _, sealed in hits])
        except BaseException:  # no view was made: all or none
            node.release(
                [(sealed.slot, sealed.gen) for sealed in found if sealed is not None for _ in range(pins)]
            )
            raise
        try:
            if not self._deliver_known(needles, hits, holders, request_id, kept, out, handed):
                for (i, sealed), holder in zip(hits, holders, strict=True):
                    handed.count += 1  # `_deliver` gives its pins back itself if it fails
                    out[i] = self._deliver(keys[i], needles[i], sealed, request_id, holder, kept)
        except BaseException:  # the hits not handed over yet give their pins back
            for (_, hit), left in zip(hits[handed.count :], holders[handed.count :], strict=True):
                self._give_back(hit, left, pins)
            raise
        finally:
            self._mappings.keep(kept)  # once for the batch: one lock
        return out

    def _deliver_known(
        self,
        needles: list[bytes],
        hits: list[tuple[int, SealedEntry]],
        holders: list[np.ndarray],
        request_id: RequestId | None,
        kept: dict[bytes, Mapping],
        out: list[Value | None],
        handed: _Handed,
    ) -> bool:
        """Deliver a batch's hits into `out` in one native call if each is a one-array value whose
        head this process checked at an earlier delivery of that very entry (False, nothing done,
        if not), counting each hit `handed` as it goes to the caller (before its request's
        reference: a signal between the two leaks that pin rather than release it twice).
        `holders` keeps every view alive meanwhile, so a value dropped here releases nothing."""
        if self._clone or self._check_views or not hits:
            return False
        local, parseds = self._local, []
        for i, sealed in hits:
            before = local.get(needles[i])
            if before is None or before.sealed != sealed or before.parsed.native is None:
                return False
            parseds.append(before.parsed)
        recipes = [parsed.native for parsed in parseds]
        sealeds = [sealed for _, sealed in hits]
        made = _arrays.deliver_many(holders, entry.ENTRY_HEADER_SIZE, recipes, Mapping, sealeds, parseds)
        for (i, sealed), (value, mapping) in zip(hits, made, strict=True):
            handed.count += 1
            if request_id is not None:
                self._requests.add(request_id, sealed.slot, sealed.gen)
            out[i] = value
            kept[needles[i]] = mapping
        return True

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
        kept: dict[bytes, Mapping] = {}
        try:
            return self._deliver(key, needle, sealed, request_id, None, kept, checked)
        finally:
            self._mappings.keep(kept)

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
        kept: dict[bytes, Mapping],
        checked: decode.ParsedValue | None = None,
    ) -> Value | None:
        """`deliver` over `holder` (its view made by `_views`, or None: made here); the mapping's
        record goes into `kept`, for the caller's `Mappings.keep`."""
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

    def _build(
        self,
        key: EmbeddingCacheKey,
        needle: bytes,
        holder: np.ndarray,
        sealed: SealedEntry,
        checked: decode.ParsedValue | None,
    ) -> tuple[Value, Mapping | None]:
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
                holder, entry.ENTRY_HEADER_SIZE, parsed.native, Mapping, sealed, parsed
            )
            return value, mapping
        return made_in_python(self._device, self._clone, holder, sealed, parsed)
