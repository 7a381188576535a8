"""Is this index a namespace of ours, and is it live, proven dead, or damaged?

An attacher holds the bootstrap lock and reads the index header. Only a *proven-dead* namespace may
be wiped, so the verdict is one of:

- **never written**: the magic and the `ready` field are zero (the creator died before it finished
  the header, which it writes magic last): stale;
- **stale**: the header is intact (magic, layout version, every layout field in range and the
  sizes they give equal to the segment's size) and either the semaphore set it names is this
  namespace's (ours, of the size the layout gives, with the namespace's signature) and no
  client's liveness semaphore is up, or no set with that id exists any more (a wiper killed
  between removing the set and unlinking the index) and no claimed client record names a process
  that is still running (pid and kernel start time);
- **live**: the set is this namespace's and a client is alive (the caller attaches);
- anything else raises: `CorruptSegment` for a header that fails its checks, names a set of ours
  that is not this namespace's, or contradicts the liveness it shows; `LayoutMismatch` for
  another layout version; `ForeignObject` for a set owned or created by another user or with
  permissions wider than allowed. Nothing is wiped then.
"""

from __future__ import annotations

import math
import mmap

from shmcache.config import MAX_CLIENTS, MAX_ENTRIES, MAX_PINS, MAX_WAYS, MIN_CAPACITY, MIN_PINS
from shmcache.errors import CorruptSegment, LayoutMismatch
from shmcache.kernel.ownership import Expected, check_semaphores, semaphore_owner
from shmcache.kernel.semaphores import KEY_LIMIT, SemaphoreSet, set_size
from shmcache.keys.key import HASH_ALGORITHMS
from shmcache.node.clients import start_ticks
from shmcache.node.layout import (
    CLIENT_HEAD,
    DESTROYED,
    H_READY,
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    Header,
    Layout,
)

__all__ = [
    "attached_process",
    "check_header",
    "judge",
    "keyed_set",
    "namespace_set",
    "never_written",
    "signature_of",
    "signed_set",
]

_MAX_SIGNATURE = (1 << 30) - 1
_PID_MAX_LIMIT = 1 << 22  # the kernel's largest pid: a held marker holds 0 or a pid


def never_written(index: mmap.mmap | bytes) -> bool:
    """True if the creator died before finishing the header (magic and `ready` still zero)."""
    if len(index) < HEADER_SIZE:
        return True
    zero = bytes(len(MAGIC))
    return index[: len(MAGIC)] == zero and index[H_READY : H_READY + 4] == bytes(4)


def check_header(header: Header, size: int, where: str) -> None:
    """`CorruptSegment` unless every field of `header` (magic and version already checked) is in
    range and the layout it gives fills exactly the `size` bytes of the segment."""
    problems = []
    if header.ready not in (0, 1, DESTROYED):
        problems.append(f"ready={header.ready}")
    if not 1 <= header.ways <= MAX_WAYS or not 1 <= header.stripes <= MAX_ENTRIES // header.ways:
        problems.append(f"stripes={header.stripes} ways={header.ways}")
    if not 1 <= header.clients <= MAX_CLIENTS or not MIN_PINS <= header.pins <= MAX_PINS:
        problems.append(f"clients={header.clients} pins={header.pins}")
    if header.capacity < MIN_CAPACITY or not 0 < header.signature <= _MAX_SIGNATURE or header.semid < 0:
        problems.append(f"capacity={header.capacity} semid={header.semid}")
    if header.algorithm >= len(HASH_ALGORITHMS) or not (math.isfinite(header.ttl) and header.ttl >= 0):
        problems.append(f"algorithm={header.algorithm} ttl={header.ttl!r}")
    if header.mode & 0o777 != header.mode or header.mode & 0o600 != 0o600:
        problems.append(f"mode={header.mode:#o}")
    if header.node_held > _PID_MAX_LIMIT or not -1 <= header.journal_row < max(header.clients, 0):
        problems.append(f"node_held={header.node_held} journal_row={header.journal_row}")
    if not problems and header.layout.size != size:
        problems.append(f"its layout needs {header.layout.size} bytes, the segment has {size}")
    if problems:
        raise CorruptSegment(f"index {where} has a damaged header: {', '.join(problems)[:200]}")


def signature_of(sems: SemaphoreSet, layout: Layout) -> int:
    """The 30-bit signature the creator wrote into the namespace's set."""
    return sems.value(layout.signature_sem) | sems.value(layout.signature_sem + 1) << 15


