"""`Writes`, the gate between writes into reservations' extents and the detach that withdraws
them: real threads, no shared memory."""

from __future__ import annotations

import threading
import time

import pytest

from shmcache import CacheClosed
from shmcache.process.writes import Writes


def test_a_write_after_the_shut_is_refused_before_it_runs() -> None:
    writes = Writes()
    assert writes.shut(0.0) == set()
    ran = []
    with pytest.raises(CacheClosed, match="detached"), writes.writing(3, 7):
        ran.append(True)
    assert ran == []


def test_the_shut_waits_for_a_running_write_and_keeps_one_that_outlasts_its_wait() -> None:
    writes, entered, leave = Writes(), threading.Event(), threading.Event()

    def write(slot: int) -> None:
        with writes.writing(slot, 1):
            entered.set()
            leave.wait(30)

    writer = threading.Thread(target=write, args=(5,))
    writer.start()
    entered.wait(30)
    assert writes.shut(0.2) == {(5, 1)}  # still running: its reservation must stay held
    threading.Timer(0.2, leave.set).start()
    started = time.monotonic()
    assert writes.shut(30) == set()  # waited for it to end
    assert time.monotonic() - started < 10
    writer.join(30)


def test_the_shut_does_not_wait_for_a_write_of_its_own_thread() -> None:
    """A detach started inside a write (an allocation that released a closed cache's last dead
    view) must not wait out its bound for a write that cannot end before it returns."""
    writes = Writes()
    started = time.monotonic()
    with writes.writing(4, 2):
        assert writes.shut(30) == {(4, 2)}  # kept: this write goes on after the detach
    assert time.monotonic() - started < 10
    with pytest.raises(CacheClosed), writes.writing(4, 3):
        pass
