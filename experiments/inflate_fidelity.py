"""How `model.weights=inflated` routes beside the small model it grew from, layer by layer.

    python -m experiments.inflate_fidelity [--model deepseek] [--items 5] [--tokens 64]
                                           [--window 17] [--layers N] [--dataset all] [--out DIR]

Routing does not depend on the widths an inflation adds (they are zero, models/inflate.py), so
the whole depth is measured here at the small model's own widths (depth, scaled and permuted
copies and the tiled vocabulary added) in a minute on the CPU; tests/test_inflate.py checks at
grown widths that the logits are those of the same chain at the small widths. The prompts are
the project's benchmark prompts (specter/models/routing_stats.py: the five datasets' first
`--items` items cut to 16 tokens, as docs/routing.md measures small_deepseek against the
published 31.7), or one dataset's with `--dataset`. Each model decodes `--tokens` greedy tokens
of its own (none masked, as the runner decodes), then runs prompt + output once; at the output
positions every MoE layer's router input and top-k are read off its router. Printed per MoE
layer of the real model: its source layer, the scales of its attention and experts' outputs,
the mean number of distinct experts that `--window` consecutive tokens touch (17: a
verification window of K = 16 drafted tokens plus one), and the next-layer router agreement
(below) beside the small model's; then the means, how many output tokens equal the small
model's, distinct-4 of both models' outputs, and both models' loss on four held-out wikitext2
texts (items 5-8, 128 tokens: not the prompts).

Next-layer router agreement (the prediction of MO-SM, baselines/mo_sm.py): layer l+1's router
applied to layer l's router input (the output of layer l's post-attention norm: what layer l's
router and experts read) guesses k experts; the agreement is the mean over tokens of the share
of layer l+1's actual top-k among them (|guess & actual| / k). `exact` is the share of tokens
whose guess is the whole set; `2-ahead` applies layer l+2's router to the same input.
Acceptance is the runner's (model=deepseek model.weights=inflated system=specter; at reduced
sizes on the CPU with model.narrow, docs/measurements/inflate-fidelity-2026-12-06).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _moe_routers(model) -> list[torch.nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith("mlp.gate")]


def router_io(model, ids: torch.Tensor) -> tuple[list[torch.nn.Module], list[torch.Tensor],
                                                   list[torch.Tensor]]:
    """(routers, router inputs [T, H], top-k ids [T, k]) of every MoE layer for one forward
    over `ids` [1, T]."""
    routers = _moe_routers(model)
    inputs: list[torch.Tensor] = [None] * len(routers)  # type: ignore[list-item]
    topk: list[torch.Tensor] = [None] * len(routers)  # type: ignore[list-item]
    handles = []
    for i, r in enumerate(routers):
        def hook(_m, inp, out, i=i):
            inputs[i] = inp[0].detach().reshape(-1, inp[0].shape[-1])
            topk[i] = out[2].detach().reshape(-1, out[2].shape[-1])
        handles.append(r.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return routers, inputs, topk


def routed(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Top-k ids per MoE layer, [tokens, k], for one forward over `ids` [1, T]."""
    return router_io(model, ids)[2]


def distinct_per_window(topk: torch.Tensor, start: int, window: int) -> list[int]:
    """Distinct experts in each full window of `window` tokens from position `start`."""
    out = []
    for a in range(start, topk.shape[0] - window + 1, window):
        out.append(int(torch.unique(topk[a:a + window]).numel()))
    return out


