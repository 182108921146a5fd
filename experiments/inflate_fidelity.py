"""How closely `model.weights=inflated` computes and routes like the small model it grew from.

    python -m experiments.inflate_fidelity [--model deepseek] [--items 6] [--tokens 68]
                                           [--window 17] [--layers N] [--out DIR]

Routing does not depend on the widths an inflation adds (they are zero, models/inflate.py), so
the whole depth is measured here at the small model's own widths (only depth, permuted routers
and the tiled vocabulary added) in seconds on the CPU; tests/test_inflate.py checks at grown
widths that the tokens and logits are the small model's. For each prompt (the dataset's texts,
truncated to 64 tokens) the small model decodes `--tokens` greedy tokens; both models then run
the whole sequence once and every MoE layer's top-k experts are read off its router. Printed
per layer of the real model: its source layer, live or a zero-output copy, and the mean number
of distinct experts that `--window` consecutive decoded tokens touch (17: a window of K = 16
drafted tokens plus one), beside the source layer's in the small model; and whether the two
models decoded the same tokens. Acceptance is measured by the runner on both models
(scripts/real_size.sh prints it for the inflated model; the small model's from a
model=small_deepseek run on the same prompts): the draft of a zero-output layer is zero too, so
the inflated model drafts exactly what the small one does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _topk_hooks(model) -> tuple[list, list]:
    """Forward hooks on every router, recording its top-k expert ids per token."""
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    seen: list[list[torch.Tensor]] = [[] for _ in routers]
    handles = []
    for i, r in enumerate(routers):
        def hook(_m, _inp, out, i=i):
            seen[i].append(out[2].detach().reshape(-1, out[2].shape[-1]))
        handles.append(r.register_forward_hook(hook))
    return seen, handles


def routed(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Top-k ids per MoE layer, [tokens, k], for one forward over `ids` [1, T]."""
    seen, handles = _topk_hooks(model)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(s) for s in seen]


def distinct_per_window(topk: torch.Tensor, start: int, window: int) -> list[int]:
    """Distinct experts in each full window of `window` tokens from position `start`."""
    out = []
    for a in range(start, topk.shape[0] - window + 1, window):
        out.append(int(torch.unique(topk[a:a + window]).numel()))
    return out


def greedy(model, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """`tokens` greedy tokens, none masked (as the runner decodes: past an EOS too; `generate`'s
    min_new_tokens masks the EOS id, which a tiled vocabulary's copy of it would then win)."""
    from transformers import DynamicCache

    cache, seq, x = DynamicCache(), ids, ids
    with torch.no_grad():
        for _ in range(tokens):
            out = model(x, past_key_values=cache, use_cache=True)
            x = out.logits[:, -1:].argmax(-1)
            seq = torch.cat([seq, x], dim=1)
    return seq


def measure(small, big, prompts: list[list[int]], tokens: int, window: int) -> dict:
    from specter.models.inflate import layer_plan

    plans = [p for p in layer_plan(big.config.to_dict(), small.config.to_dict())
             if p.layer >= small.config.first_k_dense_replace]
    per_small: list[list[int]] = [[] for _ in range(small.config.num_hidden_layers)]
    per_big: list[list[int]] = [[] for _ in plans]
    same = 0
    for ids in prompts:
        x = torch.tensor([ids])
        a, b = greedy(small, x, tokens), greedy(big, x, tokens)
        same += int(a.tolist() == b.tolist())
        rs, rb = routed(small, a), routed(big, a)
        for i, t in enumerate(rs):
            per_small[i] += distinct_per_window(t, len(ids), window)
        for i, t in enumerate(rb):
            per_big[i] += distinct_per_window(t, len(ids), window)
    mean = lambda v: sum(v) / len(v) if v else float("nan")  # noqa: E731
    dense = small.config.first_k_dense_replace
    rows = []
    for p, v in zip(plans, per_big):
        src = mean(per_small[p.source - dense])
        rows.append({"layer": p.layer, "source": p.source, "live": p.live,
                     "distinct": mean(v), "source_distinct": src, "ratio": mean(v) / src})
    small_mean = mean([mean(v) for v in per_small if v])
    big_mean = mean([r["distinct"] for r in rows])
    return {"rows": rows, "windows": len(per_big[0]), "same_tokens": same,
            "prompts": len(prompts), "small_mean": small_mean, "big_mean": big_mean,
            "mean_ratio": big_mean / small_mean,
            "worst_layer_ratio": max(rows, key=lambda r: abs(r["ratio"] - 1))["ratio"]}


def build(model_key: str, source: str | None, layers: int | None):
    """(small model, its inflation at the small model's widths and the real model's depth,
    tokenizer) on the CPU in fp32."""
    from specter.config import ModelConfig
    from specter.models.inflate import check_source, inflate_module
    from specter.models.published import fixture_config
    from specter.placement.loader import load_model

    source = check_source(model_key, source)
    small = load_model(ModelConfig(name=source, source="project"), torch.device("cpu"),
                       progress=False)
    sc = small.model.config.to_dict()
    widths = {k: sc[k] for k in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                                 "kv_lora_rank", "num_attention_heads", "num_key_value_heads",
                                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    big_cfg = fixture_config(model_key, layers=layers, narrow=widths)
    big = inflate_module(small.model, big_cfg)
    return small.model, big, small.tokenizer, source


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek")
    ap.add_argument("--source", default=None)
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--items", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=68)
    ap.add_argument("--window", type=int, default=17)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    from specter.workloads import load_workload, truncate_prompt

    torch.manual_seed(0)
    small, big, tok, source = build(a.model, a.source, a.layers)
    texts = load_workload(a.dataset, a.items).texts
    prompts = [truncate_prompt(tok, t, 64) for t in texts]
    r = measure(small, big, prompts, a.tokens, a.window)
    print(f"inflated {a.model} from {source}: {len(r['rows'])} MoE layers, {r['windows']} windows "
          f"of {a.window} decoded tokens ({a.dataset}, {a.items} prompts x {a.tokens} tokens)")
    print("| layer | source | live | distinct experts / window | source layer's | ratio |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    for row in r["rows"]:
        print(f"| {row['layer']} | {row['source']} | {'live' if row['live'] else 'zero-output'} | "
              f"{row['distinct']:.2f} | {row['source_distinct']:.2f} | {row['ratio']:.3f} |")
    print(f"mean over layers: inflated {r['big_mean']:.2f}, small {r['small_mean']:.2f} "
          f"(ratio {r['mean_ratio']:.3f}; worst layer {r['worst_layer_ratio']:.3f}); "
          f"same greedy tokens on {r['same_tokens']} of {r['prompts']} prompts")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "inflate_fidelity.json").write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
