"""The request in scope: which request the encoder calls of this thread or task serve.

Encoder call sites (`self.visual(pixel_values, grid_thw=grid_thw)`) have no request id in scope; the
stage that runs them does. It sets the request around its step (`with cache.request(rid):`),
and the calls made inside take their references for that request (released by
`cleanup_request(rid)` when the request ends). A contextvar: each thread and asyncio task sees
its own.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from shmcache.process.arguments import check_request
from shmcache.process.reservation import RequestId

__all__ = ["current_request", "request_scope"]

_current: contextvars.ContextVar[RequestId | None] = contextvars.ContextVar("shmcache_request", default=None)


def current_request() -> RequestId | None:
    """The request set by the innermost `request_scope` of this context, or None."""
    return _current.get()


@contextlib.contextmanager
def request_scope(request_id: RequestId) -> Iterator[None]:
    """Make `request_id` the request in scope until the block ends."""
    check_request(request_id)
    token = _current.set(request_id)
    try:
        yield
    finally:
        _current.reset(token)
