"""GPU entries: a value's device copy exported through CUDA IPC, the index record that publishes
it, and each reader's choice of route.

Who exports: the producing process. At commit it copies the value's CUDA arrays into a private
device buffer laid out like the value's host encoding, synchronises its current stream, and seals
the entry with a `GpuRecord` (the IPC handle of the buffer's allocation, the buffer's offset inside
it, and the exporter's identity). It keeps the buffer until the entry has left the index. The host
copy in the arena is always written as well: it serves dead exporters, GPUs without peer access,
processes without CUDA and the remote layer.

A reader takes one `Route` (see `choose_route`); it never opens the handle of a dead exporter.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from shmcache.errors import CudaError

if TYPE_CHECKING:
    import torch

__all__ = [
    "GPU_HEAD_DTYPE",
    "GPU_RECORD_SIZE",
    "CudaDriver",
    "DeviceMappings",
    "ExporterId",
    "Exports",
    "GpuRecord",
    "ReaderDevice",
    "Route",
    "choose_route",
]

log = logging.getLogger("shmcache")

# gen, exporter row, exporter pid, exporter start ticks, exporter's device ordinal, flags,
# offset of the buffer in its allocation, buffer bytes, device uuid, IPC handle; then a crc
_RECORD: Final = struct.Struct("<QiIQiIQQ16s64s")
_CRC: Final = struct.Struct("<I")
GPU_RECORD_SIZE: Final = _RECORD.size + _CRC.size
GPU_HEAD_DTYPE: Final = np.dtype({"names": ["gen", "flags"], "formats": ["<u8", "<u4"], "offsets": [0, 28]})
_WITHDRAWN: Final = 1
_IPC_LAZY_ENABLE_PEER_ACCESS: Final = 1


@dataclass(frozen=True)
class ExporterId:
    """A client record held by one process instance (row, pid and start time: rows are reused)."""

    row: int
    pid: int
    start_ticks: int


@dataclass(frozen=True)
class GpuRecord:
    """Where the device copy of entry `gen` lives: exported by `exporter` on the device `device_uuid`,
    at `offset` bytes into the allocation that `handle` opens, `nbytes` long."""

    gen: int
    exporter: ExporterId
    device_ordinal: int  # in the exporter's numbering (diagnostics: ordinals differ across processes)
    offset: int
    nbytes: int
    device_uuid: bytes
    handle: bytes
    withdrawn: bool = False

    def pack(self) -> bytes:
        """The record bytes (crc included)."""
        body = _RECORD.pack(
            self.gen,
            self.exporter.row,
            self.exporter.pid,
            self.exporter.start_ticks,
            self.device_ordinal,
            _WITHDRAWN if self.withdrawn else 0,
            self.offset,
            self.nbytes,
            self.device_uuid,
            self.handle,
        )
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> GpuRecord | None:
        """The record in `raw`, or None if it fails its crc (torn or never written)."""
        body = bytes(raw[: _RECORD.size])
        if _CRC.unpack_from(raw, _RECORD.size)[0] != zlib.crc32(body):
            return None
        gen, row, pid, ticks, ordinal, flags, offset, nbytes, uuid, handle = _RECORD.unpack(body)
        return cls(
            gen, ExporterId(row, pid, ticks), ordinal, offset, nbytes, uuid, handle, bool(flags & _WITHDRAWN)
        )

    def withdraw(self) -> GpuRecord:
        return replace(self, withdrawn=True)


class Route(enum.Enum):
    """How a reader gets a GPU entry."""

    HOST = "host"  # no CUDA in this process: zero-copy CPU views of the host copy
    ALIAS = "alias"  # the exporter's device is ours: zero-copy alias of the exporter's memory
    PEER = "peer"  # another visible GPU with peer access: one device-to-device copy through the mapping
    HOST_TO_DEVICE = "host_to_device"  # anything else: one host-to-device copy of the host copy


@dataclass(frozen=True)
class ReaderDevice:
    """The reading process's CUDA view: its current device and every device it sees, by uuid."""

    ordinal: int
    uuid: bytes
    visible: Mapping[bytes, int]  # device uuid -> this process's ordinal


