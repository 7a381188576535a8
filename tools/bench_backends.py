"""The alternatives tools/bench.py compares: one client per system (what a worker calls per request)
and the servers some of them need (redis-server, a Mooncake master, a Ray head node), started on
127.0.0.1.

Clients import their libraries when built, in the spawned worker that uses them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
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
    "RayPlasma",
    "Redis",
    "Shmcache",
    "client_for",
    "plasma_hits",
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


class RayPlasma(Client):
    """Ray's object store (plasma): values put once, found by key through a named directory actor
    (Ray addresses objects by reference, not by key), read zero-copy from shared memory."""

    def __init__(self, address: str) -> None:
        import ray

        ray.init(address=address, namespace="shmcache-bench", logging_level="ERROR", log_to_driver=False)

        class Directory:
            def __init__(self) -> None:
                self.refs: dict[int, list[Any]] = {}

            def find(self, index: int) -> list[Any] | None:
                return self.refs.get(index)

            def add(self, index: int, ref: list[Any]) -> None:
                self.refs.setdefault(index, ref)  # the first writer wins

        self.ray = ray
        actor: Any = ray.remote(num_cpus=0)(Directory)
        self.directory = actor.options(name="directory", get_if_exists=True, lifetime="detached").remote()
        self.owned: list[Any] = []  # objects this process put: it owns them, they live while it does
        self.stored = 0

    def get(self, index: int, compute: Any) -> tuple[Any, bool]:
        import torch

        found = self.ray.get(self.directory.find.remote(index))
        if found is not None:
            array = self.ray.get(found[0])  # zero-copy, read-only
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch warns about read-only arrays
                return torch.from_numpy(array).reshape(-1, WIDTH), False
        value = compute()
        ref = self.ray.put(value.numpy())
        self.owned.append(ref)
        self.stored += value.nbytes
        self.directory.add.remote(index, [ref])
        return value, True

    def node_bytes(self) -> int:
        return self.stored  # the copies this process placed in the object store

    def close(self) -> None:
        self.ray.shutdown()


class Shmcache(Client):
    def __init__(self, config: Any) -> None:
        from shmcache import EmbeddingCache

        self.cache = EmbeddingCache(config)

    def get(self, index: int, compute: Any) -> tuple[Any, bool]:
        from tools.bench_node import key

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


def _plasma_reader() -> Any:
    import ray

    class Reader:
        """A second process: times zero-copy gets of objects the driver put."""

        def time_gets(self, refs: dict[str, list[Any]], rounds: int) -> dict[str, dict[str, float]]:
            out = {}
            for label, (ref,) in refs.items():
                samples = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    value = ray.get(ref)
                    samples.append(time.perf_counter() - t0)
                    del value
                out[label] = {
                    "p50_us": float(np.percentile(samples, 50)) * 1e6,
                    "p99_us": float(np.percentile(samples, 99)) * 1e6,
                }
            return out

    return ray.remote(num_cpus=0)(Reader)


def plasma_hits(sizes: dict[str, int], rounds: int) -> dict[str, dict[str, float]] | None:
    """Ray's plasma store beside `bench_node.cross_process_hits`: p50/p99 of a zero-copy `ray.get`
    in a second process (a Ray actor) of objects of `sizes` the driver put; None without `ray`."""
    try:
        import ray
    except ImportError:
        return None
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=256 << 20,
        logging_level="ERROR",
        log_to_driver=False,
    )
    try:
        refs = {label: [ray.put(np.ones(nbytes, dtype=np.uint8))] for label, nbytes in sizes.items()}
        reader = _plasma_reader().remote()
        result: dict[str, dict[str, float]] = ray.get(reader.time_gets.remote(refs, rounds))
        return result
    finally:
        ray.shutdown()


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
        return _start_ray(setup, servers)
    if system in ("mooncake", "shmcache+remote"):
        from shmcache.testing import MooncakeMaster

        if MooncakeMaster.missing():
            return False
        master = MooncakeMaster()
        servers.append(master.process)
        setup["master"] = master.address
    return True


class _RayHead:
    """A Ray head node (GCS, raylet, object store) on 127.0.0.1, stopped with `ray stop`."""

    def __init__(self, binary: str, port: int) -> None:
        self.binary = binary
        self.process = subprocess.Popen(
            [
                binary,
                "start",
                "--head",
                "--block",
                f"--port={port}",
                "--node-ip-address=127.0.0.1",
                "--include-dashboard=false",
                "--disable-usage-stats",
                "--num-cpus=1",
                f"--object-store-memory={1 << 30}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def poll(self) -> int | None:
        return self.process.poll()

    def send_signal(self, sig: int) -> None:
        subprocess.run([self.binary, "stop", "--force"], capture_output=True, timeout=60, check=False)
        os.killpg(self.process.pid, sig)

    def wait(self) -> int:
        return self.process.wait()


def _start_ray(setup: dict[str, Any], servers: list[Any]) -> bool:
    binary = shutil.which("ray", path=os.path.dirname(sys.executable))
    if importlib.util.find_spec("ray") is None or binary is None:
        return False
    port = _free_port()
    servers.append(_RayHead(binary, port))
    setup["ray_address"] = f"127.0.0.1:{port}"
    _wait_for_port(port, timeout=60)
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
    from shmcache.remote.store import free_port

    return free_port()
