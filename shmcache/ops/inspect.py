"""`shmcache-inspect`: what this node's caches hold, who holds it, and clean-up after crashes.

    shmcache-inspect                          list this user's namespaces
    shmcache-inspect show NS [--json] [--watch SECONDS] [--entries N]
    shmcache-inspect gc NS                    reap dead processes' records, pins and reservations
    shmcache-inspect destroy NS [--force]     remove a namespace (refused while processes are attached)
    shmcache-inspect serve-metrics [NS ...] [--port N] [--host 127.0.0.1]

`list` and `show` map the namespace read-only and take no lock: they never change or block the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from shmcache.errors import NamespaceUnavailable, ShmCacheError
from shmcache.kernel.namespace import (
    PREFIX,
    SHM_DIR,
    bootstrap_lock,
    list_namespaces,
    object_names,
    open_existing,
    remove_fragments,
    remove_objects,
)
from shmcache.node.index import NodeIndex
from shmcache.node.layout import Counter as C
from shmcache.node.slots import SlotState
from shmcache.ops.argtypes import at_least
from shmcache.ops.records import ClientInfo, EntryInfo, NamespaceSnapshot, ReservationInfo
from shmcache.ops.snapshot import take_snapshot

__all__ = ["gc_namespace", "main", "render"]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def _gpu_cell(gpu: dict[str, Any] | None) -> str:
    """Where an entry's device copy is: "-" (host only), "pid 123", "pid 123 DEAD", "withdrawn"."""
    if gpu is None:
        return "-"
    if gpu["withdrawn"]:
        return "withdrawn"
    return f"pid {gpu['exporter_pid']}" + ("" if gpu["exporter_alive"] else " DEAD")


def _summary(snap: NamespaceSnapshot) -> list[str]:
    """The report's header: state, capacity and settings, then the node-wide counters."""
    s = snap.stats
    n = {counter: s[counter.label] for counter in C}  # the node-wide counters
    return [
        f"namespace {snap.namespace} (uid {snap.uid}) — {'live' if snap.live else 'no live process (stale)'}",
        f"capacity {_size(snap.capacity_bytes)}, used {_size(snap.used_bytes)}, "
        f"free {_size(snap.free_bytes)}; "
        f"entries {s['entries']}/{snap.settings['max_entries']}, ways {snap.settings['ways']}, "
        f"ttl {f'{ttl} s' if (ttl := snap.settings['ttl_s']) else 'none'}, "
        f"hash {snap.settings['hash_algorithm']}",
        f"hits {n[C.HITS_PROCESS]} process + {n[C.HITS_NODE]} node, misses {n[C.MISSES]}, "
        f"computes {n[C.COMPUTES]}, coalesced waits {n[C.COALESCED_WAITS]}, takeovers {n[C.TAKEOVERS]}, "
        f"evictions {n[C.EVICTIONS_LRU]} lru + {n[C.EVICTIONS_TTL]} ttl, "
        f"uncacheable {n[C.UNCACHEABLE]}, failures {n[C.COMPUTE_FAILURES]}, timeouts {n[C.TIMEOUTS]}, "
        f"corrupt {n[C.CORRUPT_RECORDS]}, repairs {n[C.REPAIRS]}, reaped {n[C.REAPED_CLIENTS]}",
        f"remote: hits {n[C.HITS_REMOTE]}, published {n[C.REMOTE_PUBLISHES]}, "
        f"dropped {n[C.REMOTE_PUBLISH_DROPS]}, errors {n[C.REMOTE_ERRORS]}, "
        f"rejected {n[C.REMOTE_REJECTED]}",
        f"gpu: entries {s['gpu_entries']} ({_size(s['gpu_bytes'])}), "
        f"exports {n[C.GPU_EXPORTS]} (skipped {n[C.GPU_EXPORT_SKIPS]}), "
        f"hits {n[C.GPU_HITS_ALIAS]} alias + {n[C.GPU_HITS_PEER]} peer + "
        f"{n[C.GPU_HITS_HOST_COPY]} host copy, dead exporters seen {n[C.GPU_DEAD_EXPORTER]}",
    ]


def _clients_table(clients: list[ClientInfo]) -> str:
    """The attached processes, one row each."""
    return _table(
        ["record", "pid", "alive", "attached", "pins"],
        [
            [
                str(c.record),
                str(c.pid),
                "yes" if c.alive else "DEAD",
                time.strftime("%H:%M:%S", time.localtime(c.attached_at)),
                str(c.pins),
            ]
            for c in clients
        ],
    )


def _reservations_table(reservations: list[ReservationInfo]) -> str:
    """The keys being computed, one row each."""
    return _table(
        ["key", "slot", "gen", "owner pid", "owner"],
        [
            [r.key, str(r.slot), str(r.generation), str(r.owner_pid), "alive" if r.owner_alive else "DEAD"]
            for r in reservations
        ],
    )


