"""A read-only, lock-free snapshot of a namespace: what `shmcache-inspect` and the metrics show.

It maps the index and the arena read-only and takes no lock, so it can neither change nor block
the cache; the price is that a snapshot taken while processes work may mix two instants (each
slot record is read in one pass, and entries whose bytes do not verify are shown without a dtype).
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import posix_ipc

from shmcache.entry import ENTRY_HEADER_SIZE
from shmcache.errors import CorruptSegment, CorruptValue, ShmCacheError
from shmcache.keys import HASH_ALGORITHMS, MODALITIES
from shmcache.layout import CLIENT_HEAD, HEADER, LAYOUT_VERSION, MAGIC, Layout, SlotState
from shmcache.namespace import Segments, object_names
from shmcache.node import NodeIndex
from shmcache.semaphores import SemaphoreSet
from shmcache.values import describe

__all__ = ["ClientInfo", "EntryInfo", "NamespaceSnapshot", "ReservationInfo", "take_snapshot"]

SNAPSHOT_SCHEMA_VERSION = 2  # 2: entries carry `gpu`
_KINDS = ("raw", "tensor", "token_prefix")


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
        """The documented JSON form (docs/inspect.md; schema in shmcache/inspect_schema.json)."""
        data = asdict(self)
        data["schema_version"] = SNAPSHOT_SCHEMA_VERSION
        data["free_bytes"] = self.free_bytes
        return data


def _map_readonly(name: str) -> mmap.mmap | None:
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except posix_ipc.ExistentialError:
        return None
    try:
        return mmap.mmap(shm.fd, shm.size, prot=mmap.PROT_READ) if shm.size else None
    finally:
        shm.close_fd()


def take_snapshot(
    namespace: str, uid: int | None = None, *, max_entries: int | None = None
) -> NamespaceSnapshot:
    """Snapshot `namespace` (of `uid`, default this user). Raises `ShmCacheError` if it does not exist
    and `CorruptSegment` if its index is damaged."""
    uid = os.geteuid() if uid is None else uid
    names = object_names(namespace, uid)
    index = _map_readonly(names.index)
    if index is None:
        raise ShmCacheError(f"namespace {namespace!r} of uid {uid} does not exist")
    if len(index) < 4096:
        raise CorruptSegment(f"index of {namespace!r} is truncated")
    (
        magic,
        version,
        _ready,
        stripes,
        ways,
        clients,
        pins,
        capacity,
        semid,
        _sig,
        ttl,
        created,
        algo,
        _h,
        _j,
        mode,
    ) = HEADER.unpack_from(index, 0)
    if magic != MAGIC or version != LAYOUT_VERSION:
        raise CorruptSegment(f"index of {namespace!r} has magic {magic!r}, layout {version}")
    layout = Layout(stripes, ways, clients, pins)
    arena = _map_readonly(names.arena)
    sems = SemaphoreSet(semid, layout.semaphores)
    readable = sems.probe()
    node = NodeIndex(Segments(names, layout, index, arena or mmap.mmap(-1, 1), capacity, sems), 1.0)
    sem_values = sems.values() if readable else np.zeros(layout.semaphores, dtype=np.ushort)
    first_client = layout.client_sem(0)
    client_alive = (sem_values[first_client : first_client + clients] != 0) & (node.client_states == 1)
    slots = node.slots.copy()
    pins_table = node.all_pins.copy()
    now = time.monotonic()
    settings = {
        "stripes": stripes,
        "ways": ways,
        "max_entries": layout.slots,
        "max_clients": clients,
        "max_pins_per_process": pins,
        "ttl_s": ttl or None,
        "hash_algorithm": HASH_ALGORITHMS[algo] if algo < len(HASH_ALGORITHMS) else "?",
        "mode": oct(mode),
        "created_at": created,
    }
    entries, reservations = [], []
    for found in np.nonzero(slots["state"] != SlotState.EMPTY)[0]:
        slot = int(found)
        record = slots[slot]
        state = int(record["state"])
        key_off = layout.key_off(slot)
        key_algo, key_len = index[key_off], index[key_off + 1]
        digest = bytes(index[key_off + 16 : key_off + 16 + key_len]).hex()
        gen = int(record["gen"])
        if state == SlotState.RESERVED:
            sem = layout.slot_sem(slot)
            alive = bool(sem_values[sem]) if readable else False
            reservations.append(
                ReservationInfo(slot, digest[:16], gen, sems.last_pid(sem) if readable else 0, alive)
            )
            continue
        meta = layout.slot_off(slot) + 68
        modality, key_kind = index[meta], index[meta + 1]
        holders = pins_table["slot"] == slot
        holders &= (pins_table["gen"] == gen) & (pins_table["count"] > 0) & client_alive[:, None]
        holder_rows = np.nonzero(holders.any(axis=1))[0]
        value_kind, arrays = _describe(arena, int(record["offset"]), int(record["size"]))
        last = float(record["last_access"])
        entries.append(
            EntryInfo(
                slot=slot,
                key=digest[:16],
                algorithm=HASH_ALGORITHMS[key_algo] if key_algo < len(HASH_ALGORITHMS) else "?",
                modality=MODALITIES[modality] if modality < len(MODALITIES) else "?",
                key_kind=_KINDS[key_kind] if key_kind < len(_KINDS) else "?",
                state=SlotState.NAMES[state],
                generation=gen,
                size_bytes=int(record["size"]),
                value_kind=value_kind,
                arrays=arrays,
                age_s=max(0.0, now - float(record["sealed_at"])),
                ttl_left_s=None if not ttl else max(0.0, ttl - (now - last)),
                references=int(record["refcount"]),
                holder_pids=sorted(int(node.client_pids[row]) for row in holder_rows),
                gpu=_gpu_info(node, slot, gen, client_alive),
            )
        )
    entries.sort(key=lambda e: -e.size_bytes)
    if max_entries is not None:
        entries = entries[:max_entries]
    client_list = []
    for found in np.nonzero(node.client_states == 1)[0]:
        row = int(found)
        _state, pid, _ticks, attached = CLIENT_HEAD.unpack_from(index, layout.client_off(row))
        client_list.append(
            ClientInfo(row, pid, bool(client_alive[row]), attached, int((pins_table["count"][row] > 0).sum()))
        )
    stats = node.totals()
    sealed = slots["state"] == SlotState.SEALED
    stats.update(
        entries=int(sealed.sum()),
        bytes=int(slots["size"][sealed].sum()),
        reserved=int((slots["state"] == SlotState.RESERVED).sum()),
        stale=int((slots["state"] == SlotState.STALE).sum()),
        references=int(slots["refcount"].sum()),
        clients=int(client_alive.sum()),
        gpu_entries=int((sealed & node.gpu_records_live()).sum()),
    )
    used = int(slots["size"][slots["state"] != SlotState.EMPTY].sum())
    node.release_views()
    return NamespaceSnapshot(
        namespace=namespace,
        uid=uid,
        live=bool(client_alive.any()),
        settings=settings,
        capacity_bytes=capacity,
        used_bytes=used,
        stats=stats,
        entries=entries,
        reservations=reservations,
        clients=client_list,
    )


def _gpu_info(node: NodeIndex, slot: int, gen: int, client_alive: np.ndarray) -> dict[str, Any] | None:
    record = node.gpu_record(slot, gen)
    if record is None:
        return None
    row = record.exporter.row
    alive = 0 <= row < client_alive.size and bool(client_alive[row])
    return {
        "device_uuid": record.device_uuid.hex(),
        "exporter_pid": record.exporter.pid,
        "exporter_alive": alive and node.client_identity(row) == record.exporter,
        "withdrawn": record.withdrawn,
        "bytes": record.nbytes,
    }


def _describe(arena: mmap.mmap | None, offset: int, size: int) -> tuple[str | None, list[dict[str, Any]]]:
    if arena is None or size <= ENTRY_HEADER_SIZE or offset + size > len(arena):
        return None, []
    try:
        kind, arrays = describe(memoryview(arena)[offset + ENTRY_HEADER_SIZE : offset + size])
    except (CorruptValue, ValueError):
        return None, []
    return kind, [{"dtype": dtype, "shape": list(shape)} for dtype, shape in arrays]
