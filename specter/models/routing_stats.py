"""How a MoE model routes on the benchmark prompts: the statistics every offloading result
depends on, measured from the model's own router (nothing synthetic).

Owns: the expert working-set curve (distinct experts per MoE layer needed by n consecutive
tokens), consecutive-token reuse, per-layer load entropy and the distinct-4 of greedy outputs,
and the benchmark prompts they are measured on. The build of a project-made model stores them
in its build record (zoo.py); `python -m experiments.routing_report` sets them beside the real
models' published numbers and adds the INT4 draft's side.
Does not own: the targets (experiments/plots/paper.py), the draft (specter.quant).
"""

from __future__ import annotations

import math

import torch

WINDOWS = tuple(range(1, 18)) + (33,)
PROMPT_TOKENS = 16  # the workloads' prompt length (conf/workload)
ITEMS = 5  # items per dataset (five datasets: 25 prompts)
TOKENS = 64  # greedy tokens decoded per prompt


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


def repeats(topk: torch.Tensor) -> tuple[float, float]:
    """(first-choice repeat, any-overlap repeat): the share of consecutive positions whose
    top-1 experts are the same, and whose top-k sets share at least one expert. These are the
    Mixtral paper's "repeated expert assignments" (Jiang et al. 2024, section 5: first choice,
    and first or second choice); `topk` lists each position's experts best first."""
    if topk.shape[0] < 2:
        return math.nan, math.nan
    first = float((topk[1:, 0] == topk[:-1, 0]).float().mean())
    anyk = (topk[1:].unsqueeze(2) == topk[:-1].unsqueeze(1)).any(dim=2).any(dim=1)
    return first, float(anyk.float().mean())


def load_entropy(topk: torch.Tensor, experts: int) -> float:
    """Entropy of the layer's expert load over these positions, divided by log(E)."""
    counts = torch.bincount(topk.flatten(), minlength=experts).float()
    p = counts / counts.sum()
    h = -(p[p > 0] * p[p > 0].log()).sum()
    return float(h / math.log(experts))


def random_working_set(experts: int, k: int, n: int) -> float:
    """Distinct experts n independent uniformly routed tokens need (each picks k of E)."""
    return experts * (1 - (1 - k / experts) ** n)


def benchmark_prompts(tokenizer, items: int = ITEMS) -> list[list[int]]:
    """The first `items` items of each benchmark dataset, cut to the workloads' prompt length
    (never the training text)."""
    from specter.workloads import DATASETS, load_workload, truncate_prompt

    return [truncate_prompt(tokenizer, t, PROMPT_TOKENS) for d in DATASETS
            for t in load_workload(d, items).texts]


@torch.no_grad()
def greedy_outputs(model, prompts: list[list[int]], tokens: int,
                   device: torch.device | None = None) -> list[torch.Tensor]:
    """prompt + `tokens` greedy tokens, per prompt ([1, S] each on `device`; EOS does not
    stop it)."""
    outs = []
    for ids in prompts:
        inp = torch.tensor([ids], device=device)
        outs.append(model.generate(input_ids=inp, attention_mask=torch.ones_like(inp),
                                   do_sample=False, max_new_tokens=tokens,
                                   min_new_tokens=tokens, pad_token_id=0))
    return outs


@torch.no_grad()
def measure(model, prompts: list[list[int]], tokens: int = TOKENS,
            outputs: list[torch.Tensor] | None = None) -> dict:
    """The routing statistics of `model`'s greedy outputs from `prompts` (teacher-forced
    routing of the output positions)."""
    from specter.metrics import distinct_n
    from specter.models.introspect import experts_modules, router_topk

    experts = experts_modules(model)[0][1].gate_up_proj.shape[0]
    outputs = outputs if outputs is not None else greedy_outputs(model, prompts, tokens)
    per_layer: list[list[torch.Tensor]] = []
    d4 = []
    for ids, out in zip(prompts, outputs):
        d4.append(distinct_n(out[0, len(ids):].tolist(), 4))
        for l, t in enumerate(router_topk(model, out)):  # per MoE layer [S, k]
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
            "repeat_first": _mean([repeats(t)[0] for layer in per_layer for t in layer]),
            "repeat_any": _mean([repeats(t)[1] for layer in per_layer for t in layer]),
            "load_entropy": _mean([load_entropy(torch.cat(layer), experts) for layer in per_layer]),
            "distinct_4": _mean(d4), "prompts": len(prompts), "tokens": tokens}


def _mean(v: list[float]) -> float:
    v = [x for x in v if not math.isnan(x)]
    return sum(v) / len(v) if v else math.nan


def checkpoint_record(checkpoint) -> dict:
    """The routing statistics a project-made model's build recorded (or, for a checkpoint
    built before builds measured them, the routing report written beside it), as result-row
    columns (`model.ws_growth`: working set at 17 tokens / at 1 token on the benchmark
    prompts); nan where neither exists (real weights: run experiments.routing_report)."""
    import json
    from pathlib import Path

    def read(name: str) -> dict:
        path = Path(checkpoint) / name
        return json.loads(path.read_text()) if path.is_file() else {}

    build = read("specter_build.json")
    inflated = read("specter_inflated.json")  # models/inflate.py: the source's build
    if inflated and not build:
        source = Path(inflated.get("source_folder", "")) / "specter_build.json"
        build = json.loads(source.read_text()) if source.is_file() else {}
    r = build.get("routing_benchmark") or read("specter_routing.json")
    ws = r.get("working_set") or {}
    one, seventeen = ws.get("1", math.nan), ws.get("17", math.nan)
    return {"model.ws_1": one, "model.ws_17": seventeen, "model.ws_growth": seventeen / one,
            "model.reuse": r.get("reuse", math.nan),
            "model.load_entropy": r.get("load_entropy", math.nan),
            "model.router_balance": build.get("router_balance", math.nan),
            # the shipped build (reference_models/) or one trained here; older builds: local
            "model.origin": build.get("origin", "local") if build else math.nan,
            "model.built_on": build.get("cpu", math.nan),  # the CPU that trained it
            "model.train_seed": build.get("seed", math.nan),  # with $SPECTER_TRAIN_SEED_OFFSET
            "model.weights_sha256": (build.get("weights_sha256") or "")[:16] or math.nan,
            # model.weights=inflated: the project-made model it computes like
            **({"model.inflated_from": inflated.get("from"),
                # how its depth grew (models/inflate.py RECIPE); none: zero-output copies
                "model.inflate_recipe": inflated.get("recipe", "zero-output-2026-12-04")}
               if inflated else {})}
