"""Setting one process's Mooncake client up without stalling the process.

Mooncake's `setup` (a thin client's `setup_dummy`) holds the GIL while it runs: ~1 s against a
master that answers, ~4.3 s against a closed port (it retries), up to 30 s against one that
accepts connections but does not answer (a stopped process). Every thread of the process stands
still meanwhile (measured: with the master down at open, the outage prober's retries froze the
process for 22 s of 30). So a set-up is tried only after cheaper answers:

- a TCP connect to the address the set-up talks to (the master, or the node's holder), then a few
  bytes that are no RPC request, each bounded by `remote_timeout_s` and without the GIL. A closed
  port or a silent host fails the connect in milliseconds. Mooncake's RPC server (coro_rpc)
  closes a connection whose first byte is not its header's magic, at once (0.2 to 0.5 ms measured,
  master and holder alike); a stopped or hung process accepts the connection (the kernel does)
  but never closes it, so silence for `remote_timeout_s` tells it apart. Before this answer was
  asked for, such a master cost the open Mooncake's 30 s;
- the outage prober (`health.py`) then runs the very same set-up in a child process, killed after
  `CHILD_SETUP_S` or when the store closes, and sets this process's client up only once the
  child's set-up succeeded;
- the open skips the child (it would add a set-up's ~1 s to every open). A master that answers the
  probe and stops answering right after (stopped between the two) still costs the open, or the
  prober's set-up after its child's, one stall of up to 30 s.

A set-up that finishes after `close` (the prober's, while the store closes) closes the client it
made instead of handing it over. One whose health check fails (the master died right after the
set-up) leaves its client to process exit (`leave_to_exit`): closing it unmounted the segment from
the dead master, and the open took 6.2 to 11.4 s instead of 0.24 s (tested).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from shmcache.config import CacheConfig
from shmcache.remote.staging import Staging

__all__ = ["Connection", "free_port", "leave_to_exit"]

log = logging.getLogger("shmcache")

PROBE_BUFFER: Final = 1 << 20  # a thin client's local buffer: the recovery probe's 1-byte put
CHILD_SETUP_S: Final = 60.0  # the child's set-up is killed after this (Mooncake's own wait is 30 s)
POLL_S: Final = 0.05  # how often a running child is looked at (its end, or our close)
NOT_A_REQUEST: Final = bytes(32)  # the probe's bytes: 0 is not coro_rpc's magic, so it closes at once

# The child: the same set-up as `_set_up`'s, with no segment and no buffer of its own; exit 0 if
# it succeeded. argv: "master" local_host:port protocol master, or "holder" buffer_bytes
# probe_buffer holder.
_CHILD: Final = """
import sys
from mooncake.store import MooncakeDistributedStore
client, args = MooncakeDistributedStore(), sys.argv[1:]
if args[0] == "holder":
    ok = client.setup_dummy(int(args[1]), int(args[2]), args[3]) == 0
else:
    ok = client.setup(args[1], "P2PHANDSHAKE", 0, 0, args[2], "", args[3]) == 0 and client.health_check() == 0
client.close()
sys.exit(0 if ok else 1)
"""


_LEFT_TO_EXIT: list[tuple[Any, Staging | None]] = []  # clients left unclosed, until the exit


def leave_to_exit(client: Any, staging: Staging | None, why: str) -> bool:
    """Keep `client` unclosed until the process exits (False), its segment's memory with it (on
    a master restart Mooncake mounts it again: it serves what is placed there until the exit).
    Held, not just dropped: its destructor unmounts over RPC (6.6 s and more against a dead
    master, the GIL held), which would stall the process wherever a garbage collection freed it.
    Its `staging` too: a transfer that outlived its wait may still write into a lent pull
    buffer, which must not be freed (and its memory handed out again) under it."""
    log.debug("shmcache: %s; the client is left to process exit", why)
    _LEFT_TO_EXIT.append((client, staging))
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now; 0 if `host` is not an address of this machine."""
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError:
            return 0
        return int(s.getsockname()[1])


