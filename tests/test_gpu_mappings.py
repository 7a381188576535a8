"""GPU entries on a machine without a GPU: IPC mappings and the aliases built over them.

The CUDA driver and CUDA tensors are stood in for on the host (see tests/test_gpu.py for records,
routes and exporter death).
"""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest
import torch

from shmcache import CacheConfig, EmbeddingCache
from shmcache.errors import CudaError
from shmcache.format import decode, values
from shmcache.format.entry import ENTRY_HEADER_SIZE
from shmcache.gpu.mappings import DeviceMappings
from shmcache.gpu.record import GpuRecord
from shmcache.gpu.route import ReaderDevice, Route
from shmcache.node.clients import ClientIdentity
from tests.workers import FAKE_GPU_UUID, FAKE_IPC_HANDLE, expected_value, key_of


class _RecordingDriver:
    """Stands in for the CUDA driver's open and close of IPC handles (no GPU on this machine)."""

    def __init__(self) -> None:
        self.opened: list[bytes] = []
        self.bases: list[int] = []
        self.closed: list[int] = []

    def open(self, handle: bytes, ordinal: int) -> int:
        self.opened.append(handle)
        self.bases.append(0x7000_0000 + 0x100_0000 * len(self.opened))
        return self.bases[-1]

    def close(self, base: int, ordinal: int) -> None:
        self.closed.append(base)


def test_each_handle_is_opened_once_while_views_live_and_closed_at_the_last() -> None:
    driver = _RecordingDriver()
    mappings = DeviceMappings(driver)  # type: ignore[arg-type]
    one, two = ClientIdentity(1, 100, 1), ClientIdentity(2, 200, 2)
    base = mappings.acquire(one, b"h1", 0)
    assert mappings.acquire(one, b"h1", 0) == base  # a second entry in the same allocation
    other = mappings.acquire(two, b"h1", 0)  # same handle bytes, another exporter: its own mapping
    assert driver.opened == [b"h1", b"h1"] and other != base
    mappings.release(one, b"h1")
    assert driver.closed == [] and len(mappings) == 2  # one view of `base` is still alive
    assert mappings.views(one, b"h1") == 1 and mappings.views(two, b"h1") == 1
    mappings.release(one, b"h1")
    assert driver.closed == [base] and len(mappings) == 1  # never left open idle
    assert mappings.views(one, b"h1") == 0
    assert mappings.acquire(one, b"h1", 0) != base and len(driver.opened) == 3  # opened anew
    mappings.release(one, b"h1")
    mappings.release(two, b"h1")
    assert len(driver.closed) == 3 and len(mappings) == 0


class _Event:
    """Stands in for a CUDA event recorded after an alias's last use."""

    def __init__(self, order: list[str], name: str, broken: bool = False) -> None:
        self.order, self.name, self.broken = order, name, broken

    def synchronize(self) -> None:
        if self.broken:
            raise RuntimeError("lost event")
        self.order.append(self.name)


def _no_event() -> None:
    raise RuntimeError("no CUDA event")


