"""`DeviceSide`: this process's GPU side of a cache. It exports device copies at commit and builds
CUDA values at read time along the route `shmcache.gpu.route.choose_route` picks.

Nothing here touches CUDA until a value with CUDA arrays is put, or a GPU entry is read by a
process that has initialised CUDA itself; CPU-only processes read the host copy.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from shmcache.errors import CudaError
from shmcache.format import decode, values
from shmcache.format.entry import ENTRY_HEADER_SIZE
from shmcache.gpu.driver import CudaDriver
from shmcache.gpu.exports import Exports
from shmcache.gpu.mappings import DeviceMappings
from shmcache.gpu.record import GpuRecord, withdraw_record
from shmcache.gpu.route import ReaderDevice, Route, choose_route
from shmcache.gpu.tensors import DeviceBytes, as_library, host_to_device, nothing_to_release, wait_for_fence
from shmcache.keys.dtypes import torch_dtype
from shmcache.node.clients import ClientIdentity
from shmcache.node.index import NodeIndex
from shmcache.node.layout import Counter
from shmcache.node.slots import SealedEntry

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceSide"]

log = logging.getLogger("shmcache")
_CLOSE_WAIT_S = 2.0  # how long a closing exporter waits for readers of its device copies
_KEPT_UNTIL_EXIT: list[Any] = []  # exported buffers other processes still used when their cache closed
_COUNTER = {
    Route.ALIAS: Counter.GPU_HITS_ALIAS,
    Route.PEER: Counter.GPU_HITS_PEER,
    Route.HOST_TO_DEVICE: Counter.GPU_HITS_HOST_COPY,
}


class DeviceSide:
    """GPU exports and GPU reads of one `EmbeddingCache` (see the module docstring)."""

    def __init__(self, node: NodeIndex, *, reads_host: bool, export_bytes: int) -> None:
        self._node = node
        self._me = node.identity
        self._reads_host = reads_host
        self.exports = Exports(export_bytes)
        self._driver: CudaDriver | None = None
        self._driver_failed = False
        self._mappings: DeviceMappings | None = None
        self._visible: dict[bytes, int] | None = None
        self._lock = threading.Lock()
        self._settle_lock = threading.Lock()  # one settler at a time: pins wait for *every* fence
        # released aliases: (device, CUDA event after their last use or None: wait for the whole
        # device, and the mapping view to hand back once that work is done)
        self._released: deque[tuple[int, Any, ClientIdentity, bytes]] = deque()

    # ----------------------------------------------------------------- driver
    def _cuda(self) -> CudaDriver | None:
        """The driver wrapper, loaded once; None (logged once) where it cannot be used."""
        with self._lock:
            if self._driver is None and not self._driver_failed:
                try:
                    self._driver = CudaDriver()
                    self._mappings = DeviceMappings(self._driver)
                    self._visible = self._driver.devices()
                except CudaError as exc:
                    self._driver_failed = True
                    log.warning(
                        "shmcache: no CUDA IPC in this process (%s): GPU entries use host copies", exc
                    )
            return self._driver

    @property
    def open_mappings(self) -> int:
        """How many IPC mappings of other processes' device memory this process has open."""
        return len(self._mappings) if self._mappings is not None else 0

    # ----------------------------------------------------------------- export
    def export(self, encoded: values.EncodedValue, slot: int, gen: int) -> GpuRecord | None:
        """Copy `encoded`'s CUDA arrays into a buffer laid out like its host encoding, wait for the
        copies, and return the record that publishes it; None when it is not exported (no CUDA
        arrays, over `gpu_export_bytes`, or IPC unavailable: readers then use the host copy)."""
        if not encoded.device_payloads:
            return None
        node, exports = self._node, self.exports
        need = encoded.total_len
        self.sweep()
        for old_slot, old_gen in exports.to_withdraw(need, node.entry_state):
            if withdraw_record(node, old_slot, old_gen):  # else its entry is gone: the sweep frees it
                exports.mark_withdrawn(old_slot, old_gen)
        self.sweep()
        driver = self._cuda()
        if driver is None or exports.nbytes + need > exports.limit_bytes:
            node.count(Counter.GPU_EXPORT_SKIPS)
            return None
        import torch

        device = encoded.device
        try:
            with torch.cuda.device(device):
                buffer = torch.empty(need, dtype=torch.uint8, device=device)
                for offset, tensor in encoded.device_payloads:
                    flat = tensor.reshape(-1).view(torch.uint8)
                    buffer[offset : offset + flat.numel()].copy_(flat)
                torch.cuda.current_stream(device).synchronize()  # readers use other streams and processes
                handle, offset = driver.export(buffer.data_ptr(), device.index)
                uuid = driver.uuid(device.index)
        except RuntimeError as exc:  # CudaError (e.g. expandable segments have no legacy IPC handle), OOM
            node.count(Counter.GPU_EXPORT_SKIPS)
            log.warning("shmcache: not exporting a GPU entry: %s", exc)
            return None
        exports.add(slot, gen, buffer)
        node.count(Counter.GPU_EXPORTS)
        return GpuRecord(gen, self._me, device.index, offset, need, uuid, handle)

    def sweep(self) -> int:
        """Free exported buffers whose entries left the index (or were withdrawn and are unused)."""
        return self.exports.sweep(self._node.entry_state)

    def withdraw_all(self) -> None:
        """Before this process detaches: no reader may open our handles from now on."""
        for slot, gen in self.exports.exported():
            try:
                withdraw_record(self._node, slot, gen)
            except Exception as exc:  # a destroyed namespace: nobody is left to read
                log.debug("shmcache: withdrawing GPU records failed: %s", exc)
                return
            self.exports.mark_withdrawn(slot, gen)  # freed by a sweep once nothing references it

    def settle(self) -> None:
        """Before released pins are dropped: wait for the kernels queued on every alias released
        so far, then give their mappings back. Runs where pins are released: the release thread,
        `flush_releases`, and an allocation or claim that found the node full (`release_now`)."""
        with self._settle_lock:
            released = []
            while True:
                try:
                    released.append(self._released.popleft())
                except IndexError:
                    break
            for ordinal, event, _exporter, _handle in released:
                wait_for_fence(ordinal, event)
            for _ordinal, _event, exporter, handle in released:
                assert self._mappings is not None  # aliases exist only where mappings do
                self._mappings.release(exporter, handle)

    def close(self, wait_s: float = _CLOSE_WAIT_S) -> None:
        """Withdraw our records, then wait at most `wait_s` for other processes to release the
        entries whose device copies we exported. Buffers still referenced then are kept until this
        process exits: aliases of them become invalid only then."""
        self.settle()
        self.withdraw_all()

        def others(slot: int, gen: int) -> tuple[bool, int]:
            """References of other processes. Ours are read before and after the total and the
            smaller count is taken: our threads may drop or take pins meanwhile, and neither may
            make another process's reference look like ours."""
            ours = self._node.pins.held().get((slot, gen), 0)
            indexed, references = self._node.entry_state(slot, gen)
            ours = min(ours, self._node.pins.held().get((slot, gen), 0))
            return indexed, references - ours

        deadline = time.monotonic() + wait_s
        while self.exports.exported():
            try:
                self.exports.sweep(others)
            except Exception as exc:  # a destroyed namespace: nobody is left to read
                log.debug("shmcache: sweeping exports at close failed: %s", exc)
                break
            if not self.exports.exported() or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        left = self.exports.drain()
        if left:
            _KEPT_UNTIL_EXIT.extend(left)
            log.warning(
                "shmcache: closing while other processes still reference %d GPU entries exported "
                "here; their zero-copy views become invalid when this process exits",
                len(left),
            )

    # ----------------------------------------------------------------- read
    def reader(self) -> ReaderDevice | None:
        """This process's current CUDA device, or None if it reads host copies."""
        torch = sys.modules.get("torch")
        if self._reads_host or torch is None or not torch.cuda.is_initialized():
            return None
        ordinal = torch.cuda.current_device()
        self._cuda()
        visible = self._visible or {}
        uuid = next((found for found, index in visible.items() if index == ordinal), b"")
        return ReaderDevice(ordinal, uuid, visible)

    def route(self, info: SealedEntry) -> Route:
        """The route for reading sealed entry `info` here (a dead exporter is counted)."""
        return self._route(GpuRecord.from_attachment(info.attachment))

    def _route(self, record: GpuRecord | None) -> Route:
        """The route for reading an entry with GPU record `record` here (a dead exporter is counted)."""
        reader = self.reader()
        if reader is None:
            return Route.HOST  # no liveness check and no CUDA for processes that read host copies
        alive = record is not None and self.exporter_alive(record)
        if record is not None and not alive:
            self._node.count(Counter.GPU_DEAD_EXPORTER)
        driver = self._driver
        return choose_route(
            record,
            exporter_alive=alive,
            reader=reader,
            can_access_peer=driver.can_access_peer if driver is not None else lambda a, b: False,
        )

    def exporter_alive(self, record: GpuRecord) -> bool:
        """True if `record`'s exporter is this process or a live one."""
        return record.exporter == self._me or self._node.client_alive(record.exporter)

    def still_aliasable(self, slot: int, record: GpuRecord) -> bool:
        """For a repeat hit on an alias of `record`: its exporter lives and has not withdrawn it."""
        current = GpuRecord.from_attachment(self._node.attachments.get(slot, record.gen))
        return current is not None and not current.withdrawn and self.exporter_alive(current)

    def materialize(
        self, holder: np.ndarray[Any, Any], info: SealedEntry, parsed: decode.ParsedValue, *, copy: bool
    ) -> tuple[values.Value, bool] | None:
        """(value with CUDA arrays, whether it aliases another process's memory) for GPU entry
        `info`; None for the host route.

        `holder` is the entry's host bytes; it carries the entry's view pin, and zero-copy aliases
        of another process's memory keep it alive (so the exporter keeps that memory)."""
        record = GpuRecord.from_attachment(info.attachment)
        route = self._route(record)
        if route is Route.HOST:
            return None
        reader = self.reader()
        assert reader is not None
        if route is not Route.HOST_TO_DEVICE and record is not None:
            try:
                value = self._from_mapping(holder, info.slot, record, parsed, reader, route, copy)
                return value, route is Route.ALIAS and not copy and record.exporter != self._me
            except RuntimeError as exc:  # CudaError, or the exporter died after the liveness check
                log.info("shmcache: reading the host copy instead of a GPU mapping: %s", exc)
        source = host_to_device(holder, reader.ordinal)
        return self._build(holder, parsed, reader, Route.HOST_TO_DEVICE, copy, source), False

    def _build(
        self,
        holder: np.ndarray[Any, Any],
        parsed: decode.ParsedValue,
        reader: ReaderDevice,
        route: Route,
        copy: bool,
        source: Callable[[decode.ArraySpec], torch.Tensor],
    ) -> values.Value:
        """The value with its device arrays made from `source` (uint8 CUDA bytes of an array)."""
        import torch

        target = torch.device("cuda", reader.ordinal)

        def build(spec: decode.ArraySpec) -> Any:
            dtype = torch_dtype(spec.dtype)
            if spec.nbytes == 0:
                return as_library(torch.empty(spec.shape, dtype=dtype, device=target), spec)
            tensor = source(spec).view(dtype).reshape(spec.shape)
            if route is Route.PEER:
                tensor = tensor.to(target)
            elif route is Route.ALIAS and copy:
                tensor = tensor.clone()
            return as_library(tensor, spec)

        value = decode.materialize(holder, parsed, copy=copy, base=ENTRY_HEADER_SIZE, device=build)
        self._node.count(_COUNTER[route])
        return value

    def _from_mapping(
        self,
        holder: np.ndarray[Any, Any],
        slot: int,
        record: GpuRecord,
        parsed: decode.ParsedValue,
        reader: ReaderDevice,
        route: Route,
        copy: bool,
    ) -> values.Value:
        """Alias (or copy, for the peer route and clone mode) the exported device copy."""
        import torch

        if record.exporter == self._me:  # our own export: slices keep our buffer alive
            own = self.exports.buffer(slot, record.gen)
            if own is None:
                raise CudaError("this process withdrew the entry's device copy")
            return self._build(
                holder, parsed, reader, route, copy, lambda spec: own[spec.offset : spec.offset + spec.nbytes]
            )
        mappings = self._mappings
        if mappings is None:
            raise CudaError("CUDA IPC is unavailable in this process")
        ordinal = reader.visible[record.device_uuid]
        device = torch.device("cuda", ordinal)
        exporter, handle = record.exporter, record.handle
        keep = route is Route.ALIAS and not copy  # the returned tensors alias the mapping
        # a view of the mapping for the build; each alias kept takes one more, given back by its
        # interface object when the alias dies, before the holder (and with it the pin) can go
        start = mappings.acquire(exporter, handle, ordinal) + record.offset
        try:
            if not self.exporter_alive(record):  # died since the route was chosen
                raise CudaError("the exporter died while its handle was being opened")

            def source(spec: decode.ArraySpec) -> torch.Tensor:
                released: Callable[[], None] = nothing_to_release  # copies are waited for below
                if keep:
                    mappings.acquire(exporter, handle, ordinal)
                    released = functools.partial(self._released_alias, ordinal, exporter, handle)
                interface = DeviceBytes(start + spec.offset, spec.nbytes, holder, released)
                return torch.as_tensor(interface, device=device)

            value = self._build(holder, parsed, reader, route, copy, source)
            if not keep:  # copies out of the mapping end before it and the pin are released
                for used in {reader.ordinal, ordinal}:
                    torch.cuda.current_stream(used).synchronize()
        finally:
            mappings.release(exporter, handle)
        return value

    def _released_alias(self, ordinal: int, exporter: ClientIdentity, handle: bytes) -> None:
        """An alias died: record an event after the work queued so far on device `ordinal`'s
        current stream (if that fails, the settler waits for the whole device), and queue it with
        the alias's mapping view; the release path settles both before it drops the entry's pin."""
        import torch

        try:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(ordinal))
        except Exception as exc:  # a lost context, say: fall back to the device
            log.debug("shmcache: recording a release fence failed (%s): waiting for the device", exc)
            event = None
        self._released.append((ordinal, event, exporter, handle))
