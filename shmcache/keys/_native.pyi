"""Type stub of key construction's C extension (native.c has what it does and why)."""

from collections.abc import Callable
from typing import Any, TypeVar

from shmcache.keys.key import EmbeddingCacheKey, HashAlgorithm, Modality

_K = TypeVar("_K", bound=EmbeddingCacheKey)

class Header:
    """The memoised key header of one (algorithm, namespace, modality, config, salt)."""

    config: Any
    framed: bytes
    algorithm: str
    modality: str
    def __init__(
        self, config: object, hash_fn: Callable[[Any], bytes], framed: bytes, algorithm: str, modality: str
    ) -> None: ...
    def key(self, cls: type[_K], content: Any, nbytes: int, extra: bytes, kind: str) -> _K: ...

def bind(build_header: Callable[..., Header], parts_slot: object, unsupported: type[Exception]) -> None: ...
def header(algorithm: object, kind: str, modality: object, config: object, tenant_salt: object) -> Header: ...
def from_raw_bytes(
    cls: type[_K],
    data: bytes | bytearray | memoryview,
    config: object,
    *,
    modality: Modality,
    algorithm: HashAlgorithm = ...,
    tenant_salt: str | bytes | None = ...,
) -> _K: ...
