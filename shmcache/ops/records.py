"""What a namespace snapshot reports (`shmcache.ops.snapshot` takes it): its records, their JSON
form, and the JSON Schema that form follows (`inspect_schema.json`, installed with the package)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

__all__ = [
    "SCHEMA_FILE",
    "SNAPSHOT_SCHEMA_VERSION",
    "ClientInfo",
    "EntryInfo",
    "NamespaceSnapshot",
    "ReservationInfo",
    "json_schema",
]

SNAPSHOT_SCHEMA_VERSION = 4  # 2: entries carry `gpu`; 3: stats carry `gpu_bytes`; 4: state `damaged`
SCHEMA_FILE = "inspect_schema.json"  # package data of shmcache.ops, beside this module


@dataclass(frozen=True)
class EntryInfo:
    """One sealed or stale entry."""

    slot: int
    key: str  # hex digest prefix
    algorithm: str
    modality: str
    key_kind: str
    state: str
    generation: int
    size_bytes: int
    value_kind: str | None
    arrays: list[dict[str, Any]]  # [{"dtype": ..., "shape": [...]}]
    age_s: float
    ttl_left_s: float | None
    references: int
    holder_pids: list[int]
    gpu: dict[str, Any] | None = None  # the device copy: uuid, exporter pid, alive, withdrawn, bytes


@dataclass(frozen=True)
class ReservationInfo:
    """A key being computed right now."""

    slot: int
    key: str
    generation: int
    owner_pid: int
    owner_alive: bool


@dataclass(frozen=True)
class ClientInfo:
    """An attached process (alive, or dead and not yet reaped)."""

    record: int
    pid: int
    alive: bool
    attached_at: float
    pins: int


@dataclass(frozen=True)
class NamespaceSnapshot:
    """Everything `shmcache-inspect show` reports about one namespace."""

    namespace: str
    uid: int
    live: bool
    settings: dict[str, Any]
    capacity_bytes: int
    used_bytes: int
    stats: dict[str, int]
    entries: list[EntryInfo] = field(default_factory=list)
    reservations: list[ReservationInfo] = field(default_factory=list)
    clients: list[ClientInfo] = field(default_factory=list)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def to_json(self) -> dict[str, Any]:
        """The documented JSON form (docs/inspect.md; its schema: `json_schema()`)."""
        data = asdict(self)
        data["schema_version"] = SNAPSHOT_SCHEMA_VERSION
        data["free_bytes"] = self.free_bytes
        return data


def json_schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of `NamespaceSnapshot.to_json`, as installed with the package."""
    schema: dict[str, Any] = json.loads(resources.files("shmcache.ops").joinpath(SCHEMA_FILE).read_text())
    return schema
