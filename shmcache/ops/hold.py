"""`shmcache hold`: keep a namespace alive on a node while engines come and go.

A namespace lives while some process has it open: the last process to detach removes it (so a
node never keeps shared memory nobody uses). A serving node whose engines restart (upgrades, OOM
kills, scale-downs) runs this as a small service, so their cache survives them::

    shmcache hold --config '{"namespace": "qwen-omni", "capacity_bytes": 4294967296}'

`--config` takes the vLLM connector's `ec_connector_extra_config` as it is (the `CacheConfig`
fields; `key_salt`, which only goes into keys, is read and not used); the layout settings must
match the engines' or attaching fails with `LayoutMismatch`. It runs until SIGTERM or SIGINT, then
detaches (removing the namespace if no engine has it open). `--ready FILE` is created once the
namespace is open (for scripts). It looks at its namespace every second: one destroyed under it
(`shmcache-inspect destroy --force`) ends it with rc 1 and says so (it went on holding nothing
before, while engines made the namespace anew without it); a service manager restarts it or not.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Final

from shmcache.errors import CacheClosed, ShmCacheError
from shmcache.integrations.vllm.settings import ConnectorSettings
from shmcache.process.cache import EmbeddingCache

__all__ = ["main"]

CHECK_S: Final = 1.0  # how often the namespace held is looked at


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shmcache hold", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default="{}", help="the connector's ec_connector_extra_config JSON (enabled by default)"
    )
    parser.add_argument("--ready", help="create this file once the namespace is open")
    args = parser.parse_args(argv)
    try:
        extra = json.loads(args.config)
        if not isinstance(extra, dict):
            raise TypeError(f"expected a JSON object, got {type(extra).__name__}")
        config = ConnectorSettings.from_extra_config(extra).cache
    except (ValueError, TypeError) as exc:
        print(f"shmcache hold: bad --config: {exc}", file=sys.stderr)
        return 2
    if not config.enable_embedding_cache:
        print("shmcache hold: --config disables the cache: nothing to hold", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        with EmbeddingCache(config) as cache:
            if args.ready:
                Path(args.ready).touch()
            print(f"shmcache hold: holding namespace {config.namespace!r}", flush=True)
            while not stop.wait(CHECK_S):
                try:
                    cache.stats()
                except CacheClosed as exc:
                    said = f"namespace {config.namespace!r} was destroyed under it ({exc})"
                    print(f"shmcache hold: {said}", file=sys.stderr)
                    return 1
    except (ShmCacheError, OSError) as exc:  # OSError: --ready in a folder that does not exist
        print(f"shmcache hold: {exc}", file=sys.stderr)
        return 1
    return 0
