"""How a model routes, beside the real model it stands for (issue 13's measurement).

    python -m experiments.routing_report [--models small_deepseek,small_qwen,small_phi]
                                         [--items 5] [--tokens 64] [--out DIR]

For each model, on the benchmark prompts (the five datasets' first `--items` items, cut to 16
tokens, as the workloads run them; never the training text): the target decodes greedily,
then one teacher-forced forward over prompt + output records every MoE layer's top-k expert
ids (the model's own router; nothing synthetic). From the output positions:
- the expert working-set curve: distinct experts per layer needed by n consecutive tokens,
  n = 1..17 and 33 (non-overlapping windows, mean over windows and layers) — what one
  verification of K = n - 1 drafted tokens needs;
- the uniform-random reference at the same n: E * (1 - (1 - k/E)^n), the expected distinct
  experts of n independent tokens that each pick k of E uniformly;
- consecutive-token reuse: the mean fraction of token t+1's top-k experts that token t used;
- per-layer load entropy (normalised: 1 = every expert equally used);
- distinct-4 of the greedy outputs.
The paper's targets (experiments/plots/paper.py; docs/routing_targets_sources.md) stand beside
them: DeepSeek-V2-Lite 6.0 -> 31.7 distinct experts from 1 to 17 tokens, growth 7.18x
(Qwen1.5-MoE) and 4.65x (Phi-3.5-MoE). Writes `routing_report.md` and `.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

WINDOWS = tuple(range(1, 18)) + (33,)


def working_set(topk: torch.Tensor, n: int) -> float:
    """Mean distinct experts in non-overlapping windows of `n` consecutive positions of one
    layer's routing `topk` [T, k]; nan when T < n."""
    T = topk.shape[0]
    sizes = [len(set(topk[s:s + n].flatten().tolist())) for s in range(0, T - n + 1, n)]
    return sum(sizes) / len(sizes) if sizes else math.nan


def reuse(topk: torch.Tensor) -> float:
    """Mean share of position t+1's experts that position t also used."""
    if topk.shape[0] < 2:
        return math.nan
    k = topk.shape[1]
    same = (topk[1:].unsqueeze(2) == topk[:-1].unsqueeze(1)).any(dim=2).sum(dim=1).float() / k
    return float(same.mean())


def load_entropy(topk: torch.Tensor, experts: int) -> float:
    """Entropy of the layer's expert load over these positions, divided by log(E)."""
    counts = torch.bincount(topk.flatten(), minlength=experts).float()
    p = counts / counts.sum()
    h = -(p[p > 0] * p[p > 0].log()).sum()
    return float(h / math.log(experts))


def random_working_set(experts: int, k: int, n: int) -> float:
    """Distinct experts n independent uniformly routed tokens need (each picks k of E)."""
    return experts * (1 - (1 - k / experts) ** n)


@torch.no_grad()
def measure(model, tokenizer, prompts: list[list[int]], tokens: int) -> dict:
    from specter.metrics import distinct_n
    from specter.models.introspect import experts_modules, router_topk

    experts = experts_modules(model)[0][1].gate_up_proj.shape[0]
    per_layer: list[list[torch.Tensor]] = []
    d4 = []
    for ids in prompts:
        inp = torch.tensor([ids])
        out = model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), do_sample=False,
                             max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
        d4.append(distinct_n(out[0, len(ids):].tolist(), 4))
        topk = router_topk(model, out)  # per MoE layer [S, k]
        for l, t in enumerate(topk):
            if len(per_layer) <= l:
                per_layer.append([])
            per_layer[l].append(t[len(ids):])  # output positions only
    k = per_layer[0][0].shape[1]
    curve = {n: _mean([working_set(t, n) for layer in per_layer for t in layer]) for n in WINDOWS}
    return {"experts": experts, "top_k": k, "moe_layers": len(per_layer),
            "working_set": curve,
            "random_working_set": {n: random_working_set(experts, k, n) for n in WINDOWS},
            "growth_1_to_17": curve[17] / curve[1],
            "reuse": _mean([reuse(t) for layer in per_layer for t in layer]),
            "load_entropy": _mean([load_entropy(torch.cat(layer), experts) for layer in per_layer]),
            "distinct_4": _mean(d4), "prompts": len(prompts), "tokens": tokens}


