"""Outputs written in place (`Reservation.create` / `seal`): real processes, real shared memory.
What the compute writes is what everyone reads; nothing written through the tensor after its
reservation ended (seal, abandon, withdraw, another commit) reaches node memory;
a compute killed mid-write costs one takeover; a forked child cannot write there at all."""

from __future__ import annotations

import ctypes
import dataclasses
import faulthandler
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shmcache import (
    ArgumentTypeError,
    CacheConfig,
    EmbeddingCache,
    InvalidArgument,
    Reservation,
    ReservationLost,
    UnsupportedValue,
)
from tests import workers
from tests.helpers import spawn, wait_for
from tests.workers import expected_value, fingerprint, key_of

NUMEL = 1 << 16  # 128 KiB of bf16


@pytest.mark.parametrize("then", ["seal", "die"])
def test_another_process_gets_what_was_written_in_place_or_computes_once_its_writer_died(
    config: CacheConfig, tmp_path: Path, then: str
) -> None:
    """A process writes its output in place while another waits for the key. Sealed: the waiter
    gets it without computing, and the writer's scribbles after the seal reach neither the entry
    nor the waiter's view. Killed mid-write: the waiter takes over and computes."""
    started, go = tmp_path / "started", tmp_path / "go"
    with EmbeddingCache(config) as observer:
        owner = spawn(workers.write_in_place, config, "k", NUMEL, str(started), str(go), then)
        try:
            wait_for(started.exists, what="the owner to start writing")
            got = tmp_path / "waiter"
            waiter = spawn(workers.get_or_compute_to, config, "k", str(got))
            wait_for(lambda: observer.stats()["coalesced_waits"] == 1, what="the waiter to block")
            go.touch()
            waiter.join(60)
            assert waiter.exitcode == 0
            if then == "seal":
                wait_for(Path(f"{go}.done").exists, what="the owner's scribbles after its seal")
            expected = expected_value("k", NUMEL) if then == "seal" else expected_value("k")  # the waiter's
            how = "waited" if then == "seal" else "computed"
            assert got.read_text() == f"{how} {fingerprint(expected).hex()}"
            held = observer.get(key_of("k"))
            assert held is not None and fingerprint(held) == fingerprint(expected)
            del held
            stats = observer.stats()
            assert (stats["computes"], stats["takeovers"]) == ((0, 0) if then == "seal" else (1, 1)), stats
        finally:
            Path(f"{go}.stop").touch()
            owner.join(30)
    assert owner.exitcode == (0 if then == "seal" else -signal.SIGKILL)


def test_a_write_after_the_seal_changes_only_the_writers_copy(config: CacheConfig) -> None:
    value = expected_value("k", NUMEL)
    with EmbeddingCache(config) as cache, EmbeddingCache(config) as other:
        with cache.reserve(key_of("k"), request_id="r") as res:
            out = res.create(value.shape, value.dtype)
            out.copy_(value)
            view = res.seal()
        assert fingerprint(view) == fingerprint(value)
        out.fill_(1)
        assert bool((out == 1).all())  # the writer sees its own writes
        assert fingerprint(view) == fingerprint(value)  # a view held across them does not
        seen = other.get(key_of("k"))
        assert seen is not None and fingerprint(seen) == fingerprint(value)
        assert cache.stats()["puts"] == 1
        del view, seen


def _end_by_abandon(cache: EmbeddingCache, res: Reservation) -> None:
    res.abandon()


def _end_by_withdraw(cache: EmbeddingCache, res: Reservation) -> None:
    res.withdraw()


def _end_by_commit(cache: EmbeddingCache, res: Reservation) -> None:
    res.commit(torch.zeros(16), view=False)  # another value, in another extent