def choose_route(
    record: GpuRecord | None,
    *,
    exporter_alive: bool,
    reader: ReaderDevice | None,
    can_access_peer: Callable[[int, int], bool],
) -> Route:
    """The route for reading a GPU entry. A withdrawn record or a dead exporter is never opened."""
    if reader is None:
        return Route.HOST
    if record is None or record.withdrawn or not exporter_alive:
        return Route.HOST_TO_DEVICE
    local = reader.visible.get(record.device_uuid)
    if local is None:
        return Route.HOST_TO_DEVICE
    if local == reader.ordinal:
        return Route.ALIAS
    return Route.PEER if can_access_peer(reader.ordinal, local) else Route.HOST_TO_DEVICE


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaDriver:
    """The few CUDA driver calls torch does not expose: IPC handles, allocation ranges, device uuids.

    Calls on a device run with its primary context (the one torch uses) current on the calling
    thread and restore the thread's previous context after. Raises `CudaError` naming the call
    and the driver's error.
    """

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from None
        lib = self._lib
        u64, p = ctypes.c_uint64, ctypes.POINTER
        self._signatures(
            cuInit=[ctypes.c_uint],
            cuDeviceGet=[p(ctypes.c_int), ctypes.c_int],
            cuDeviceGetCount=[p(ctypes.c_int)],
            cuDevicePrimaryCtxRetain=[p(ctypes.c_void_p), ctypes.c_int],
            cuCtxSetCurrent=[ctypes.c_void_p],
            cuCtxGetCurrent=[p(ctypes.c_void_p)],
            cuDeviceCanAccessPeer=[p(ctypes.c_int), ctypes.c_int, ctypes.c_int],
            cuIpcGetMemHandle=[p(_Handle), u64],
            cuIpcCloseMemHandle=[u64],
            cuMemGetAddressRange_v2=[p(u64), p(ctypes.c_size_t), u64],
            cuGetErrorName=[ctypes.c_int, p(ctypes.c_char_p)],
        )
        self._open_fn = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        self._open_fn.argtypes = [p(u64), _Handle, ctypes.c_uint]
        self._uuid_fn = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
        self._uuid_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        self._check("cuInit", lib.cuInit(0))

    def _signatures(self, **functions: list[Any]) -> None:
        for name, argtypes in functions.items():
            function = getattr(self._lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int

    def _check(self, call: str, result: int) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(result, ctypes.byref(name))
            raise CudaError(f"{call} failed: {(name.value or b'error %d' % result).decode()}")

    @contextlib.contextmanager
    def _on(self, ordinal: int) -> Iterator[None]:
        """Run the block with device `ordinal`'s primary context current, then restore the previous
        one (torch's current device follows the thread's current context)."""
        previous = ctypes.c_void_p()
        self._check("cuCtxGetCurrent", self._lib.cuCtxGetCurrent(ctypes.byref(previous)))
        device = ctypes.c_int()
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(device), ordinal))
        with self._lock:
            context = self._contexts.get(ordinal)
            if context is None:
                context = ctypes.c_void_p()
                self._check(
                    "cuDevicePrimaryCtxRetain",
                    self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
                )
                self._contexts[ordinal] = context
        self._check("cuCtxSetCurrent", self._lib.cuCtxSetCurrent(context))
        try:
            yield
        finally:
            self._lib.cuCtxSetCurrent(previous)

    def devices(self) -> dict[bytes, int]:
        """uuid -> ordinal of every device this process sees."""
        count = ctypes.c_int()
        self._check("cuDeviceGetCount", self._lib.cuDeviceGetCount(ctypes.byref(count)))
        return {self.uuid(ordinal): ordinal for ordinal in range(count.value)}

    def uuid(self, ordinal: int) -> bytes:
        device = ctypes.c_int()
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(device), ordinal))
        raw = ctypes.create_string_buffer(16)
        self._check("cuDeviceGetUuid", self._uuid_fn(raw, device))
        return raw.raw

    def can_access_peer(self, ordinal: int, peer: int) -> bool:
        a, b, result = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(a), ordinal))
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(b), peer))
        self._check("cuDeviceCanAccessPeer", self._lib.cuDeviceCanAccessPeer(ctypes.byref(result), a, b))
        return bool(result.value)

    def export(self, pointer: int, ordinal: int) -> tuple[bytes, int]:
        """(IPC handle, offset of `pointer` in its allocation). A caching allocator hands out
        pieces of larger allocations, and the handle opens the whole allocation."""
        handle = _Handle()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        with self._on(ordinal):
            self._check(
                "cuMemGetAddressRange",
                self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer),
            )
            self._check("cuIpcGetMemHandle", self._lib.cuIpcGetMemHandle(ctypes.byref(handle), base))
        return ctypes.string_at(ctypes.byref(handle), 64), pointer - base.value

    def open(self, handle: bytes, ordinal: int) -> int:
        """Map another process's allocation on device `ordinal`; returns its base address."""
        raw = _Handle.from_buffer_copy(handle)
        pointer = ctypes.c_uint64()
        with self._on(ordinal):
            self._check(
                "cuIpcOpenMemHandle", self._open_fn(ctypes.byref(pointer), raw, _IPC_LAZY_ENABLE_PEER_ACCESS)
            )
        return pointer.value

    def close(self, base: int, ordinal: int) -> None:
        with self._on(ordinal):
            self._check("cuIpcCloseMemHandle", self._lib.cuIpcCloseMemHandle(base))


@dataclass
class _Opened:
    base: int
    ordinal: int
    views: int = 0


