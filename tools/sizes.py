"""Size limits of the code: no module over 400 lines, no class over 300, no function over 60.

    python -m tools.sizes [paths...]     (default: shmcache tools tests)

Exits 1 and lists every offender. Run by ./tools/test next to ruff and mypy.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LIMITS = {"module": 400, "class": 300, "function": 60}


def offenders(path: Path) -> list[str]:
    """Every module, class and function of `path` over its limit, as `path:line kind name (n lines)`."""
    text = path.read_text()
    found = []
    lines = text.count("\n")
    if lines > LIMITS["module"]:
        found.append(f"{path}: module has {lines} lines (limit {LIMITS['module']})")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            kind = "class"
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "function"
        else:
            continue
        size = (node.end_lineno or node.lineno) - node.lineno + 1
        if size > LIMITS[kind]:
            found.append(f"{path}:{node.lineno} {kind} {node.name} has {size} lines (limit {LIMITS[kind]})")
    return found


def main(argv: list[str] | None = None) -> int:
    roots = [Path(p) for p in (argv if argv is not None else sys.argv[1:]) or ["shmcache", "tools", "tests"]]
    files = sorted(f for root in roots for f in ([root] if root.is_file() else root.rglob("*.py")))
    found = [line for f in files for line in offenders(f)]
    print("\n".join(found) if found else f"sizes: {len(files)} files within the limits {LIMITS}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
