"""Functions that run in spawned worker processes (importable by the spawn start method)."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import resource
import threading
import time
from pathlib import Path
from typing import Any

import torch

from shmcache import CacheConfig, EmbeddingCache, EmbeddingCacheKey
from shmcache.kernel.cowmap import CowMapper
from shmcache.testing import sample_preprocessing


def report(path: str, text: str) -> None:
    """Write `text` to the file `path` whole: a test reads it as soon as it exists (a file made
    and then written read empty once, in a CI run)."""
    Path(path + ".tmp").write_text(text)
    os.rename(path + ".tmp", path)


def key_of(name: str) -> EmbeddingCacheKey:
    return EmbeddingCacheKey.from_raw_bytes(name.encode(), sample_preprocessing(), modality="image")


def expected_value(name: str, numel: int = 4096) -> torch.Tensor:
    """The deterministic 'encoder output' of input `name`."""
    generator = torch.Generator().manual_seed(int.from_bytes(key_of(name).digest[:4], "little"))
    return torch.randn(numel, generator=generator).to(torch.bfloat16)


def fingerprint(value: torch.Tensor) -> bytes:
    return bytes(value.contiguous().view(torch.uint8).numpy().tobytes())


def _mark(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text + "\n")


def exactly_once(config: CacheConfig, name: str, threads: int, log: str, start: Any, results: Any) -> None:
    """Threads of one process all ask for the same key at once; each reports what it got."""
    with EmbeddingCache(config) as cache:

        def compute() -> torch.Tensor:
            _mark(Path(log), f"{os.getpid()}:{threading.get_ident()}")
            time.sleep(0.5)
            return expected_value(name)

        def ask() -> None:
            try:
                value = cache.get_or_compute(key_of(name), compute, request_id=f"r{threading.get_ident()}")
                results.put(("ok", fingerprint(value)))
            except Exception as exc:  # reported to the parent
                results.put(("error", repr(exc)))

        start.wait()
        workers = [threading.Thread(target=ask) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()


def compute_forever(config: CacheConfig, name: str, started: str) -> None:
    """Reserve a key and hang in its compute (the parent SIGKILLs us there)."""
    cache = EmbeddingCache(config)

    def compute() -> torch.Tensor:
        Path(started).touch()
        time.sleep(3600)
        raise AssertionError("unreachable")

    cache.get_or_compute(key_of(name), compute)


def compute_then_fail(config: CacheConfig, name: str, started: str, go: str) -> None:
    """Reserve a key, wait for the file `go`, then fail the compute."""
    with EmbeddingCache(config) as cache:

        def compute() -> torch.Tensor:
            Path(started).touch()
            while not Path(go).exists():
                time.sleep(0.01)
            raise ValueError("decoder exploded on frame 17")

        with contextlib.suppress(ValueError):
            cache.get_or_compute(key_of(name), compute)


def get_or_compute_report(config: CacheConfig, name: str, results: Any) -> None:
    """get_or_compute one key and report (outcome, fingerprint or error text, takeovers)."""
    with EmbeddingCache(config) as cache:
        try:
            value = cache.get_or_compute(key_of(name), lambda: expected_value(name))
            results.put(("ok", fingerprint(value), cache.stats()["takeovers"]))
        except Exception as exc:
            results.put((type(exc).__name__, str(exc), 0))


def put_value(config: CacheConfig, name: str, numel: int, done: str) -> None:
    """Store one value, signal, and stay attached until killed or told to stop."""
    cache = EmbeddingCache(config)
    cache.put(key_of(name), expected_value(name, numel))
    Path(done).touch()
    while not Path(done + ".stop").exists():
        time.sleep(0.01)
    cache.close()


def hold_view_and_ref(config: CacheConfig, name: str, ready: str, request_id: str | None = "held") -> None:
    """Take a view and a request reference (none if `request_id` is None), then wait to be SIGKILLed."""
    cache = EmbeddingCache(config)
    view = cache.get(key_of(name), request_id=request_id)
    assert view is not None
    Path(ready).touch()
    time.sleep(3600)


def hold_stripe_section(config: CacheConfig, name: str, ready: str) -> None:
    """Enter the stripe section of `name`'s entry (its lock held, its held marker set), then wait
    inside it to be SIGKILLed."""
    cache = EmbeddingCache(config)
    node = cache._node
    with node.sections.stripe(node.stripe_of(key_of(name).record)):
        Path(ready).touch()
        time.sleep(3600)


def die_retiring_while_another_waits(config: CacheConfig, name: str, ready: str) -> None:
    """Put `name`, then detach as `close` does but holding the node section 0.5 s before the
    retire (`ready` touched inside), with crash point `retiring-client` armed: SIGKILLed in the
    retire while another process waits for the node lock."""
    from shmcache.node import crashpoints

    cache = EmbeddingCache(config)
    cache.put(key_of(name), expected_value(name))
    node = cache._node
    crashpoints.arm(crashpoints.CrashPoint.RETIRING_CLIENT)
    with node.sections.node():
        Path(ready).touch()
        time.sleep(0.5)
        node.counters.retire(node.client, node.clients.clear)


def stop_retiring(config: CacheConfig, names: list[str]) -> None:
    """Put each of `names`, then close with crash point `retiring-client` armed to stop: the
    process stops (SIGSTOP) inside its retire, its counters folded into the retired totals and
    its record not zeroed yet, holding the node section."""
    from shmcache.node import crashpoints

    crashpoints.arm(crashpoints.CrashPoint.RETIRING_CLIENT, stop=True)
    with EmbeddingCache(config) as cache:
        for name in names:
            cache.put(key_of(name), expected_value(name))


def put_stopping_at(config: CacheConfig, point: str) -> None:
    """Put "a", stopping (SIGSTOP) at crash point `point` (`reserved`: claimed, no extent yet;
    `unsealed-payload`: the entry written, not sealed); once continued, finish the put and close."""
    from shmcache.node import crashpoints

    crashpoints.arm(crashpoints.CrashPoint(point), stop=True)
    with EmbeddingCache(config) as cache:
        cache.put(key_of("a"), expected_value("a"))


def crash_at(config: CacheConfig, point: str) -> None:
    """Arm crash point `point`, then run a workload that passes every point of the table: attach
    (create, reap), put, a pinned get, cleanup, close. Returns only if `point` was never reached."""
    from shmcache.node import crashpoints

    crashpoints.arm(crashpoints.CrashPoint(point))
    cache = EmbeddingCache(config)
    cache.put(key_of("a"), expected_value("a"))
    view = cache.get(key_of("a"), request_id="r")
    assert view is not None
    cache.cleanup_request("r")
    del view
    cache.close()


def attach_and_report(config: CacheConfig, start: Any, results: Any) -> None:
    start.wait()
    try:
        with EmbeddingCache(config) as cache:
            cache.put(key_of(f"p{os.getpid()}"), expected_value("x", 16))
            results.put(("ok", cache.stats()["clients"]))
    except Exception as exc:
        results.put((type(exc).__name__, str(exc)))


def attach_and_die(config: CacheConfig, ready: str) -> None:
    cache = EmbeddingCache(config)
    cache.put(key_of("orphan"), expected_value("orphan", 64))
    Path(ready).touch()
    time.sleep(3600)


FAKE_GPU_UUID = bytes(range(16))
FAKE_IPC_HANDLE = b"\xab" * 64


def stand_in_gpu_export(cache: EmbeddingCache) -> None:
    """Make `cache` export like a GPU producer on this GPU-less machine: its entries are stored as
    device-born values (what a CUDA put writes) and sealed with a record whose IPC handle is made
    up; a host tensor stands in for the exported device buffer."""
    from shmcache.format.entry import ENTRY_HEADER_SIZE
    from shmcache.gpu.record import GpuRecord

    side, identity = cache._device, cache._node.identity
    arena = memoryview(cache._segments.arena)

    def export(encoded: Any, slot: int, gen: int) -> GpuRecord:
        offset = cache._node.slots.raw(slot)[0].offset  # our reservation's extent, set before the write
        first_lib = offset + ENTRY_HEADER_SIZE + 32  # the first array's descriptor
        assert arena[first_lib] == 1  # a CPU torch tensor ...
        arena[first_lib] = 3  # ... stored as the CUDA tensor it stands for
        side.exports.add(slot, gen, torch.empty(encoded.total_len, dtype=torch.uint8))
        return GpuRecord(gen, identity, 0, 4096, encoded.total_len, FAKE_GPU_UUID, FAKE_IPC_HANDLE)

    side.export = export  # type: ignore[method-assign]


def fake_gpu_exporter(config: CacheConfig, name: str, ready: str) -> None:
    """Seal `name` as a GPU entry (see `stand_in_gpu_export`), then wait to be SIGKILLed."""
    cache = EmbeddingCache(config)
    stand_in_gpu_export(cache)
    cache.put(key_of(name), expected_value(name))
    identity = cache._node.identity
    report(ready, f"{identity.row} {identity.pid} {identity.start_ticks}")
    time.sleep(3600)


def churn_refs(config: CacheConfig, name: str, ready: str, stop: str) -> None:
    """Take and drop references on `name` in a tight loop (each rewrites its slot record), from
    the file `ready` on until the file `stop` exists."""
    from shmcache.node.layout import needle_of

    with EmbeddingCache(config) as cache:
        node = cache._node
        info = node.lookups.lookup(needle_of(key_of(name)), 0)
        assert info is not None
        Path(ready).touch()
        while not Path(stop).exists():
            for _ in range(200):
                assert node.add_ref(info.slot, info.gen)
                node.release([(info.slot, info.gen)])


def adopt_then(
    config: CacheConfig, ticket: Any, name: str, adopted: str, go: str | None, fail: bool = False
) -> None:
    """Adopt the reservation of `name` from `ticket`, report it in the file `adopted`; then commit
    (`fail`: abandon, as a failed compute does) when the file `go` appears, or (go None) wait to
    be SIGKILLed holding it."""
    cache = EmbeddingCache(config)
    res = cache.adopt(ticket, key_of(name))
    report(adopted, "adopted" if res is not None else "lost")
    if res is None or go is None:
        time.sleep(3600)
        return
    while not Path(go).exists():
        time.sleep(0.01)
    if fail:
        res.abandon("the encoder failed")
    else:
        res.commit(expected_value(name))
    cache.close()


def hand_over_then_wait(config: CacheConfig, name: str, ticket_path: str) -> None:
    """Reserve `name`, hand it over (the ticket pickled to `ticket_path`), wait to be SIGKILLed."""
    import pickle

    cache = EmbeddingCache(config)
    res = cache.try_reserve(key_of(name))
    assert res is not None and res.owned
    Path(ticket_path + ".tmp").write_bytes(pickle.dumps(res.hand_over()))
    os.rename(ticket_path + ".tmp", ticket_path)
    time.sleep(3600)


def get_or_compute_to(config: CacheConfig, name: str, out: str) -> None:
    """get_or_compute `name` and write 'computed ' or 'waited ' plus the value's fingerprint to `out`."""
    computed = []

    def compute() -> torch.Tensor:
        computed.append(True)
        return expected_value(name)

    with EmbeddingCache(config) as cache:
        value = cache.get_or_compute(key_of(name), compute)
        how = "computed" if computed else "waited"
        report(out, f"{how} {fingerprint(value).hex()}")