@pytest.mark.parametrize("end", [_end_by_abandon, _end_by_withdraw, _end_by_commit])
def test_an_output_whose_reservation_ended_writes_nowhere_after(
    config: CacheConfig, end: Callable[[EmbeddingCache, Reservation], None]
) -> None:
    """The extent of an output whose reservation ended unsealed goes to another entry (the arena
    has room for one); writes through the old tensor then never reach that entry."""
    numel = 3 << 17  # 768 KiB of bf16: the arena (1 MiB) has room for one
    small = dataclasses.replace(config, capacity_bytes=1 << 20)
    with EmbeddingCache(small) as observer:
        writer = EmbeddingCache(small)
        try:
            res = writer.reserve(key_of("first"))
            out = res.create((numel,), torch.bfloat16)
            out.fill_(3)
            slots = observer._node.slots.array  # read only: where the extents are
            offset = int(slots["offset"][res.slot])
            end(writer, res)
            other = expected_value("second", numel)
            observer.put(key_of("second"), other)
            stored = observer.get(key_of("second"))
            assert stored is not None
            assert int(slots["offset"][slots["size"].argmax()]) == offset  # the same extent
            out.fill_(7)
            assert fingerprint(stored) == fingerprint(other)
            again = observer.get(key_of("second"))
            assert again is not None and fingerprint(again) == fingerprint(other)
            del stored, again
        finally:
            writer.close()


def test_a_forked_child_cannot_write_an_output_in_place(config: CacheConfig) -> None:
    """The shared mapping under the tensor is not inherited: the child faults on it."""
    with EmbeddingCache(config) as cache:
        with cache.reserve(key_of("k")) as res:
            out = res.create((NUMEL,), torch.bfloat16)
            out.fill_(2)
            pid = os.fork()
            if pid == 0:  # the child: touches the output's memory, which it must not have
                faulthandler.disable()  # the fault is expected: no traceback dump
                ctypes.memset(out.data_ptr(), 9, 64)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, status
            res.seal()
        stored = cache.get(key_of("k"))
        assert stored is not None and bool((stored == 2).all())
        del stored


def test_an_output_that_cannot_be_stored_is_this_processs_own(config: CacheConfig) -> None:
    """Larger than the cache: `create` still gives a tensor (private), `seal` returns it, counted
    uncacheable; nothing is stored."""
    with EmbeddingCache(dataclasses.replace(config, capacity_bytes=1 << 20)) as cache:
        with cache.reserve(key_of("big")) as res:
            out = res.create((1 << 20,), torch.float32)
            assert not res.cached
            out.fill_(5)
            value = res.seal()
        assert value is out
        stats = cache.stats()
        assert (stats["uncacheable"], stats["entries"]) == (1, 0), stats
        assert cache.get(key_of("big")) is None


@pytest.mark.parametrize(
    ("shape", "dtype", "error"),
    [
        ((-1, 4), torch.float32, InvalidArgument),
        ((2.0, 4), torch.float32, ArgumentTypeError),
        ("24", torch.float32, ArgumentTypeError),
        ((2, 4), "float32", ArgumentTypeError),
        ((2, 4), torch.quint8, UnsupportedValue),
    ],
)
def test_a_bad_shape_or_dtype_is_refused_and_the_reservation_stays_usable(
    config: CacheConfig, shape: object, dtype: object, error: type[Exception]
) -> None:
    with EmbeddingCache(config) as cache:
        with cache.reserve(key_of("k")) as res:
            with pytest.raises(error):
                res.create(shape, dtype)  # type: ignore[arg-type]
            with pytest.raises(ReservationLost, match="seal needs"):
                res.seal()  # no output yet
            out = res.create((2, 4), torch.float32)
            with pytest.raises(ReservationLost, match="create needs"):
                res.create((2, 4), torch.float32)  # one output per reservation
            out.copy_(torch.arange(8.0).view(2, 4))
            value = res.seal()
            with pytest.raises(ReservationLost):
                res.seal()
        assert torch.equal(value, torch.arange(8.0).view(2, 4))
        del value


@pytest.mark.parametrize("shape", [(0, 16), ()], ids=["empty", "scalar"])
def test_outputs_of_no_bytes_and_of_no_dimensions_round_trip(
    config: CacheConfig, shape: tuple[int, ...]
) -> None:
    with EmbeddingCache(dataclasses.replace(config, debug_check_views=True)) as cache:
        with cache.reserve(key_of("k")) as res:
            out = res.create(shape, torch.float32)
            out.fill_(4)
            res.seal()
        stored = cache.get(key_of("k"))
        assert stored is not None and stored.shape == torch.Size(shape) and torch.equal(stored, out)
        del stored
