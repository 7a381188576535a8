"""The extent a pull guesses for a key: the entry size of its modality and kind, once steady.

A pull into node memory allocates before it transfers, and asking the store for the size costs a
round trip. When the last two entries this process pulled or published for a (modality, key kind)
had the same size (a ViT's tokens per image at a fixed resolution, a video's frames), that size
is the guess. A kind whose sizes vary (audio clips of any length) is never guessed: a guess far
above the object would evict entries for room it gives back, and one below costs a refused call.
One wrong guess, when a steady kind's size changes, costs either that refused call or, at most
once, the eviction of the difference. A guess decides only an extent's size, never what is
stored (every pull is verified), so threads racing on `saw` are harmless.
"""

from __future__ import annotations

from typing import NamedTuple

from shmcache.keys.key import EmbeddingCacheKey
from shmcache.node.layout import key_meta

__all__ = ["SizeGuesses"]


class _Seen(NamedTuple):
    size: int  # the last entry's size
    steady: bool  # the entry before it had that size too


class SizeGuesses:
    """Per (modality, key kind): the last entry size seen, and whether it is a guess yet."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], _Seen] = {}

    def saw(self, key: EmbeddingCacheKey, size: int) -> None:
        """An entry of `size` bytes of `key`'s kind was pulled or published."""
        meta = key_meta(key)
        last = self._seen.get(meta)
        self._seen[meta] = _Seen(size, last is not None and last.size == size)

    def guess(self, key: EmbeddingCacheKey) -> int | None:
        """The extent to try for `key`, or None: ask the store for the size."""
        seen = self._seen.get(key_meta(key))
        return seen.size if seen is not None and seen.steady else None