def test_released_aliases_are_settled_before_their_pins_go(
    config: CacheConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fence is waited for (the whole device where an event is missing or broken) and every
    mapping view given back before the view pins of the batch are dropped."""
    with EmbeddingCache(config) as cache:
        cache.put(key_of("v"), expected_value("v"))
        order: list[str] = []
        side, release = cache._device, cache._node.release
        driver = _RecordingDriver()
        side._mappings = DeviceMappings(driver)  # type: ignore[arg-type]
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device: order.append(f"device {device}"))
        monkeypatch.setattr(torch.cuda, "Event", _no_event)
        monkeypatch.setattr(driver, "close", lambda base, ordinal: order.append("unmap"))

        def noted_release(pins: list[tuple[int, int]]) -> None:
            order.append("unpin")
            release(pins)

        monkeypatch.setattr(cache._node, "release", noted_release)
        view = cache.get(key_of("v"))
        assert view is not None and cache.stats()["references"] == 1
        exporter = ClientIdentity(9, 99, 9)
        for _ in range(3):
            side._mappings.acquire(exporter, FAKE_IPC_HANDLE, 0)
        side._released.append((0, _Event(order, "event"), exporter, FAKE_IPC_HANDLE))
        side._released.append((1, _Event(order, "broken", broken=True), exporter, FAKE_IPC_HANDLE))
        side._released_alias(2, exporter, FAKE_IPC_HANDLE)  # its event cannot be made
        del view
        cache.flush_releases()
        assert order == ["event", "device 1", "device 2", "unmap", "unpin"]
        assert cache.stats()["references"] == 0 and side.open_mappings == 0


class _HostTwin:
    """What the patched `torch.as_tensor` below wraps a CUDA array interface in: host bytes whose
    tensor keeps the interface alive, as torch keeps it alive for a CUDA tensor made from it."""

    def __init__(self, interface: object) -> None:
        self.interface = interface
        nbytes = interface.__cuda_array_interface__["shape"][0]  # type: ignore[attr-defined]
        self.buffer = np.zeros(nbytes, np.uint8)
        self.__array_interface__ = self.buffer.__array_interface__


@pytest.fixture
def mapping_side(config: CacheConfig, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A cache's GPU side reading another exporter's entries, CUDA stood in for on the host:
    tensors "made from" IPC mappings are host tensors that keep their interface objects alive."""
    made: list[int] = []

    def as_tensor(interface: object, device: object = None) -> torch.Tensor:
        made.append(1)
        if len(made) == fail_at[0]:
            raise RuntimeError("no memory for the view")
        return torch.from_numpy(np.asarray(_HostTwin(interface)))

    fail_at = [0]
    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    monkeypatch.setattr(torch.cuda, "Event", _no_event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: torch.cuda.Stream)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", staticmethod(lambda: None), raising=False)
    with EmbeddingCache(config) as cache:
        side = cache._device
        driver = _RecordingDriver()
        side._mappings = DeviceMappings(driver)  # type: ignore[arg-type]
        monkeypatch.setattr(side, "exporter_alive", lambda record: True)
        yield side, driver, fail_at


def _from_mapping(side, value: values.Value, route: Route, copy: bool):  # type: ignore[no-untyped-def]
    encoded = values.encode(value)
    parsed = decode.parse(memoryview(encoded))
    parsed = dataclasses.replace(parsed, arrays=tuple(dataclasses.replace(a, lib=3) for a in parsed.arrays))
    holder = np.frombuffer(bytes(ENTRY_HEADER_SIZE) + encoded, np.uint8)
    record = GpuRecord(1, ClientIdentity(9, 99, 9), 0, 0, len(encoded), FAKE_GPU_UUID, FAKE_IPC_HANDLE)
    reader = ReaderDevice(0, FAKE_GPU_UUID, {FAKE_GPU_UUID: 0})
    return side._from_mapping(holder, 0, record, parsed, reader, route, copy)


def test_every_alias_holds_one_mapping_view_until_it_is_settled(mapping_side) -> None:  # type: ignore[no-untyped-def]
    side, driver, _fail_at = mapping_side
    value = _from_mapping(side, {"a": torch.ones(8), "b": torch.zeros(4)}, Route.ALIAS, copy=False)
    assert set(value) == {"a", "b"} and driver.opened == [FAKE_IPC_HANDLE]
    views = side._mappings.views(ClientIdentity(9, 99, 9), FAKE_IPC_HANDLE)
    assert views == 2 and driver.closed == []  # one per alias; the build's own is given back
    del value
    assert len(side._released) == 2 and driver.closed == []  # queued, not yet settled
    side.settle()
    assert driver.closed == driver.bases and side.open_mappings == 0


def test_copies_out_of_a_mapping_give_it_back_at_once(mapping_side) -> None:  # type: ignore[no-untyped-def]
    side, driver, _fail_at = mapping_side
    value = _from_mapping(side, {"a": torch.ones(8), "b": torch.zeros(4)}, Route.ALIAS, copy=True)
    assert len(driver.closed) == 1 and side.open_mappings == 0 and not side._released
    del value


def test_a_failed_build_gives_every_mapping_view_back(mapping_side) -> None:  # type: ignore[no-untyped-def]
    side, driver, fail_at = mapping_side
    fail_at[0] = 2  # the second array's tensor cannot be made
    with pytest.raises(RuntimeError, match="no memory"):
        _from_mapping(side, {"a": torch.ones(8), "b": torch.zeros(4)}, Route.ALIAS, copy=False)
    gc.collect()  # the first array's alias died with the traceback
    side.settle()
    assert len(driver.closed) == 1 and side.open_mappings == 0


def test_an_exporter_dead_after_the_route_was_chosen_gets_no_alias(  # type: ignore[no-untyped-def]
    mapping_side, monkeypatch: pytest.MonkeyPatch
) -> None:
    side, driver, _fail_at = mapping_side
    monkeypatch.setattr(side, "exporter_alive", lambda record: False)
    with pytest.raises(CudaError, match="died"):
        _from_mapping(side, torch.ones(8), Route.ALIAS, copy=False)
    assert len(driver.closed) == 1 and side.open_mappings == 0 and not side._released
