"""The scheduler side of the connector: which items a request loads from the node, which it
computes, and node-wide exactly-once across engines.

Per step, for each request vLLM wants to schedule (`ensure_cache_available`):
- an item sealed on the node is loaded (vLLM asks `has_cache_item`; the scheduler pins the entry
  from that question until the request finishes, so it cannot vanish before the worker loads it);
- an item no process computes is reserved here, handed to the worker with the step's metadata
  (the worker adopts it and commits its encoder output), and let go once adopted; one vLLM does
  not allocate in that step (it had the item in its own encoder cache, or did not schedule the
  request) is given back when the step's metadata is built;
- an item another process is computing defers the request (False) until it is sealed; a request
  that is deferred gives back the reservations it took, so two engines never wait on each other.
An engine that does not store (`ec_consumer`) reserves nothing and takes no cross-node lease: it
loads what is sealed (or pulled from the store), waits for what another process or another node
(its lease) computes, and computes the rest for itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from shmcache.integrations.vllm.metadata import LoadItem, SaveItem, ShmCacheECMetadata
from shmcache.integrations.vllm.settings import KeyMaker
from shmcache.keys.key import EmbeddingCacheKey
from shmcache.process.cache import EmbeddingCache
from shmcache.process.reservation import Reservation

__all__ = ["SchedulerSide"]

log = logging.getLogger("shmcache")


@dataclass
class _Step:
    """What the scheduler decided since the last `build_connector_meta`."""

    loads: list[LoadItem] = field(default_factory=list)
    saves: list[SaveItem] = field(default_factory=list)
    checked: set[str] = field(default_factory=set)  # held by has_cache_item for this step


class SchedulerSide:
    """Scheduler-side state of one engine's connector."""

    def __init__(self, cache: EmbeddingCache, keys: KeyMaker, *, stores: bool = True) -> None:
        self._cache, self._keys, self._stores = cache, keys, stores
        self._step = _Step()
        self._steps = 0
        self._reserved: dict[str, Reservation] = {}  # identifier -> ours, not yet handed over
        self._owners: dict[str, str] = {}  # identifier -> the request it was reserved for
        self._handed: list[tuple[str, Reservation]] = []  # (request, reservation) to let go once adopted
        self._modalities: dict[str, str] = {}

    def key(self, identifier: str) -> EmbeddingCacheKey:
        return self._keys(identifier, self._modalities.get(identifier, "image"))

    @property
    def _step_holder(self) -> str:
        """The request id under which this step's `has_item` answers hold their entries."""
        return f"shmcache-connector-step-{self._steps}"

    def has_item(self, identifier: str) -> bool:
        """Sealed on the node: hold it (a reference, no view) until this step's metadata is built,
        so the load vLLM plans on this answer finds it."""
        if identifier in self._step.checked:
            return True
        if not self._cache.hold(self.key(identifier), self._step_holder):
            return False
        self._step.checked.add(identifier)
        return True

    def ensure(self, request: Any, num_computed_tokens: int) -> bool:
        """True if every item of `request` still to encode is sealed, ours, or now reserved by
        us; False (nothing held for it) if another process, or another node, computes one of
        them. The node misses (each distinct item once) are claimed in one call, which with a
        remote store configured pulls those the store has (one batch; the item is then sealed on
        the node, and held for this step like a `has_item` answer) and takes the cross-node lease
        of the rest. An engine that does not store takes no lease and gives its claims straight
        back: it computes those items alone, and nobody waits for it."""
        todo: dict[str, None] = {}  # the distinct items to claim, in order
        for feature in request.mm_features:
            if feature.mm_position.offset + feature.mm_position.length <= num_computed_tokens:
                continue
            identifier = feature.identifier
            self._modalities[identifier] = feature.modality
            if identifier not in self._reserved and not self._cache.contains(self.key(identifier)):
                todo[identifier] = None
        if not todo:
            return True
        wanted = [self.key(i) for i in todo]  # an engine that does not store takes no cross-node lease
        claims = dict(zip(todo, self._cache.try_reserve_many(wanted, lease=self._stores), strict=True))
        owned = {identifier: res for identifier, res in claims.items() if res is not None and res.owned}
        deferred = any(res is None for res in claims.values())  # another computes one: wait for it
        if deferred or not self._stores:  # holding nothing; an engine that does not store computes alone
            for mine in owned.values():
                mine.withdraw()
            owned = {}
        if deferred:
            return False
        for identifier, mine in owned.items():
            self._reserved[identifier] = mine
            self._owners[identifier] = request.request_id
        for identifier, res in claims.items():
            if res is not None and res.value is not None:  # pulled: held until this step's loads are planned
                self.has_item(identifier)
        return True

    def after_alloc(self, request: Any, index: int) -> None:
        """vLLM allocated item `index` of `request`: plan its load, or hand its reservation over."""
        feature = request.mm_features[index]
        identifier = feature.identifier
        self._modalities[identifier] = feature.modality
        key = self.key(identifier)
        res = self._reserved.pop(identifier, None)
        if res is not None:
            self._owners.pop(identifier, None)
            self._step.saves.append(SaveItem(identifier, key, res.hand_over()))
            self._handed.append((request.request_id, res))
        elif identifier in self._step.checked and self._cache.hold(key, request.request_id):
            self._step.loads.append(LoadItem(identifier, key))  # held until the request finishes
        else:
            self._step.saves.append(SaveItem(identifier, key, None))

    def build(self) -> ShmCacheECMetadata:
        """This step's metadata; lets go of reservations the worker adopted, and gives back the
        ones vLLM did not allocate in this step (an item it found in its own encoder cache, a
        request it did not schedule): the next `ensure` reserves them again. Kept, they held their
        keys for every engine of the node until the request finished, and were never stored."""
        self._give_back(list(self._reserved))
        step, self._step = self._step, _Step()
        self._cache.cleanup_request(self._step_holder)
        self._steps += 1
        self._handed = [(owner, res) for owner, res in self._handed if not res.let_go()]
        return ShmCacheECMetadata(step.loads, step.saves)

    def finished(self, request: Any) -> None:
        """Release what `request` held: its references, and its reservations. One handed over and
        never adopted (the worker died inside the adoption, say) ends here; one adopted is only let
        go (`withdraw` is fenced: it frees nothing that is not ours any more)."""
        self._cache.cleanup_request(request.request_id)
        mine = [identifier for identifier, owner in self._owners.items() if owner == request.request_id]
        self._give_back(mine)
        for owner, res in self._handed:
            if owner == request.request_id:
                res.withdraw()
        self._handed = [(owner, res) for owner, res in self._handed if owner != request.request_id]

    def _give_back(self, identifiers: list[str]) -> None:
        for identifier in identifiers:
            res = self._reserved.pop(identifier, None)
            self._owners.pop(identifier, None)
            if res is not None:
                res.withdraw()

    def close(self) -> None:
        """Give back every reservation this engine still holds (handed over or not)."""
        for res in [*self._reserved.values(), *(res for _owner, res in self._handed)]:
            res.withdraw()
        self._reserved.clear()
        self._handed.clear()
