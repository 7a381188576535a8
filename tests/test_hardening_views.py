"""No consumer can write through a returned view into the node's copy: numpy views are read-only
(a write raises), and a write through a torch tensor (or a numpy array made writeable on purpose)
lands in this process's copy-on-write mapping, never in the node's copy or another process; and no
change a consumer makes to its value in place (shape, dtype, the memory a tensor points at, a
prefix's token ids) reaches the values later gets return."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import multiprocessing as mp
import os
from typing import Any

import numpy as np
import pytest
import torch

from shmcache import CacheConfig, EmbeddingCache, EmbeddingCacheKey, HiddenStatePrefix, ViewMutated
from shmcache.node.audit import audit
from shmcache.process.mappings import Mappings
from shmcache.process.views import Views
from shmcache.testing import sample_preprocessing
from tests.helpers import InterruptAtLine, spawn, wait_for

ONES = torch.ones(4096, dtype=torch.float32)  # 16 KiB: several pages, so a write copies one of many


def _key(name: str) -> EmbeddingCacheKey:
    return EmbeddingCacheKey.from_raw_bytes(name.encode(), sample_preprocessing(), modality="image")


def read_both(config: CacheConfig, results: Any) -> None:
    """Another process: report whether both entries read as stored."""
    with EmbeddingCache(config) as cache:
        tensor, array = cache.get(_key("tensor")), cache.get(_key("array"))
        results.put((torch.equal(tensor, ONES), bool((array == ONES.numpy()).all())))


def _other_process_reads(config: CacheConfig) -> tuple[bool, bool]:
    results = mp.get_context("spawn").Queue()
    proc = spawn(read_both, config, results)
    report: tuple[bool, bool] = results.get(timeout=120)
    proc.join(30)
    return report


def test_a_write_through_a_returned_view_never_reaches_the_nodes_copy(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        cache.put(_key("tensor"), ONES)
        cache.put(_key("array"), ONES.numpy())
        tensor, array = cache.get(_key("tensor")), cache.get(_key("array"))
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 42.0  # numpy: read-only, the write raises
        tensor.add_(1)  # torch has no read-only tensors: the write is this mapping's own
        array.flags.writeable = True  # on purpose, as a careless consumer might
        array[:] = 7.0
        assert float(tensor[0]) == 2.0 and float(array[-1]) == 7.0
        assert _other_process_reads(config) == (True, True)
        del tensor, array
        gc.collect()
        # a view made after the written ones are gone reads the node's copy
        assert torch.equal(cache.get(_key("tensor")), ONES)
        assert (cache.get(_key("array")) == ONES.numpy()).all()
        assert cache.stats()["corrupt_records"] == 0


def _prefix() -> HiddenStatePrefix:
    return HiddenStatePrefix([1, 2, 3], torch.arange(12.0).reshape(3, 4), {"voice": "a"})


IN_PLACE: dict[str, tuple[Any, Any]] = {  # what is stored, and a change made to the value a get returned
    "tensor.unsqueeze_": (torch.arange(6.0).reshape(2, 3), lambda v: v.unsqueeze_(0)),
    "tensor.t_": (torch.arange(9.0).reshape(3, 3), lambda v: v.t_()),  # same shape, other strides
    "bfloat16.t_": (torch.arange(9.0).reshape(3, 3).to(torch.bfloat16), lambda v: v.t_()),  # over DLPack
    "tensor.data": (torch.arange(6.0), lambda v: setattr(v, "data", v.data.view(torch.int32))),
    "array.shape": (np.arange(6.0).reshape(2, 3), lambda v: setattr(v, "shape", (3, 2))),
    "array.dtype": (np.arange(6.0), lambda v: setattr(v, "dtype", np.int64)),
    "array.writeable": (np.arange(6.0), lambda v: setattr(v.flags, "writeable", True)),
    "prefix.token_ids": (_prefix(), lambda v: v.token_ids.append(4)),
    "prefix.metadata": (_prefix(), lambda v: v.metadata.update(voice="b")),
}


def _same(got: Any, stored: Any) -> bool:
    if isinstance(stored, HiddenStatePrefix):
        return (
            isinstance(got, HiddenStatePrefix)
            and (got.token_ids, got.metadata) == (stored.token_ids, stored.metadata)
            and _same(got.hidden_states, stored.hidden_states)
        )
    if isinstance(stored, np.ndarray):
        readonly = not got.flags.writeable  # as every array a get returns
        return (
            type(got) is np.ndarray and readonly and got.dtype == stored.dtype and np.array_equal(got, stored)
        )
    return type(got) is torch.Tensor and got.dtype == stored.dtype and torch.equal(got, stored)


@pytest.mark.parametrize("change", list(IN_PLACE))
def test_a_value_changed_in_place_by_its_consumer_never_changes_the_next_get(
    config: CacheConfig, change: str
) -> None:
    """Repeat hits alias the value returned before (cheap) only while it is as it was returned."""
    stored, edit = IN_PLACE[change]
    with EmbeddingCache(config) as cache:
        cache.put(_key(change), stored)
        first = cache.get(_key(change))
        edit(first)
        again = cache.get(_key(change))  # a repeat hit: `first` is alive
        assert cache.stats()["hits_process"] == 1
        assert _same(again, stored), (again, stored)
        del first, again


def test_views_of_one_process_alias_each_other_and_nothing_else(config: CacheConfig) -> None:
    """Within one process the views of an entry share one mapping (a repeat hit costs no new one),
    as the values of an in-process cache would; another process never sees the write."""
    with EmbeddingCache(config) as cache:
        cache.put(_key("tensor"), ONES)
        cache.put(_key("array"), ONES.numpy())
        first = cache.get(_key("tensor"))
        first[0] = -1.0
        assert float(cache.get(_key("tensor"))[0]) == -1.0
        assert _other_process_reads(config) == (True, True)


def test_debug_mode_names_a_written_view_and_keeps_the_nodes_copy(config: CacheConfig) -> None:
    with EmbeddingCache(dataclasses.replace(config, debug_check_views=True)) as cache:
        cache.put(_key("tensor"), ONES)
        view = cache.get(_key("tensor"))
        view.mul_(3)
        with pytest.raises(ViewMutated, match="node's copy is intact"):
            cache.get(_key("tensor"))
        # the process's written mapping is forgotten: the next get maps the node's copy afresh
        assert torch.equal(cache.get(_key("tensor")), ONES)
        assert float(view[0]) == 3.0  # the written view itself is the consumer's own
        assert cache.stats()["corrupt_records"] == 0


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # numpy's twin; over DLPack


@DTYPES
def test_a_dead_views_mapping_is_reset_and_reused_then_removed_at_detach(
    config: CacheConfig, dtype: torch.dtype
) -> None:
    """A view's mapping lives while any array derived from it does; then it is reset (its written
    pages dropped) and kept for the next view of the same entry, which reads the node's copy
    through the same addresses; the detach unmaps it."""
    path = f"/dev/shm/shmcache.{os.geteuid()}.{config.namespace}.arena"
    ones = ONES.to(dtype)
    cache = EmbeddingCache(config)
    cache.put(_key("tensor"), ones)
    before = _mappings(path)
    view = cache.get(_key("tensor"))
    row = view[1:]  # derived: keeps the mapping alive
    address = view.data_ptr()
    assert _mappings(path) == before + 1
    del view
    gc.collect()
    row.add_(1)  # written: this mapping's own pages now
    assert float(row[0]) == 2.0 and _mappings(path) == before + 1
    del row
    gc.collect()
    again = cache.get(_key("tensor"))  # the same pages: the kept mapping, reset
    assert again.data_ptr() == address and torch.equal(again, ones) and _mappings(path) == before + 1
    cache.close()  # a view alive at close stays valid; the detach waits for it
    assert again.dtype == dtype and torch.equal(again, ones)
    del again
    gc.collect()
    wait_for(lambda: _mappings(path) == before, what="the mapping unmapped at detach")


def _mappings(path: str) -> int:
    """How many mappings of `path` this process has."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.split(maxsplit=5)[-1].strip().startswith(path))


