"""Kernel objects: the SysV semaphore set with SEM_UNDO (semaphores.py) and a namespace's shared
memory segments (segments.py), attached, wiped and destroyed under a bootstrap lock
(namespace.py; creation.py makes them; the names in names.py, the lock in lockfile.py). Every
object is verified to be ours before it is used or removed (ownership.py), and only a
proven-dead namespace is ever wiped (identity.py). Readers get copy-on-write views (cowmap.py,
mapped by the C extension mapping.c); writers fill shared memory with `copy_into` (mapping.c:
from 2 MiB on x86-64 the copy bypasses the cache)."""

from shmcache.kernel._mapping import copy_into

__all__ = ["copy_into"]
