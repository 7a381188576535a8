"""How one batched encoder call is made of items: which rows are an item's input (and its key),
how to call the encoder on some of the items, and how to cut and join the outputs.

- `BatchedItems`: item i is row i of the first argument (CLIP/SigLIP pixel batches, Whisper
  feature batches); the output has one row per item.

Each item's key also covers the call's other arguments (and the item's rows of per-item ones):
`context.py`.
- `PackedItems`: the items are packed one after another along a dimension of the first argument,
  each described by one row of a table argument (Qwen-VL's `grid_thw`: an image of t x h x w
  patches is t*h*w rows of `pixel_values` and gives `output_rows(t, h, w)` rows of embeddings).
  An item's key is its rows shaped by its row of that tensor, so the same rows under another
  grid are another key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shmcache.errors import ArgumentTypeError, UnsupportedValue
from shmcache.integrations.encoder.context import call_context

__all__ = ["BatchedItems", "ItemCall", "ItemLayout", "PackedItems"]


@dataclass(frozen=True)
class ItemCall:
    """One batched call, cut into its items."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    keys: list[Any]  # per item, the tensor its cache key is made of
    contexts: list[bytes | None]  # per item, `call_context` of everything else its output depends on

    @property
    def count(self) -> int:
        return len(self.keys)


