"""Content-addressed cache keys.

A key's digest is taken over framed input (see `shmcache.framing`): the key schema version, the hash
algorithm, the namespace (raw bytes / decoded tensor / token prefix), the modality, every
`EncoderPreprocessingConfig` field and the optional tenant salt (all of it memoised as the digest of
that framed header), then the dtype and shape (tensors) or the parent (token prefixes), then the
content's length and its full-width digest under the same algorithm, so the content, the only large
part, is hashed once at the hash function's full speed. The three namespaces are explicit
constructors, never chosen automatically. Digests are full width (16 bytes for xxh3_128, 32 for
blake3 and sha256) and identical across processes and interpreter runs.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np
import xxhash

from shmcache.errors import InvalidKey, UnsupportedValue
from shmcache.keys.framing import frame
from shmcache.keys.preprocessing import EncoderPreprocessingConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "HASH_ALGORITHMS",
    "KEY_KINDS",
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
KEY_KINDS: Final[tuple[str, ...]] = ("raw", "tensor", "token_prefix")

_LEN_AND_DIGEST = struct.Struct("<BQ")


def _blake3(data: Any) -> bytes:
    import blake3

    return bytes(blake3.blake3(data).digest())


def _sha256(data: Any) -> bytes:
    return hashlib.sha256(data).digest()


_ONE_SHOT: Final[dict[str, Callable[[Any], bytes]]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "blake3": _blake3,
    "sha256": _sha256,
}

_prefixes: dict[
    tuple[str, str, str, int, bytes | None], tuple[EncoderPreprocessingConfig, Callable[[Any], bytes], bytes]
] = {}


def _prefix(
    algorithm: str,
    kind: str,
    modality: str,
    config: EncoderPreprocessingConfig,
    tenant_salt: str | bytes | None,
) -> tuple[EncoderPreprocessingConfig, Callable[[Any], bytes], bytes]:
    """(config, hash function, framed digest of the key header) for these settings; memoised.

    The header frames the key schema version, the algorithm, the namespace, the modality, every
    config field and the salt; its full-width digest stands for it in every key made with it.
    """
    salt = tenant_salt.encode() if isinstance(tenant_salt, str) else tenant_salt
    memo_key = (algorithm, kind, modality, id(config), salt)
    found = _prefixes.get(memo_key)
    if found is not None and found[0] is config:
        return found
    if not isinstance(config, EncoderPreprocessingConfig):
        raise UnsupportedValue(f"config must be an EncoderPreprocessingConfig, got {type(config).__name__}")
    if algorithm not in _ONE_SHOT:
        raise InvalidKey(f"unknown hash algorithm {algorithm!r}; choose one of {HASH_ALGORITHMS}")
    if modality not in MODALITIES:
        raise InvalidKey(f"modality must be one of {MODALITIES}, got {modality!r}")
    if tenant_salt is not None and not isinstance(tenant_salt, str | bytes):
        raise UnsupportedValue(f"tenant_salt must be str, bytes or None, got {type(tenant_salt).__name__}")
    hash_fn = _ONE_SHOT[algorithm]
    header = frame(("shmcache-key", KEY_SCHEMA_VERSION, algorithm, kind, modality))
    header += config.framed() + frame(salt)
    if len(_prefixes) > 4096:
        _prefixes.clear()
    found = _prefixes[memo_key] = (config, hash_fn, frame(hash_fn(header)))  # holds config: id stays unique
    return found


def _digest(
    prefix: tuple[Any, Callable[[Any], bytes], bytes], content: Any, nbytes: int, extra: bytes = b""
) -> bytes:
    """H(frame(H(header)) || extra || frame(len(content), H(content))): the content, the only large
    part, is hashed once at the hash function's full speed."""
    hash_fn = prefix[1]
    return hash_fn(prefix[2] + extra + _LEN_AND_DIGEST.pack(_CONTENT_TAG, nbytes) + hash_fn(content))


