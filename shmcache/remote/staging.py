"""The memory remote transfers land in or leave from, in each way of connecting to Mooncake.

- **Own segment** (`setup`): a pull lands in a registered numpy array and is copied into the
  arena after verification; a publish is zero-copy from the arena (registered once).
- **Thin client of the node's holder** (`setup_dummy`, `remote_holder`): Mooncake moves data only
  through the holder's shared memory pool (`alloc_from_mem_pool` + `register_buffer`; registering
  other memory fails), so both directions pass through pool buffers: half of
  `remote_buffer_bytes` for pulls, half for publishes (one publish at a time). Values larger
  than a half do not cross nodes in this mode (counted as drops / misses).

A failed or timed-out transfer may still write into its buffer after the call returned, so the
buffer is *lent* to each transfer call before the call starts (`lend`: set aside, kept alive, never
handed out) and given back only when its answer was read and says nothing writes there any more
(`give_back`). An interrupt anywhere in between leaves it lent. A lent buffer whose call outlived
its wait comes back when that call answers that nothing writes there any more (the whole object
arrived, or no transfer ran): the next pull takes it back (a thin client has one pull half: until
then it pulls nothing, counted as remote errors). A transfer that failed on TCP and was answered
while we waited, well before Mooncake's own wait ran out, leaves nothing writing (answers.py:
Mooncake answered after every slice ended, as when the segment's holder is dead): its buffer is
given back. One that failed otherwise may leave slices in flight: its buffer stays lent. So does
one interrupted before its call started or after its answer came back but before it was read (no
late call to wait for): a thin client then pulls no more until it restarts.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

__all__ = ["ABANDONED", "TOO_LARGE", "LateCall", "Loan", "Reading", "Staging"]

TOO_LARGE: Final = 1  # not a Mooncake code: a value larger than the thin client's publish buffer
ABANDONED: Final = 2  # not a Mooncake code: the publish was ended before it read node memory
Reading = Callable[[], AbstractContextManager[bool]]  # a publish's reading part: may it read


@dataclass(frozen=True)
class LateCall:
    """A transfer call that outlived its wait, and which of its answers mean "nothing writes into
    its memory any more"."""

    future: Future[Any]
    clean: Callable[[Any], bool]

    def ended(self) -> bool:
        """It returned, and its answer is clean: nothing writes into its memory any more (a failed
        transfer may leave slices in flight)."""
        done = self.future
        return done.done() and not done.cancelled() and done.exception() is None and self.clean(done.result())


@dataclass(frozen=True, eq=False)
class Loan:
    """The pull buffer lent to one transfer call, and what that call's answers must be for it to
    come back by itself once the call outlived its wait (`calls` gets that call)."""

    buffer: np.ndarray
    clean: Callable[[Any], bool]
    calls: list[Future[Any]] = field(default_factory=list)

    def ended(self) -> bool:
        """The call outlived its wait and has since answered clean."""
        return bool(self.calls) and LateCall(self.calls[0], self.clean).ended()


class Staging:
    """Pull and publish buffers of one Mooncake client."""

    def __init__(self, client: Any, *, pooled: bool, pool_bytes: int) -> None:
        self._client, self.pooled, self._half = client, pooled, pool_bytes // 2
        self._pull_room = True  # pooled: may the pull half still be allocated
        self._pull: np.ndarray | None = None
        self._publish: np.ndarray | None = None
        self._lent: list[Loan] = []  # pull buffers a transfer call may still write into
        self._publish_lock = threading.Lock()

    def _pool_array(self, nbytes: int) -> np.ndarray | None:
        """`nbytes` of the holder's pool, registered; None when the pool has no room left."""
        address = self._client.alloc_from_mem_pool(nbytes)
        if not address or self._client.register_buffer(address, nbytes) != 0:
            return None
        pool: Any = (ctypes.c_uint8 * nbytes).from_address(address)
        array: np.ndarray = np.frombuffer(pool, dtype=np.uint8)
        return array

    def pull_buffer(self, size: int) -> np.ndarray | None:
        """A registered buffer of at least `size` bytes for `get_into`; None if none can hold it."""
        buffer = self._pull
        if buffer is None:
            buffer = self._pull = self._taken_back()
        if buffer is not None and buffer.nbytes >= size:
            return buffer
        if self.pooled:
            if buffer is not None or size > self._half or not self._pull_room:
                return None  # too large for the pull half, or that half is set aside
            self._pull_room = False
            buffer = self._pool_array(self._half)
        else:
            if buffer is not None:
                self._unregister(buffer)  # grown: its memory may be handed out and registered again
            self._pull = None
            buffer = np.empty(max(size, 1 << 20), dtype=np.uint8)
            if self._client.register_buffer(buffer.ctypes.data, buffer.nbytes) != 0:
                return None
        self._pull = buffer
        return buffer

    def _unregister(self, buffer: np.ndarray) -> None:
        """Own segment: `buffer` is dropped; Mooncake refuses to register memory that overlaps a
        registered range, so a later array at the same addresses could not be registered."""
        self._client.unregister_buffer(int(buffer.ctypes.data))

    def lend(self, buffer: np.ndarray, clean: Callable[[Any], bool]) -> Loan:
        """Set the pull buffer `buffer` aside for one transfer call, before the call starts: it
        is not handed out again until `give_back`, or until the call, once it outlived its wait
        (`Loan.calls`), answers `clean`."""
        if not self.pooled:  # a new array replaces it: those nothing writes into any more can go
            for ended in [loan for loan in self._lent if loan.ended()]:
                self._lent.remove(ended)
                self._unregister(ended.buffer)
        loan = Loan(buffer, clean)
        self._lent.append(loan)  # first: an interrupt before the next line leaves a loan that
        self._pull = None  # never ends (nothing in flight), never a buffer a transfer shares
        return loan

    def give_back(self, loan: Loan) -> None:
        """The call's answer was read, and nothing writes into the buffer any more."""
        self._pull = loan.buffer
        self._lent.remove(loan)

    def _taken_back(self) -> np.ndarray | None:
        """A lent buffer nothing writes into any more, handed out again; None if none."""
        for i, loan in enumerate(self._lent):
            if loan.ended():
                del self._lent[i]
                return loan.buffer
        return None

    def put_from(self, name: str, address: int, nbytes: int, reading: Reading) -> int:
        """`put_from` of [address, address + nbytes): straight from there with our own segment,
        through the publish buffer as a thin client (`TOO_LARGE` if it cannot hold it). The memory
        is read inside `reading()` only: the whole put with our own segment, the copy into the
        publish buffer as a thin client; if it yields False nothing is put (`ABANDONED`)."""
        if not self.pooled:
            with reading() as may:
                return int(self._client.put_from(name, address, nbytes)) if may else ABANDONED
        with self._publish_lock:  # one publish at a time through it
            buffer = self._publish_buffer(nbytes)
            if buffer is None:
                return TOO_LARGE
            with reading() as may:
                if not may:
                    return ABANDONED
                ctypes.memmove(int(buffer.ctypes.data), address, nbytes)
            return int(self._client.put_from(name, int(buffer.ctypes.data), nbytes))

    def _publish_buffer(self, size: int) -> np.ndarray | None:
        """Pooled mode: the buffer a publish copies its entry into."""
        if self._publish is None and self._half:
            self._publish = self._pool_array(self._half)
        buffer = self._publish
        return buffer if buffer is not None and buffer.nbytes >= size else None
