"""`CacheConfig`: how a process opens a node cache, validated at construction."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from shmcache.errors import ConfigTypeError, InvalidConfig
from shmcache.keys.key import HASH_ALGORITHMS
from shmcache.keys.text import short_repr, utf8

__all__ = [
    "MAX_CLIENTS",
    "MAX_ENTRIES",
    "MAX_PINS",
    "MAX_WAYS",
    "MIN_CAPACITY",
    "MIN_PINS",
    "NAMESPACE_PATTERN",
    "NAMESPACE_RULE",
    "CacheConfig",
    "is_host_port",
    "is_unicast_ipv4",
]

# anchored at both ends (\A, \Z): "$" would also match before a trailing newline; no leading "."
# (hidden, "..") or "-" (read as an option by `shmcache-inspect show NAMESPACE`)
NAMESPACE_PATTERN = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")
NAMESPACE_RULE = "namespace must be 1 to 64 of A-Z a-z 0-9 _ . -, not starting with '.' or '-'"
MIN_CAPACITY = 1 << 20
MAX_CAPACITY = 1 << 48
MAX_WAYS = 64
MAX_ENTRIES = 16384
MAX_CLIENTS = 1024
MIN_PINS, MAX_PINS = 16, 65536
MAX_TIMEOUT_S = 366 * 86400.0  # a year: larger waits overflow the kernel's and threading's timeouts
MAX_REMOTE_BYTES = 1 << 48
_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


@dataclass(frozen=True)
class CacheConfig:
    """Settings of one process's view of a node cache.

    Settings that shape the shared layout (capacity, entries, ways, clients, pins, TTL, hash
    algorithm) must match every other process attached to the namespace, or attaching raises
    `LayoutMismatch`. The rest (timeouts, return mode, debug checks, remote and GPU settings) are
    per process. `gpu_reads="auto"` returns entries put from CUDA arrays as CUDA arrays in processes
    that have initialised CUDA ("host": always the host copy); `gpu_export_bytes` bounds the device
    memory this process keeps exported for other processes (0: never export).
    """

    enable_embedding_cache: bool = False
    namespace: str = "default"
    capacity_bytes: int = 1 << 30
    max_entries: int = 4096
    ttl_s: float | None = 3600.0
    compute_timeout_s: float = 300.0
    lock_timeout_s: float = 10.0
    return_mode: Literal["view", "clone"] = "view"
    debug_check_views: bool = False
    hash_algorithm: Literal["xxh3_128", "blake3", "sha256"] = "xxh3_128"
    tenant_salt: str | None = None
    ways: int = 16
    max_clients: int = 64
    max_pins_per_process: int = 4096
    mode: int = 0o600
    remote_master: str | None = None
    remote_protocol: Literal["tcp", "rdma"] = "tcp"  # our transfers'; a thin client names its holder's
    remote_segment_bytes: int = 256 << 20
    remote_buffer_bytes: int = 64 << 20
    remote_key_prefix: str = "shmcache"
    remote_publish_queue: int = 64
    remote_timeout_s: float = 2.0
    remote_holder: str | None = None
    remote_local_host: str = "127.0.0.1"  # where other nodes reach our segment: the node's IPv4 address
    remote_single_flight: bool = True
    store_unavailable_mode: Literal["degrade", "strict"] = "degrade"
    gpu_reads: Literal["auto", "host"] = "auto"
    gpu_export_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check_type(field.name, str(field.type), getattr(self, field.name))
        named = NAMESPACE_PATTERN.fullmatch(self.namespace) is not None
        _require(named, NAMESPACE_RULE)
        sized = MIN_CAPACITY <= self.capacity_bytes <= MAX_CAPACITY
        _require(sized, "capacity_bytes must be in 1 MiB..256 TiB")
        _require(1 <= self.ways <= MAX_WAYS, f"ways must be in 1..{MAX_WAYS}")
        _require(self.max_entries >= self.ways, "max_entries must be at least ways")
        _require(self.max_entries <= MAX_ENTRIES, f"max_entries must be at most {MAX_ENTRIES}")
        _require(1 <= self.max_clients <= MAX_CLIENTS, f"max_clients must be in 1..{MAX_CLIENTS}")
        _require(
            MIN_PINS <= self.max_pins_per_process <= MAX_PINS,
            f"max_pins_per_process must be in {MIN_PINS}..{MAX_PINS}",
        )
        _require(
            self.ttl_s is None or (self.ttl_s > 0 and math.isfinite(self.ttl_s)), "ttl_s must be > 0 or None"
        )
        _require(_timeout_ok(self.compute_timeout_s), "compute_timeout_s must be > 0 and at most a year")
        _require(_timeout_ok(self.lock_timeout_s), "lock_timeout_s must be > 0 and at most a year")
        _require(self.return_mode in ("view", "clone"), "return_mode must be 'view' or 'clone'")
        _require(self.hash_algorithm in HASH_ALGORITHMS, f"hash_algorithm must be one of {HASH_ALGORITHMS}")
        _require(self.mode & 0o777 == self.mode and self.mode & 0o600 == 0o600, "mode must include 0o600")
        _require(
            self.store_unavailable_mode in ("degrade", "strict"),
            "store_unavailable_mode must be 'degrade' or 'strict'",
        )
        self._check_remote()
        _require(self.gpu_reads in ("auto", "host"), "gpu_reads must be 'auto' or 'host'")
        _require(self.gpu_export_bytes >= 0, "gpu_export_bytes must be >= 0 (0: never export)")

    def _check_remote(self) -> None:
        """The Mooncake settings (validated even when no remote store is configured)."""
        _require(1 <= self.remote_publish_queue <= 1 << 20, "remote_publish_queue must be in 1..1048576")
        for name in ("remote_master", "remote_holder"):
            address = getattr(self, name)
            _require(
                address is None or is_host_port(address), f"{name} must be HOST:PORT (port 1..65535) or None"
            )
        for name in ("remote_segment_bytes", "remote_buffer_bytes"):
            _require(0 <= getattr(self, name) <= MAX_REMOTE_BYTES, f"{name} must be in 0..256 TiB")
        _require("@" not in self.remote_key_prefix, "remote_key_prefix must not contain '@'")
        _require(self.remote_protocol in ("tcp", "rdma"), "remote_protocol must be 'tcp' or 'rdma'")
        _require(is_unicast_ipv4(self.remote_local_host), "remote_local_host must be a unicast IPv4 address")
        _require(_timeout_ok(self.remote_timeout_s), f"remote_timeout_s must be in (0, {MAX_TIMEOUT_S}]")

    @property
    def n_stripes(self) -> int:
        """Number of stripes (sets of `ways` slots); max_entries is rounded down to a multiple."""
        return self.max_entries // self.ways

    @property
    def key_settings(self) -> dict[str, Any]:
        """What a key constructor takes from this config: its hash algorithm and tenant salt."""
        return {"algorithm": self.hash_algorithm, "tenant_salt": self.tenant_salt}

    @classmethod
    def from_stage_config(cls, stage: Mapping[str, Any]) -> CacheConfig:
        """Build from the `CacheConfig` fields of a vLLM-Omni stage's `embedding_cache:` block
        (`enable_embedding_cache` + these fields; not the whole stage). `InvalidConfig` for any
        other name, `key_salt` included: a connector setting that `shmcache omni-deploy` places."""
        if not isinstance(stage, Mapping):
            raise ConfigTypeError(f"the stage config must be a mapping, got {type(stage).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        odd = [name for name in stage if not isinstance(name, str)]
        if odd:
            raise ConfigTypeError(f"embedding-cache setting names must be str, got {short_repr(odd[0])}")
        unknown = sorted(set(stage) - names)
        if unknown:
            listed = ", ".join(short_repr(name, 40) for name in unknown[:5])
            raise InvalidConfig(f"unknown embedding-cache settings: {listed}")
        return cls(**stage)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidConfig(message)


def is_unicast_ipv4(text: str) -> bool:
    """Whether `text` is a unicast IPv4 address in dotted form (one a peer can connect to)."""
    try:
        address = ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return not (address.is_unspecified or address.is_multicast or address == _BROADCAST)


def is_host_port(text: str) -> bool:
    """Whether `text` is `HOST:PORT`: a host name or IPv4 address, and a port in 1..65535."""
    host, _, port = text.rpartition(":")
    return (
        bool(host)
        and not any(c.isspace() or c == ":" for c in host)
        and port.isascii()
        and (port.isdigit() and 1 <= int(port) <= 65535)
    )


def _timeout_ok(value: float) -> bool:
    return 0 < value <= MAX_TIMEOUT_S  # NaN fails both comparisons


def _check_type(name: str, annotation: str, value: Any) -> None:
    accepted: dict[str, tuple[type, ...]] = {
        "bool": (bool,),
        "int": (int,),
        "str": (str,),
        "float": (int, float),
        "float | None": (int, float, type(None)),
        "str | None": (str, type(None)),
    }
    kinds = accepted.get(annotation, (str,))  # Literal[...] fields are strings
    if (bool not in kinds and isinstance(value, bool)) or not isinstance(value, kinds):
        raise ConfigTypeError(f"{name} must be {annotation}, got {type(value).__name__}")
    if isinstance(value, str):
        utf8(value, name, InvalidConfig)
    elif isinstance(value, int) and not isinstance(value, bool) and "float" in annotation:
        _require(abs(value) <= 1 << 53, f"{name} is out of range")  # an int too large for a float
