"""A real Mooncake master on loopback, for tests and benchmarks of the remote layer.

The pytest plugin's `shmcache_mooncake` fixture wraps it (and skips when `missing()` says why it
cannot run); tools/bench.py and tools/bench_remote.py start one per run.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from shmcache.errors import InvalidConfig
from shmcache.remote.connection import free_port

__all__ = ["MooncakeHolder", "MooncakeMaster"]


class MooncakeMaster:
    """A real `mooncake_master` bound to 127.0.0.1 on free ports (never the HTTP metadata server)."""

    def __init__(self, timeout: float = 20.0, attempts: int = 3, client_ttl_s: int | None = None) -> None:
        """Start it; `client_ttl_s`: how long after a client's last heartbeat the master unmounts
        its segment (Mooncake's default: 10 s)."""
        if client_ttl_s is not None and (type(client_ttl_s) is not int or client_ttl_s < 1):
            raise InvalidConfig(f"client_ttl_s must be a whole number of seconds >= 1, got {client_ttl_s!r}")
        self._ttl = [] if client_ttl_s is None else [f"--client_ttl={client_ttl_s}"]
        for attempt in range(attempts):
            self.port, self._metrics = free_port(), free_port()
            self.address = f"127.0.0.1:{self.port}"
            try:
                self.process = self._start(timeout)
                return
            except RuntimeError:
                if attempt == attempts - 1:
                    raise  # else: another process took a port between free_port() and the bind

    def _start(self, timeout: float) -> subprocess.Popen[bytes]:
        """Start the master and wait until its admin endpoint says it serves (a listening RPC port
        alone is not enough: it accepts before the master is ready, and a master whose metrics
        port was taken exits right after)."""
        with tempfile.TemporaryFile() as log:
            process = subprocess.Popen(
                [
                    self.binary(),
                    f"--rpc_port={self.port}",
                    "--rpc_address=127.0.0.1",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={self._metrics}",
                    *self._ttl,
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
            deadline = time.monotonic() + timeout
            while not self._serving():
                if process.poll() is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
                    raise RuntimeError(f"mooncake_master on {self.address} exited: {tail}")
                if time.monotonic() > deadline:
                    process.kill()
                    process.wait(10)
                    raise RuntimeError(f"mooncake_master did not start on {self.address}")
                time.sleep(0.05)
        return process

    def _serving(self) -> bool:
        """The master answers on both ports and reports itself ready."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                pass
            url = f"http://127.0.0.1:{self._metrics}/health"
            with urllib.request.urlopen(url, timeout=1) as answer:
                return json.load(answer).get("service_ready") is True
        except (OSError, ValueError):
            return False

    def restart(self, timeout: float = 20.0) -> None:
        """Start a new master on the same ports (after `kill`): as an operator's restart would. It
        starts empty: Mooncake's master keeps no keys across a restart."""
        self.kill()
        self.process = self._start(timeout)

    @staticmethod
    def binary() -> str:
        found = shutil.which("mooncake_master") or os.path.join(
            os.path.dirname(sys.executable), "mooncake_master"
        )
        return found

    @classmethod
    def missing(cls) -> str | None:
        """Why Mooncake cannot run here (None if it can)."""
        try:
            import mooncake.store  # noqa: F401
        except ImportError as exc:
            return (
                f"`import mooncake.store` failed ({exc}); pip install 'shmcache[mooncake]' and apt-get "
                "install libibverbs1 librdmacm1 libnuma1"
            )
        if not os.access(cls.binary(), os.X_OK):
            return "the mooncake_master program is not installed"
        return None

    def kill(self) -> None:
        """SIGKILL the master (as a crash would) and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


class MooncakeHolder:
    """A real node store holder (`mooncake_client`, as `shmcache remote-holder` runs it) on a free
    127.0.0.1 port (or `port`), mounting `segment` of the store of `master`."""

    def __init__(
        self, master: MooncakeMaster, segment: str = "128 MB", timeout: float = 20.0, port: int = 0
    ) -> None:
        from shmcache.remote.holder import holder_command

        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        command = holder_command(master.address, port=self.port, segment=segment)
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"mooncake_client did not start on {self.address}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the holder and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
