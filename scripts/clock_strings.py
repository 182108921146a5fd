"""Where code outside the clock's package asks a clock which one it is, by its name.

Issue 57's measure: comparisons of a clock or clock kind with "virtual", "wall", "emulated" or
"cuda" in `specter/` and `baselines/`, outside `specter/clock/` (which decides what each clock
is: specter/clock/kinds.py), device-type tests apart (`device.type == "cuda"`). Code asks a
clock by trait instead (`timing.kind.charged`, `hardware.kind.real`, `timing.charged`).

    python scripts/clock_strings.py            # each place, then the count
    python scripts/clock_strings.py --max 2    # exit 1 above 2
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMES = {"virtual", "wall", "emulated", "cuda"}
SCOPE = ("specter", "baselines")
EXEMPT = ("specter/clock/",)


def _names_a_clock(node: ast.AST) -> bool:
    """A string constant among NAMES, alone or inside a tuple / list / set literal."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_clock(e) for e in node.elts)
    return False


def _about_a_device(node: ast.AST) -> bool:
    """`x.type`, or a name that says device (`device`, `device_kind`, `torch.device(d).type`)."""
    text = ast.unparse(node)
    return text.endswith(".type") or "device" in text


def string_tests(source: str) -> list[tuple[int, str]]:
    """(line, code) of each comparison of something with a clock's name, in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(_names_a_clock(s) for s in sides):
            continue
        if any(_about_a_device(s) for s in sides if not _names_a_clock(s)):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def clock_string_tests(root: Path = ROOT) -> list[tuple[str, int, str]]:
    out = []
    for top in SCOPE:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(EXEMPT):
                continue
            out += [(rel, line, code) for line, code in string_tests(path.read_text())]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max", type=int, default=None, help="exit 1 when more are found")
    args = ap.parse_args(argv)
    found = clock_string_tests()
    for rel, line, code in found:
        print(f"{rel}:{line}: {code}")
    print(f"{len(found)} string test(s) of the clock kind outside specter/clock/")
    if args.max is not None and len(found) > args.max:
        print(f"more than {args.max}: ask the clock by trait (specter/clock/kinds.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
