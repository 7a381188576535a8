"""Whether the remote store answers: up, or down since an outage began.

An outage begins at the first call that finds the master gone (`RPC_FAIL`, an RPC timeout, or no
answer within `remote_timeout_s`). It is counted (`remote_outages`) and warned once; while it
lasts every remote call returns "not available" at once, without touching Mooncake, so no
request waits on a dead master. A background thread probes with backoff (0.25 s doubling to 5 s)
and ends the outage at the first probe that succeeds; Mooncake's client remounts its segment on
a restarted master by itself (~1 s), so the same client carries on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from shmcache.node.layout import Counter

__all__ = ["Health"]

log = logging.getLogger("shmcache")

FIRST_PROBE_S: Final = 0.25
MAX_PROBE_S: Final = 5.0


class Health:
    """The up/down state of one process's link to the store, and its prober."""

    def __init__(self, master: str, probe: Callable[[], bool], count: Callable[[Counter, int], None]) -> None:
        self._master, self._probe, self._count = master, probe, count
        self._up = True
        self._since = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None

    @property
    def up(self) -> bool:
        return self._up

    def down(self, why: str) -> None:
        """An outage begins (if none is running): counted, warned once, probed until it ends
        (once closing, only marked: the store's last steps skip a master that does not answer)."""
        with self._lock:
            if not self._up:
                return
            self._up, self._since = False, time.monotonic()
            if self._stop.is_set():
                return
            self._prober = threading.Thread(target=self._recover, name="shmcache-remote-probe", daemon=True)
            self._prober.start()
        self._count(Counter.REMOTE_OUTAGES, 1)
        log.warning(
            "shmcache: remote store %s unavailable, node-local only until it answers again: %s",
            self._master,
            why,
        )

    def _recover(self) -> None:
        delay = FIRST_PROBE_S
        while not self._stop.wait(delay):
            try:
                answered = self._probe()
            except Exception:  # a probe must never kill its thread
                answered = False
            if answered:
                with self._lock:
                    self._up = True
                log.warning(
                    "shmcache: remote store %s answers again after %.1f s",
                    self._master,
                    time.monotonic() - self._since,
                )
                return
            delay = min(delay * 2, MAX_PROBE_S)

    def close(self) -> None:
        """Stop probing (the store is closing)."""
        self._stop.set()
        prober = self._prober
        if prober is not None:
            prober.join(MAX_PROBE_S + 1)
