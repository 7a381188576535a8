"""Outputs written in place (`Reservation.create`, then `seal`): the compute writes its output
straight into its reservation's extent, and the seal stores it with no copy (Ray plasma's
create/seal).

A reservation's extent is read by nobody and written by nobody else until the seal. The tensor
`create` returns is over a *shared* mapping of the extent's payload pages (`Pool.map_shared` in
kernel/mapping.c; a forked child does not inherit it). Before the reservation ends in any way
(seal, a commit of another value, abandon, withdraw, hand-over) that mapping is *frozen*:
remapped copy-on-write in place (read-only if that fails). The tensor stays valid, but a write
through it from then on reaches only this process's copy of its pages: never the
sealed entry that other processes read, nor memory the allocator later gives to another entry.
A process that dies while writing leaves an unsealed reservation, which a waiter takes over as
after any owner's death (node/reservations.py). A reservation left open at the cache's close
stays its process's until that process exits (its semaphore is held till then), so the extent is
never handed out while the tensor can still write it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from shmcache.errors import ArgumentTypeError, InvalidArgument
from shmcache.format import entry, values
from shmcache.format.values import EncodedValue
from shmcache.kernel import _mapping
from shmcache.kernel.cowmap import CowMapper
from shmcache.keys.dtypes import torch_dtype_name

if TYPE_CHECKING:
    import torch

__all__ = ["Output", "check_output", "create", "plan", "private_output"]


def check_output(shape: Any, dtype: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """`shape` as a tuple and `dtype`: `ArgumentTypeError` unless a sequence of ints and a
    torch.dtype, `InvalidArgument` for a negative dimension, `UnsupportedValue` for a dtype the
    value format does not hold."""
    import torch

    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    torch_dtype_name(dtype)
    if not isinstance(shape, Sequence) or isinstance(shape, str | bytes):
        raise ArgumentTypeError(f"shape must be a sequence of ints, got {type(shape).__name__}")
    dims = tuple(shape)
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ArgumentTypeError(f"shape must be a sequence of ints, got a {type(dim).__name__}")
        if dim < 0:
            raise InvalidArgument(f"shape {dims} has a negative dimension")
    return dims, dtype


def private_output(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor an uncached reservation's compute writes into: this process's own memory."""
    import torch

    return torch.empty(shape, dtype=dtype)


def plan(shape: tuple[int, ...], dtype: torch.dtype) -> EncodedValue:
    """The layout of a tensor of `shape` and `dtype` (its memory, allocated lazily, is never
    touched)."""
    return values.plan(private_output(shape, dtype))


@dataclass(eq=False)
class Output:
    """An output being written in place: the tensor handed to the compute, the entry's extent
    (`offset`, `nbytes`: the entry, header included) and its encoding, and the shared mapping
    under the tensor (None for an output of no bytes)."""

    tensor: torch.Tensor
    encoded: EncodedValue
    offset: int
    nbytes: int
    mapping: _mapping.Mapping | None

    def freeze(self) -> None:
        """Make the tensor copy-on-write: nothing written through it reaches node memory any more
        (`OSError` if that failed: its reservation must then not end). Idempotent."""
        if self.mapping is not None:
            self.mapping.freeze()


def create(
    arena: CowMapper, offset: int, shape: tuple[int, ...], dtype: torch.dtype, encoded: EncodedValue
) -> Output:
    """The output of `encoded` (a tensor of `shape` and `dtype`) whose entry starts at `offset`
    of the arena: a tensor over a shared mapping of its payload bytes."""
    import torch

    ((payload, data),) = encoded.payloads
    start = offset + entry.ENTRY_HEADER_SIZE + payload
    mapping = arena.shared(start, data.nbytes) if data.nbytes else None
    if mapping is None:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        tensor = torch.frombuffer(cast(bytes, mapping), dtype=dtype).view(shape)
    return Output(tensor, encoded, offset, entry.entry_size(encoded), mapping)
