"""Request references: which entries each request of this process holds, for `cleanup_request`."""

from __future__ import annotations

import threading
from collections.abc import Callable

from shmcache.process.reservation import RequestId

__all__ = ["RequestRefs"]


class RequestRefs:
    """request id -> the (slot, gen) of every reference taken for it (one item per reference)."""

    def __init__(self) -> None:
        self._refs: dict[RequestId, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def add(self, request_id: RequestId, slot: int, gen: int) -> None:
        """Remember one reference on (slot, gen) for `request_id` (taken by the caller)."""
        with self._lock:
            self._refs.setdefault(request_id, []).append((slot, gen))

    def pop(self, request_id: RequestId) -> list[tuple[int, int]]:
        """Forget `request_id`; its references, for the caller to release."""
        with self._lock:
            return self._refs.pop(request_id, [])

    def release(self, request_id: RequestId, release: Callable[[list[tuple[int, int]]], None]) -> int:
        """`release` the references of `request_id` and forget them; how many. If it raises, the
        references it lists as `unreleased` (`NodeIndex.release`) stay the request's."""
        refs = self.pop(request_id)
        try:
            release(refs)
        except BaseException as exc:
            unreleased = getattr(exc, "unreleased", [])
            if unreleased:
                with self._lock:
                    self._refs.setdefault(request_id, []).extend(unreleased)
            raise
        return len(refs)

    def ids(self) -> list[RequestId]:
        with self._lock:
            return list(self._refs)
