"""A read-only, lock-free snapshot of a namespace: what `shmcache-inspect` and the metrics show.

It maps the index and the arena read-only and takes no lock, so it can neither change nor block
the cache. The index is copied into private memory in one pass and unmapped at once; everything is
decoded from that copy through the node layer's own decoders (`Header.read`, `Layout` and the
slot, pin, client, counter and attachment tables), so the snapshot knows no offset of its own.
The semaphore values (liveness) are read once, right after the copy. The price of taking no lock
is that a snapshot taken while processes work may still mix two instants (the copy is not atomic,
and the arena is read after it: entries whose bytes do not verify are shown without a dtype).
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shmcache.errors import CorruptSegment, CorruptValue, NamespaceUnavailable
from shmcache.format.decode import describe
from shmcache.format.entry import ENTRY_HEADER_SIZE
from shmcache.gpu.record import GpuRecord
from shmcache.kernel.identity import check_header, never_written
from shmcache.kernel.namespace import object_names
from shmcache.kernel.ownership import Expected, check_semaphores, open_verified, semaphore_owner
from shmcache.kernel.semaphores import SemaphoreSet
from shmcache.keys.key import HASH_ALGORITHMS, KEY_KINDS, MODALITIES
from shmcache.node.attachments import AttachmentTable
from shmcache.node.clients import ClientTable
from shmcache.node.counters import Counters
from shmcache.node.layout import (
    CLIENT_HEAD,
    HEADER_SIZE,
    KEY_DIGEST,
    KEY_HEAD,
    KEY_SIZE,
    LAYOUT_VERSION,
    META,
    S_META,
    Header,
    IndexBuffer,
    Layout,
)
from shmcache.node.pins import PinTable
from shmcache.node.slots import SealedEntry, SlotRecord, SlotState, SlotTable
from shmcache.ops.records import (
    ClientInfo,
    EntryInfo,
    NamespaceSnapshot,
    ReservationInfo,
)
from shmcache.process.stats import occupancy

__all__ = ["take_snapshot"]


def _map_readonly(path: str, uid: int, what: str) -> mmap.mmap | None:
    """A read-only mapping of `path`, verified to be a regular file of `uid` (`ForeignObject`
    otherwise, or when we may not read it); None if it does not exist or is empty."""
    fd = open_verified(path, os.O_RDONLY, Expected(uid, None), what)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
    finally:
        os.close(fd)


def _copy_index(path: str, uid: int) -> bytearray | None:
    """A private copy of the index segment at `path` (one pass; the mapping is closed at once)."""
    mapped = _map_readonly(path, uid, "index segment")
    if mapped is None:
        return None
    with mapped:
        return bytearray(mapped)


@dataclass
class _Index:
    """The node layer's tables over a private copy of one index, and the liveness read with it."""

    buf: IndexBuffer
    header: Header
    layout: Layout
    slots: SlotTable
    pins: PinTable
    clients: ClientTable
    counters: Counters
    attachments: AttachmentTable
    sems: SemaphoreSet
    sems_readable: bool
    sem_values: np.ndarray
    client_alive: np.ndarray  # per client row: claimed and its liveness semaphore is up

    @classmethod
    def open(cls, namespace: str, buf: IndexBuffer, uid: int) -> _Index:
        if never_written(bytes(buf[:HEADER_SIZE])):  # not damaged: its creator has not written it yet
            raise NamespaceUnavailable(
                f"namespace {namespace!r} is being created (its index is not written yet; if no process "
                "is creating it, `shmcache-inspect gc` removes it)"
            )
        try:
            header = Header.read(buf)
        except CorruptSegment as exc:
            raise CorruptSegment(f"index of {namespace!r}: {exc}") from None
        if header.layout_version != LAYOUT_VERSION:
            raise CorruptSegment(
                f"index of {namespace!r} has layout {header.layout_version}, expected {LAYOUT_VERSION}"
            )
        check_header(header, len(buf), repr(namespace))  # fields in range (a layout of zero ways...)
        layout = header.layout
        idx = memoryview(buf)
        sems = SemaphoreSet(header.semid, layout.semaphores)
        owner = semaphore_owner(header.semid)
        if owner is not None:
            check_semaphores(header.semid, owner, Expected(uid, None))  # another user's: ForeignObject
        readable = owner is not None and sems.probe()
        values = sems.values() if readable else np.zeros(layout.semaphores, dtype=np.ushort)
        clients = ClientTable(idx, layout, buf, sems)
        first = layout.client_sem(0)
        alive: np.ndarray = (values[first : first + layout.clients] != 0) & clients.claimed()
        native = layout.native(buf, header.ttl or None, 0.0, SealedEntry)  # reads only
        return cls(
            buf=buf,
            header=header,
            layout=layout,
            slots=SlotTable(idx, layout, native, header.ttl or None),
            pins=PinTable(idx, layout, native),
            clients=clients,
            counters=Counters(idx, layout, native),
            attachments=AttachmentTable(idx, layout, buf),
            sems=sems,
            sems_readable=readable,
            sem_values=values,
            client_alive=alive,
        )

    def key(self, slot: int) -> tuple[str, str]:
        """(hash algorithm, digest hex) of the slot's key record."""
        off = self.layout.key_off(slot)
        algorithm, length = KEY_HEAD.unpack_from(self.buf, off)
        length = min(length, KEY_SIZE - KEY_DIGEST)
        digest = bytes(self.buf[off + KEY_DIGEST : off + KEY_DIGEST + length]).hex()
        return _name(HASH_ALGORITHMS, algorithm), digest

    def meta(self, slot: int) -> tuple[str, str]:
        """(modality, key kind) kept beside the slot record."""
        modality, kind = META.unpack_from(self.buf, self.layout.slot_off(slot) + S_META)
        return _name(MODALITIES, modality), _name(KEY_KINDS, kind)

    def reservation(self, slot: int, digest: str, record: SlotRecord) -> ReservationInfo:
        """Its owner is the process its record names (after a hand-over: the adopter, where the
        semaphore's last user is the giver); alive while anyone holds its semaphore."""
        sem, gen = self.layout.slot_sem(slot), record.gen
        row = record.owner  # its pid only while the row is a live client (a dead one's row is reused)
        owner = (
            int(self.clients.pids[row]) if 0 <= row < self.layout.clients and self.client_alive[row] else 0
        )
        if not self.sems_readable:
            return ReservationInfo(slot, digest[:16], gen, owner, False)
        return ReservationInfo(
            slot, digest[:16], gen, owner or self.sems.last_pid(sem), bool(self.sem_values[sem])
        )

    def holders(self, slot: int, gen: int) -> list[int]:
        """Pids of live clients holding pins on entry (slot, gen)."""
        pins = self.pins.array
        held = (pins["slot"] == slot) & (pins["gen"] == gen) & (pins["count"] > 0)
        rows = np.nonzero((held & self.client_alive[:, None]).any(axis=1))[0]
        return sorted(int(self.clients.pids[row]) for row in rows)

    def gpu(self, slot: int, gen: int) -> dict[str, Any] | None:
        """The entry's device copy, decoded from its attachment (None: host only)."""
        record = GpuRecord.from_attachment(self.attachments.get(slot, gen))
        if record is None:
            return None
        exporter = record.exporter  # alive: its record is live and still held by that process
        alive = 0 <= exporter.row < self.layout.clients and bool(self.client_alive[exporter.row])
        alive = alive and self.clients.identity(exporter.row) == exporter
        return {
            "device_uuid": record.device_uuid.hex(),
            "exporter_pid": exporter.pid,
            "exporter_alive": alive,
            "withdrawn": record.withdrawn,
            "bytes": record.nbytes,
        }

    def client_list(self) -> list[ClientInfo]:
        out = []
        counts = self.pins.array["count"]
        for found in np.nonzero(self.clients.claimed())[0]:
            row = int(found)
            _state, pid, _ticks, attached = CLIENT_HEAD.unpack_from(self.buf, self.layout.client_off(row))
            out.append(
                ClientInfo(row, pid, bool(self.client_alive[row]), attached, int((counts[row] > 0).sum()))
            )
        return out

    def scan(self, arena: mmap.mmap | None, now: float) -> tuple[list[EntryInfo], list[ReservationInfo]]:
        """Every non-empty slot decoded: the entries and the reservations in flight."""
        entries: list[EntryInfo] = []
        reservations: list[ReservationInfo] = []
        for found in np.nonzero(self.slots.array["state"] != SlotState.EMPTY)[0]:
            slot = int(found)
            record, valid = self.slots.raw(slot)
            if not valid:  # its fields are not to be believed: shown, described by nothing
                entry = self.entry(slot, record._replace(size=0), None, now)
                damaged = replace(entry, state="damaged", age_s=0.0, ttl_left_s=None, references=0)
                entries.append(replace(damaged, holder_pids=[], gpu=None))
            elif record.state == SlotState.RESERVED:
                reservations.append(self.reservation(slot, self.key(slot)[1], record))
            else:
                entries.append(self.entry(slot, record, arena, now))
        return entries, reservations

    def used_bytes(self) -> int:
        """The extents of the non-empty slots whose records verify (a damaged size is not counted)."""
        found = np.nonzero(self.slots.array["state"] != SlotState.EMPTY)[0]
        return sum(record.size for record, valid in map(self.slots.raw, map(int, found)) if valid)

    def entry(self, slot: int, record: SlotRecord, arena: mmap.mmap | None, now: float) -> EntryInfo:
        """The sealed or stale entry of `slot` (its value described from `arena`), as seen at `now`."""
        algorithm, digest = self.key(slot)
        modality, key_kind = self.meta(slot)
        value_kind, arrays = _describe(arena, record.offset, record.size)
        ttl = self.header.ttl
        return EntryInfo(
            slot=slot,
            key=digest[:16],
            algorithm=algorithm,
            modality=modality,
            key_kind=key_kind,
            state=record.state.label,
            generation=record.gen,
            size_bytes=record.size,
            value_kind=value_kind,
            arrays=arrays,
            age_s=max(0.0, now - record.sealed_at),
            ttl_left_s=None if not ttl else max(0.0, ttl - (now - self.slots.last_access(slot))),
            references=record.refs,
            holder_pids=self.holders(slot, record.gen),
            gpu=self.gpu(slot, record.gen),
        )

    def stats(self) -> dict[str, int]:
        """The node-wide counter totals, with the slot table's occupancy and the live clients."""
        stats = self.counters.totals(self.clients.claimed)
        stats.update(occupancy(self.slots, self.attachments), clients=int(self.client_alive.sum()))
        return stats

    def settings(self) -> dict[str, Any]:
        """The namespace's settings, as its header and layout record them."""
        header, layout = self.header, self.layout
        return {
            "stripes": layout.stripes,
            "ways": layout.ways,
            "max_entries": layout.slots,
            "max_clients": layout.clients,
            "max_pins_per_process": layout.pins,
            "ttl_s": header.ttl or None,
            "hash_algorithm": _name(HASH_ALGORITHMS, header.algorithm),
            "mode": oct(header.mode),
            "created_at": header.created,
        }


