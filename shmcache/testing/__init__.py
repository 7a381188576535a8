"""Test helpers for shmcache and its users: multi-process pools with crash checkpoints
(pool.py), a Mooncake master on loopback (mooncake.py) and the pytest plugin (pytest_plugin.py).
The ready-made crash workers are in crashes.py, the shared sample configs in samples.py."""

from shmcache.testing.crashes import (
    POINTS,
    crash_after_reserve,
    crash_holding_view,
    crash_while_computing,
)
from shmcache.testing.mooncake import MooncakeHolder, MooncakeMaster
from shmcache.testing.pool import (
    ProcessPool,
    RemoteTraceback,
    Worker,
    WorkerTimeout,
    checkpoint,
    kernel_objects,
    namespace_objects,
)
from shmcache.testing.samples import SAMPLE_PREPROCESSING, sample_cache_config, sample_preprocessing

__all__ = [
    "POINTS",
    "SAMPLE_PREPROCESSING",
    "MooncakeHolder",
    "MooncakeMaster",
    "ProcessPool",
    "RemoteTraceback",
    "Worker",
    "WorkerTimeout",
    "checkpoint",
    "crash_after_reserve",
    "crash_holding_view",
    "crash_while_computing",
    "kernel_objects",
    "namespace_objects",
    "sample_cache_config",
    "sample_preprocessing",
]