def namespace_set(header: Header, expected: Expected, *, strict: bool = True) -> SemaphoreSet | None:
    """The namespace's semaphore set named by `header`, verified; None if no set has that id.

    `ForeignObject` for another user's set, or one of ours whose permissions are wider than
    allowed. A set of ours that is not this namespace's (another size, another signature) means
    the header is damaged: `CorruptSegment` if `strict`, else None.
    """
    owner = semaphore_owner(header.semid)
    if owner is None:
        return None
    if owner.uid != expected.uid or owner.cuid != expected.uid:
        check_semaphores(header.semid, owner, expected)  # raises: not ours
    layout = header.layout
    sems = SemaphoreSet(header.semid, layout.semaphores)
    if not sems.probe() or signature_of(sems, layout) != header.signature:
        if not strict:
            return None
        raise CorruptSegment(
            f"index header names semaphore set {header.semid}, which is not this namespace's "
            "(another size or signature)"
        )
    check_semaphores(header.semid, owner, expected)  # ours: the mode must be within bounds
    return sems


def signed_set(header: Header, expected: Expected) -> SemaphoreSet | None:
    """The set `header` names when its layout fields are damaged (the set cannot be sized by
    them): ours, and carrying the header's signature in its last two semaphores, where every
    layout keeps it; None otherwise (another user's set too: a damaged header may name any)."""
    owner = semaphore_owner(header.semid)
    if owner is None or not 0 < header.signature <= _MAX_SIGNATURE:
        return None
    if owner.uid != expected.uid or owner.cuid != expected.uid:
        return None
    count = set_size(header.semid)
    if count < 2:
        return None
    sems = SemaphoreSet(header.semid, count)
    return sems if sems.value(count - 2) | sems.value(count - 1) << 15 == header.signature else None


def keyed_set(header: Header, expected: Expected) -> SemaphoreSet | None:
    """The set made under `header.semkey` by a creator that died before it wrote the set's id
    into the header (`semid` still -1): ours, of the size the layout gives, and signed with the
    header's signature or not signed yet (the creator signs right after making it); None
    otherwise. The key was drawn at random and the set made with IPC_EXCL, so an unsigned set
    of ours under it is another namespace's only if that namespace drew the same 31-bit key
    after this creator died before making its set."""
    semid = SemaphoreSet.find(header.semkey) if 0 < header.semkey < KEY_LIMIT else None
    owner = None if semid is None else semaphore_owner(semid)
    if semid is None or owner is None or owner.uid != expected.uid or owner.cuid != expected.uid:
        return None
    layout = header.layout
    sems = SemaphoreSet(semid, layout.semaphores)
    if not sems.probe() or signature_of(sems, layout) not in (0, header.signature):
        return None
    return sems


def attached_process(index: mmap.mmap, layout: Layout) -> int | None:
    """The pid of a process that a claimed client record names and that still runs (same pid and
    kernel start time), or None."""
    for row in range(layout.clients):
        state, pid, ticks, _attached = CLIENT_HEAD.unpack_from(index, layout.client_off(row))
        if state == 1 and pid and ticks and start_ticks(pid) == ticks:
            return int(pid)
    return None


def judge(index: mmap.mmap, where: str, expected: Expected) -> tuple[Header, SemaphoreSet] | None:
    """(header, semaphore set) of a live namespace, None for a stale one; raises otherwise (see the
    module docstring). The caller holds the bootstrap lock."""
    if never_written(index):
        return None
    header = Header.read(index)
    if header.layout_version != LAYOUT_VERSION:
        raise LayoutMismatch(
            f"namespace {where} has layout version {header.layout_version}, this shmcache writes "
            f"{LAYOUT_VERSION}"
        )
    check_header(header, len(index), where)
    if header.ready == DESTROYED:  # a destroy died before it removed everything: finish it
        return None
    layout = header.layout
    sems = namespace_set(header, expected)
    if sems is None:  # the set is gone: dead only if no process of the client table still runs
        pid = attached_process(index, layout)
        if pid is not None:
            raise CorruptSegment(
                f"index {where} names semaphore set {header.semid}, which does not exist, while "
                f"process {pid} is attached"
            )
        return None
    if not sems.values()[layout.client_sem(0) : layout.client_sem(layout.clients)].any():
        return None
    if header.ready != 1:
        raise CorruptSegment(f"index {where} is marked half-created but has live clients")
    return header, sems
