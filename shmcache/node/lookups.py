"""The hit path: finding and pinning sealed entries, existence checks and repeat-hit checks.

Each is one native call (native.c); this module adds only what the native code hands back: a
stripe whose last holder died inside, or a damaged record, answers `SLOW`, and the lookup is then
redone on the locked path: the stripe section entered from Python (which runs its repair) with the
same native step inside, quarantining damaged records as it meets them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from shmcache.errors import PinLimitReached
from shmcache.node import _native
from shmcache.node.layout import Counter
from shmcache.node.sections import Sections
from shmcache.node.slots import SealedEntry

__all__ = ["Lookups"]


class Lookups:
    """The lookups of one `NodeIndex` (its native handle, sections and quarantine)."""

    def __init__(
        self,
        native: _native.Index,
        sections: Sections,
        quarantine: Callable[[int], None],
        stripe_of: Callable[[bytes], int],
        reclaim: Callable[[], bool],
    ) -> None:
        """`reclaim`: release this process's dead views' pins now (True if any were)."""
        self._native, self._sections, self._quarantine = native, sections, quarantine
        self._stripe_of, self._reclaim = stripe_of, reclaim

    def lookup(self, needle: bytes, pins: int, *, counted: bool = False) -> SealedEntry | None:
        """A sealed, unexpired entry for `needle`, pinned `pins` times; None on a miss. When
        `counted`, the hit or miss is counted (HITS_NODE, MISSES). Out of pin records, the dead
        views' pins are released first, then once more (`PinLimitReached` if still out)."""
        try:  # the hit path: `after_reclaim` written out (no closure per call)
            answer = self._native.lookup(needle, pins, counted)
        except PinLimitReached:
            if not self._reclaim():
                raise
            answer = self._native.lookup(needle, pins, counted)
        if isinstance(answer, _native.Slow):  # (the locked path does not release dead views first)
            answer = self._locked(needle, pins, counted)
        return answer

    def lookup_many(
        self, needles: list[bytes], pins: int, release: Callable[[list[tuple[int, int]]], None]
    ) -> list[SealedEntry | None]:
        """`lookup` of every needle, in order, in one native call, each hit or miss counted. If
        anything raises (out of pin records, a lock timeout), the hits already pinned are given
        to `release` first. With fewer free pin records than the batch may take, the dead views'
        pins are released first."""
        if pins and self._native.pins_spare() < len(needles):
            self._reclaim()
        try:
            answers = self._native.lookup_many(needles, pins, True)
        except BaseException as exc:  # KeyboardInterrupt too: a wait for a stripe is interruptible
            release(_pins(getattr(exc, "answers", []), pins))
            raise
        hits: list[SealedEntry | None] = []
        try:
            for needle, answer in zip(needles, answers, strict=True):
                if isinstance(answer, _native.Slow):  # not pinned: its stripe needs a repair
                    answer = self._locked(needle, pins, True)
                hits.append(answer)
        except BaseException:
            release(_pins([*hits, *answers[len(hits) :]], pins))  # the one that raised held no pin
            raise
        return hits

    def contains(self, needle: bytes) -> bool:
        """True if `needle` is sealed and unexpired now: lock-free, no pin (the access is stamped)."""
        answer = self._native.contains(needle)
        return self.lookup(needle, 0) is not None if isinstance(answer, _native.Slow) else answer

    def contains_many(self, needles: list[bytes]) -> list[bool]:
        """`contains` of every needle, in order, in one native call."""
        return [
            self.lookup(needle, 0) is not None if isinstance(answer, _native.Slow) else answer
            for needle, answer in zip(needles, self._native.contains_many(needles), strict=True)
        ]

    def repeat_hit(self, slot: int, gen: int, *, counted: bool) -> bool:
        """Lock-free: an entry this process holds a pin on, (slot, gen), is still sealed and
        unexpired (the access is then stamped, and with `counted` a process hit counted)."""
        return self._native.repeat_hit(slot, gen, counted)

    def hit_in(self, stripe: int, needle: bytes, now: float, pins: int) -> SealedEntry | None:
        """The lookup step inside a stripe section the caller holds."""
        while True:
            answer = self._native.hit_in(stripe, needle, now, pins)
            if not isinstance(answer, int):
                return answer
            self._quarantine(answer)  # a damaged record: made unreachable, then look again

    def _locked(self, needle: bytes, pins: int, counted: bool) -> SealedEntry | None:
        stripe = self._stripe_of(needle)
        with self._sections.stripe(stripe):  # repairs the stripe if its last holder died inside
            hit = self.hit_in(stripe, needle, time.monotonic(), pins)
        if counted:
            self._native.count(Counter.MISSES if hit is None else Counter.HITS_NODE, 1)
        return hit


def _pins(answers: Sequence[SealedEntry | _native.Slow | None], pins: int) -> list[tuple[int, int]]:
    """One (slot, gen) per pin the hits among `answers` hold."""
    return [
        (answer.slot, answer.gen)
        for answer in answers
        if isinstance(answer, SealedEntry)
        for _ in range(pins)
    ]