def _entries_table(entries: list[EntryInfo]) -> str:
    """The entries, one row each, in the snapshot's order."""
    return _table(
        ["key", "modality", "value", "size", "state", "age", "ttl left", "refs", "holders", "gpu copy"],
        [
            [
                e.key,
                e.modality,
                ", ".join(f"{a['dtype']}{a['shape']}" for a in e.arrays) or (e.value_kind or "?"),
                _size(e.size_bytes),
                e.state,
                f"{e.age_s:.0f}s",
                "-" if e.ttl_left_s is None else f"{e.ttl_left_s:.0f}s",
                str(e.references),
                ",".join(map(str, e.holder_pids)) or "-",
                _gpu_cell(e.gpu),
            ]
            for e in entries
        ],
    )


def render(snap: NamespaceSnapshot) -> str:
    """The human report of one namespace (plain text)."""
    out = [
        *_summary(snap),
        "",
        "processes",
        _clients_table(snap.clients),
        "",
        "reservations in flight",
        _reservations_table(snap.reservations),
        "",
        "entries (largest first)",
        _entries_table(snap.entries),
    ]
    return "\n".join(out)


def gc_namespace(namespace: str) -> dict[str, Any]:
    """Reap dead processes, their pins and reservations; remove the namespace if nobody is alive.
    Returns what was done."""
    names = object_names(namespace)
    nothing = {"namespace": namespace, "removed": True, "reaped_clients": 0, "freed_reservations": 0}
    with bootstrap_lock(names, 0o600, 10.0, create=False) as held:
        if not held:  # no lock file: no namespace protocol can be running; drop a leftover arena/index
            if not remove_fragments(names):  # verified ours first (ForeignObject otherwise)
                raise ShmCacheError(f"namespace {namespace!r} does not exist")
            return nothing
        segments = open_existing(names, None)
        if segments is None:  # nobody alive (or only fragments left): everything is garbage
            remove_objects(names)
            return nothing
        segments.close()  # gc makes no views
        node = NodeIndex(segments, 10.0)
        dead = len(node.clients.dead())
        node.attach()  # attaching reaps dead records already
        try:
            before = _reserved(node)
            node.reap()
            freed = before - _reserved(node)
        finally:
            node.detach()
            if not node.clients.live().any():  # we are detached: anyone live is another process
                remove_objects(names)
    return {"namespace": namespace, "removed": False, "reaped_clients": dead, "freed_reservations": freed}


def _reserved(node: NodeIndex) -> int:
    return int((node.slots.array["state"] == SlotState.RESERVED).sum())


def orphans() -> list[str]:
    """Namespaces of this user with objects in /dev/shm but no index (`gc NAME` removes them)."""
    prefix = f"{PREFIX}.{os.geteuid()}."
    indexed = set(list_namespaces())
    names = {n[len(prefix) :].rsplit(".", 1)[0] for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    return sorted(names - indexed)


def _destroy(namespace: str, force: bool) -> int:
    if not force:
        try:
            snap = take_snapshot(namespace)
        except ShmCacheError as exc:
            print(f"shmcache-inspect: {exc}", file=sys.stderr)
            return 1
        alive = [c.pid for c in snap.clients if c.alive]
        if alive:
            print(
                f"shmcache-inspect: refusing to destroy {namespace!r}: processes {alive} are attached "
                "(use --force; they will get CacheClosed)",
                file=sys.stderr,
            )
            return 1
    from shmcache.kernel.namespace import destroy_namespace

    names = object_names(namespace)
    paths = (names.index_path, f"{SHM_DIR}{names.arena}", names.lock_path)
    if not any(os.path.lexists(path) for path in paths):
        print(f"shmcache-inspect: namespace {namespace!r} does not exist", file=sys.stderr)
        return 1  # a typo is not a success (without --force the snapshot says so too)
    if not destroy_namespace(namespace, unless_attached=not force):  # one attached since the snapshot
        print(
            f"shmcache-inspect: refusing to destroy {namespace!r}: a process attached (use --force)",
            file=sys.stderr,
        )
        return 1
    print(f"destroyed {namespace}")
    return 0


def _until_reader_goes(command: Callable[[], int]) -> int:
    """Run `command` and flush what it printed; Ctrl-C (ending --watch) and a reader that went
    (`| head`) end it with 0, without a traceback."""
    try:
        code = command()
        if sys.stdout is not None:  # None: started with its stdout closed (`>&-`): print wrote nothing
            sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        if sys.__stdout__ is not None and sys.stdout is sys.__stdout__:  # the command's own: no
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.__stdout__.fileno())  # second error at exit
        return 0