def _name(names: tuple[str, ...], code: int) -> str:
    return names[code] if code < len(names) else "?"


def take_snapshot(
    namespace: str, uid: int | None = None, *, max_entries: int | None = None
) -> NamespaceSnapshot:
    """Snapshot `namespace` (of `uid`, default this user). Raises `NamespaceUnavailable` if it does
    not exist (or is being created), `CorruptSegment` if its index is damaged and `ForeignObject`
    if one of its objects is not owned by `uid` (squatted) or is not readable by this user."""
    uid = os.geteuid() if uid is None else uid
    names = object_names(namespace, uid)
    buf = _copy_index(names.index_path, uid)
    if buf is None:
        raise NamespaceUnavailable(f"namespace {namespace!r} of uid {uid} does not exist")
    node = _Index.open(namespace, buf, uid)
    if node.header.ready == 0 and not node.client_alive.any():  # written, its objects not all made
        raise NamespaceUnavailable(
            f"namespace {namespace!r} is being created (not ready yet; if no process is creating "
            "it, `shmcache-inspect gc` removes it)"
        )
    now = time.monotonic()
    arena = _map_readonly(names.arena_path, uid, "arena segment")
    try:
        entries, reservations = node.scan(arena, now)
    finally:
        if arena is not None:
            arena.close()
    entries.sort(key=lambda e: -e.size_bytes)
    if max_entries is not None:
        entries = entries[:max_entries]
    stats = node.stats()
    return NamespaceSnapshot(
        namespace=namespace,
        uid=uid,
        live=bool(node.client_alive.any()),
        settings=node.settings(),
        capacity_bytes=node.header.capacity,
        used_bytes=node.used_bytes(),
        stats=stats,
        entries=entries,
        reservations=reservations,
        clients=node.client_list(),
    )


def _describe(arena: mmap.mmap | None, offset: int, size: int) -> tuple[str | None, list[dict[str, Any]]]:
    if arena is None or size <= ENTRY_HEADER_SIZE or offset + size > len(arena):
        return None, []
    try:
        with memoryview(arena) as whole, whole[offset + ENTRY_HEADER_SIZE : offset + size] as body:
            kind, arrays = describe(body)
    except (CorruptValue, ValueError):
        return None, []
    return kind, [{"dtype": dtype, "shape": list(shape)} for dtype, shape in arrays]
