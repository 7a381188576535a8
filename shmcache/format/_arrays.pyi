"""Type stub of the value-array extension (arrays.c)."""

from typing import Any

import numpy as np

def array(
    buffer: np.ndarray[Any, np.dtype[np.uint8]],
    offset: int,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    writeable: bool,
    /,
) -> np.ndarray[Any, Any]:
    """The C-contiguous array of `dtype` and `shape` whose first byte is byte `offset` of `buffer`
    (a 1-D, C-contiguous uint8 ndarray, its base); writable only if asked and `buffer` is.
    `ValueError` if it does not fit in `buffer`, `TypeError` for arguments of the wrong kind."""

def dlpack(
    buffer: np.ndarray[Any, np.dtype[np.uint8]],
    offset: int,
    dltype: tuple[int, int, int],
    shape: tuple[int, ...],
    /,
) -> Any:
    """A "dltensor" capsule (for `torch.from_dlpack`) of the C-contiguous CPU tensor of DLPack type
    `dltype` (code, bits, lanes) and `shape` whose first byte is byte `offset` of `buffer` (a 1-D,
    C-contiguous, writable uint8 ndarray, which the tensor keeps alive). `ValueError` if it does not
    fit in `buffer` or `dltype` is not of whole bytes, `TypeError` for arguments of the wrong kind."""

def dltype(capsule: Any, /) -> tuple[int, int, int]:
    """(code, bits, lanes) of the tensor in a "dltensor" capsule not yet taken over."""
