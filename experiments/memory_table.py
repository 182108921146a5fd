"""Device memory of the shared draft/target instance against two separate models.

`python -m experiments.memory_table [--context 12288] [--csv FILE] [--out DIR]`

For the three real models (sizes from their configs on the meta device, FP16 target, INT4
GPTQ draft in groups of 128 with FP16 scales) at their high and low budgets: non-expert
weights, the INT4 draft experts, the target's resident expert slots and one KV cache at
`--context` tokens. Shared = one instance (one copy of everything but the routed experts,
one KV cache); separate = a draft model and a target model, each with its own non-expert
weights and KV cache. The arithmetic is `specter.decoding.draft_mode.MemoryAccount`. `--out DIR`
also writes the rows as parquet records (experiment "memory", one case per model, budget and
context; a rerun skips recorded rows) for `python -m experiments.plots`.
"""

from __future__ import annotations

import argparse
import json
import sys


def rows(context: int) -> list[dict]:
    from pathlib import Path

    import yaml
    from transformers import AutoConfig

    from specter.budget import fp16_spec, resolve_slots
    from specter.config import BudgetConfig, ModelConfig
    from specter.models.real_configs import PAPER_MODELS, REAL_CONFIGS
    from specter.decoding.draft_mode import account_model

    out = []
    conf = Path(__file__).resolve().parents[1] / "conf" / "model"
    for name in PAPER_MODELS:  # the paper's table
        real = REAL_CONFIGS[name]
        spec = fp16_spec(AutoConfig.for_model(**real))
        mcfg = ModelConfig(**yaml.safe_load((conf / f"{name}.yaml").read_text()))
        for budget in ("high", "low"):
            slots = resolve_slots(BudgetConfig(name=budget), mcfg, spec.num_experts, spec.top_k).slots
            a = account_model(f"real:{real.get('_name_or_path', name)}", spec, slots, context)
            gb = 1e9
            out.append({"model": name, "source": a.source, "budget": budget, "slots": slots,
                        "context": context,
                        "non_expert_GB": a.non_expert_bytes / gb,
                        "int4_draft_GB": a.draft_expert_bytes / gb,
                        "target_slots_GB": a.target_slot_bytes / gb, "kv_GB": a.kv_bytes / gb,
                        "shared_GB": a.shared_bytes / gb, "separate_GB": a.separate_bytes / gb,
                        "saving": a.saving})
    return out


def write_records(out_dir: str, rows_: list[dict]) -> tuple[int, int]:
    """The rows as parquet records (experiment "memory"); returns (written, already there)."""
    from experiments.provenance import provenance
    from experiments.records import CaseStore

    written = skipped = 0
    for r in rows_:
        case = {"experiment": "memory", "model": r["model"], "source": r["source"],
                "budget": r["budget"], "slots": r["slots"], "context": r["context"]}
        store = CaseStore(out_dir, case)
        request_id = f"{r['model']}-{r['budget']}-ctx{r['context']}"
        if store.done(request_id, 0):
            skipped += 1
            continue
        # byte arithmetic on the real configs: no clock, no hardware
        store.write({**r, "experiment": "memory", "system": "memory_account",
                     "budget_slots": r["slots"], "clock": "none", "hardware": "none",
                     "case_id": store.case_id, "request_id": request_id, "repeat": 0,
                     **provenance()})
        written += 1
    return written, skipped


def main(argv: list[str]) -> int:
    import pandas as pd

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=12288)
    ap.add_argument("--csv")
    ap.add_argument("--out", help="also write the rows as parquet records under this results tree")
    args = ap.parse_args(argv)
    full = pd.DataFrame(rows(args.context))
    df = full.drop(columns="source")  # printed and --csv as before; records keep the source
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if args.csv:
        df.to_csv(args.csv, index=False)
    if args.out:
        written, skipped = write_records(args.out, full.to_dict(orient="records"))
        print(f"[memory] wrote {written} record(s), skipped {skipped} already recorded -> "
              f"{args.out}/records")
    print("SUMMARY " + json.dumps(df.to_dict(orient="records")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