class ItemLayout(Protocol):
    """What a `CachedEncoder` needs to know about its encoder's batched calls."""

    def split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ItemCall:
        """Cut a call into its items (`ArgumentTypeError` if the call does not have the layout)."""

    def subset(self, call: ItemCall, items: Sequence[int]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments of the same call over `items` only, in that order."""

    def cut(self, output: Any, call: ItemCall, items: Sequence[int]) -> list[Any]:
        """The per-item outputs of the encoder called on `subset(call, items)`."""

    def join(self, outputs: Sequence[Any]) -> Any:
        """The output of the whole call, from its items' outputs in order."""


def _first_tensor(args: tuple[Any, ...]) -> Any:
    import torch

    if not args or not isinstance(args[0], torch.Tensor):
        raise ArgumentTypeError("the encoder's first argument must be the batched input tensor")
    return args[0]


def _output_tensor(output: Any) -> Any:
    import torch

    if not isinstance(output, torch.Tensor):
        raise UnsupportedValue(f"the encoder must return one tensor, got {type(output).__name__}")
    return output


@dataclass(frozen=True)
class BatchedItems:
    """Item i is `args[0][i]` (and row i of each keyword tensor named in `per_item`); the output
    is a tensor whose row i is item i's output."""

    per_item: tuple[str, ...] = ()

    def split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ItemCall:
        batch = _first_tensor(args)
        if batch.dim() == 0:
            raise ArgumentTypeError("the batched input must have a batch dimension")
        count = batch.shape[0]
        given = [name for name in self.per_item if kwargs.get(name) is not None]  # may be left out, or None
        shared = {name: value for name, value in kwargs.items() if name not in given}
        if not given:  # one digest for the whole call
            contexts = [call_context(args[1:], shared)] * count
        else:
            own = [{f"{name}[item]": kwargs[name][i] for name in given} for i in range(count)]
            contexts = [call_context(args[1:], {**shared, **rows}) for rows in own]
        return ItemCall(args, kwargs, [batch[i] for i in range(count)], contexts)

    def subset(self, call: ItemCall, items: Sequence[int]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        rows = list(items)
        kwargs = dict(call.kwargs)
        for name in self.per_item:
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name][rows]
        return (call.args[0][rows], *call.args[1:]), kwargs

    def cut(self, output: Any, call: ItemCall, items: Sequence[int]) -> list[Any]:
        tensor = _output_tensor(output)
        if tensor.dim() == 0 or tensor.shape[0] != len(items):
            raise UnsupportedValue(f"the encoder gave {tuple(tensor.shape)} for {len(items)} items")
        return list(tensor.unbind(0))

    def join(self, outputs: Sequence[Any]) -> Any:
        import torch

        return torch.stack(list(outputs))


def _row(row: Any) -> tuple[int, ...]:
    values = row.tolist() if hasattr(row, "tolist") else row
    return tuple(int(v) for v in values) if isinstance(values, list | tuple) else (int(values),)


@dataclass(frozen=True)
class PackedItems:
    """Items packed along `dim` of `args[0]`; row i of the per-item table `meta` describes item i,
    whose input is the product of that row's values long and whose output is `output_rows(row)`
    rows of the output tensor (packed along its dimension 0). The table is a tensor, an array or
    a list of rows, passed as the keyword `meta` or as positional argument `position` (vLLM's
    Qwen-VL towers are called `visual(x, grid_thw=rows_as_a_list)` and `visual(x, grid_thw)`)."""

    meta: str
    output_rows: Callable[[tuple[int, ...]], int]
    dim: int = 0
    position: int | None = 1

    def __post_init__(self) -> None:
        if self.position is not None and (type(self.position) is not int or self.position < 1):
            raise ArgumentTypeError(
                f"position must be None or an int >= 1 (0 is the input), got {self.position!r}"
            )

    def _table(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, str | int]:
        """The per-item table and where the call passed it (its keyword, or its position)."""
        if self.meta in kwargs:
            return kwargs[self.meta], self.meta
        if self.position is not None and len(args) > self.position:
            return args[self.position], self.position
        raise ArgumentTypeError(
            f"the call must pass its per-item table as {self.meta}= (or argument {self.position})"
        )

    def _rows(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int, ...]]:
        table, _ = self._table(args, kwargs)
        rows = table.tolist() if hasattr(table, "tolist") else table
        try:
            if not isinstance(rows, list | tuple):
                raise TypeError(type(table).__name__)
            return [_row(row) for row in rows]
        except (TypeError, ValueError) as exc:
            raise ArgumentTypeError(f"{self.meta} must be a table of integer rows ({exc})") from None

    def split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ItemCall:
        packed = _first_tensor(args)
        rows = self._rows(args, kwargs)
        lengths = [math.prod(row) for row in rows]
        if sum(lengths) != packed.shape[self.dim]:
            raise ArgumentTypeError(
                f"{self.meta} describes {sum(lengths)} rows, the input has {packed.shape[self.dim]}"
            )
        parts = packed.split(lengths, dim=self.dim)
        keys = [
            part.movedim(self.dim, 0).reshape(*row, *part.movedim(self.dim, 0).shape[1:])
            for part, row in zip(parts, rows, strict=True)
        ]
        _, place = self._table(args, kwargs)  # the table is in the keys' shapes
        others = tuple(value for i, value in enumerate(args) if i not in (0, place))
        context = call_context(others, {name: value for name, value in kwargs.items() if name != place})
        return ItemCall(args, kwargs, keys, [context] * len(keys))

    def subset(self, call: ItemCall, items: Sequence[int]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call over `items`, its table in the form and place the call gave it."""
        import torch

        packed = call.args[0]
        lengths = [math.prod(row) for row in self._rows(call.args, call.kwargs)]
        parts = packed.split(lengths, dim=self.dim)
        chosen = torch.cat([parts[i] for i in items], dim=self.dim)
        table, place = self._table(call.args, call.kwargs)
        rows = table[list(items)] if hasattr(table, "tolist") else type(table)(table[i] for i in items)
        args, kwargs = (chosen, *call.args[1:]), dict(call.kwargs)
        if isinstance(place, str):
            kwargs[place] = rows
        else:
            args = (*args[:place], rows, *args[place + 1 :])
        return args, kwargs

    def cut(self, output: Any, call: ItemCall, items: Sequence[int]) -> list[Any]:
        tensor = _output_tensor(output)
        rows = self._rows(call.args, call.kwargs)
        sizes = [self.output_rows(rows[i]) for i in items]
        if tensor.dim() == 0 or tensor.shape[0] != sum(sizes):
            raise UnsupportedValue(f"the encoder gave {tuple(tensor.shape)} for item outputs of {sizes} rows")
        return list(tensor.split(sizes, dim=0))

    def join(self, outputs: Sequence[Any]) -> Any:
        import torch

        return torch.cat(list(outputs), dim=0)