def test_views_cost_no_file_descriptor(config: CacheConfig) -> None:
    with EmbeddingCache(config) as cache:
        keys = [_key(f"v{i}") for i in range(64)]
        for k in keys:
            cache.put(k, np.arange(8, dtype=np.int64))
        before = len(os.listdir("/proc/self/fd"))
        views = [cache.get(k) for k in keys]
        assert len(os.listdir("/proc/self/fd")) == before
        assert all((v == np.arange(8)).all() for v in views)


def read_many(config: CacheConfig, names: list[str], results: Any) -> None:
    """Another process: report whether each entry reads as stored (entry i holds i + 1)."""
    with EmbeddingCache(config) as cache:
        values = cache.get_many([_key(name) for name in names])
        results.put([bool((v == i + 1).all()) for i, v in enumerate(values)])


@DTYPES
def test_get_many_maps_a_batch_once_and_each_view_stays_its_own(
    config: CacheConfig, dtype: torch.dtype
) -> None:
    """`get_many`'s views share one copy-on-write mapping; a write through one of them reaches
    neither its neighbours, nor the same entry asked for twice, nor the node's copy; each view's
    death gives its own pin back while the others live; the mapping goes with the last one."""
    path = f"/dev/shm/shmcache.{os.geteuid()}.{config.namespace}.arena"
    names = [f"batch-{i}" for i in range(16)]
    with EmbeddingCache(config) as cache:
        for i, name in enumerate(names):
            cache.put(_key(name), torch.full((4096,), float(i + 1), dtype=dtype))
        node, before = cache._node, _mappings(path)
        values = cache.get_many([_key(name) for name in [*names, names[3]]])
        assert all(v.dtype == dtype for v in values)
        assert _mappings(path) == before + 2  # one for the batch, one for the entry asked for twice
        values[3].add_(100)  # torch tensors are writable: the write is this mapping's own
        assert float(values[3][0]) == 104.0 and float(values[16][0]) == 4.0  # the twin is its own
        assert all(bool((v == i + 1).all()) for i, v in enumerate(values[:16]) if i != 3)
        results = mp.get_context("spawn").Queue()
        proc = spawn(read_many, config, names, results)
        assert results.get(timeout=120) == [True] * 16
        proc.join(30)
        pinned = dict(node.pins.held())
        assert len(pinned) == 16 and sorted(pinned.values()) == [1] * 15 + [2]
        written = values.pop(3)
        del written
        gc.collect()
        wait_for(lambda: sorted(node.pins.held().values()) == [1] * 16, what="the written view's pin")
        assert _mappings(path) == before + 2 and float(values[15][0]) == 4.0
        del values
        gc.collect()
        wait_for(lambda: node.pins.held() == {}, what="every pin back")
        assert _mappings(path) == before
        assert [float(v[0]) for v in cache.get_many([_key(name) for name in names])] == [
            float(i + 1) for i in range(16)
        ]
        assert cache.stats()["corrupt_records"] == 0


