"""The `shmcache` command: demo, hold, inspect, omni-deploy, remote-holder (and `python -m shmcache`)."""

from __future__ import annotations

import sys

__all__ = ["main"]

USAGE = """usage: shmcache COMMAND [ARGS]

commands:
  demo      encoder and prefill processes sharing one node cache (see `shmcache demo --help`)
  inspect   what this node's caches hold and who holds it (the same as `shmcache-inspect`)
  hold      keep a namespace alive while engines come and go (see `shmcache hold --help`)
  omni-deploy  turn a vLLM-Omni deploy YAML's embedding_cache: blocks into engine arguments
  remote-holder  run the node's Mooncake client, which keeps published copies past workers
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "demo":
        from shmcache.ops.demo import main as demo

        return demo(rest)
    if command == "hold":
        from shmcache.ops.hold import main as hold

        return hold(rest)
    if command == "omni-deploy":
        from shmcache.integrations.vllm_omni.deploy import main as omni_deploy

        return omni_deploy(rest)
    if command == "remote-holder":
        from shmcache.remote.holder import main as remote_holder

        return remote_holder(rest)
    if command == "inspect":
        from shmcache.ops.inspect import main as inspect

        return inspect(rest)
    print(f"shmcache: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
