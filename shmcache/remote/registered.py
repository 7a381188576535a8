"""Node memory registered with one process's Mooncake client: transfers land in it, or leave
from it, without a copy. A thin client of the node's holder registers none (its transfers pass
through the holder's pool: staging.py)."""

from __future__ import annotations

from typing import Any

__all__ = ["NodeMemory"]


class NodeMemory:
    """The ranges (address, nbytes) of node memory asked to be registered, and those registered."""

    def __init__(self, *, thin: bool) -> None:
        self._thin = thin
        self._wanted: set[tuple[int, int]] = set()  # registered once a client is set up
        self._registered: set[tuple[int, int]] = set()

    def register(self, address: int, nbytes: int, client: Any) -> None:
        """Register a range with `client` (once; None: not set up yet, `ready` registers it)."""
        self._wanted.add((address, nbytes))
        fresh = client is not None and not self._thin and (address, nbytes) not in self._registered
        if fresh and client.register_buffer(address, nbytes) == 0:
            self._registered.add((address, nbytes))

    def ready(self, client: Any) -> None:
        """A client was set up: register with it every range asked for."""
        for address, nbytes in list(self._wanted):
            self.register(address, nbytes, client)

    def covers(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies in a registered range."""
        return any(
            start <= address and address + nbytes <= start + length for start, length in self._registered
        )
