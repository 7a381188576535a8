"""`shmcache omni-deploy IN.yaml [-o OUT.yaml]`: write a vLLM-Omni deploy YAML whose stages'
`embedding_cache:` blocks are turned into the engine arguments vLLM-Omni passes to vLLM."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shmcache.errors import ShmCacheError
from shmcache.integrations.vllm_omni.stages import deploy_with_embedding_cache

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="shmcache omni-deploy",
        description="Turn the embedding_cache: blocks of a vLLM-Omni deploy YAML into engine arguments.",
    )
    parser.add_argument("source", type=Path, help="the deploy YAML with embedding_cache: blocks")
    parser.add_argument("-o", "--output", type=Path, help="where to write it (default: standard output)")
    args = parser.parse_args(argv)
    import yaml

    try:
        deploy = yaml.safe_load(args.source.read_text())
        text = yaml.safe_dump(deploy_with_embedding_cache(deploy), sort_keys=False)
    except (OSError, yaml.YAMLError, ShmCacheError) as exc:
        print(f"shmcache omni-deploy: {args.source}: {exc}", file=sys.stderr)
        return 1
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        args.output.write_text(text)
    except OSError as exc:
        print(f"shmcache omni-deploy: cannot write {args.output}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0