def reserve_then_wait(config: CacheConfig, name: str, batch: bool, ready: str) -> None:
    """Own the node reservation of `name` and, with a remote store, its cross-node lease
    (`try_reserve_many`, or the blocking `reserve`); say so in the file `ready`; wait to be
    SIGKILLed holding both, as an engine killed mid-compute does."""
    cache = EmbeddingCache(config)
    [res] = cache.try_reserve_many([key_of(name)]) if batch else [cache.reserve(key_of(name))]
    assert res is not None and res.owned
    Path(ready).touch()
    time.sleep(3600)


def get_or_compute_until_interrupted(config: CacheConfig, name: str, go: str, out: str) -> None:
    """Open the cache (file `go + ".ready"`), then at the file `go` get_or_compute `name`; a
    KeyboardInterrupt (SIGINT) in the middle, say while its pull hangs on a stopped store, is
    reported in the file `out`."""
    with EmbeddingCache(config) as cache:
        Path(go + ".ready").touch()
        while not Path(go).exists():
            time.sleep(0.01)
        try:
            cache.get_or_compute(key_of(name), lambda: expected_value(name))
            how = "returned"
        except KeyboardInterrupt:
            how = "interrupted"
        report(out, how)


def pull_until_interrupted_then_stay(
    config: CacheConfig, steady: list[str], name: str, numel: int, go: str, out: str
) -> None:
    """Node B: pull `steady` (values of `numel` elements, published elsewhere: their size becomes
    the kind's guess), then at the file `go` get_or_compute `name`; a KeyboardInterrupt in the
    middle is reported in `out`; then stay attached until the file `go + ".stop"`."""
    with EmbeddingCache(config) as cache:
        for pulled in steady:
            value = cache.get_or_compute(key_of(pulled), lambda p=pulled: expected_value(p, numel))
            del value
        assert cache.stats()["hits_remote"] == len(steady), cache.stats()
        Path(go + ".ready").touch()
        while not Path(go).exists():
            time.sleep(0.01)
        try:
            cache.get_or_compute(key_of(name), lambda: expected_value(name, numel))
            how = "returned"
        except KeyboardInterrupt:
            how = "interrupted"
        report(out, how)
        while not Path(go + ".stop").exists():
            time.sleep(0.01)
    os._exit(0)  # closed: skip Mooncake's exit handler, which unmounts from the dead master (~10 s)


