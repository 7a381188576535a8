"""GPU entries on a machine without a GPU: records, routes, exporter death and export bookkeeping.

IPC mappings and the aliases over them are in tests/test_gpu_mappings.py; the CUDA copies
themselves are checked by tests/test_gpu_cuda.py and tools/gpu_check.py on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import threading
import time
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import torch

from shmcache import CacheConfig, EmbeddingCache, InvalidConfig
from shmcache.format import decode, values
from shmcache.gpu import side as side_module
from shmcache.gpu.exports import Exports
from shmcache.gpu.record import GpuRecord, live_mask, withdraw_record
from shmcache.gpu.route import ReaderDevice, Route, choose_route
from shmcache.node.clients import ClientIdentity
from shmcache.node.layout import ATTACHMENT_SIZE, needle_of
from shmcache.node.slots import SealedEntry
from shmcache.ops.inspect import render
from shmcache.ops.snapshot import take_snapshot
from shmcache.process.stats import occupancy
from tests import workers
from tests.helpers import kill, spawn, wait_for
from tests.workers import FAKE_GPU_UUID, FAKE_IPC_HANDLE, expected_value, fingerprint, key_of

OTHER_UUID = bytes(range(16, 32))
RECORD = GpuRecord(7, ClientIdentity(3, 4242, 99), 1, 512, 8 << 20, FAKE_GPU_UUID, FAKE_IPC_HANDLE)


def test_record_round_trips_and_a_torn_record_reads_as_none() -> None:
    raw = RECORD.pack()
    assert len(raw) == ATTACHMENT_SIZE and struct.unpack_from("<Q", raw)[0] == RECORD.gen
    assert GpuRecord.unpack(raw) == RECORD
    assert GpuRecord.from_attachment(raw) == RECORD
    assert GpuRecord.from_attachment(None) is None  # the entry has no attachment
    assert GpuRecord.unpack(RECORD.withdraw().pack()) == dataclasses.replace(RECORD, withdrawn=True)
    for at in (0, 20, 60, 120):  # any flipped byte fails the crc
        torn = bytearray(raw)
        torn[at] ^= 0xFF
        assert GpuRecord.unpack(bytes(torn)) is None
    assert GpuRecord.unpack(bytes(len(raw))) is None  # never written
    assert GpuRecord.from_attachment(bytes(len(raw))) is None


def _reader(ordinal: int = 0) -> ReaderDevice:
    """A CUDA process on device `ordinal` that sees the exporter's GPU as 0 and another as 1."""
    devices = {FAKE_GPU_UUID: 0, OTHER_UUID: 1}
    return ReaderDevice(ordinal, next(u for u, o in devices.items() if o == ordinal), devices)


@pytest.mark.parametrize(
    ("record", "alive", "reader", "peer", "route"),
    [
        (RECORD, True, None, True, Route.HOST),  # no CUDA in this process: host copy, zero-copy
        (RECORD, True, "same", True, Route.ALIAS),
        (RECORD, False, "same", True, Route.HOST_TO_DEVICE),  # dead exporter: never open its handle
        (RECORD.withdraw(), True, "same", True, Route.HOST_TO_DEVICE),
        (None, True, "same", True, Route.HOST_TO_DEVICE),  # e.g. pulled from the remote store
        (RECORD, True, "other", True, Route.PEER),
        (RECORD, True, "other", False, Route.HOST_TO_DEVICE),  # no peer access
        (dataclasses.replace(RECORD, device_uuid=b"\xee" * 16), True, "same", True, Route.HOST_TO_DEVICE),
    ],
)
def test_route_table(
    record: GpuRecord | None, alive: bool, reader: str | None, peer: bool, route: Route
) -> None:
    device = None if reader is None else _reader(0 if reader == "same" else 1)
    assert (
        choose_route(record, exporter_alive=alive, reader=device, can_access_peer=lambda a, b: peer) is route
    )


def _slot_info(cache: EmbeddingCache, name: str) -> SealedEntry:
    info = cache._node.lookups.lookup(needle_of(key_of(name)), 0)
    assert info is not None
    return info


