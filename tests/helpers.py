"""Test helpers: kernel-object snapshots and spawned worker processes."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from shmcache.node.slots import SlotState
from shmcache.testing import kernel_objects

__all__ = [
    "InterruptAtLine",
    "arena_page",
    "inspect_show",
    "file_offset",
    "kernel_objects",
    "finished",
    "kill",
    "map_fresh",
    "mapped_ranges",
    "pages_present",
    "physical_page",
    "running",
    "sealed_slot",
    "settle",
    "spawn",
    "wait_for",
]

_MAP_FIXED_NOREPLACE = 0x100000  # Linux 4.17+: map there only if nothing is mapped there


def settle() -> None:
    """Let dropped views release their pins (the release thread batches for a few ms)."""
    gc.collect()
    time.sleep(0.05)


def spawn(target: Callable[..., Any], *args: Any) -> mp.process.BaseProcess:
    """Start `target(*args)` in a freshly spawned interpreter."""
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


@contextlib.contextmanager
def running(target: Callable[..., Any], *args: Any) -> Iterator[mp.process.BaseProcess]:
    """`spawn(target, *args)` for the block; killed at its end if still alive (the block failed)."""
    proc = spawn(target, *args)
    try:
        yield proc
    finally:
        if proc.is_alive():
            kill(proc)


def finished(proc: mp.process.BaseProcess, timeout: float = 60.0) -> bool:
    """Whether `proc` ends with exit code 0 within `timeout` seconds."""
    proc.join(timeout)
    return proc.exitcode == 0


def kill(proc: mp.process.BaseProcess) -> None:
    """SIGKILL a process and reap it."""
    assert proc.pid is not None
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `predicate` (tests only) until true or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def stopped(pid: int) -> bool:
    """Every thread of process `pid` is stopped (SIGSTOP: state T in /proc)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that just ended
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state == "T" for state in states)


def stop(pid: int) -> None:
    """SIGSTOP process `pid` and wait until every thread of it is stopped. `kill` returns before
    that: the signal wakes one thread to stop the group, and on a loaded machine the others may
    still answer a request meanwhile (the likely cause of a close that found a master stopped
    after the test's SIGSTOP still answering its probe, in CI)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: stopped(pid), timeout=10.0, what=f"process {pid} to stop")


def longest_stall(seconds: float) -> float:
    """The longest this thread waited for a 10 ms sleep to return over `seconds`: Mooncake's
    set-up holds the GIL (4.3 s against a closed port, 30 s against a stopped master)."""
    longest, last = 0.0, time.monotonic()
    end = last + seconds
    while last < end:
        time.sleep(0.01)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    return longest


def sealed_slot(cache: Any) -> int:
    """The slot of the only sealed entry of `cache` (for tests that damage it on purpose)."""
    states = cache._node.slots.array["state"]
    sealed = [int(s) for s in range(cache._node.layout.slots) if states[s] == SlotState.SEALED]
    assert len(sealed) == 1, sealed
    return sealed[0]


def file_offset(address: int, path: str) -> int:
    """The offset in `path` of the byte this process maps at `address` (from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end and len(fields) == 6 and fields[5].strip() == path:
                return int(fields[2], 16) + address - start
    raise AssertionError(f"{address:#x} is not in a mapping of {path}")


def mapped_ranges() -> set[tuple[int, int]]:
    """The address ranges (start, end) this process maps now (from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return {(int(a, 16), int(b, 16)) for a, b in (line.split(maxsplit=1)[0].split("-") for line in maps)}


def map_fresh(ranges: Iterable[tuple[int, int]]) -> list[Any]:
    """Fresh zeroed private memory mapped at each of `ranges` that is unmapped now, as uint8
    arrays (a range mapped again meanwhile is skipped: MAP_FIXED_NOREPLACE never replaces)."""
    import numpy as np  # (only for tests that map memory)

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE
    fresh = []
    for start, end in ranges:
        if libc.mmap(start, end - start, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0) == start:
            fresh.append(np.ctypeslib.as_array((ctypes.c_uint8 * (end - start)).from_address(start)))
    return fresh


def physical_page(address: int) -> int:
    """The physical page frame behind `address` (root only; 0 when the page is not present)."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(address // page * 8)
        entry = int.from_bytes(pagemap.read(8), "little")
    return entry & ((1 << 55) - 1) if entry >> 63 else 0


def pages_present(view: Any) -> int:
    """How many of the pages under the array `view` this process has mapped (not touching them)."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(view.ctypes.data // page * 8)
        entries = pagemap.read(view.nbytes // page * 8)
    return sum(entries[i + 7] >> 7 for i in range(0, len(entries), 8))


def arena_page(shared: Any, offset: int) -> int:
    """The physical page frame of byte `offset` of the shared arena mapping `shared` (a uint8
    array over it), read first so that the page is mapped in this process."""
    int(shared[offset])
    return physical_page(shared.ctypes.data + offset)


def inspect_show(namespace: str) -> dict[str, Any]:
    """`shmcache inspect show NAMESPACE --json`, run as an operator would (another process)."""
    import json
    import subprocess
    import sys

    shown = subprocess.run(
        [sys.executable, "-m", "shmcache", "inspect", "show", namespace, "--json"],
        capture_output=True,
        check=True,
        text=True,
    )
    snapshot: dict[str, Any] = json.loads(shown.stdout)
    return snapshot


class InterruptAtLine:
    """Raises KeyboardInterrupt where a SIGINT landing between two lines would: at the `at`-th line
    run, counted over the frames of the functions in `after` (each from the line after its local
    of that name was bound; a callable: from the line where it answers True given the frame's
    locals; None: from its first line). Use as `with interrupter.tracing(): ...`; `fired` tells
    whether it raised (False: the code ran fewer lines than `at`)."""

    def __init__(
        self, at: int, after: Mapping[CodeType, str | Callable[[dict[str, Any]], bool] | None]
    ) -> None:
        self.at, self.after, self.seen, self.fired = at, after, 0, False
        self.line = 0  # the line it raised at

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        sys.settrace(self._call)
        try:
            yield
        finally:
            sys.settrace(None)

    def _call(self, frame: FrameType, event: str, arg: object) -> Any:
        return self._line if frame.f_code in self.after else None

    def _line(self, frame: FrameType, event: str, arg: object) -> Any:
        bound = self.after[frame.f_code]
        if event == "line" and not self.fired and _counts_from(bound, frame.f_locals):
            if self.seen == self.at:
                self.fired, self.line = True, frame.f_lineno
                raise KeyboardInterrupt
            self.seen += 1
        return self._line


def _counts_from(bound: str | Callable[[dict[str, Any]], bool] | None, local: dict[str, Any]) -> bool:
    """Whether `InterruptAtLine` counts a line of a frame with these locals (see `after`)."""
    if bound is None:
        return True
    return bound(local) if callable(bound) else bound in local