def map_past_idle_mappings(path: str) -> None:
    """(test_native) 60 dead 4 MiB views' mappings kept idle, then an address-space limit that
    leaves 100 MiB: a 200 MiB view is made once the idle mappings are unmapped for it."""
    mapper = CowMapper(os.open(path, os.O_RDWR))
    views = [mapper.view(i << 22, 4 << 20) for i in range(60)]
    del views
    gc.collect()
    assert mapper.idle() == 60
    with open("/proc/self/status") as status:
        used = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (used + (100 << 20), resource.RLIM_INFINITY))
    large = mapper.view(0, 200 << 20)
    assert large.nbytes == 200 << 20 and mapper.idle() == 0


def adopt_and_hand_back(config: CacheConfig, ticket: Any, name: str, back: str, go: str) -> None:
    """Adopt the reservation of `name`, hand it back at once (its ticket pickled into `back`), then
    let go once the file `go` appears."""
    cache = EmbeddingCache(config)
    res = cache.adopt(ticket, key_of(name))
    assert res is not None
    Path(back + ".tmp").write_bytes(pickle.dumps(res.hand_over()))
    os.rename(back + ".tmp", back)
    while not Path(go).exists():
        time.sleep(0.01)
    while not res.let_go():
        time.sleep(0.01)
    cache.close()
