"""Import circles inside `specter/`: groups of modules that import one another, directly or
round a loop, counting imports inside functions too (a lazy import is still an arrow).

Issue 57's measure is 0. Each circle is printed as its modules; `--max N` exits 1 above N.

    python scripts/import_circles.py
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (absolute imports, anywhere in the file)."""
    base = package.parent
    modules = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(base).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                continue
            edges[name].update(t for t in named
                               if t in modules and t != name and t != package.name)
    return {m: edges[m] for m in modules}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max", type=int, default=None, help="exit 1 when more are found")
    args = ap.parse_args(argv)
    found = circles(import_graph(ROOT / "specter"))
    for group in found:
        print(f"{len(group)} modules: {' <-> '.join(group)}")
    print(f"{len(found)} import circle(s) inside specter/")
    return 1 if args.max is not None and len(found) > args.max else 0


if __name__ == "__main__":
    sys.exit(main())
