"""Argument checks of the public calls: each raises one typed error before anything is touched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shmcache.config import CacheConfig
from shmcache.errors import ArgumentTypeError, InvalidKey, KeyTypeError, RequestIdTypeError
from shmcache.keys.key import EmbeddingCacheKey
from shmcache.node.layout import Layout, needle_of
from shmcache.process.reservation import ReservationTicket
from shmcache.remote.lease import Lease

__all__ = [
    "check_callable",
    "check_keys",
    "check_request",
    "check_request_named",
    "check_ticket",
    "check_ticket_fits",
    "config_of",
    "needle",
    "needles",
    "request_needle",
    "request_needles",
]


def check_request(request_id: Any) -> None:
    """`RequestIdTypeError` for a request id that cannot be a dict key."""
    try:
        hash(request_id)
    except TypeError:
        raise RequestIdTypeError(f"request_id must be hashable, got {type(request_id).__name__}") from None


def check_request_named(request_id: Any) -> None:
    """`check_request`, and `RequestIdTypeError` for None too: `hold` and `cleanup_request` name a
    request, where None means "no request" to the calls that take one optionally."""
    if request_id is None:
        raise RequestIdTypeError("request_id must name a request, got None")
    check_request(request_id)


def config_of(config: Any) -> CacheConfig:
    """`config`, or the default `CacheConfig` for None; `ArgumentTypeError` for anything else (a
    dict of settings, say: `CacheConfig(**settings)` or `CacheConfig.from_stage_config` make one)."""
    if config is None:
        return CacheConfig()
    if not isinstance(config, CacheConfig):
        raise ArgumentTypeError(
            f"config must be a CacheConfig, got {type(config).__name__} "
            "(build one with CacheConfig(**settings) or CacheConfig.from_stage_config(settings))"
        )
    return config


def check_callable(name: str, function: Any) -> None:
    """`ArgumentTypeError` unless `function` can be called."""
    if not callable(function):
        raise ArgumentTypeError(f"{name} must be callable, got {type(function).__name__}")


def check_ticket(ticket: Any) -> None:
    """`ArgumentTypeError` unless `ticket` is a `ReservationTicket` of well-typed fields (and a
    lease, if any, that is a `Lease`)."""
    if not isinstance(ticket, ReservationTicket):
        raise ArgumentTypeError(f"ticket must be a ReservationTicket, got {type(ticket).__name__}")
    fields = (ticket.slot, ticket.gen, ticket.giver)
    if not (
        all(type(field) is int for field in fields)
        and isinstance(ticket.namespace, str)
        and isinstance(ticket.digest, bytes)
    ):
        raise ArgumentTypeError(f"a ticket's slot, gen and giver must be ints, got {ticket!r}")
    lease = ticket.lease
    if lease is not None and not (
        isinstance(lease, Lease) and isinstance(lease.name, str) and isinstance(lease.token, bytes)
    ):
        raise ArgumentTypeError(f"a ticket's lease must be a Lease(name: str, token: bytes), got {lease!r}")


def check_ticket_fits(ticket: ReservationTicket, layout: Layout) -> None:
    """`InvalidKey` unless `ticket` names a slot, generation and client `layout` can have."""
    if not (0 <= ticket.slot < layout.slots and ticket.gen > 0 and 0 <= ticket.giver < layout.clients):
        raise InvalidKey(f"the ticket names no reservation this namespace can hold: {ticket!r}")


def check_keys(keys: Any) -> None:
    """`ArgumentTypeError` unless `keys` is a list or tuple (of keys: each is checked by `needle`)."""
    if not isinstance(keys, list | tuple):
        raise ArgumentTypeError(f"keys must be a list or tuple of keys, got {type(keys).__name__}")


def needle(key: Any, algorithm: str) -> bytes:
    """The index needle of `key`: `KeyTypeError` for anything but a key, `InvalidKey` for a key of
    another hash algorithm than `algorithm`."""
    if not isinstance(key, EmbeddingCacheKey):
        raise KeyTypeError(f"expected an EmbeddingCacheKey, got {type(key).__name__}")
    if key.algorithm != algorithm:
        raise InvalidKey(f"key uses {key.algorithm}, this cache is configured for {algorithm}")
    return needle_of(key)


def needles(keys: Sequence[Any], algorithm: str) -> list[bytes]:
    """`needle` of each of `keys`, in order."""
    return [needle(key, algorithm) for key in keys]


def request_needle(key: Any, request_id: Any, algorithm: str) -> bytes:
    """`needle` of `key` for a call that takes an optional `request_id`, checked first."""
    if request_id is not None:
        check_request(request_id)
    return needle(key, algorithm)


def request_needles(keys: Any, request_id: Any, algorithm: str) -> list[bytes]:
    """`needles` of a batch of `keys` (`check_keys`) for an optional `request_id`, checked first."""
    check_keys(keys)
    check_request(request_id)
    return needles(keys, algorithm)
