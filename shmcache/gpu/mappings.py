"""`DeviceMappings`: the CUDA IPC handles this process has open, shared by every view into them."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from shmcache.errors import CudaError
from shmcache.gpu.driver import CudaDriver
from shmcache.node.clients import ClientIdentity

__all__ = ["DeviceMappings"]

log = logging.getLogger("shmcache")


@dataclass
class _Opened:
    """One open handle: its base address, its device, and how many views hold it."""

    base: int
    ordinal: int
    views: int = 0


class DeviceMappings:
    """The IPC handles this process has open, each (exporter, handle) once, shared by every live
    view into that allocation. A mapping is closed at the end of its last view, as torch does:
    CUDA leaves it undefined what an open mapping does once its exporter frees the memory (a
    caching allocator's `empty_cache`, say), so none is kept open idle."""

    def __init__(self, driver: CudaDriver) -> None:
        self._driver = driver
        self._opened: dict[tuple[ClientIdentity, bytes], _Opened] = {}
        self._lock = threading.Lock()

    def acquire(self, exporter: ClientIdentity, handle: bytes, ordinal: int) -> int:
        """The base address of `handle` (opened now if no view holds it), counted as one more view."""
        with self._lock:
            opened = self._opened.get((exporter, handle))
            if opened is None:
                opened = _Opened(self._driver.open(handle, ordinal), ordinal)
                self._opened[(exporter, handle)] = opened
            opened.views += 1
            return opened.base

    def release(self, exporter: ClientIdentity, handle: bytes) -> None:
        """One view of the mapping is gone; the last one closes it."""
        with self._lock:
            opened = self._opened[(exporter, handle)]
            opened.views -= 1
            if opened.views == 0:
                del self._opened[(exporter, handle)]
                self._close(opened)

    def views(self, exporter: ClientIdentity, handle: bytes) -> int:
        """How many views hold the mapping of (exporter, handle) (0: it is not open)."""
        with self._lock:
            opened = self._opened.get((exporter, handle))
            return 0 if opened is None else opened.views

    def __len__(self) -> int:
        """How many mappings are open."""
        with self._lock:
            return len(self._opened)

    def _close(self, opened: _Opened) -> None:
        try:
            self._driver.close(opened.base, opened.ordinal)
        except CudaError as exc:  # the exporter's context is gone: nothing left to unmap
            log.debug("shmcache: closing an IPC mapping failed: %s", exc)