_CONTENT_TAG = 0xC0


class EmbeddingCacheKey:
    """An immutable cache key. Compares and hashes by (algorithm, digest); pickles.

    Build keys with `from_raw_bytes`, `from_decoded_tensor` or `from_token_prefix`.
    """

    __slots__ = ("_parts",)

    _parts: tuple[str, bytes, str, str]  # algorithm, digest, modality, kind

    def __init__(self, algorithm: str, digest: bytes, modality: str, kind: str) -> None:
        if algorithm not in HASH_ALGORITHMS:
            raise InvalidKey(f"unknown hash algorithm {algorithm!r}")
        expected = 16 if algorithm == "xxh3_128" else 32
        if not isinstance(digest, bytes) or len(digest) != expected:
            raise InvalidKey(f"{algorithm} digests are {expected} bytes")
        _set_parts(self, (algorithm, digest, modality, kind))

    @classmethod
    def _make(cls, algorithm: str, digest: bytes, modality: str, kind: str) -> EmbeddingCacheKey:
        """Construct without re-validating (the constructors above produced the parts)."""
        key = _new_key(cls)
        _set_parts(key, (algorithm, digest, modality, kind))
        return key

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
        if isinstance(data, bytes | bytearray):
            nbytes = len(data)
        elif isinstance(data, memoryview):
            if not data.c_contiguous:
                raise UnsupportedValue("from_raw_bytes needs a C-contiguous buffer")
            nbytes = data.nbytes
        else:
            raise UnsupportedValue(
                f"from_raw_bytes takes bytes, bytearray or memoryview, got {type(data).__name__}"
            )
        prefix = _prefix(algorithm, "raw", modality, config, tenant_salt)
        return cls._make(algorithm, _digest(prefix, data, nbytes), modality, "raw")

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
        from shmcache.keys.dtypes import tensor_bytes

        dtype_name, shape, content = tensor_bytes(tensor)
        prefix = _prefix(algorithm, "tensor", modality, config, tenant_salt)
        digest = _digest(prefix, content, content.nbytes, frame((dtype_name, shape)))
        return cls._make(algorithm, digest, modality, "tensor")

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
        prefix = _prefix(algorithm, "token_prefix", modality, config, tenant_salt)
        digest = _digest(prefix, content.view(np.uint8).data, content.nbytes, frame(parent_bytes))
        return cls._make(algorithm, digest, modality, "token_prefix")

    @property
    def digest(self) -> bytes:
        """The full-width digest bytes."""
        return self._parts[1]

    @property
    def hex(self) -> str:
        """The digest as lowercase hex."""
        return self._parts[1].hex()

    @property
    def algorithm(self) -> str:
        """The hash algorithm ("xxh3_128", "blake3" or "sha256")."""
        return self._parts[0]

    @property
    def modality(self) -> str:
        """The modality the key was made for (already part of the digest)."""
        return self._parts[2]

    @property
    def kind(self) -> str:
        """The namespace: "raw", "tensor" or "token_prefix" (already part of the digest)."""
        return self._parts[3]

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("EmbeddingCacheKey is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EmbeddingCacheKey):
            return NotImplemented
        return self._parts[:2] == other._parts[:2]

    def __hash__(self) -> int:
        return hash(self._parts[1])

    def __reduce__(self) -> tuple[type[EmbeddingCacheKey], tuple[str, bytes, str, str]]:
        return (EmbeddingCacheKey, self._parts)

    def __repr__(self) -> str:
        algorithm, _digest, modality, kind = self._parts
        return f"EmbeddingCacheKey({kind}/{modality} {algorithm}:{self.hex[:16]}…)"


_new_key = object.__new__
# the slot's own descriptor setter: bypasses the __setattr__ that makes keys immutable
_set_parts: Callable[[EmbeddingCacheKey, tuple[str, bytes, str, str]], None] = vars(EmbeddingCacheKey)[
    "_parts"
].__set__
