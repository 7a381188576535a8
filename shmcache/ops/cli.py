"""The `shmcache` command: demo, hold, inspect, omni-deploy, remote-holder (and `python -m shmcache`)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Final

__all__ = ["main"]

USAGE = """usage: shmcache COMMAND [ARGS]

commands:
  demo      encoder and prefill processes sharing one node cache (see `shmcache demo --help`)
  inspect   what this node's caches hold and who holds it (the same as `shmcache-inspect`)
  hold      keep a namespace alive while engines come and go (see `shmcache hold --help`)
  omni-deploy  turn a vLLM-Omni deploy YAML's embedding_cache: blocks into engine arguments
  remote-holder  run the node's Mooncake client, which keeps published copies past workers
"""


# each command's module, imported only when the command runs (vLLM's and Mooncake's imports are slow)
COMMANDS: Final = {
    "demo": "shmcache.ops.demo",
    "hold": "shmcache.ops.hold",
    "inspect": "shmcache.ops.inspect",
    "omni-deploy": "shmcache.integrations.vllm_omni.deploy",
    "remote-holder": "shmcache.remote.holder",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not args or args[0] not in COMMANDS:
        unknown = f"shmcache: unknown command {args[0]!r}\n\n" if args else ""
        print(f"{unknown}{USAGE}", file=sys.stderr)
        return 2
    command: Callable[[list[str]], int] = importlib.import_module(COMMANDS[args[0]]).main
    return command(args[1:])
