"""How many kernels one draft step runs on the device: counted, not assumed.

    python -m experiments.kernel_count [--layers 27] [--narrow] [--backend gather_int4]
                                       [--compile-backend inductor] [--list] [--out FILE]

Builds `model=deepseek model.weights=random` (DeepSeek-V2-Lite's architecture; `--layers`
cuts its depth, `--narrow` shrinks its widths so the whole depth fits a laptop: the kernels a
step runs do not depend on the widths, checked by `--layers 3` with and without `--narrow`),
compiles its draft step as `spec.compile=on` does (a static cache, `quant.backend`), decodes a
few tokens on the CPU, and prints the compiled step's kernels after inductor's fusion
(specter/clock/graph_kernels.py `KernelTally`: what its generated code launches; on CUDA the
captured graph's own count settles it) and, with `--compile-backend eager`, the step's
operations unfused (an eager step's launches). The virtual clock charges each such kernel its
floor (docs/clocks.md, "The kernel floor"). `--list` prints what each kernel is (the library
call or custom op, or a generated kernel, and the graph's operations it was made from), in the
order inductor emits them, with how often each line repeats (at 2-3 layers: one layer's kernels).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

NARROW = "{hidden_size: 256, intermediate_size: 512, moe_intermediate_size: 64}"


def count(layers: int, narrow: bool, backend: str = "gather_int4",
          compile_backend: str = "inductor", log=print, listed: bool = False) -> dict:
    """One draft step's kernels at `layers` deep (the model's decoder layers)."""
    import specter

    over = ["model.weights=random", f"model.layers={layers}", "spec.compile=on",
            f"spec.compile_backend={compile_backend}", f"quant.backend={backend}",
            "quant.method=rtn"]
    if narrow:
        over.append(f"model.narrow={NARROW}")
    began = time.time()
    llm = specter.load("deepseek", budget="full", hardware="h200_realsize", k=4,
                       max_prompt_tokens=32, max_new_tokens=16, overrides=over)
    layout = llm.engine.draft.layout
    if listed:
        layout.tally.labels = []  # each kernel's line (lowered afresh: graph_kernels.py)
    llm.generate("The kernels of one step", max_new_tokens=8)
    row = {"layers": layers, "narrow": narrow, "backend": backend,
           "compile_backend": compile_backend, "graphs": list(layout.tally.graphs),
           "compiled_kernels": layout.tally.kernels, "step_kernels": layout.step_kernels,
           "how": layout.tally.how, "seconds": round(time.time() - began, 1)}
    if listed and layout.tally.labels:
        from collections import Counter
        for label, n in Counter(layout.tally.labels).items():  # first appearance order
            log(f"{n:4d}  {label}")
    log(json.dumps(row))
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[27])
    ap.add_argument("--narrow", action="store_true")
    ap.add_argument("--backend", default="gather_int4")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--list", action="store_true", help="print what each kernel is")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    rows = [count(n, a.narrow, a.backend, a.compile_backend, listed=a.list) for n in a.layers]
    if len(rows) >= 2:
        (x0, y0), (x1, y1) = [(r["layers"], r["step_kernels"]) for r in rows[:2]]
        per = (y1 - y0) / (x1 - x0)
        print(f"per layer {per:.1f}; at 27 layers {y0 + per * (27 - x0):.0f}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
