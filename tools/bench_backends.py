"""The alternatives tools/bench.py compares: one client per system (what a worker calls per request)
and the servers some of them need (redis-server, a Mooncake master), started on 127.0.0.1.

Clients import their libraries when built, in the spawned worker that uses them.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = [
    "WIDTH",
    "Client",
    "Lru",
    "Memcpy",
    "MooncakeAlone",
    "NoCache",
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