def _mean(v: list[float]) -> float:
    v = [x for x in v if not math.isnan(x)]
    return sum(v) / len(v) if v else math.nan


def paper_targets(family: str | None) -> dict:
    from experiments.plots import paper

    if family is None:
        return {}
    growth = paper.EXPLOSION_GROWTH_1_TO_16.get(family)
    out = {"growth_1_to_17": growth}
    if family == "deepseek":
        out.update({"working_set_1": paper.EXPLOSION_DEEPSEEK[1], "working_set_17": paper.EXPLOSION_DEEPSEEK[16]})
    return out


def report(rows: dict[str, dict]) -> str:
    lines = ["# Routing report: how the project-made models route, beside the real models", "",
             "Measured on the benchmark prompts (greedy outputs, teacher-forced routing of the output "
             "positions). Paper targets: DeepSeek-V2-Lite 6.0 -> 31.7 distinct experts per layer from "
             "1 to 17 tokens; growth 7.18x (Qwen1.5-MoE), 4.65x (Phi-3.5-MoE). Sources: "
             "docs/routing_targets_sources.md.", "",
             "| model | stands for | E / top-k | n=1 | n=2 | n=4 | n=8 | n=17 | n=33 | random n=17 | growth 1->17 | paper growth | reuse t->t+1 | load entropy | distinct-4 |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        ws, tg = r["working_set"], r["paper"]
        pg = tg.get("growth_1_to_17")
        lines.append(
            f"| {name} | {r['stands_for'] or '-'} | {r['experts']} / {r['top_k']} | "
            + " | ".join(f"{ws[n]:.1f}" for n in (1, 2, 4, 8, 17, 33))
            + f" | {r['random_working_set'][17]:.1f} | {r['growth_1_to_17']:.2f}x | "
            + (f"{pg:.2f}x" if pg else "-")
            + f" | {r['reuse']:.3f} | {r['load_entropy']:.3f} | {r['distinct_4']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.routing_report",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small_deepseek,small_qwen,small_phi")
    ap.add_argument("--items", type=int, default=5, help="items per dataset (five datasets)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="results/routing_report")
    args = ap.parse_args(argv)
    from omegaconf import OmegaConf

    from experiments.runner import HARDWARE_DIR
    from specter.config import ModelConfig
    from specter.errors import UserError
    from specter.models.loading import load_model
    from specter.workloads import DATASETS, load_workload, truncate_prompt

    rows = {}
    for name in args.models.split(","):
        path = HARDWARE_DIR.parent / "model" / f"{name}.yaml"
        if not path.is_file():
            print(f"error: unknown model '{name}' (no conf/model/{name}.yaml).", file=sys.stderr)
            return 2
        mcfg = ModelConfig(**OmegaConf.to_container(OmegaConf.load(path)))
        try:
            loaded = load_model(mcfg, torch.device("cpu"), progress=False)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        prompts = [truncate_prompt(loaded.tokenizer, t, 16) for d in DATASETS
                   for t in load_workload(d, args.items).texts]
        r = measure(loaded.model, loaded.tokenizer, prompts, args.tokens)
        r["stands_for"] = mcfg.stands_for
        r["paper"] = paper_targets(mcfg.stands_for)
        rows[name] = r
        print(f"[routing] {name}: working set n=1 {r['working_set'][1]:.1f}, n=17 "
              f"{r['working_set'][17]:.1f} (growth {r['growth_1_to_17']:.2f}x), reuse "
              f"{r['reuse']:.3f}, load entropy {r['load_entropy']:.3f}, distinct-4 {r['distinct_4']:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing_report.md").write_text(report(rows))
    (out / "routing_report.json").write_text(json.dumps(rows, indent=1, default=str))
    print(report(rows))
    print(f"wrote {out / 'routing_report.md'}, {out / 'routing_report.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
