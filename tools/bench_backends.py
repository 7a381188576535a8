"""The alternatives tools/bench.py compares: one client per system (what a worker calls per request)
and the servers some of them need (redis-server, a Mooncake master), started on 127.0.0.1.

Clients import their libraries when built, in the spawned worker that uses them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "WIDTH",
    "Client",
    "Lru",
    "Memcpy",
    "MooncakeAlone",
    "NoCache",
    "RayPlasma",
    "Redis",
    "Shmcache",
    "client_for",
    "start_servers",
]

WIDTH = 256  # the encoder's output width (float32): rows = size / (4 * WIDTH)


class Client:
    """What a worker calls per request: returns (value, computed)."""

    def get(self, index: int, compute: Any) -> tuple[Any, bool]:
        raise NotImplementedError

    def node_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class NoCache(Client):
    def get(self, index: int, compute: Any) -> tuple[Any, bool]:
        return compute(), True


class Lru(Client):
    """The RFC's design: a plain in-process LRU in each process."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self.entries: OrderedDict[int, Any] = OrderedDict()

    def get(self, index: int, compute: Any) -> tuple[Any, bool]:
        if index in self.entries:
            self.entries.move_to_end(index)
            return self.entries[index], False
        value = compute()
        self.entries[index] = value
        self.used += value.nbytes
        while self.used > self.capacity and self.entries:
            _, old = self.entries.popitem(last=False)
            self.used -= old.nbytes
        return value, True

    def node_bytes(self) -> int:
        return self.used


class Redis(Client):
    def __init__(self, port: int) -> None:
        import redis

        self.client = redis.Redis(host="127.0.0.1", port=port)

    def get(self, index: int, compute: Any) -> tuple[Any, bool]:
        import torch

        raw = self.client.get(f"emb:{index}")
        if isinstance(raw, bytes):  # a copy into this process, as every Redis client makes
            return torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(-1, WIDTH), False
        value = compute()
        self.client.set(f"emb:{index}", value.numpy().tobytes(), nx=True)
        return value, True

    def node_bytes(self) -> int:
        return int(self.client.info("memory")["used_memory"])


class MooncakeAlone(Client):
    def __init__(self, master: str) -> None:
        from shmcache import CacheConfig
        from shmcache.remote.store import RemoteStore

        self.store = RemoteStore(
            CacheConfig(
                remote_master=master,
                remote_segment_bytes=512 << 20,
                remote_buffer_bytes=16 << 20,
                remote_publish_queue=1,
                store_unavailable_mode="strict",
            ),
            lambda counter, n: None,
        )
        self.prefix = "bench-mooncake-alone"
        self.stored = 0

    def get(self, index: int, compute: Any) -> tuple[Any, bool]:
        import torch

        name = f"{self.prefix}@{index}"
        size = self.store.size_of(name)
        if size is not None:
            fetched = self.store.fetch(name, size)
            if fetched is not None:
                return torch.from_numpy(fetched.copy().view(np.float32)).reshape(-1, WIDTH), False
        value = compute()
        array = value.numpy()
        self.store.register(array.ctypes.data, array.nbytes)
        assert self.store._client is not None
        if self.store._client.put_from(name, array.ctypes.data, array.nbytes) == 0:
            self.stored += array.nbytes
        return value, True

    def node_bytes(self) -> int:
        return self.stored  # the copies this process placed in the store

    def close(self) -> None:
        self.store.close()


RAY_NAMESPACE = "shmcache-bench"
# nothing leaves the machine: no usage stats, and every Ray server binds 127.0.0.1 and names it as
# the node's address (Ray's single-machine mode, its default off Linux) instead of eth0's
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class RayPlasma(Client):
    """Ray's object store (plasma, in the raylet), the trusted node-local shared-memory store: a
    value computed by a process is handed to a named directory actor, which puts it in the store
    and so owns it (it outlives that process), and the others find it there (Ray has no
    content-addressed lookup of its own); a process remembers the references it learned, so a
    hit is one `ray.get`: a read-only numpy array over the store's shared memory (zero-copy), as
    a tensor. (A value under Ray's inline limit, 100 KiB, is kept by its owner, the actor, not in
    the shared store: that `ray.get` copies it from the actor.)"""

    def __init__(self, address: str) -> None:
        import logging
        import warnings

        os.environ.update(RAY_ENV)  # before Ray reads its settings, at its import
        import ray

        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        ray.init(address=address, namespace=RAY_NAMESPACE, logging_level=logging.ERROR, log_to_driver=False)
        self.ray: Any = ray  # (untyped for mypy: its remote handles are made at run time)
        actor: Any = ray.remote(num_cpus=0)(_RayDirectory)
        self.directory = actor.options(name="directory", lifetime="detached", get_if_exists=True).remote()
        self.refs: dict[int, Any] = {}

    def get(self, index: int, compute: Any) -> tuple[Any, bool]:
        import torch

        ref = self.refs.get(index)
        if ref is None:
            found = self.ray.get(self.directory.lookup.remote(index))
            if found is not None:
                ref = self.refs[index] = found[0]
        if ref is not None:
            return torch.from_numpy(self.ray.get(ref)), False
        value = compute()
        self.ray.get(self.directory.store.remote(index, value.numpy()))  # put there: it owns it
        return value, True

    def node_bytes(self) -> int:
        return int(self.ray.get(self.directory.stored.remote()))

    def close(self) -> None:
        self.ray.shutdown()


