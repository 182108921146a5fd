"""Cross-check the built-in GPTQ against gptqmodel on one project-made model.

`python -m experiments.crosscheck_gptq --model tiny_qwen [--group 32] [--out DIR]`

Both quantize the routed experts at 4 bits from the same calibration windows; each
quantized matrix is scored by the GPTQ objective on the full-precision inputs routed to that
expert (`gptq.reconstruction_error`), and RTN is scored beside them. Prints one row per
(MoE layer, matrix) and a summary line; writes `crosscheck.parquet` under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def crosscheck(model_name: str, group: int, calib_tokens: int, cache_dir: Path | None = None):
    import pandas as pd

    from specter.config import ModelConfig
    from specter.models.loading import resolve_checkpoint
    from specter.placement.loader import load_model
    from specter.models.zoo import default_cache_dir
    from specter.quant.calibrate import (QuantSpec, calibration_windows, layer_hessians,
                                         quantize_experts, source_checksum)
    from specter.quant.formats import rtn_quantize
    from specter.quant.gptq import reconstruction_error
    from specter.quant.gptq_import import import_gptq, quantize_with_gptqmodel

    cache_dir = cache_dir or default_cache_dir()
    cfg = ModelConfig(name=model_name, source="project", dtype="float32")
    ckpt = resolve_checkpoint(cfg, cache_dir, 0, False)
    lm = load_model(cfg, torch.device("cpu"), cache_dir, 0, progress=False)
    spec = QuantSpec(method="gptq", bits=4, group=group, calib_tokens=calib_tokens)
    windows = calibration_windows(lm.tokenizer, spec)
    ref_dir = cache_dir / "quant" / f"gptqmodel-plain-{source_checksum(lm.model)}-w4g{group}-t{calib_tokens}"
    theirs = import_gptq(quantize_with_gptqmodel(ckpt, windows, 4, group, ref_dir), lm.model)
    ours = quantize_experts(lm.model, spec, windows, torch.device("cpu"))
    from specter.models.introspect import experts_modules

    rows = []
    for l, (_, m) in enumerate(experts_modules(lm.model)):
        h_gu, h_dn = layer_hessians(lm.model, l, windows, torch.device("cpu"))
        their_gu, their_dn = theirs.layer(l)  # the import reads its layers one at a time
        for e in range(m.gate_up_proj.shape[0]):
            for kind, w, h, a, b in (("gate_up", m.gate_up_proj[e], h_gu[e], ours.gate_up[l][e], their_gu[e]),
                                     ("down", m.down_proj[e], h_dn[e], ours.down[l][e], their_dn[e])):
                if h.n < spec.min_tokens:
                    continue  # our RTN fallback: not a GPTQ comparison
                rows.append({"model": model_name, "moe_layer": l, "expert": e, "matrix": kind,
                             "tokens": h.n, "ours": reconstruction_error(w.detach(), a, h.h),
                             "gptqmodel": reconstruction_error(w.detach(), b, h.h),
                             "rtn": reconstruction_error(w.detach(), rtn_quantize(w.detach(), 4, group), h.h)})
    return pd.DataFrame(rows)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny_qwen")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--out", default="results/crosscheck_gptq")
    args = ap.parse_args(argv)
    df = crosscheck(args.model, args.group, args.calib_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out / f"crosscheck-{args.model}.parquet")
    table = df.groupby(["moe_layer", "matrix"])[["ours", "gptqmodel", "rtn"]].sum()
    table["ours/gptqmodel"] = table["ours"] / table["gptqmodel"]
    print(table.to_string(float_format=lambda v: f"{v:.4g}"))
    ratio = df["ours"] / df["gptqmodel"]
    summary = {"model": args.model, "matrices": len(df),
               "total_ratio": float(df["ours"].sum() / df["gptqmodel"].sum()),
               "median_ratio": float(ratio.median()),
               "frac_within_10pct": float((ratio <= 1.1).mean()),
               "rtn_over_gptqmodel": float(df["rtn"].sum() / df["gptqmodel"].sum())}
    print("SUMMARY " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
