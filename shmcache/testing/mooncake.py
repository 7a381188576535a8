"""A real Mooncake master on loopback, for tests and benchmarks of the remote layer.

The pytest plugin's `shmcache_mooncake` fixture wraps it (and skips when `missing()` says why it
cannot run); tools/bench.py and tools/bench_remote.py start one per run.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

from shmcache.remote.store import free_port

__all__ = ["MooncakeHolder", "MooncakeMaster"]


class MooncakeMaster:
    """A real `mooncake_master` bound to 127.0.0.1 on free ports (never the HTTP metadata server)."""

    def __init__(self, timeout: float = 20.0) -> None:
        self.port, self._metrics = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.process = self._start(timeout)

    def _start(self, timeout: float) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [
                self.binary(),
                f"--rpc_port={self.port}",
                "--rpc_address=127.0.0.1",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self._metrics}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return process
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    if process.poll() is None:
                        process.kill()
                    process.wait(10)
                    raise RuntimeError(f"mooncake_master did not start on {self.address}") from None
                time.sleep(0.05)

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
    127.0.0.1 port, mounting `segment` of the store of `master`."""

    def __init__(self, master: MooncakeMaster, segment: str = "128 MB", timeout: float = 20.0) -> None:
        from shmcache.remote.holder import holder_command

        self.port = free_port()
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
