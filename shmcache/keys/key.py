"""Content-addressed cache keys.

A key's digest is taken over framed input (see `shmcache.keys.framing`): the key schema version, the hash
algorithm, the namespace (raw bytes / decoded tensor / token prefix), the modality, every
`EncoderPreprocessingConfig` field and the optional tenant salt (all of it memoised as the digest of
that framed header), then the dtype and shape (tensors) or the parent (token prefixes), then the
content's length and its full-width digest under the same algorithm, so the content, the only large
part, is hashed once at the hash function's full speed. The per-key work (the memo lookup, the
digest composition, the key object, and all of `from_raw_bytes`) is one native call (native.c);
what runs once per header is here. The namespaces are explicit constructors, never chosen
automatically. Digests are full width (16 bytes for xxh3_128, 32 for
blake3 and sha256) and identical across processes and interpreter runs.

The dtype and the full shape of a tensor are hashed, 0-d included (a 0-d array never shares a key
with its 1-d twin). Every input is validated first, with a short typed error: `KeyTypeError` (an
`InvalidKey` and a TypeError) for an algorithm, modality, kind, digest, config, salt, parent or
identifier of the wrong type, `InvalidKey` for an unknown one, a digest of the wrong width or text
with lone surrogates (a salt),
`UnsupportedValue` for content that cannot be hashed (meta, nested, sparse tensors, object arrays).
The public constructor `EmbeddingCacheKey(algorithm, digest, modality, kind)` validates its parts too.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, Self

import numpy as np
import xxhash

from shmcache.errors import InvalidKey, KeyTypeError, UnsupportedValue
from shmcache.keys import _native
from shmcache.keys.framing import frame
from shmcache.keys.preprocessing import EncoderPreprocessingConfig
from shmcache.keys.text import short_repr, utf8

if TYPE_CHECKING:
    import torch

__all__ = [
    "HASH_ALGORITHMS",
    "KEY_KINDS",
    "KEY_SCHEMA_VERSION",
    "MODALITIES",
    "RECORD_HEAD",
    "RECORD_SIZE",
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
KeyKind = Literal["raw", "tensor", "token_prefix", "external"]
KEY_KINDS: Final[tuple[str, ...]] = ("raw", "tensor", "token_prefix", "external")

RECORD_HEAD: Final = struct.Struct("<BB14x")  # a key record: algorithm index, digest length; digest at +16
RECORD_SIZE: Final = RECORD_HEAD.size + 32


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


def _build_header(
    algorithm: object, kind: str, modality: object, config: object, tenant_salt: object
) -> _native.Header:
    """The key header for these settings, validated (native.c memoises it: `_native.header`).

    The header frames the key schema version, the algorithm, the namespace, the modality, every
    config field and the salt; its full-width digest stands for it in every key made with it.
    """
    if not isinstance(config, EncoderPreprocessingConfig):
        raise KeyTypeError(f"config must be an EncoderPreprocessingConfig, got {type(config).__name__}")
    algorithm = _known("hash algorithm", algorithm, HASH_ALGORITHMS)
    modality = _known("modality", modality, MODALITIES)
    hash_fn = _ONE_SHOT[algorithm]
    header = frame(("shmcache-key", KEY_SCHEMA_VERSION, algorithm, kind, modality))
    header += config.framed() + frame(_salt_bytes(tenant_salt))
    return _native.Header(config, hash_fn, frame(hash_fn(header)), algorithm, modality)


def _known(what: str, value: object, allowed: tuple[str, ...]) -> str:
    """The canonical spelling of `value`, one of `allowed`: `KeyTypeError` if it is no str,
    `InvalidKey` if it is another one."""
    if not isinstance(value, str):
        raise KeyTypeError(f"{what} must be a str, got {type(value).__name__}")
    if value not in allowed:
        raise InvalidKey(f"unknown {what} {short_repr(value)}; choose one of {allowed}")
    return allowed[allowed.index(value)]


def _salt_bytes(tenant_salt: object) -> bytes | None:
    """The salt as bytes: str is UTF-8 encoded (`InvalidKey` for lone surrogates)."""
    if tenant_salt is None or type(tenant_salt) is bytes:
        return tenant_salt
    if isinstance(tenant_salt, str):
        return utf8(tenant_salt, "tenant_salt", InvalidKey)
    if isinstance(tenant_salt, bytes):
        return bytes(tenant_salt)
    raise KeyTypeError(f"tenant_salt must be str, bytes or None, got {type(tenant_salt).__name__}")


class EmbeddingCacheKey:
    """An immutable cache key. Compares and hashes by (algorithm, digest); pickles.

    Build keys with `from_raw_bytes`, `from_decoded_tensor` or `from_token_prefix`.
    """

    __slots__ = ("_parts", "_record")

    _parts: tuple[str, bytes, str, str]  # algorithm, digest, modality, kind
    _record: bytes  # `record`, made on first use

    def __init__(self, algorithm: str, digest: bytes, modality: str, kind: str) -> None:
        """Rebuild a key from its parts (unpickling does this); every part is validated:
        `KeyTypeError` for a part of the wrong type, `InvalidKey` for an unknown algorithm,
        modality or kind, or a digest that is not the algorithm's full width."""
        algorithm = _known("hash algorithm", algorithm, HASH_ALGORITHMS)
        modality = _known("modality", modality, MODALITIES)
        kind = _known("key kind", kind, KEY_KINDS)
        if not isinstance(digest, bytes):
            raise KeyTypeError(f"digest must be bytes, got {type(digest).__name__}")
        expected = 16 if algorithm == "xxh3_128" else 32
        if len(digest) != expected:
            raise InvalidKey(f"{algorithm} digests are {expected} bytes, got {len(digest)}")
        _set_parts(self, (algorithm, bytes(digest), modality, kind))

    if TYPE_CHECKING:  # the signature native.c parses

        @classmethod
        def from_raw_bytes(
            cls,
            data: bytes | bytearray | memoryview,
            config: EncoderPreprocessingConfig,
            *,
            modality: Modality,
            algorithm: HashAlgorithm = "xxh3_128",
            tenant_salt: str | bytes | None = None,
        ) -> Self:
            """Key of an input's raw bytes (the encoded image / audio file as received)."""
    else:
        from_raw_bytes = classmethod(_native.from_raw_bytes)  # one native call (native.c)

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
        header = _native.header(algorithm, "tensor", modality, config, tenant_salt)
        return header.key(cls, content, content.nbytes, frame((dtype_name, shape)), "tensor")

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
            raise KeyTypeError(f"parent must be a key, bytes or None, got {type(parent).__name__}")
        try:
            tokens = np.asarray(token_ids)
        except (TypeError, ValueError, OverflowError) as exc:
            raise UnsupportedValue(f"token_ids must be a sequence of ints: {str(exc)[:80]}") from None
        if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
            raise UnsupportedValue("token_ids must be a flat sequence of ints")
        if tokens.size and (tokens.dtype.kind == "u" and tokens.max() > np.iinfo(np.int64).max):
            raise UnsupportedValue("token ids must fit in int64")
        content = np.ascontiguousarray(tokens, dtype="<i8")
        header = _native.header(algorithm, "token_prefix", modality, config, tenant_salt)
        framed_parent = frame(parent_bytes)
        return header.key(cls, content.view(np.uint8).data, content.nbytes, framed_parent, "token_prefix")

    @classmethod
    def from_external_id(
        cls,
        identifier: str,
        config: EncoderPreprocessingConfig,
        *,
        source: str,
        modality: Modality,
        algorithm: HashAlgorithm = "xxh3_128",
        tenant_salt: str | bytes | None = None,
    ) -> EmbeddingCacheKey:
        """Key of an input named by another system's identifier (vLLM's `mm_hash`, say).

        Its own namespace ("external"), framed with `source` (who made the identifier, e.g.
        "vllm"): an identifier never meets a raw-bytes or tensor key, nor one of another source.
        The config adds what the identifier does not cover (model revision, encoder config,
        dtype). The identifier must itself be content-addressed: equal identifiers are equal inputs.
        """
        for name, text in (("identifier", identifier), ("source", source)):
            if not isinstance(text, str):
                raise KeyTypeError(f"{name} must be a non-empty str, got {type(text).__name__}")
            if not text:
                raise InvalidKey(f"{name} must be a non-empty str, got ''")
        try:
            content = identifier.encode("utf-8")
            framed_source = frame(source)
        except UnicodeEncodeError:
            raise InvalidKey("identifier and source must be valid text (no lone surrogates)") from None
        header = _native.header(algorithm, "external", modality, config, tenant_salt)
        return header.key(cls, content, len(content), framed_source, "external")

    @property
    def digest(self) -> bytes:
        """The full-width digest bytes."""
        return self._parts[1]

    @property
    def record(self) -> bytes:
        """The key as 48 bytes: algorithm index, digest length, 14 zero bytes, then the digest
        padded with zeros to 32 bytes (how the node index stores and finds it). Made once."""
        try:
            return self._record
        except AttributeError:
            algorithm, digest = self._parts[:2]
            record = RECORD_HEAD.pack(HASH_ALGORITHMS.index(algorithm), len(digest)) + digest.ljust(32, b"\0")
            _set_record(self, record)
            return record

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
        """The namespace: "raw", "tensor", "token_prefix" or "external" (already part of the digest)."""
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


# the slot's own descriptor setter: bypasses the __setattr__ that makes keys immutable
_set_parts: Callable[[EmbeddingCacheKey, tuple[str, bytes, str, str]], None] = vars(EmbeddingCacheKey)[
    "_parts"
].__set__
_set_record: Callable[[EmbeddingCacheKey, bytes], None] = vars(EmbeddingCacheKey)["_record"].__set__
_native.bind(_build_header, vars(EmbeddingCacheKey)["_parts"], UnsupportedValue)
