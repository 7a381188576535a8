"""The pieces `DeviceSide` builds CUDA values from: tensors over another process's device memory,
host-to-device copies of the host copy, the fence wait of released aliases, and cupy arrays."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from shmcache.format import decode
from shmcache.format.entry import ENTRY_HEADER_SIZE

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceBytes", "as_library", "host_to_device", "nothing_to_release", "wait_for_fence"]

log = logging.getLogger("shmcache")


class DeviceBytes:
    """A CUDA array interface over `nbytes` device bytes at `pointer`; keeps `owner` alive for as
    long as any tensor made from it (torch holds the interface object until its storage dies).

    When the last tensor goes, `released()` runs before `owner` can go: for an alias it records
    an event after the kernels already queued on the memory and hands its mapping view back,
    both of which the release path settles before it drops the entry's pin."""

    def __init__(self, pointer: int, nbytes: int, owner: object, released: Callable[[], None]) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
        }
        self.owner = owner
        self._released = released

    def __del__(self) -> None:
        try:
            self._released()
        except Exception as exc:  # interpreter shutdown: nothing is left to wait for
            log.debug("shmcache: releasing a GPU alias failed: %s", exc)


def nothing_to_release() -> None:
    """Released interface objects that only fed copies: the copies were waited for."""


def host_to_device(holder: np.ndarray[Any, Any], ordinal: int) -> Callable[[decode.ArraySpec], torch.Tensor]:
    """Array spec -> uint8 tensor on device `ordinal` copied from the entry's host bytes `holder`
    (synchronous: pageable memory)."""
    import torch

    target = torch.device("cuda", ordinal)

    def source(spec: decode.ArraySpec) -> torch.Tensor:
        start = ENTRY_HEADER_SIZE + spec.offset
        return torch.from_numpy(holder[start : start + spec.nbytes]).to(target)

    return source


def wait_for_fence(ordinal: int, event: Any) -> None:
    """Wait for `event`, or for all of device `ordinal`'s work where there is no event or the
    wait on it fails. A device that cannot be waited for runs no more work: that is logged."""
    import torch

    if event is not None:
        try:
            event.synchronize()
            return
        except Exception as exc:  # a broken event: the device wait below covers its work too
            log.debug("shmcache: waiting for a release fence failed (%s): waiting for the device", exc)
    try:
        torch.cuda.synchronize(ordinal)
    except Exception as exc:
        log.warning("shmcache: cannot wait for device %d before releasing its aliases: %s", ordinal, exc)


def as_library(tensor: torch.Tensor, spec: decode.ArraySpec) -> Any:
    """A cupy array for arrays put as CUDA arrays of another library (where cupy is installed)."""
    if spec.torch_dtype is not None:
        return tensor
    try:
        import cupy
    except ImportError:
        return tensor
    return cupy.from_dlpack(tensor)
