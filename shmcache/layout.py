"""Byte layout of the index segment and of the semaphore set of a namespace.

Index segment::

    header   4096 B  magic, layout version, settings, semaphore-set id, node-lock held marker,
                     counter journal, retired counters
    stripes  8 B x S          held marker u32, repairs u32
    slots    64 B x N         state, owner, gen, extent, sealed_at, refcount, crc,
                              last_access, failure record (gen, kind)
    keys     48 B x N         algorithm u8, digest length u8, modality u8, kind u8, pad, digest 32 B
    errors   128 B x N        failure message of the slot's last failed reservation (utf-8)
    gpu      192 B x N        the CUDA IPC record of a GPU entry (see `shmcache.gpu.GpuRecord`)
    clients  (512 + 16 P) B x C  state, pid, start time, attach time, counters, then P pins
                                 (slot i32, count u32, gen u64)

Semaphore set: [node lock] [S stripe locks] [N reservations] [C client liveness] [2 signature].
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Final

import numpy as np

__all__ = [
    "COUNTERS",
    "NODE_LOCK",
    "HEADER",
    "LAYOUT_VERSION",
    "MAGIC",
    "PIN",
    "SLOT",
    "Layout",
    "SlotState",
]

MAGIC: Final = b"SHMCIDX\x01"
NODE_LOCK: Final = 0  # semaphore index of the node lock
LAYOUT_VERSION: Final = 2

COUNTERS: Final = (
    "hits_process",
    "hits_node",
    "misses",
    "computes",
    "coalesced_waits",
    "takeovers",
    "evictions_lru",
    "evictions_ttl",
    "puts",
    "bytes_put",
    "uncacheable",
    "compute_failures",
    "timeouts",
    "corrupt_records",
    "repairs",
    "reaped_clients",
    "hits_remote",
    "remote_publishes",
    "remote_publish_drops",
    "remote_errors",
    "remote_rejected",
    "gpu_exports",
    "gpu_export_skips",
    "gpu_hits_alias",
    "gpu_hits_peer",
    "gpu_hits_host_copy",
    "gpu_dead_exporter",
)
N_COUNTERS: Final = len(COUNTERS)


class SlotState:
    """Slot states. STALE: expired or damaged but still referenced; freed at its last release."""

    EMPTY: Final = 0
    RESERVED: Final = 1
    SEALED: Final = 2
    STALE: Final = 3
    NAMES: Final = {0: "empty", 1: "reserved", 2: "sealed", 3: "stale"}


# header: magic, layout, ready, stripes, ways, clients, pins, capacity, semid, signature, ttl,
# created, algorithm, node-lock held, journal row, mode
HEADER: Final = struct.Struct("<8sIIIIIIQiIddIIiI")
HEADER_SIZE: Final = 4096
H_READY: Final = 12
H_NODE_HELD: Final = 68
H_JOURNAL_ROW: Final = 72
H_RETIRED: Final = 128
H_JOURNAL: Final = H_RETIRED + 8 * N_COUNTERS

STRIPE_SIZE: Final = 8
# slot: state u32, owner i32, gen u64, offset u64, size u64, sealed_at f64, refcount u32, crc u32
SLOT: Final = struct.Struct("<IiQQQdII")
SLOT_SIZE: Final = 80
SLOT_CRC_SPAN: Final = 44  # bytes [0, 44) are covered by the crc: everything up to refcount
S_REFCOUNT: Final = 40
S_CRC: Final = 44
S_LAST_ACCESS: Final = 48  # f64, written without a lock (approximate LRU), outside the crc
S_ERROR: Final = struct.Struct("<QI")  # gen of the last failed reservation, failure kind
S_ERROR_OFF: Final = 56
KEY_SIZE: Final = 48
KEY_HEAD: Final = struct.Struct("<BBBB12x")
ERROR_SIZE: Final = 128
GPU_SIZE: Final = 192

CLIENT_HEAD: Final = struct.Struct("<IIQd")  # state, pid, start ticks, attached at (wall)
CLIENT_HEAD_SIZE: Final = 512
C_COUNTERS: Final = 64
PIN: Final = struct.Struct("<iIQ")  # slot, count, gen

SLOT_DTYPE: Final = np.dtype(
    {
        "names": ["state", "owner", "gen", "offset", "size", "sealed_at", "refcount", "last_access"],
        "formats": ["<u4", "<i4", "<u8", "<u8", "<u8", "<f8", "<u4", "<f8"],
        "offsets": [0, 4, 8, 16, 24, 32, 40, 48],
        "itemsize": SLOT_SIZE,
    }
)
PIN_DTYPE: Final = np.dtype([("slot", "<i4"), ("count", "<u4"), ("gen", "<u8")])


@dataclass(frozen=True)
class Layout:
    """Offsets of every table for given sizes."""

    stripes: int
    ways: int
    clients: int
    pins: int

    @cached_property
    def slots(self) -> int:
        return self.stripes * self.ways

    @cached_property
    def stripes_off(self) -> int:
        return HEADER_SIZE

    @cached_property
    def slots_off(self) -> int:
        return _align(self.stripes_off + STRIPE_SIZE * self.stripes)

    @cached_property
    def keys_off(self) -> int:
        return self.slots_off + SLOT_SIZE * self.slots

    @cached_property
    def errors_off(self) -> int:
        return self.keys_off + KEY_SIZE * self.slots

    @cached_property
    def gpu_off(self) -> int:
        return _align(self.errors_off + ERROR_SIZE * self.slots)

    @cached_property
    def client_size(self) -> int:
        return CLIENT_HEAD_SIZE + PIN.size * self.pins

    @cached_property
    def clients_off(self) -> int:
        return _align(self.gpu_off + GPU_SIZE * self.slots)

    @cached_property
    def size(self) -> int:
        return _align(self.clients_off + self.client_size * self.clients, 4096)

    def stripe_sem(self, stripe: int) -> int:
        return 1 + stripe

    def slot_sem(self, slot: int) -> int:
        return 1 + self.stripes + slot

    def client_sem(self, client: int) -> int:
        return 1 + self.stripes + self.slots + client

    @cached_property
    def signature_sem(self) -> int:
        return 1 + self.stripes + self.slots + self.clients

    @cached_property
    def semaphores(self) -> int:
        return self.signature_sem + 2

    def slot_off(self, slot: int) -> int:
        return self.slots_off + SLOT_SIZE * slot

    def key_off(self, slot: int) -> int:
        return self.keys_off + KEY_SIZE * slot

    def error_off(self, slot: int) -> int:
        return self.errors_off + ERROR_SIZE * slot

    def gpu_record_off(self, slot: int) -> int:
        return self.gpu_off + GPU_SIZE * slot

    def client_off(self, client: int) -> int:
        return self.clients_off + self.client_size * client

    def pin_off(self, client: int, pin: int) -> int:
        return self.client_off(client) + CLIENT_HEAD_SIZE + PIN.size * pin


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to
