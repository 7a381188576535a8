"""`CudaDriver`: the few CUDA driver calls torch does not expose, through ctypes."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any, Final

from shmcache.errors import CudaError

__all__ = ["CudaDriver"]

_IPC_LAZY_ENABLE_PEER_ACCESS: Final = 1


class _Handle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes."""

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
        """Declare each driver function's argument types; every one returns a CUresult."""
        for name, argtypes in functions.items():
            function = getattr(self._lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int

    def _check(self, call: str, result: int) -> None:
        """Raise `CudaError` naming `call` and the driver's error unless `result` is CUDA_SUCCESS."""
        if result != 0:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(result, ctypes.byref(name))
            raise CudaError(f"{call} failed: {(name.value or b'error %d' % result).decode()}")

    def _device(self, ordinal: int) -> ctypes.c_int:
        """The CUdevice of `ordinal`."""
        device = ctypes.c_int()
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(device), ordinal))
        return device

    @contextlib.contextmanager
    def _on(self, ordinal: int) -> Iterator[None]:
        """Run the block with device `ordinal`'s primary context current, then restore the previous
        one (torch's current device follows the thread's current context)."""
        previous = ctypes.c_void_p()
        self._check("cuCtxGetCurrent", self._lib.cuCtxGetCurrent(ctypes.byref(previous)))
        device = self._device(ordinal)
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
        """The 16-byte uuid of device `ordinal` (the same in every process, unlike ordinals)."""
        device = self._device(ordinal)
        raw = ctypes.create_string_buffer(16)
        self._check("cuDeviceGetUuid", self._uuid_fn(raw, device))
        return raw.raw

    def can_access_peer(self, ordinal: int, peer: int) -> bool:
        """True if device `ordinal` can access the memory of device `peer`."""
        a, b, result = self._device(ordinal), self._device(peer), ctypes.c_int()
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
        """Unmap the allocation `open` mapped at `base` on device `ordinal`."""
        with self._on(ordinal):
            self._check("cuIpcCloseMemHandle", self._lib.cuIpcCloseMemHandle(base))
