"""Text helpers for validation: short reprs for error messages and strict UTF-8 encoding.

Errors name the offending input, but never through a huge repr (a 10 MB string as a modality must
not become a 10 MB message), and a string that cannot be encoded to UTF-8 (a lone surrogate) is
refused with the caller's typed error instead of a bare `UnicodeEncodeError`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["short_repr", "utf8"]

_LIMIT = 60


def short_repr(value: Any, limit: int = _LIMIT) -> str:
    """`repr(value)` cut to `limit` characters (a broken __repr__ gives the type name)."""
    try:
        text = repr(value) if not isinstance(value, str | bytes) or len(value) <= 4 * limit else None
    except Exception:  # a value whose __repr__ fails still gets named
        text = None
    if text is None:
        if isinstance(value, str | bytes):
            text = repr(value[:limit])
        else:
            return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def utf8(value: str, what: str, error: type[Exception]) -> bytes:
    """`value` encoded as UTF-8; `error` naming `what` if it holds lone surrogates."""
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise error(f"{what} is not valid text (it holds a lone surrogate)") from None