def _show_until_stopped(args: argparse.Namespace) -> int:
    while True:
        try:
            snap = take_snapshot(args.namespace, max_entries=args.entries)
        except ShmCacheError as exc:
            print(f"shmcache-inspect: {exc}", file=sys.stderr, flush=True)
            if not args.watch or not isinstance(exc, NamespaceUnavailable):
                return 1
            time.sleep(args.watch)  # absent or being created again (an engine restarting, say)
            continue
        if args.json:
            print(json.dumps(snap.to_json(), indent=None if args.watch else 2), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")
            print(render(snap), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)


def _serve(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry, start_http_server

    from shmcache.ops.metrics import ShmCacheCollector

    try:
        for namespace in args.namespaces:
            object_names(namespace)  # a name that cannot be a namespace's is refused, not dropped
    except ShmCacheError as exc:
        print(f"shmcache-inspect: {exc}", file=sys.stderr)
        return 1
    registry = CollectorRegistry()
    registry.register(ShmCacheCollector(args.namespaces or None))
    try:
        server, _thread = start_http_server(args.port, addr=args.host, registry=registry)
    except OSError as exc:  # the port is taken, or the host is not an address of this machine
        print(f"shmcache-inspect: cannot serve on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    port = server.server_address[1]  # the one bound: --port 0 takes a free one
    print(f"serving shmcache metrics on http://{args.host}:{port}/metrics", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


def _list(as_json: bool) -> int:
    rows: list[dict[str, Any]] = []
    for namespace in list_namespaces():
        try:
            snap = take_snapshot(namespace, max_entries=0)
        except ShmCacheError as exc:
            rows.append({"namespace": namespace, "error": str(exc)})
            continue
        rows.append(
            {
                "namespace": namespace,
                "live": snap.live,
                "clients": snap.stats["clients"],
                "entries": snap.stats["entries"],
                "used_bytes": snap.used_bytes,
                "capacity_bytes": snap.capacity_bytes,
            }
        )
    fragments = orphans()
    if as_json:
        print(json.dumps({"namespaces": rows, "fragments": fragments}, indent=2))
        return 0
    table = []
    for row in rows:
        if "error" in row:
            table.append([row["namespace"], f"error: {row['error']}", "", "", "", ""])
        else:
            state = "live" if row["live"] else "stale"
            sizes = [_size(row["used_bytes"]), _size(row["capacity_bytes"])]
            table.append([row["namespace"], state, str(row["clients"]), str(row["entries"]), *sizes])
    print(_table(["namespace", "state", "processes", "entries", "used", "capacity"], table))
    if fragments:
        print("fragments without an index (shmcache-inspect gc NAME removes them): " + ", ".join(fragments))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="shmcache-inspect", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command")
    listing = sub.add_parser("list", help="this user's namespaces")
    listing.add_argument("--json", action="store_true")
    show = sub.add_parser("show", help="one namespace in detail")
    show.add_argument("namespace")
    show.add_argument("--json", action="store_true", help="machine-readable (docs/inspect.md)")
    show.add_argument(
        "--watch", type=at_least(0.01, float, at_most=86400), metavar="SECONDS", help="repeat every SECONDS"
    )
    show.add_argument("--entries", type=at_least(0), default=None, help="show at most N entries")
    gc = sub.add_parser("gc", help="reap dead processes' records, pins and reservations")
    gc.add_argument("namespace")
    destroy = sub.add_parser("destroy", help="remove a namespace")
    destroy.add_argument("namespace")
    destroy.add_argument("--force", action="store_true", help="even while processes are attached")
    serve = sub.add_parser("serve-metrics", help="Prometheus metrics over HTTP")
    serve.add_argument("namespaces", nargs="*", help="default: every namespace of this user")
    serve.add_argument("--port", type=at_least(0, at_most=65535), default=9464)
    serve.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    if args.command in (None, "list"):
        return _until_reader_goes(lambda: _list(getattr(args, "json", False)))
    if args.command == "show":
        return _until_reader_goes(lambda: _show_until_stopped(args))
    if args.command == "gc":
        try:
            done = gc_namespace(args.namespace)
        except ShmCacheError as exc:
            print(f"shmcache-inspect: {exc}", file=sys.stderr)
            return 1
        if done["removed"]:
            print(f"{args.namespace}: no live process; removed its objects")
        else:
            print(
                f"{args.namespace}: reaped {done['reaped_clients']} dead process record(s), "
                f"freed {done['freed_reservations']} dead reservation(s)"
            )
        return 0
    if args.command == "destroy":
        try:
            return _destroy(args.namespace, args.force)
        except ShmCacheError as exc:
            print(f"shmcache-inspect: {exc}", file=sys.stderr)
            return 1
    return _serve(args)