def test_exporter_death_falls_back_to_the_host_copy_and_the_entry_survives(
    config: CacheConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ready = tmp_path / "ready"
    exporter = spawn(workers.fake_gpu_exporter, config, "gpu-frame", str(ready))
    try:
        wait_for(ready.exists, what="the exporter's seal")
        wait_for(lambda: bool(ready.read_text()))
        row, pid, ticks = map(int, ready.read_text().split())
        with EmbeddingCache(config) as cache:
            info = _slot_info(cache, "gpu-frame")
            record = GpuRecord.from_attachment(info.attachment)
            assert record is not None
            assert record.exporter == ClientIdentity(row, pid, ticks) and pid == exporter.pid
            assert (record.handle, record.offset, record.gen) == (FAKE_IPC_HANDLE, 4096, info.gen)
            side = cache._device
            assert side.reader() is None  # this process never initialised CUDA: it reads host copies
            monkeypatch.setattr(side, "reader", lambda: _reader(0))  # as if it ran on the exporter's GPU
            assert side.route(info) is Route.ALIAS
            snap = take_snapshot(config.namespace)
            stats = cache.stats()
            assert (stats["gpu_entries"], stats["gpu_bytes"]) == (1, info.size)
            assert {
                name: snap.stats[name] for name in occupancy(cache._node.slots, cache._node.attachments)
            } == {
                name: stats[name] for name in occupancy(cache._node.slots, cache._node.attachments)
            }  # `show --json` reads what stats() reads
            assert snap.entries[0].gpu == {
                "device_uuid": FAKE_GPU_UUID.hex(),
                "exporter_pid": pid,
                "exporter_alive": True,
                "withdrawn": False,
                "bytes": record.nbytes,
            }
            assert f"pid {pid}" in render(snap) and f"pid {pid} DEAD" not in render(snap)
            schema = json.loads(resources.files("shmcache.ops").joinpath("inspect_schema.json").read_text())
            jsonschema.validate(json.loads(json.dumps(snap.to_json())), schema)

            kill(exporter)
            assert side.route(_slot_info(cache, "gpu-frame")) is Route.HOST_TO_DEVICE
            assert cache.stats()["gpu_dead_exporter"] == 1
            assert f"pid {pid} DEAD" in render(take_snapshot(config.namespace))
            monkeypatch.undo()  # this process again: no CUDA, so the host copy, zero-copy
            value = cache.get(key_of("gpu-frame"))  # the entry survives its exporter
            assert isinstance(value, torch.Tensor) and value.device.type == "cpu"
            assert fingerprint(value) == fingerprint(expected_value("gpu-frame"))
            assert cache._views._local[needle_of(key_of("gpu-frame"))].parsed.on_device  # through DeviceSide
            again = cache.get(key_of("gpu-frame"))  # a repeat hit on the held view
            assert again is not None and again.data_ptr() == value.data_ptr()
            stats = cache.stats()
            assert stats["hits_node"] == stats["hits_process"] == 1
            assert stats["gpu_dead_exporter"] == 1  # host-copy readers never check the exporter
            assert stats["gpu_hits_alias"] == stats["gpu_hits_host_copy"] == 0
            del value, again
            cache.gc()  # reap the dead exporter; its client row is free for the next process
    finally:
        kill(exporter)


def test_a_reused_client_row_is_not_the_dead_exporter(config: CacheConfig, tmp_path: Path) -> None:
    with EmbeddingCache(config) as keeper:  # keeps the namespace alive past the exporter's death
        _sealed_by_a_killed_exporter(config, tmp_path)
        assert keeper.gc() == 1  # the dead exporter's row is free again
        with EmbeddingCache(config) as cache:  # and the next process to attach takes it
            record = GpuRecord.from_attachment(_slot_info(cache, "gpu-frame").attachment)
            assert record is not None
            assert cache._node.client == record.exporter.row != keeper._node.client
            assert cache._node.identity != record.exporter  # same row, another pid or start time
            assert not cache._node.client_alive(record.exporter)
            assert cache._node.client_alive(cache._node.identity)


def _sealed_by_a_killed_exporter(config: CacheConfig, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    exporter = spawn(workers.fake_gpu_exporter, config, "gpu-frame", str(ready))
    try:
        wait_for(lambda: ready.exists() and bool(ready.read_text()), what="the exporter's seal")
    finally:
        kill(exporter)


def test_records_of_earlier_generations_are_ignored(config: CacheConfig, tmp_path: Path) -> None:
    with EmbeddingCache(config) as cache:
        _sealed_by_a_killed_exporter(config, tmp_path)
        node = cache._node
        info = _slot_info(cache, "gpu-frame")
        assert GpuRecord.from_attachment(node.attachments.get(info.slot, info.gen)) is not None
        assert GpuRecord.from_attachment(node.attachments.get(info.slot, info.gen + 1)) is None
        assert (
            live_mask(node.slots, node.attachments)[info.slot]
            and int(live_mask(node.slots, node.attachments).sum()) == 1
        )
        assert not withdraw_record(node, info.slot, info.gen + 1)  # no record of that generation
        assert withdraw_record(node, info.slot, info.gen)
        withdrawn = GpuRecord.from_attachment(node.attachments.get(info.slot, info.gen))
        assert withdrawn is not None and withdrawn.withdrawn
        assert not live_mask(node.slots, node.attachments).any()
        assert cache.stats()["gpu_entries"] == 0
        assert "withdrawn" in render(take_snapshot(config.namespace))
        node.drop(info.slot, info.gen)  # the slot's next generation is a CPU entry
        cache.put(key_of("gpu-frame"), expected_value("gpu-frame"))
        again = _slot_info(cache, "gpu-frame")
        assert again.gen > info.gen and GpuRecord.from_attachment(again.attachment) is None
        assert not live_mask(node.slots, node.attachments).any()


def test_exports_are_freed_when_their_entry_leaves_and_withdrawn_lru_first(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        node = cache._node
        names = ("a", "b", "c", "pending")
        for name in names:
            cache.put(key_of(name), expected_value(name, 64))
        slots = {name: _slot_info(cache, name) for name in names}
        exports = Exports(limit_bytes=3000)
        for name in names:  # stand-ins for device buffers: 1000 bytes each
            exports.add(slots[name].slot, slots[name].gen, torch.empty(1000, dtype=torch.uint8))
        for name in ("a", "b", "c"):  # sealed with our record; "pending" is still being committed
            exports.published(slots[name].slot, slots[name].gen)
        pending = (slots["pending"].slot, slots["pending"].gen)
        node.drop(*pending)  # whatever the index says about a pending export ...
        assert exports.nbytes == 4000
        state = node.entry_state
        found = {name: (info.slot, info.gen) for name, info in slots.items()}
        assert exports.to_withdraw(0, state) == [found["a"]]  # least recently used
        exports.buffer(*found["a"])  # a used again: b is now the oldest
        assert exports.to_withdraw(500, state) == [found["b"], found["c"]]
        assert node.add_ref(*found["b"])  # a reader holds b: withdrawing it would free nothing now
        assert exports.to_withdraw(500, state) == [found["c"], found["a"]]
        assert exports.to_withdraw(2500, state) == []  # no room even without c and a: keep them all
        assert exports.to_withdraw(3001, state) == []  # over the limit on its own: never exported
        node.release([found["b"]])
        assert exports.sweep(node.entry_state) == 0  # ... it is neither withdrawn nor freed
        exports.mark_withdrawn(slots["b"].slot, slots["b"].gen)
        assert node.add_ref(slots["b"].slot, slots["b"].gen)  # a reader still holds b
        assert exports.sweep(node.entry_state) == 0
        node.release([found["b"]])
        assert exports.sweep(node.entry_state) == 1  # withdrawn and unreferenced
        node.drop(slots["c"].slot, slots["c"].gen)  # evicted
        assert exports.sweep(node.entry_state) == 1
        assert exports.exported() == [pending, (slots["a"].slot, slots["a"].gen)]


def test_cpu_values_never_load_cuda(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        value = cache.get_or_compute(key_of("cpu"), lambda: expected_value("cpu"))
        assert value.device.type == "cpu"
        assert cache._device._driver is None and not cache._device._driver_failed
        stats = cache.stats()
        assert stats["gpu_exports"] == stats["gpu_export_skips"] == stats["gpu_entries"] == 0


def _as_device_born(encoded: bytes, lib: int) -> bytes:
    """The encoding of a value whose array was on a GPU (lib 3 torch CUDA, 4 a CUDA array)."""
    raw = bytearray(encoded)
    assert raw[32] in (1, 2)  # the first descriptor's lib byte follows the 32-byte header
    raw[32] = lib
    return bytes(raw)


def test_device_born_values_read_back_on_the_host_as_their_cpu_twin() -> None:
    tensor = torch.randn(3, 5).to(torch.bfloat16)
    encoded = _as_device_born(values.encode(tensor), 3)
    assert decode.parse(memoryview(encoded)).on_device
    back = decode.decode(encoded)
    assert isinstance(back, torch.Tensor) and back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.int16), tensor.view(torch.int16))
    array = torch.arange(6, dtype=torch.float16).numpy()
    host = decode.decode(_as_device_born(values.encode(array), 4))
    assert host.dtype == array.dtype and bytes(host) == bytes(array)
    assert struct.unpack_from("<B", values.encode(tensor), 32)[0] == 1


def test_gpu_settings_are_validated() -> None:
    with pytest.raises(InvalidConfig, match="gpu_reads"):
        CacheConfig(gpu_reads="device")  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig, match="gpu_export_bytes"):
        CacheConfig(gpu_export_bytes=-1)


def test_a_closing_exporter_withdraws_and_waits_for_its_readers(
    config: CacheConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    exporter = EmbeddingCache(config)
    workers.stand_in_gpu_export(exporter)
    exporter.put(key_of("held"), expected_value("held"))
    exporter.put(key_of("free"), expected_value("free"))
    ready = tmp_path / "ready"
    reader = spawn(workers.hold_view_and_ref, config, "held", str(ready))
    try:
        wait_for(ready.exists, what="the reader's view")
        kept = len(side_module._KEPT_UNTIL_EXIT)
        started = time.monotonic()
        exporter.close()  # "free" is released at once; "held" is waited for, then warned about
        assert 1.5 < time.monotonic() - started < 10
        assert "still reference 1 GPU entries" in caplog.text
        with EmbeddingCache(config) as cache:
            records = [GpuRecord.from_attachment(_slot_info(cache, n).attachment) for n in ("held", "free")]
            assert all(record is not None and record.withdrawn for record in records)
        assert exporter._device.exports.exported() == []
        assert len(side_module._KEPT_UNTIL_EXIT) == kept + 1  # "held" lives until this process exits
    finally:
        kill(reader)


def test_a_closing_exporter_counts_its_own_references_as_they_are_now(
    config: CacheConfig, tmp_path: Path
) -> None:
    """Its release thread may drop its own last view while it waits: that must not make another
    process's reference look like its own (the buffer would be freed under that reader)."""
    exporter = EmbeddingCache(config)
    workers.stand_in_gpu_export(exporter)
    exporter.put(key_of("held"), expected_value("held"))
    ready = tmp_path / "ready"
    reader = spawn(workers.hold_view_and_ref, config, "held", str(ready), None)  # one view, no ref
    try:
        wait_for(ready.exists, what="the reader's view")
        info = _slot_info(exporter, "held")
        assert exporter._node.add_ref(info.slot, info.gen)  # our own view, still alive at close
        kept = len(side_module._KEPT_UNTIL_EXIT)
        closing = threading.Thread(target=exporter._device.close, kwargs={"wait_s": 1.0})
        closing.start()
        wait_for(lambda: _withdrawn(exporter, info), what="close's withdrawal")  # it counts and waits now
        time.sleep(0.1)
        exporter._node.release([(info.slot, info.gen)])  # our view goes while close waits
        closing.join()
        assert exporter._node.entry_state(info.slot, info.gen) == (True, 1)  # the reader's view
        assert len(side_module._KEPT_UNTIL_EXIT) == kept + 1  # so its device copy was not freed
        exporter.close()
    finally:
        kill(reader)


def _withdrawn(cache: EmbeddingCache, info: SealedEntry) -> bool:
    record = GpuRecord.from_attachment(cache._node.attachments.get(info.slot, info.gen))
    return record is not None and record.withdrawn


def test_a_closing_process_does_not_wait_for_its_own_references(config: CacheConfig) -> None:
    cache = EmbeddingCache(config)
    workers.stand_in_gpu_export(cache)
    cache.put(key_of("mine"), expected_value("mine"), request_id="r")  # our own request reference
    started = time.monotonic()
    cache._device.close()
    assert time.monotonic() - started < 1.0 and cache._device.exports.exported() == []
    cache.close()
