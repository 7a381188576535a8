"""shmcache: a node-wide, crash-safe, shared-memory cache for multimodal encoder outputs."""

from shmcache.config import CacheConfig
from shmcache.errors import (
    ArgumentTypeError,
    CacheClosed,
    CapacityError,
    ComputeFailed,
    ComputeReentered,
    ComputeTimeout,
    ConfigTypeError,
    CorruptSegment,
    CorruptValue,
    CudaError,
    ForeignObject,
    InvalidConfig,
    InvalidKey,
    KeyTypeError,
    LayoutMismatch,
    LockTimeout,
    NamespaceUnavailable,
    PinLimitReached,
    ProtocolViolation,
    RemoteUnavailable,
    RequestIdTypeError,
    ReservationLost,
    SemaphoreTimeout,
    ShmCacheError,
    UnsupportedValue,
    ViewMutated,
)
from shmcache.format.values import HiddenStatePrefix
from shmcache.kernel.namespace import destroy_namespace, list_namespaces
from shmcache.keys.key import EmbeddingCacheKey
from shmcache.keys.preprocessing import EncoderPreprocessingConfig
from shmcache.process.cache import EmbeddingCache, Reservation, ReservationTicket

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "CacheClosed",
    "CacheConfig",
    "CapacityError",
    "ComputeFailed",
    "ComputeReentered",
    "ComputeTimeout",
    "ConfigTypeError",
    "CorruptSegment",
    "CorruptValue",
    "CudaError",
    "EmbeddingCache",
    "EmbeddingCacheKey",
    "EncoderPreprocessingConfig",
    "ForeignObject",
    "HiddenStatePrefix",
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
    "Reservation",
    "ReservationLost",
    "ReservationTicket",
    "SemaphoreTimeout",
    "ShmCacheError",
    "UnsupportedValue",
    "ViewMutated",
    "destroy_namespace",
    "list_namespaces",
]
