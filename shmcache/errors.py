"""Typed errors. Every error derives from `ShmCacheError` and from the matching builtin.

All of them pickle (they carry a message; `PinLimitReached` may carry a value too), so a worker
process can send one back to its parent.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ArgumentTypeError",
    "CacheClosed",
    "CapacityError",
    "ComputeFailed",
    "ComputeReentered",
    "ComputeTimeout",
    "ConfigTypeError",
    "CorruptSegment",
    "CorruptValue",
    "CudaError",
    "ForeignObject",
    "InvalidConfig",
    "InvalidKey",
    "KeyTypeError",
    "LayoutMismatch",
    "LockTimeout",
    "NamespaceUnavailable",
    "PinLimitReached",
    "ProtocolViolation",
    "RemoteUnavailable",
    "RequestIdTypeError",
    "ReservationLost",
    "SemaphoreTimeout",
    "ShmCacheError",
    "UnsupportedValue",
    "ViewMutated",
]


class ShmCacheError(Exception):
    """Base class of every error shmcache raises on purpose."""


class ConfigTypeError(ShmCacheError, TypeError):
    """A configuration field has the wrong type; the message names the field."""


class InvalidConfig(ShmCacheError, ValueError):
    """A configuration field has a value outside its allowed range; the message names the field."""


class InvalidKey(ShmCacheError, ValueError):
    """A key does not fit this cache (for example it was made with another hash algorithm)."""


class KeyTypeError(InvalidKey, TypeError):
    """A key, or a part of one (algorithm, modality, salt, digest), has the wrong type."""


class UnsupportedValue(ShmCacheError, TypeError):
    """A value of a type or dtype the value format cannot store without pickling."""


class CorruptValue(ShmCacheError, ValueError):
    """Encoded value bytes are truncated or malformed."""


class CapacityError(ShmCacheError, MemoryError):
    """Not enough room: value larger than the cache, shared memory full, or all slots referenced."""


class PinLimitReached(CapacityError):
    """This process holds pins on `max_pins_per_process` entries: release requests with
    `cleanup_request()` or drop returned views. Raised by a compute or put whose value was stored
    but cannot be held for its request, it carries the caller's value as `value` (else None)."""

    value: Any = None


class LayoutMismatch(ShmCacheError, ValueError):
    """An existing namespace was created with another layout version or other settings."""


class CorruptSegment(ShmCacheError, RuntimeError):
    """The shared index fails its integrity checks (bad magic, CRC or bounds)."""


class ForeignObject(ShmCacheError, PermissionError):
    """An object of a namespace is not safely ours: owned or created by another user, a symbolic
    link or not a regular file, not accessible to us, or with permissions wider than the configured
    mode. Nothing was attached, created or wiped; the message names the object and its owner."""


class ComputeTimeout(ShmCacheError, TimeoutError):
    """Waiting for another process's compute of the same key took longer than compute_timeout_s."""


class ComputeReentered(ShmCacheError, RecursionError):
    """A compute asked for the very key it is computing, in the thread computing it: it would wait
    on itself until compute_timeout_s (a compute function or encoder that calls back into the
    cache for its own key)."""


class ComputeFailed(ShmCacheError, RuntimeError):
    """The elected computer of a key failed; the message names the cause it reported."""


class ReservationLost(ShmCacheError, RuntimeError):
    """A commit was fenced off: the reservation was abandoned, committed, or taken over."""


class ViewMutated(ShmCacheError, RuntimeError):
    """Debug mode found that a returned zero-copy view was written to (only this process's
    copy-on-write copy changed: the node's copy is intact, and the next get maps it afresh)."""


class CacheClosed(ShmCacheError, RuntimeError):
    """The cache was closed, or is used in a process it was not opened in (after fork)."""


class CudaError(ShmCacheError, RuntimeError):
    """A CUDA driver call failed (the message names the call and the driver's error)."""


class SemaphoreTimeout(ShmCacheError, TimeoutError):
    """A semaphore wait ran out of time."""


class LockTimeout(ShmCacheError, TimeoutError):
    """A stripe or node lock was held longer than lock_timeout_s (a stopped or hung holder)."""


class ProtocolViolation(ShmCacheError, RuntimeError):
    """A write the slot state machine does not allow (a bug in shmcache, never a caller's error)."""


class RemoteUnavailable(ShmCacheError, ConnectionError):
    """The remote store cannot be reached (strict mode raises this at open)."""


class ArgumentTypeError(ShmCacheError, TypeError):
    """An argument of a public call has a type the call does not take."""


class NamespaceUnavailable(ShmCacheError, FileNotFoundError):
    """A namespace that does not exist, or whose index is not written yet (being created)."""


class RequestIdTypeError(ArgumentTypeError):
    """A request id that cannot name a request (it must be hashable; None where one is required)."""
