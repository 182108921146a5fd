"""Arrows back up inside `specter/`: imports from a lower layer to a higher one.

The layering is written here (`LAYERS`, top to bottom) and in docs/layout.md: a unit is a
subpackage (`specter/decoding/`, `specter/clock/`, ...) or a top-level module; a unit may
import its own layer and any layer below it. An arrow back up is a pair of units (lower ->
higher) with at least one import between them, lazy imports inside functions included (they
are still arrows: scripts/import_circles.py reads the same graph). Issue 57's goal is at most
2; each arrow is printed with the imports that make it. `--max N` exits 1 above N.

    python scripts/layers.py [--max N]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from import_circles import import_graph  # noqa: E402

# Top to bottom. Each line one layer: who may be imported by the lines above it.
LAYERS: list[tuple[str, ...]] = [
    ("specter", "__main__", "api", "serve"),  # the library, the command, the server
    ("compose", "specs", "settings", "recipes", "specter_recipe"),  # the composition root
    ("pio", "decoding"),  # the window: loops, drafts, the orchestrator
    ("offload", "experts", "placement", "budget"),  # where experts live and how they run
    ("clock",),  # time: cost model, clock kinds, the virtual link
    ("quant", "models"),  # the INT4 draft's kernels, the models and their loading
    ("config", "registry", "metrics", "workloads"),  # settings, names, measures, prompts
    ("errors", "counting", "switch", "grouping", "hermetic"),  # leaves
]


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def arrows_back_up(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(lower unit, higher unit) -> the imports that point up."""
    layer = {u: i for i, units in enumerate(LAYERS) for u in units}
    missing = sorted({unit(m) for m in graph} - set(layer))
    if missing:
        raise SystemExit(f"units without a layer: {', '.join(missing)} (add them to LAYERS)")
    up: dict[tuple[str, str], list[str]] = defaultdict(list)
    for a, targets in graph.items():
        for b in targets:
            if layer[unit(a)] > layer[unit(b)]:
                up[(unit(a), unit(b))].append(f"{a} -> {b}")
    return dict(sorted(up.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max", type=int, default=None, help="exit 1 when more are found")
    args = ap.parse_args(argv)
    up = arrows_back_up(import_graph(ROOT / "specter"))
    for (a, b), imports in up.items():
        print(f"{a} -> {b}: {'; '.join(sorted(imports))}")
    print(f"{len(up)} arrow(s) back up")
    return 1 if args.max is not None and len(up) > args.max else 0


if __name__ == "__main__":
    sys.exit(main())