class _RayDirectory:
    """The named actor that puts each input's value in Ray's store (the first one handed to it),
    owns it, answers its reference, and counts the bytes stored."""

    def __init__(self) -> None:
        self.refs: dict[int, list[Any]] = {}
        self.bytes = 0

    def store(self, index: int, value: np.ndarray) -> None:
        """Put `value` in Ray's store, owned by this actor: it outlives the process that computed
        it (an object dies with its owner)."""
        import ray

        if index not in self.refs:
            self.refs[index], self.bytes = [ray.put(value)], self.bytes + value.nbytes  # a list: not resolved

    def lookup(self, index: int) -> list[Any] | None:
        return self.refs.get(index)

    def stored(self) -> int:
        return self.bytes


class RayHead:
    """A Ray head node on 127.0.0.1 (GCS, raylet with its plasma store, their agents; no
    dashboard, no usage stats), with the `poll`/`send_signal`/`wait` of the server processes
    tools/bench stops. `ray start` returns once its daemons run; they and every worker they start
    stay in the session it was started in, which the stop kills whole."""

    def __init__(self, binary: Path, object_store_bytes: int) -> None:
        self.port, self.stopped = _free_port(), False
        self.signum: int = signal.SIGKILL  # what the stop sends
        self.temp = tempfile.mkdtemp(prefix="ray-")  # its session's files, removed by the stop
        log = Path(self.temp, "start.log")  # not a pipe: the daemons inherit its descriptor
        with log.open("w") as output:
            start = subprocess.Popen(
                [
                    binary, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.port}",
                    f"--ray-client-server-port={_free_port()}",
                    f"--dashboard-agent-listen-port={_free_port()}",
                    "--include-dashboard=false", "--disable-usage-stats", "--num-cpus=1",
                    f"--object-store-memory={object_store_bytes}", f"--temp-dir={self.temp}",
                ],
                env={**os.environ, **RAY_ENV}, start_new_session=True, stdout=output, stderr=output,
            )  # fmt: skip
        self.session = start.pid
        if start.wait() != 0:
            error = log.read_text()[-2000:]
            self.send_signal(signal.SIGKILL)
            self.wait()
            raise RuntimeError(f"ray start failed: {error}")
        self.address = f"127.0.0.1:{self.port}"

    def poll(self) -> int | None:
        return 0 if self.stopped else None

    def send_signal(self, signum: int) -> None:
        """Send `signum` to every process of the head's session (`wait` sends it again to any
        started meanwhile)."""
        self.signum, self.stopped = signum, True
        for pid in _session(self.session):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def wait(self, timeout: float = 30.0) -> int:
        """Once the session has no live process left (zombies are their parents' to reap), remove
        its files; until then signal what is left again."""
        deadline = time.monotonic() + timeout
        while left := _session(self.session):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray's processes {left} outlived the stop")
            time.sleep(0.05)
            self.send_signal(self.signum)
        shutil.rmtree(self.temp, ignore_errors=True)
        return 0


def _session(sid: int) -> list[int]:
    """The live processes of session `sid` (field 6 of /proc/PID/stat; zombies left out)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


class Shmcache(Client):
    def __init__(self, config: Any) -> None:
        from shmcache import EmbeddingCache

        self.cache = EmbeddingCache(config)

    def get(self, index: int, compute: Any) -> tuple[Any, bool]:
        from tools.benchkit import key

        computed = []

        def run() -> Any:
            computed.append(1)
            return compute()

        return self.cache.get_or_compute(key(f"bench-{index}"), run), bool(computed)

    def node_bytes(self) -> int:
        return int(self.cache.stats()["bytes"])

    def close(self) -> None:
        self.cache.close()


class Memcpy(Client):
    """The floor for any copying cache: a hit costs one memcpy of the value."""

    def __init__(self) -> None:
        self.values: dict[int, Any] = {}

    def get(self, index: int, compute: Any) -> tuple[Any, bool]:
        import torch

        if index in self.values:
            source = self.values[index]
            out = torch.empty_like(source)
            out.copy_(source)
            return out, False
        self.values[index] = compute()
        return self.values[index], True

    def node_bytes(self) -> int:
        return sum(v.nbytes for v in self.values.values())


def client_for(system: str, setup: dict[str, Any]) -> Client:
    """The client of `system`, built from what `start_servers` (and the caller) put in `setup`."""
    if system == "none":
        return NoCache()
    if system == "lru":
        return Lru(setup["lru_bytes"])
    if system == "redis":
        return Redis(setup["redis_port"])
    if system == "mooncake":
        return MooncakeAlone(setup["master"])
    if system == "ray":
        return RayPlasma(setup["ray_address"])
    if system in ("shmcache", "shmcache+remote"):
        return Shmcache(setup["config"])
    return Memcpy()


def start_servers(system: str, setup: dict[str, Any], servers: list[Any]) -> bool:
    """Start the servers `system` needs on 127.0.0.1, appending their processes to `servers` (the
    caller kills them) and their addresses to `setup`; False if one is not installed here."""
    if system == "redis":
        binary = shutil.which("redis-server")
        if binary is None:
            return False
        port = _free_port()
        servers.append(
            subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        setup["redis_port"] = port
        _wait_for_port(port)
    if system == "ray":
        ray_binary = Path(sys.executable).parent / "ray"  # the console script beside this Python
        if importlib.util.find_spec("ray") is None or not ray_binary.exists():
            return False
        head = RayHead(ray_binary, max(setup["lru_bytes"], 128 << 20))
        servers.append(head)
        setup["ray_address"] = head.address
    if system in ("mooncake", "shmcache+remote"):
        from shmcache.testing import MooncakeMaster

        if MooncakeMaster.missing():
            return False
        master = MooncakeMaster()
        servers.append(master.process)
        setup["master"] = master.address
    return True


def _wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.05)


def _free_port() -> int:
    from shmcache.remote.connection import free_port

    return free_port()
