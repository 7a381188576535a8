"""The node's store holder: Mooncake's own standalone client (`mooncake_client`), which mounts the
node's segment and outlives the workers; workers attach to it as thin clients
(`remote_holder="127.0.0.1:PORT"`), so what they publish stays in the store after they exit.

    shmcache remote-holder --master 127.0.0.1:50051 [--port 50052] [--segment "4 GB"] [--host IP]

runs it in the foreground with P2PHANDSHAKE metadata, its segment advertised at `--host` (127.0.0.1
by default: peers connect there; a cluster gives each node's own address, as workers'
`remote_local_host`). Mooncake's transfer-engine listeners bind the wildcard address whatever the
settings (upstream issue #1938): where other hosts must not reach them, firewall the node or run
the holder in a network namespace with only `lo`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from shmcache.config import is_host_port, is_unicast_ipv4
from shmcache.ops.argtypes import at_least

__all__ = ["holder_command", "main"]


def _program() -> str:
    found = shutil.which("mooncake_client")
    return found or os.path.join(os.path.dirname(sys.executable), "mooncake_client")


def _ipv4(text: str) -> str:
    """`text` if it is a unicast IPv4 address (argparse's type check of --host)."""
    if not is_unicast_ipv4(text):
        raise argparse.ArgumentTypeError(f"not a unicast IPv4 address: {text!r}")
    return text


def _host_port(text: str) -> str:
    """`text` if it is HOST:PORT (argparse's type check of --master)."""
    if not is_host_port(text):
        raise argparse.ArgumentTypeError(f"not HOST:PORT (port 1..65535): {text!r}")
    return text


def holder_command(
    master: str, *, host: str = "127.0.0.1", port: int = 50052, segment: str = "4 GB", threads: int = 2
) -> list[str]:
    """The `mooncake_client` command line of a holder of a `segment` sized segment, advertised at
    `host`."""
    return [
        _program(),
        f"--host={host}",
        f"--port={port}",
        "--metadata_server=P2PHANDSHAKE",
        f"--master_server_address={master}",
        f"--global_segment_size={segment}",
        "--protocol=tcp",
        f"--threads={threads}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="shmcache remote-holder",
        description="Run the node's Mooncake client (mooncake_client), which holds the node's "
        "segment: copies published by workers attached to it outlive them.",
    )
    parser.add_argument("--master", type=_host_port, required=True, help="the Mooncake master, HOST:PORT")
    parser.add_argument(
        "--port",
        type=at_least(1, at_most=65535),
        default=50052,
        help="the port workers attach to (remote_holder)",
    )
    parser.add_argument("--segment", default="4 GB", help='the segment it mounts, e.g. "4 GB"')
    parser.add_argument(
        "--host", type=_ipv4, default="127.0.0.1", help="the node's IPv4 address other nodes pull from"
    )
    args = parser.parse_args(argv)
    command = holder_command(args.master, host=args.host, port=args.port, segment=args.segment)
    if not os.access(command[0], os.X_OK):
        print(
            "shmcache remote-holder: mooncake_client is not installed (pip install 'shmcache[mooncake]')",
            file=sys.stderr,
        )
        return 1
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", args.host)
    os.execv(command[0], command)