def overlap_share(guess: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """Per token [T]: the share of `actual`'s k experts that `guess` [T, k] holds."""
    return (guess.unsqueeze(-1) == actual.unsqueeze(-2)).any(-1).float().mean(-1)


def next_layer_agreement(routers, inputs, topk, start: int, ahead: int = 1) -> list[torch.Tensor]:
    """Per transition l -> l + ahead: the per-token share of layer l+ahead's top-k that its
    router, applied to layer l's router input, predicts (output positions from `start`)."""
    out = []
    with torch.no_grad():
        for l in range(len(routers) - ahead):
            guess = routers[l + ahead](inputs[l][start:])[2]
            out.append(overlap_share(guess, topk[l + ahead][start:]))
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


def routing_stats(model, prompts: list[list[int]], outputs: list[torch.Tensor],
                  window: int) -> dict:
    """Per MoE layer: distinct experts per window, next-layer agreement (share and exact set)
    and the 2-ahead agreement, teacher-forced over each prompt + output, output positions."""
    distinct: list[list[int]] = []
    agree: list[list[torch.Tensor]] = []
    ahead2: list[list[torch.Tensor]] = []
    for ids, out in zip(prompts, outputs):
        routers, inputs, topk = router_io(model, out)
        if not distinct:
            distinct = [[] for _ in routers]
            agree = [[] for _ in routers[1:]]
            ahead2 = [[] for _ in routers[2:]]
        for i, t in enumerate(topk):
            distinct[i] += distinct_per_window(t, len(ids), window)
        for i, a in enumerate(next_layer_agreement(routers, inputs, topk, len(ids))):
            agree[i].append(a)
        for i, a in enumerate(next_layer_agreement(routers, inputs, topk, len(ids), ahead=2)):
            ahead2[i].append(a)
    mean = lambda v: sum(v) / len(v) if v else float("nan")  # noqa: E731
    cat = [torch.cat(a) for a in agree]
    return {"distinct": [mean(v) for v in distinct],
            "agree": [float(a.mean()) for a in cat],
            "exact": [float((a == 1).float().mean()) for a in cat],
            "agree_2ahead": [float(torch.cat(a).mean()) for a in ahead2],
            "windows": len(distinct[0]) if distinct else 0}


def nll(model, texts: list[list[int]], vocab: int) -> float:
    """Mean next-token loss (nats) over `texts`, on the first `vocab` logits (the small
    model's vocabulary: an inflated model repeats each logit in the tiled ids)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in texts:
            x = torch.tensor([ids])
            logits = model(x, use_cache=False).logits[0, :-1, :vocab].float()
            total += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            count += len(ids) - 1
    return total / count if count else float("nan")


def measure(small, big, prompts: list[list[int]], tokens: int, window: int,
            texts: list[list[int]] | None = None) -> dict:
    from specter.metrics import distinct_n
    from specter.models.inflate import layer_plan

    plans = [p for p in layer_plan(big.config.to_dict(), small.config.to_dict())
             if p.layer >= small.config.first_k_dense_replace]
    outs_s = [greedy(small, torch.tensor([ids]), tokens) for ids in prompts]
    outs_b = [greedy(big, torch.tensor([ids]), tokens) for ids in prompts]
    rs = routing_stats(small, prompts, outs_s, window)
    rb = routing_stats(big, prompts, outs_b, window)
    mean = lambda v: sum(v) / len(v) if v else float("nan")  # noqa: E731
    dense = small.config.first_k_dense_replace
    rows = []
    for i, p in enumerate(plans):
        rows.append({"layer": p.layer, "source": p.source, "attn": p.attn, "moe": p.moe,
                     "distinct": rb["distinct"][i],
                     "source_distinct": rs["distinct"][p.source - dense],
                     "agree_next": rb["agree"][i] if i < len(rb["agree"]) else None,
                     "exact_next": rb["exact"][i] if i < len(rb["exact"]) else None})
    same = [float((a[0, len(ids):] == b[0, len(ids):]).float().mean())
            for ids, a, b in zip(prompts, outs_s, outs_b)]
    d4 = lambda outs: mean([distinct_n(o[0, len(i):].tolist(), 4)  # noqa: E731
                            for i, o in zip(prompts, outs)])
    return {"rows": rows, "windows": rb["windows"], "prompts": len(prompts), "tokens": tokens,
            "big_distinct": mean(rb["distinct"]), "small_distinct": mean(rs["distinct"]),
            "big_distinct_range": [min(rb["distinct"]), max(rb["distinct"])],
            "big_agree": mean(rb["agree"]), "small_agree": mean(rs["agree"]),
            "big_agree_range": [min(rb["agree"]), max(rb["agree"])],
            "small_agree_layers": rs["agree"],
            "big_exact": mean(rb["exact"]), "small_exact": mean(rs["exact"]),
            "big_agree_2ahead": mean(rb["agree_2ahead"]),
            "small_agree_2ahead": mean(rs["agree_2ahead"]),
            "small_distinct_layers": rs["distinct"],
            "same_token_share": mean(same),
            "distinct4_big": d4(outs_b), "distinct4_small": d4(outs_s),
            **({"nll_big": nll(big, texts, small.config.vocab_size),
                "nll_small": nll(small, texts, small.config.vocab_size), "nll_texts": len(texts)}
               if texts else {})}


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


def prompts_for(tok, dataset: str, items: int) -> list[list[int]]:
    from specter.models.routing_stats import PROMPT_TOKENS, benchmark_prompts
    from specter.workloads import load_workload, truncate_prompt

    if dataset == "all":
        return benchmark_prompts(tok, items)
    return [truncate_prompt(tok, t, PROMPT_TOKENS) for t in load_workload(dataset, items).texts]


PUBLISHED_DISTINCT = 31.7  # DeepSeek-V2-Lite, 17 tokens, 64 experts top-6 (docs/routing.md)


def print_report(r: dict, head: str) -> None:
    print(head)
    print("| layer | source | attn scale | experts scale | distinct experts / window | "
          "source layer's | next-layer agreement | exact set |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in r["rows"]:
        agree = "" if row["agree_next"] is None else f"{row['agree_next']:.3f}"
        exact = "" if row["exact_next"] is None else f"{row['exact_next']:.3f}"
        print(f"| {row['layer']} | {row['source']} | {row['attn']:+.3f} | {row['moe']:+.3f} | "
              f"{row['distinct']:.2f} | {row['source_distinct']:.2f} | {agree} | {exact} |")
    lo, hi = r["big_agree_range"]
    dlo, dhi = r["big_distinct_range"]
    small_agree = ", ".join(f"{a:.3f}" for a in r["small_agree_layers"])
    print(f"next-layer agreement: inflated {r['big_agree']:.3f} (layers {lo:.3f}-{hi:.3f}; exact "
          f"set {r['big_exact']:.3f}; 2-ahead {r['big_agree_2ahead']:.3f}), small "
          f"{r['small_agree']:.3f} (transitions {small_agree}; exact set {r['small_exact']:.3f}; "
          f"2-ahead {r['small_agree_2ahead']:.3f})")
    print(f"distinct experts / window: inflated {r['big_distinct']:.2f} (layers {dlo:.2f}-"
          f"{dhi:.2f}; {r['big_distinct'] / PUBLISHED_DISTINCT:.3f} of the published "
          f"{PUBLISHED_DISTINCT}), small {r['small_distinct']:.2f}")
    print(f"outputs: {r['same_token_share']:.3f} of the inflated model's greedy tokens equal the "
          f"small model's at the same position; distinct-4 inflated {r['distinct4_big']:.3f}, "
          f"small {r['distinct4_small']:.3f}")
    if "nll_big" in r:
        print(f"held-out loss ({r['nll_texts']} wikitext2 texts of 128 tokens, items 5 on): "
              f"inflated {r['nll_big']:.3f}, small {r['nll_small']:.3f} nats per token")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek")
    ap.add_argument("--source", default=None)
    ap.add_argument("--dataset", default="all", help="all: the benchmark prompts (5 datasets)")
    ap.add_argument("--items", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=17)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    torch.manual_seed(0)
    small, big, tok, source = build(a.model, a.source, a.layers)
    prompts = prompts_for(tok, a.dataset, a.items)
    from specter.workloads import load_workload

    held_out = [tok(t)["input_ids"][:128] for t in load_workload("wikitext2", 9).texts[5:]]
    r = measure(small, big, prompts, a.tokens, a.window, held_out)
    print_report(r, f"inflated {a.model} from {source}: {len(r['rows'])} MoE layers, "
                    f"{r['windows']} windows of {a.window} decoded tokens per layer ({a.dataset}, "
                    f"{len(prompts)} prompts x {a.tokens} tokens, each model its own greedy "
                    "tokens)")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "inflate_fidelity.json").write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
