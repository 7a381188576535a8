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
