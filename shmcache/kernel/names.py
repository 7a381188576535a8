"""The names of a namespace's objects: ``/dev/shm/shmcache.UID.NS.{index,arena,lock}``.

A namespace name is checked against `NAMESPACE_PATTERN` (anchored at both ends) before it becomes
part of a path, so it can never escape /dev/shm. Each `ObjectNames` also carries the uid that must
own every object (`shmcache.kernel.ownership`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from shmcache.config import NAMESPACE_PATTERN, NAMESPACE_RULE
from shmcache.errors import InvalidConfig
from shmcache.keys.text import short_repr

__all__ = ["PREFIX", "SHM_DIR", "ObjectNames", "list_namespaces", "object_names"]

SHM_DIR = "/dev/shm"
PREFIX = "shmcache"


@dataclass(frozen=True)
class ObjectNames:
    """The names of a namespace's shared-memory objects, and the uid that must own them."""

    index: str
    arena: str
    lock_path: str
    uid: int

    @property
    def index_path(self) -> str:
        return f"{SHM_DIR}{self.index}"

    @property
    def arena_path(self) -> str:
        return f"{SHM_DIR}{self.arena}"


def object_names(namespace: str, uid: int | None = None) -> ObjectNames:
    """Names for `namespace` of user `uid` (default: this process's effective uid);
    `InvalidConfig` for a name that could escape /dev/shm or is not a namespace name."""
    if not isinstance(namespace, str) or NAMESPACE_PATTERN.fullmatch(namespace) is None:
        raise InvalidConfig(f"{NAMESPACE_RULE}, got {short_repr(namespace)}")
    owner = os.geteuid() if uid is None else uid
    base = f"{PREFIX}.{owner}.{namespace}"
    return ObjectNames(f"/{base}.index", f"/{base}.arena", f"{SHM_DIR}/{base}.lock", owner)


def list_namespaces(uid: int | None = None) -> list[str]:
    """Namespaces of user `uid` that have an index segment in /dev/shm."""
    prefix = f"{PREFIX}.{os.geteuid() if uid is None else uid}."
    return sorted(
        name[len(prefix) : -len(".index")]
        for name in os.listdir(SHM_DIR)
        if name.startswith(prefix) and name.endswith(".index")
    )
