"""Prometheus metrics of node caches: a collector usable in any process, read-only and lock-free.

    from prometheus_client import REGISTRY
    from shmcache.metrics import ShmCacheCollector
    REGISTRY.register(ShmCacheCollector(["qwen-omni"]))   # or None: every namespace of this user

`shmcache-inspect serve-metrics` serves the same on http://127.0.0.1:9464/metrics.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shmcache.errors import ShmCacheError
from shmcache.namespace import list_namespaces
from shmcache.snapshot import take_snapshot

__all__ = ["ShmCacheCollector"]

_COUNTERS = {
    "computes": "Encoder forwards run through the cache",
    "misses": "Lookups that found nothing",
    "coalesced_waits": "Waits for another caller's compute of the same key",
    "takeovers": "Reservations taken over from a dead owner",
    "puts": "Entries sealed",
    "bytes_put": "Bytes sealed",
    "uncacheable": "Values returned but not cached (too large or no room)",
    "compute_failures": "Computes that raised",
    "timeouts": "Waits that exceeded compute_timeout_s",
    "corrupt_records": "Damaged index records or entries dropped",
    "repairs": "Sections repaired after a holder died inside",
    "reaped_clients": "Dead processes' records reaped",
    "hits_remote": "Node misses served by a pull from Mooncake Store",
    "remote_publishes": "Entries published to Mooncake Store",
    "remote_publish_drops": "Publishes dropped because the publish queue was full",
    "remote_errors": "Mooncake transfer or RPC errors",
    "remote_rejected": "Remote values rejected (corrupt or foreign)",
    "gpu_exports": "Device copies exported through CUDA IPC",
    "gpu_export_skips": "GPU entries stored with their host copy only (export limit or no IPC)",
    "gpu_hits_alias": "GPU hits served as zero-copy aliases of the exporter's memory",
    "gpu_hits_peer": "GPU hits served by a peer copy from another GPU",
    "gpu_hits_host_copy": "GPU hits served by a host-to-device copy of the host copy",
    "gpu_dead_exporter": "GPU reads that found the exporter dead and used the host copy",
}
_GAUGES = {
    "entries": "Sealed entries",
    "bytes": "Bytes held by sealed entries",
    "reserved": "Reservations in flight",
    "stale": "Expired entries still referenced",
    "references": "Pins and request references held",
    "clients": "Live attached processes",
    "gpu_entries": "Sealed entries with a device-copy record not withdrawn (exporter alive or not)",
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
            name: CounterMetricFamily(f"shmcache_{name}", text, labels=["namespace"])
            for name, text in _COUNTERS.items()
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
            hits.add_metric([namespace, "process"], stats["hits_process"])
            hits.add_metric([namespace, "node"], stats["hits_node"])
            evictions.add_metric([namespace, "lru"], stats["evictions_lru"])
            evictions.add_metric([namespace, "ttl"], stats["evictions_ttl"])
            for name, family in counters.items():
                family.add_metric([namespace], stats[name])
            for name, gauge in gauges.items():
                gauge.add_metric([namespace], stats[name])
            capacity.add_metric([namespace], snap.capacity_bytes)
        yield hits
        yield evictions
        yield from counters.values()
        yield from gauges.values()
        yield capacity
