"""argparse types of the command-line tools: numbers within bounds (a usage error otherwise)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["at_least"]


def at_least(
    minimum: float, kind: type[int] | type[float] = int, *, at_most: int = 1 << 31
) -> Callable[[str], int | float]:
    """An argparse type: a number of `kind` from `minimum` to `at_most`."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not minimum <= value <= at_most:  # NaN too
            raise argparse.ArgumentTypeError(f"must be {minimum} or more (at most {at_most}), got {text}")
        return value

    return parse
