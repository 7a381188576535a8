"""shmcache: a node-wide, crash-safe, shared-memory cache for multimodal encoder outputs."""

from shmcache.config import CacheConfig
from shmcache.errors import (
    ArgumentTypeError,
    CacheClosed,
    CapacityError,
    ComputeFailed,
    ComputeTimeout,
    ConfigTypeError,
    CorruptSegment,
    CorruptValue,
    ForeignObject,
    InvalidConfig,
    InvalidKey,
    KeyTypeError,
    LayoutMismatch,
    PinLimitReached,
    RequestIdTypeError,
    ReservationLost,
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
    "ComputeTimeout",
    "ConfigTypeError",
    "CorruptSegment",
    "CorruptValue",
    "EmbeddingCache",
    "EmbeddingCacheKey",
    "EncoderPreprocessingConfig",
    "ForeignObject",
    "HiddenStatePrefix",
    "InvalidConfig",
    "InvalidKey",
    "KeyTypeError",
    "LayoutMismatch",
    "PinLimitReached",
    "RequestIdTypeError",
    "Reservation",
    "ReservationLost",
    "ReservationTicket",
    "ShmCacheError",
    "UnsupportedValue",
    "ViewMutated",
    "destroy_namespace",
    "list_namespaces",
]
