"""Content-addressed cache keys.

A key's digest is taken over framed input (see `shmcache.framing`): the key schema version, the hash
algorithm, the namespace (raw bytes / decoded tensor / token prefix), the modality, every
`EncoderPreprocessingConfig` field, the optional tenant salt, then the content. The three namespaces
are explicit constructors, never chosen automatically. Digests are full width (16 bytes for xxh3_128,
32 for blake3 and sha256) and identical across processes and interpreter runs.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, cast

import numpy as np
import xxhash

from shmcache.errors import InvalidKey, UnsupportedValue
from shmcache.framing import frame
from shmcache.preprocessing import EncoderPreprocessingConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "HASH_ALGORITHMS",
    "KEY_SCHEMA_VERSION",
    "MODALITIES",
    "EmbeddingCacheKey",
    "HashAlgorithm",
    "KeyKind",
    "Modality",
]

KEY_SCHEMA_VERSION: Final = 1
HashAlgorithm = Literal["xxh3_128", "blake3", "sha256"]
HASH_ALGORITHMS: Final[tuple[str, ...]] = ("xxh3_128", "blake3", "sha256")
Modality = Literal["image", "video", "audio"]
MODALITIES: Final[tuple[str, ...]] = ("image", "video", "audio")
KeyKind = Literal["raw", "tensor", "token_prefix"]

_CONTENT_HEADER = struct.Struct("<BQ")  # the framing of a bytes item: tag 5, then its length
_BYTES_TAG = 5


class _Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...
    def digest(self) -> bytes: ...
    def copy(self) -> _Hasher: ...


def _new_hasher(algorithm: str) -> _Hasher:
    if algorithm == "xxh3_128":
        hasher: _Hasher = xxhash.xxh3_128()
    elif algorithm == "blake3":
        import blake3

        hasher = cast(_Hasher, blake3.blake3())
    elif algorithm == "sha256":
        hasher = hashlib.sha256()
    else:
        raise InvalidKey(f"unknown hash algorithm {algorithm!r}; choose one of {HASH_ALGORITHMS}")
    return hasher


_prefixes: dict[tuple[str, str, str, int, bytes | None], tuple[EncoderPreprocessingConfig, _Hasher]] = {}


def _prefixed_hasher(
    algorithm: str,
    kind: str,
    modality: str,
    config: EncoderPreprocessingConfig,
    tenant_salt: str | bytes | None,
) -> _Hasher:
    """A fresh hasher that has already absorbed the framed header; header states are memoised."""
    salt = tenant_salt.encode() if isinstance(tenant_salt, str) else tenant_salt
    memo_key = (algorithm, kind, modality, id(config), salt)
    found = _prefixes.get(memo_key)
    if found is not None and found[0] is config:
        return found[1].copy()
    if not isinstance(config, EncoderPreprocessingConfig):
        raise UnsupportedValue(f"config must be an EncoderPreprocessingConfig, got {type(config).__name__}")
    if modality not in MODALITIES:
        raise InvalidKey(f"modality must be one of {MODALITIES}, got {modality!r}")
    if tenant_salt is not None and not isinstance(tenant_salt, str | bytes):
        raise UnsupportedValue(f"tenant_salt must be str, bytes or None, got {type(tenant_salt).__name__}")
    hasher = _new_hasher(algorithm)
    hasher.update(frame(("shmcache-key", KEY_SCHEMA_VERSION, algorithm, kind, modality)))
    hasher.update(config.framed())
    hasher.update(frame(salt))
    if len(_prefixes) > 4096:
        _prefixes.clear()
    _prefixes[memo_key] = (config, hasher)  # holds config: its id() cannot be reused while memoised
    return hasher.copy()


def _absorb_content(hasher: _Hasher, data: Any, nbytes: int) -> bytes:
    hasher.update(_CONTENT_HEADER.pack(_BYTES_TAG, nbytes))
    hasher.update(data)
    return hasher.digest()


class EmbeddingCacheKey:
    """An immutable cache key. Compares and hashes by (algorithm, digest); pickles.

    Build keys with `from_raw_bytes`, `from_decoded_tensor` or `from_token_prefix`.
    """

    __slots__ = ("_algorithm", "_digest", "_kind", "_modality")

    _algorithm: str
    _digest: bytes
    _kind: str
    _modality: str

    def __init__(self, algorithm: str, digest: bytes, modality: str, kind: str) -> None:
        if algorithm not in HASH_ALGORITHMS:
            raise InvalidKey(f"unknown hash algorithm {algorithm!r}")
        expected = 16 if algorithm == "xxh3_128" else 32
        if not isinstance(digest, bytes) or len(digest) != expected:
            raise InvalidKey(f"{algorithm} digests are {expected} bytes")
        object.__setattr__(self, "_algorithm", algorithm)
        object.__setattr__(self, "_digest", digest)
        object.__setattr__(self, "_modality", modality)
        object.__setattr__(self, "_kind", kind)

    @classmethod
    def from_raw_bytes(
        cls,
        data: bytes | bytearray | memoryview,
        config: EncoderPreprocessingConfig,
        *,
        modality: Modality,
        algorithm: HashAlgorithm = "xxh3_128",
        tenant_salt: str | bytes | None = None,
    ) -> EmbeddingCacheKey:
        """Key of an input's raw bytes (the encoded image / audio file as received)."""
        if isinstance(data, memoryview):
            if not data.c_contiguous:
                raise UnsupportedValue("from_raw_bytes needs a C-contiguous buffer")
            nbytes = data.nbytes
        elif isinstance(data, bytes | bytearray):
            nbytes = len(data)
        else:
            raise UnsupportedValue(
                f"from_raw_bytes takes bytes, bytearray or memoryview, got {type(data).__name__}"
            )
        hasher = _prefixed_hasher(algorithm, "raw", modality, config, tenant_salt)
        return cls(algorithm, _absorb_content(hasher, data, nbytes), modality, "raw")

    @classmethod
    def from_decoded_tensor(
        cls,
        tensor: torch.Tensor | np.ndarray[Any, Any],
        config: EncoderPreprocessingConfig,
        *,
        modality: Modality,
        algorithm: HashAlgorithm = "xxh3_128",
        tenant_salt: str | bytes | None = None,
    ) -> EmbeddingCacheKey:
        """Key of a decoded input tensor: its dtype and shape are hashed, then its contiguous bytes.

        torch tensors (any dtype including bfloat16, CPU or CUDA, contiguous or not) and numpy arrays
        of numeric dtypes; the same values give the same key either way.
        """
        from shmcache.dtypes import tensor_bytes

        dtype_name, shape, content = tensor_bytes(tensor)
        hasher = _prefixed_hasher(algorithm, "tensor", modality, config, tenant_salt)
        hasher.update(frame((dtype_name, shape)))
        return cls(algorithm, _absorb_content(hasher, content, content.nbytes), modality, "tensor")

    @classmethod
    def from_token_prefix(
        cls,
        token_ids: Sequence[int] | np.ndarray[Any, Any],
        config: EncoderPreprocessingConfig,
        *,
        parent: EmbeddingCacheKey | bytes | None = None,
        modality: Modality = "audio",
        algorithm: HashAlgorithm = "xxh3_128",
        tenant_salt: str | bytes | None = None,
    ) -> EmbeddingCacheKey:
        """Key of a codec-token block chained to its parent, like a prefix cache's block hash.

        `parent` is the key of the previous block (or a prefix cache's own block hash as bytes, or
        None for the first block), so each block's tokens are hashed once and the key of a whole
        voice reference is the key of its last block.
        """
        if isinstance(parent, EmbeddingCacheKey):
            parent_bytes: bytes | None = parent.digest
        elif parent is None or isinstance(parent, bytes):
            parent_bytes = parent
        else:
            raise UnsupportedValue(f"parent must be a key, bytes or None, got {type(parent).__name__}")
        try:
            tokens = np.asarray(token_ids)
        except (TypeError, ValueError) as exc:
            raise UnsupportedValue(f"token_ids must be a sequence of ints: {exc}") from None
        if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
            raise UnsupportedValue("token_ids must be a flat sequence of ints")
        if tokens.size and (tokens.dtype.kind == "u" and tokens.max() > np.iinfo(np.int64).max):
            raise UnsupportedValue("token ids must fit in int64")
        content = np.ascontiguousarray(tokens, dtype="<i8")
        hasher = _prefixed_hasher(algorithm, "token_prefix", modality, config, tenant_salt)
        hasher.update(frame(parent_bytes))
        digest = _absorb_content(hasher, content.view(np.uint8).data, content.nbytes)
        return cls(algorithm, digest, modality, "token_prefix")

    @property
    def digest(self) -> bytes:
        """The full-width digest bytes."""
        return self._digest

    @property
    def hex(self) -> str:
        """The digest as lowercase hex."""
        return self._digest.hex()

    @property
    def algorithm(self) -> str:
        """The hash algorithm ("xxh3_128", "blake3" or "sha256")."""
        return self._algorithm

    @property
    def modality(self) -> str:
        """The modality the key was made for (already part of the digest)."""
        return self._modality

    @property
    def kind(self) -> str:
        """The namespace: "raw", "tensor" or "token_prefix" (already part of the digest)."""
        return self._kind

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("EmbeddingCacheKey is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EmbeddingCacheKey):
            return NotImplemented
        return self._digest == other._digest and self._algorithm == other._algorithm

    def __hash__(self) -> int:
        return hash(self._digest)

    def __reduce__(self) -> tuple[type[EmbeddingCacheKey], tuple[str, bytes, str, str]]:
        return (EmbeddingCacheKey, (self._algorithm, self._digest, self._modality, self._kind))

    def __repr__(self) -> str:
        return f"EmbeddingCacheKey({self._kind}/{self._modality} {self._algorithm}:{self.hex[:16]}…)"