class Connection:
    """The set-up of one process's Mooncake client; `ready(client)` receives it once set up."""

    def __init__(self, config: CacheConfig, ready: Callable[[Any], None]) -> None:
        self._config, self._ready = config, ready
        holder = config.remote_holder
        self._target = (
            f"the node's Mooncake client {holder}" if holder else f"Mooncake master {config.remote_master}"
        )
        self._address = holder or config.remote_master or ""
        self._lock = threading.Lock()
        self._closed = False

    def connect(self, *, child_first: bool) -> str | None:
        """Set the client up: None once `ready` was called, else why not. With `child_first`
        (the prober), only after the same set-up succeeded in a child process."""
        why = self._refused()
        if why is None and child_first:
            why = self._child_fails()
        if why is None and self._closed:  # closed while the child ran: no set-up in this process
            why = "the remote layer closed"
        return why if why is not None else self._set_up()

    def close(self) -> None:
        """No client is handed over from now on: a set-up finishing later closes its own."""
        with self._lock:
            self._closed = True

    def _refused(self) -> str | None:
        """Why the set-up's address does not answer (a TCP connection, then `NOT_A_REQUEST`: its
        close, a reset or any bytes are an answer) within `remote_timeout_s` each, or None."""
        host, _, port = self._address.rpartition(":")
        timeout = self._config.remote_timeout_s
        try:
            probe = socket.create_connection((host, int(port)), timeout=timeout)
        except (OSError, ValueError) as exc:
            return f"{self._target} does not accept connections ({exc})"
        with probe:
            try:
                probe.sendall(NOT_A_REQUEST)
                probe.recv(1)
            except TimeoutError:
                return f"{self._target} accepted a connection but did not answer in {timeout} s"
            except OSError:  # reset: a running process answered
                pass
        return None

    def _child_fails(self) -> str | None:
        """Why the same set-up failed in a child process, or None if it succeeded."""
        config = self._config
        if config.remote_holder is not None:
            args = ["holder", str(config.remote_buffer_bytes), str(PROBE_BUFFER), config.remote_holder]
        else:
            port = free_port(config.remote_local_host)
            args = ["master", f"{config.remote_local_host}:{port}", config.remote_protocol, self._address]
        try:
            child = subprocess.Popen(
                [sys.executable, "-c", _CHILD, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        except OSError:  # no Python to run it with (an embedded interpreter): set up here, as before
            return None
        deadline = time.monotonic() + CHILD_SETUP_S
        try:
            while child.poll() is None:
                if self._closed:
                    return "the remote layer closed"
                if time.monotonic() > deadline:
                    return f"{self._target} did not answer a set-up in {CHILD_SETUP_S} s"
                time.sleep(POLL_S)
        finally:
            if child.poll() is None:  # closing, or it ran out of time: it goes with us
                child.kill()
                child.wait()
        return None if child.returncode == 0 else f"{self._target} refused a set-up"

    def _set_up(self) -> str | None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            return f"the mooncake package is not importable ({exc})"
        config, holder = self._config, self._config.remote_holder
        port = free_port(config.remote_local_host) if holder is None else 0  # a thin client has no segment
        if holder is None and not port:
            return f"remote_local_host {config.remote_local_host} is not an address of this machine"
        client = MooncakeDistributedStore()
        if holder is not None:  # a thin client of the node's mooncake_client
            rc = client.setup_dummy(config.remote_buffer_bytes, PROBE_BUFFER, holder)
        else:
            rc = client.setup(
                f"{config.remote_local_host}:{port}",
                "P2PHANDSHAKE",
                config.remote_segment_bytes,
                config.remote_buffer_bytes,
                config.remote_protocol,
                "",
                config.remote_master,
            )
        if rc != 0:  # nothing to unmount
            client.close()
            return f"{self._target} is unreachable (setup rc {rc})"
        if holder is None and client.health_check() != 0:  # a thin client has none
            leave_to_exit(client, None, "the Mooncake master stopped answering after the set-up")
            return f"{self._target} stopped answering after the set-up"
        with self._lock:
            if self._closed:
                client.close()
                return "the remote layer closed during the set-up"
            self._ready(client)
        return None