@pytest.mark.parametrize("known", [False, True], ids=["first-deliveries", "known-heads-in-one-call"])
def test_an_interrupt_anywhere_after_a_batchs_views_are_made_leaks_no_pin_and_releases_none_twice(
    config: CacheConfig, known: bool
) -> None:
    """A SIGINT between any two lines of a `get_many` from the moment its views exist (each armed
    in the call that made it) through every delivery (one by one, or all in one native call once
    the process checked every head before), a failed delivery's give-back and `keep` leaves no
    pin behind once the values are gone and releases none twice (a request's pins on the same
    entries stay), and a closed cache still waits for a live view before it detaches. Before
    the views were armed as they are made, a signal on entry of `keep` leaked the batch's pins
    until the process detached."""
    source, first = inspect.getsourcelines(Mappings.keep)
    lock_line = first + next(i for i, text in enumerate(source) if "with self._lock:" in text)
    traced = {
        Views.lookup_many.__code__: "holders",
        Views._deliver_known.__code__: None,
        Views._deliver.__code__: None,
        Views._give_back.__code__: None,
        Mappings.keep.__code__: None,
    }
    names = ["a", "b", "c"]
    with EmbeddingCache(config) as keeper:
        cache = EmbeddingCache(config)
        node = cache._node
        for name in names:
            cache.put(_key(name), torch.full((4096,), len(name), dtype=torch.uint8))
            assert cache.hold(_key(name), "held")  # a pin a second release would take away
        at = 0
        while True:  # up to `keep`'s lock (the line event a block's exit reports is no place a signal lands)
            # each round starts alike: no head checked before, or every one (one native call)
            cache._views.forget()
            if known:
                assert all(v is not None for v in cache.get_many([_key(name) for name in names]))
                gc.collect()
            interrupter = InterruptAtLine(at, traced)
            values = None
            with pytest.raises(KeyboardInterrupt), interrupter.tracing():
                values = cache.get_many([_key(name) for name in names])
            assert interrupter.fired, at
            del values
            gc.collect()
            cache.flush_releases()
            assert cache.stats()["references"] == 3, (at, interrupter.line)  # none left behind, none twice
            assert len(node.pins.held()) == 3 and audit(node) == [], (at, interrupter.line)
            if interrupter.line == lock_line:
                break
            at += 1
        assert at > 20  # the sweep crossed every delivery of the batch
        assert [int(v[0]) for v in cache.get_many([_key(name) for name in names])] == [1, 1, 1]
        cache.cleanup_request("held")
        live = cache.get(_key("a"))
        cache.close()
        assert keeper.stats()["clients"] == 2  # the closed cache waits for its live view
        del live
        gc.collect()
        wait_for(lambda: keeper.stats()["clients"] == 1, what="the detach after the last view")
