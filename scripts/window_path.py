"""The files and functions of `specter/` a newcomer follows through one speculative window.

    .venv/bin/python scripts/window_path.py [--model tiny_deepseek] [--json OUT.json]

Builds Specter through the library (`specter.load`: a project-made model, the low budget, so
experts are copied, on the embedded default's virtual clock), decodes one short request, and
records every Python function of `specter/` that runs inside the window loop (the body of
`decoding/loop.py speculative_batch`'s `while`, after the prefill), with its *depth*: how many
`specter/` frames stand between the loop and it (1: called by the loop itself; 2: called by
those, e.g. the experts runtime under the verify forward, reached through Hugging Face's
model; frames of torch and transformers in between are not counted). Windows repeat the same
calls, so the request's windows together are one window's path.

It prints, per depth limit, the distinct files and functions, and the files at depth 1 and 2
with their functions: the reading path of issue 47 item 5 ("draft, plan and prefetch, verify,
accept, evict through at most 5 files").

A comprehension or generator expression runs as a frame of its own in CPython 3.11 (3.12
inlines list, dict and set comprehensions: PEP 709), but it is not a function a reader goes
to: it is read where it stands. So functions are counted without them (`<listcomp>`,
`<genexpr>`, ...); the count with them follows in brackets, as issue 57 first counted.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SPECTER = str(ROOT / "specter")


def window_lines(fn) -> tuple[int, int]:
    """The first and last source lines of `fn`'s outermost `while` loop (the window loop)."""
    source, start = inspect.getsourcelines(fn)
    tree = ast.parse("".join(source))
    for node in ast.walk(tree):
        if isinstance(node, ast.While):
            return start + node.lineno - 1, start + node.end_lineno - 1
    raise SystemExit(f"{fn.__name__} has no while loop")


def trace(model: str, tokens: int) -> dict[tuple[str, str], int]:
    import specter
    from specter.decoding import loop

    llm = specter.load(model, budget="low", max_new_tokens=tokens, max_prompt_tokens=32)
    window_loop = inspect.unwrap(loop.speculative_batch)  # (under torch.no_grad)
    loop_code = window_loop.__code__
    first, last = window_lines(window_loop)
    seen: dict[tuple[str, str], int] = {}

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(SPECTER):
            return
        depth, f = 0, frame
        while f is not None and f.f_code is not loop_code:
            if f.f_code.co_filename.startswith(SPECTER):
                depth += 1
            f = f.f_back
        if f is None or not (first < f.f_lineno <= last):
            return
        code = frame.f_code
        key = (str(Path(code.co_filename).relative_to(ROOT)), code.co_qualname)
        seen[key] = min(seen.get(key, depth), depth)

    ids = llm.ids("The capital of France is")
    sys.setprofile(profile)
    try:
        llm.generate(ids, tokens)
    finally:
        sys.setprofile(None)
        llm.close()
    return seen


def comprehension(qualname: str) -> bool:
    """A comprehension's or generator expression's frame (`f.<locals>.<listcomp>`)."""
    return qualname.rsplit(".", 1)[-1] in ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def reading(seen: dict[tuple[str, str], int], limit: int | None) -> tuple[list[str], list]:
    """The files and the functions (comprehensions apart) at most `limit` calls deep (None: all)."""
    keys = [k for k, d in seen.items() if (limit is None or d <= limit) and not comprehension(k[1])]
    return sorted({f for f, _ in keys}), keys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny_deepseek")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--max", nargs=2, type=int, metavar=("FILES", "FUNCTIONS"),
                    help="exit 1 when three calls deep reads more (issue 57's goal: 8 40)")
    args = ap.parse_args()
    seen = trace(args.model, args.tokens)
    table = []
    for limit in (1, 2, 3, None):
        frames = [k for k, d in seen.items() if limit is None or d <= limit]
        files, keys = reading(seen, limit)
        table.append({"depth": limit or "all", "files": len(files), "functions": len(keys),
                      "with_comprehensions": len(frames)})
        print(f"depth <= {limit or 'all'}: {len(files)} files, {len(keys)} functions "
              f"({len(frames)} with comprehension frames)")
    for limit in (1, 2):
        by_file = defaultdict(list)
        for (f, name), d in sorted(seen.items()):
            if d <= limit and not comprehension(name):
                by_file[f].append(name)
        print(f"\nat depth <= {limit}:")
        for f, names in by_file.items():
            print(f"  {f}: {', '.join(names)}")
    if args.json:
        args.json.write_text(json.dumps({"summary": table, "functions": [
            {"file": f, "function": n, "depth": d} for (f, n), d in sorted(seen.items())]},
            indent=1))
    three = table[2]
    if args.max and (three["files"] > args.max[0] or three["functions"] > args.max[1]):
        print(f"three calls deep: {three['files']} files, {three['functions']} functions; more "
              f"than {args.max[0]} / {args.max[1]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