class DeviceMappings:
    """The IPC handles this process has open, each (exporter, handle) once, shared by every live
    view into that allocation. A mapping is closed at the end of its last view, as torch does:
    CUDA leaves it undefined what an open mapping does once its exporter frees the memory (a
    caching allocator's `empty_cache`, say), so none is kept open idle."""

    def __init__(self, driver: CudaDriver) -> None:
        self._driver = driver
        self._opened: dict[tuple[ExporterId, bytes], _Opened] = {}
        self._lock = threading.Lock()

    def acquire(self, exporter: ExporterId, handle: bytes, ordinal: int) -> int:
        """The base address of `handle` (opened now if no view holds it), counted as one more view."""
        with self._lock:
            opened = self._opened.get((exporter, handle))
            if opened is None:
                opened = _Opened(self._driver.open(handle, ordinal), ordinal)
                self._opened[(exporter, handle)] = opened
            opened.views += 1
            return opened.base

    def release(self, exporter: ExporterId, handle: bytes) -> None:
        """One view of the mapping is gone; the last one closes it."""
        with self._lock:
            opened = self._opened[(exporter, handle)]
            opened.views -= 1
            if opened.views == 0:
                del self._opened[(exporter, handle)]
                self._close(opened)

    def __len__(self) -> int:
        with self._lock:
            return len(self._opened)

    def _close(self, opened: _Opened) -> None:
        try:
            self._driver.close(opened.base, opened.ordinal)
        except CudaError as exc:  # the exporter's context is gone: nothing left to unmap
            log.debug("shmcache: closing an IPC mapping failed: %s", exc)


@dataclass
class _Export:
    buffer: torch.Tensor
    pending: bool = True  # exported, not sealed yet: its entry is still a reservation
    withdrawn: bool = False


class Exports:
    """The device buffers this process exported, by (slot, gen), until their entry leaves the index.

    An export is pending from `add` until `published` (after the seal): sweeps and withdrawals
    leave it alone, as its entry is not in the index yet."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._exports: OrderedDict[tuple[int, int], _Export] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(export.buffer.nbytes for export in self._exports.values())

    def add(self, slot: int, gen: int, buffer: torch.Tensor) -> None:
        with self._lock:
            self._exports[(slot, gen)] = _Export(buffer)

    def published(self, slot: int, gen: int) -> None:
        """The entry of (slot, gen) was sealed with our record."""
        with self._lock:
            export = self._exports.get((slot, gen))
            if export is not None:
                export.pending = False

    def discard(self, slot: int, gen: int) -> None:
        with self._lock:
            self._exports.pop((slot, gen), None)

    def buffer(self, slot: int, gen: int) -> torch.Tensor | None:
        """Our buffer for (slot, gen), unless it was withdrawn."""
        with self._lock:
            export = self._exports.get((slot, gen))
            if export is None or export.withdrawn:
                return None
            self._exports.move_to_end((slot, gen))
            return export.buffer

    def sweep(self, state: Callable[[int, int], tuple[bool, int]]) -> int:
        """Free buffers whose entry left the index, or that were withdrawn and are unreferenced.
        `state(slot, gen)` -> (entry still indexed, references). Returns how many were freed."""
        with self._lock:
            items = [(found, export) for found, export in self._exports.items() if not export.pending]
        freed = 0
        for (slot, gen), export in items:
            indexed, references = state(slot, gen)
            if not indexed or (export.withdrawn and references == 0):
                with self._lock:
                    self._exports.pop((slot, gen), None)
                freed += 1
        return freed

    def to_withdraw(self, need: int, state: Callable[[int, int], tuple[bool, int]]) -> list[tuple[int, int]]:
        """Least recently used published exports to withdraw so that `need` more bytes fit the
        limit; `state` as for `sweep`. Only unreferenced exports are chosen (withdrawing one a
        reader holds frees nothing now), and none at all if that cannot make room."""
        if need > self.limit_bytes:
            return []
        with self._lock:
            items = list(self._exports.items())
        excess = sum(export.buffer.nbytes for _found, export in items) + need - self.limit_bytes
        chosen: list[tuple[int, int]] = []
        for found, export in items:
            if excess <= 0:
                break
            if export.withdrawn or export.pending or state(*found)[1] > 0:
                continue
            chosen.append(found)
            excess -= export.buffer.nbytes
        return chosen if excess <= 0 else []

    def mark_withdrawn(self, slot: int, gen: int) -> None:
        """Its record was withdrawn (a pending export has none yet: it is left as is)."""
        with self._lock:
            export = self._exports.get((slot, gen))
            if export is not None and not export.pending:
                export.withdrawn = True

    def drain(self) -> list[torch.Tensor]:
        """Forget every export; returns their buffers."""
        with self._lock:
            buffers = [export.buffer for export in self._exports.values()]
            self._exports.clear()
            return buffers

    def exported(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(self._exports)
