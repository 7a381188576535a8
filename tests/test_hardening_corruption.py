"""Random byte flips in a live namespace's index: never a wrong value, a crash or a hang.

A real second process holds entries. Over several rounds the test flips seeded random bytes in
the index header (past its magic), the slot records and the key records (most slot flips land
on the slots that hold entries). After each round a new attacher either attaches and reads the
untouched entries exactly, or gets a typed error, and never wipes the live namespace; then the
holder gets every entry: each `get` must return the exact value, a miss, or a typed error, and
every entry whose slot and key bytes were never touched must still be there. The damage to the
slot and key tables accumulates over the rounds; the header's fields are restored after each
round (each round damages them afresh) and at the end, so that the last process out can remove
the namespace (the leak check).

`SHMCACHE_CORRUPTION_SEEDS=1,2,...` runs other seeds.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import random
import traceback
from typing import Any

import pytest

from shmcache import CacheConfig, EmbeddingCache
from shmcache.errors import ShmCacheError
from shmcache.kernel.namespace import object_names
from shmcache.node.layout import HEADER_SIZE, KEY_SIZE, SLOT_SIZE, Header, Layout, needle_of
from tests.helpers import kill, spawn
from tests.workers import expected_value, fingerprint, key_of

ENTRIES = [f"entry-{i}" for i in range(64)]
ROUNDS = 6
FLIPS = {"header": 5, "slots": 25, "keys": 20}  # per round: 50, 300 in all
HEADER_FIELDS = 80  # the header's fields; past them come counters and their journal
SEEDS = [int(s) for s in os.environ.get("SHMCACHE_CORRUPTION_SEEDS", "1,2,3,4,5,6").split(",")]


def _untyped(exc: BaseException) -> str:
    where = "".join(traceback.format_tb(exc.__traceback__)[-2:])
    return f"UNTYPED {type(exc).__name__}: {str(exc)[:120]}\n{where}"


def _outcome(cache: EmbeddingCache, name: str) -> str:
    try:
        value = cache.get(key_of(name))
    except ShmCacheError as exc:
        return f"typed {type(exc).__name__}"
    except Exception as exc:  # reported, then failed by the test
        return _untyped(exc)
    if value is None:
        return "miss"
    return "exact" if fingerprint(value) == fingerprint(expected_value(name, 256)) else "WRONG"


def holder(config: CacheConfig, puts: bool, commands: Any, results: Any) -> None:
    """Put ENTRIES; on each command get every one of them (and with `puts`, put one more)."""
    with EmbeddingCache(config) as cache:
        for name in ENTRIES:
            cache.put(key_of(name), expected_value(name, 256))
        results.put("ready")
        while (command := commands.get()) != "stop":
            report = {name: _outcome(cache, name) for name in ENTRIES}
            if puts:
                try:
                    cache.put(key_of(command), expected_value(command, 256))
                    report["put"] = _outcome(cache, command)
                except ShmCacheError as exc:
                    report["put"] = f"typed {type(exc).__name__}"
                except Exception as exc:
                    report["put"] = _untyped(exc)
            results.put(report)
    results.put("closed")


def _slots_of(index: mmap.mmap, layout: Layout) -> dict[str, int]:
    """name -> slot of every entry, read from the key table before any damage."""
    keys = {needle_of(key_of(name)): name for name in ENTRIES}
    found = {}
    for slot in range(layout.slots):
        off = layout.key_off(slot)
        name = keys.get(bytes(index[off : off + KEY_SIZE]))
        if name is not None:
            found[name] = slot
    return found


def _flip(rng: random.Random, index: mmap.mmap, layout: Layout, occupied: list[int]) -> int:
    """Flip one random byte of the header or of a slot or key record; returns the slot touched
    (-1 for the header)."""
    region = rng.choices(list(FLIPS), weights=list(FLIPS.values()))[0]
    if region == "header":
        # not the magic: a bad magic stops every later attacher early (test_hardening_header has it)
        pos = rng.randrange(8, HEADER_FIELDS) if rng.random() < 0.7 else rng.randrange(8, HEADER_SIZE)
        slot = -1
    else:
        slot = rng.choice(occupied) if rng.random() < 0.6 else rng.randrange(layout.slots)
        if region == "slots":
            pos = layout.slot_off(slot) + rng.randrange(SLOT_SIZE)
        else:
            pos = layout.key_off(slot) + rng.randrange(KEY_SIZE)
    index[pos] ^= rng.randrange(1, 256)
    return slot


def _new_attacher(config: CacheConfig, untouched: list[str]) -> list[str]:
    """A process attaching to the damaged namespace attaches and reads (the entries that were not
    touched, exactly), or gets a typed error; either way the namespace is not wiped."""
    paths = object_names(config.namespace)
    before = [os.stat(path).st_ino for path in (paths.index_path, paths.arena_path)]
    try:
        cache = EmbeddingCache(config)
    except ShmCacheError:
        cache = None
    except Exception as exc:
        return [f"attach: {_untyped(exc)}"]
    problems = []
    if cache is not None:
        try:
            outcomes = {name: _outcome(cache, name) for name in ENTRIES[:8]}
        finally:
            cache.close()
        problems += [
            f"attacher {name}: {outcome}"
            for name, outcome in outcomes.items()
            if outcome == "WRONG"
            or outcome.startswith("UNTYPED")
            or (name in untouched and outcome != "exact")
        ]
    if [os.stat(path).st_ino for path in (paths.index_path, paths.arena_path)] != before:
        problems.append("an attacher wiped the live namespace and created another")
    return problems


def _run(config: CacheConfig, seed: int, *, puts: bool) -> list[str]:
    """Flip bytes for ROUNDS rounds under a live holder; every problem found, as text."""
    rng = random.Random(seed)
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    proc = spawn(holder, config, puts, commands, results)
    assert results.get(timeout=60) == "ready"
    fd = os.open(object_names(config.namespace).index_path, os.O_RDWR)
    index = mmap.mmap(fd, 0)
    original_header = bytes(index[:HEADER_FIELDS])
    problems: list[str] = []
    try:
        layout = Header.read(index).layout
        where = _slots_of(index, layout)
        assert len(where) == len(ENTRIES)
        touched: set[int] = set()
        for round_ in range(ROUNDS):
            for _ in range(sum(FLIPS.values())):
                touched.add(_flip(rng, index, layout, list(where.values())))
            problems += _new_attacher(config, [n for n, slot in where.items() if slot not in touched])
            commands.put(f"round-{round_}")
            try:
                report = results.get(timeout=120)
            except Exception:
                return [*problems, f"round {round_}: the holder hung or died (alive: {proc.is_alive()})"]
            problems += [
                f"seed {seed} round {round_} {name}: {outcome}"
                for name, outcome in report.items()
                if outcome == "WRONG" or outcome.startswith("UNTYPED")
            ]
            problems += [
                f"seed {seed} round {round_} {name}: untouched, yet {report[name]}"
                for name, slot in where.items()
                if slot not in touched and report[name] != "exact"
            ]
            index[:HEADER_FIELDS] = original_header  # each round damages the header afresh
        index[:HEADER_FIELDS] = original_header  # the last process out must find its semaphore set
        commands.put("stop")
        assert results.get(timeout=60) == "closed"
        proc.join(30)
    finally:
        index[:HEADER_FIELDS] = original_header
        index.close()
        os.close(fd)
        if proc.is_alive():
            kill(proc)
    return problems


@pytest.mark.parametrize("seed", SEEDS)
def test_random_byte_flips_never_give_a_wrong_value(config: CacheConfig, seed: int) -> None:
    problems = _run(config, seed, puts=False)
    assert not problems, "\n".join(problems)


def test_puts_into_a_damaged_index_fail_typed(config: CacheConfig) -> None:
    problems = [p for seed in (1, 6, 13) for p in _run(config, seed, puts=True)]
    assert not problems, "\n".join(problems)
