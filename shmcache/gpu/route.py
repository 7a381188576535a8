"""Each reader's choice of route for a GPU entry (see `choose_route`).

A reader never opens the handle of a dead exporter or of a withdrawn record: it copies the
entry's host copy instead, which is always written.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from shmcache.gpu.record import GpuRecord

__all__ = ["ReaderDevice", "Route", "choose_route"]


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
