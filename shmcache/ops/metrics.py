"""Prometheus metrics of node caches: a collector usable in any process, read-only and lock-free.

    from prometheus_client import REGISTRY
    from shmcache.ops.metrics import ShmCacheCollector
    REGISTRY.register(ShmCacheCollector(["qwen-omni"]))   # or None: every namespace of this user

`shmcache-inspect serve-metrics` serves the same on http://127.0.0.1:9464/metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shmcache.errors import ShmCacheError
from shmcache.kernel.namespace import list_namespaces
from shmcache.node.layout import Counter
from shmcache.ops.snapshot import take_snapshot

__all__ = ["ShmCacheCollector"]

_COUNTERS: Final[dict[Counter, str]] = {
    Counter.COMPUTES: "Encoder forwards run through the cache",
    Counter.MISSES: "Lookups that found nothing",
    Counter.COALESCED_WAITS: "Waits for another caller's compute of the same key",
    Counter.TAKEOVERS: "Reservations taken over from a dead owner",
    Counter.PUTS: "Entries sealed",
    Counter.BYTES_PUT: "Bytes sealed",
    Counter.UNCACHEABLE: "Values returned but not cached (too large or no room)",
    Counter.COMPUTE_FAILURES: "Computes that raised",
    Counter.TIMEOUTS: "Waits that exceeded compute_timeout_s",
    Counter.CORRUPT_RECORDS: "Damaged index records or entries dropped",
    Counter.REPAIRS: "Sections repaired after a holder died inside",
    Counter.REAPED_CLIENTS: "Dead processes' records reaped",
    Counter.HITS_REMOTE: "Node misses served by a pull from Mooncake Store",
    Counter.REMOTE_PUBLISHES: "Entries published to Mooncake Store",
    Counter.REMOTE_PUBLISH_DROPS: "Publishes dropped: queue full, store unavailable, entry gone, too large",
    Counter.REMOTE_ERRORS: "Mooncake transfer or RPC errors",
    Counter.REMOTE_REJECTED: "Remote values rejected (corrupt or foreign)",
    Counter.REMOTE_OUTAGES: "Remote store outages (each warned once, survived)",
    Counter.REMOTE_SET_ASIDE: "Pulls whose transfer failed into node memory (kept out of use until it ends)",
    Counter.GPU_EXPORTS: "Device copies exported through CUDA IPC",
    Counter.GPU_EXPORT_SKIPS: "GPU entries stored with their host copy only (export limit or no IPC)",
    Counter.GPU_HITS_ALIAS: "GPU hits served as zero-copy aliases of the exporter's memory",
    Counter.GPU_HITS_PEER: "GPU hits served by a peer copy from another GPU",
    Counter.GPU_HITS_HOST_COPY: "GPU hits served by a host-to-device copy of the host copy",
    Counter.GPU_DEAD_EXPORTER: "GPU reads that found the exporter dead and used the host copy",
}
_HITS: Final = {Counter.HITS_PROCESS: "process", Counter.HITS_NODE: "node"}  # shmcache_hits{layer}
_EVICTIONS: Final = {Counter.EVICTIONS_LRU: "lru", Counter.EVICTIONS_TTL: "ttl"}  # shmcache_evictions{cause}
assert {*_COUNTERS, *_HITS, *_EVICTIONS} == set(Counter), "every counter is exported once"

_GAUGES = {
    "entries": "Sealed entries",
    "bytes": "Bytes held by sealed entries",
    "reserved": "Reservations in flight",
    "stale": "Expired entries still referenced",
    "references": "Pins and request references held",
    "clients": "Live attached processes",
    "gpu_entries": "Sealed entries with a device-copy record not withdrawn (exporter alive or not)",
    "gpu_bytes": "Bytes held by those entries (their host copies' size)",
}


class ShmCacheCollector(Collector):
    """Collects node-wide stats of `namespaces` (default: every namespace of this user) on scrape."""

    def __init__(self, namespaces: list[str] | None = None) -> None:
        self.namespaces = namespaces

    def collect(self) -> Iterator[Metric]:
        hits = CounterMetricFamily("shmcache_hits", "Cache hits by layer", labels=["namespace", "layer"])
        evictions = CounterMetricFamily(
            "shmcache_evictions", "Evictions by cause", labels=["namespace", "cause"]
        )
        counters = {
            counter: CounterMetricFamily(f"shmcache_{counter.label}", text, labels=["namespace"])
            for counter, text in _COUNTERS.items()
        }
        gauges = {
            name: GaugeMetricFamily(f"shmcache_{name}", text, labels=["namespace"])
            for name, text in _GAUGES.items()
        }
        capacity = GaugeMetricFamily("shmcache_capacity_bytes", "Arena capacity", labels=["namespace"])
        for namespace in self.namespaces if self.namespaces is not None else list_namespaces():
            try:
                snap = take_snapshot(namespace, max_entries=0)
            except ShmCacheError:
                continue  # gone or damaged between listing and reading: nothing to report
            stats = snap.stats
            for counter, layer in _HITS.items():
                hits.add_metric([namespace, layer], stats[counter.label])
            for counter, cause in _EVICTIONS.items():
                evictions.add_metric([namespace, cause], stats[counter.label])
            for counter, family in counters.items():
                family.add_metric([namespace], stats[counter.label])
            for name, gauge in gauges.items():
                gauge.add_metric([namespace], stats[name])
            capacity.add_metric([namespace], snap.capacity_bytes)
        yield hits
        yield evictions
        yield from counters.values()
        yield from gauges.values()
        yield capacity
