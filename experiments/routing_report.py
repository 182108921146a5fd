"""How each model routes and drafts, beside the real model it stands for.

    python -m experiments.routing_report [--models small_deepseek,small_qwen,small_phi]
                                         [--items 5] [--tokens 64] [--out DIR] [--no-draft]

For each model, on the benchmark prompts (the five datasets' first `--items` items, cut to 16
tokens as the workloads run them; never the training text) the target decodes greedily, then
teacher-forced forwards over prompt + output record every MoE layer's top-k expert ids (the
model's own router; nothing synthetic) — specter/models/routing_stats.py:
- the expert working-set curve: distinct experts per layer needed by n consecutive tokens,
  n = 1..17 and 33 — what one verification of K = n - 1 drafted tokens needs;
- consecutive-token reuse, per-layer load entropy, distinct-4 of the greedy outputs.
And the INT4 self-draft's side (the default quantization, conf/quant): routing fidelity (top-k
agreement of draft and target on the same prefix, the paper's Table 1 metric), how often the
draft's greedy token is the target's, and acceptance at K = 1, 2, 4, 8, 16 as the speculative
loop would find it from that token agreement (teacher-forced estimate: greedy speculation
accepts a draft token exactly when it equals the target's, given an accepted prefix).

Targets (docs/routing.md): the paper publishes each real model's curve only at its ends, 1 token
(top-k) and 17 (DeepSeek-V2-Lite 31.7; Qwen1.5-MoE 4 x 7.18; Phi-3.5-MoE 2 x 4.65). Between
them the target is a band spanned by two curves through both ends: the effective-pool curve
E'(1 - (1 - k/E')^n), routing that draws uniformly from E' experts (saturating), and the power
law k n^a (never saturating). A model is within tolerance when its n = 17 point is within 15%
of the published value and every point n = 2..16 lies within 15% of the band.

For project-made models the report is also written beside the checkpoint
(`specter_routing.json`), where every result row finds the model's working-set growth. Writes
`routing_report.md` and `.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

from specter.models.routing_stats import (WINDOWS, load_entropy, measure,  # noqa: F401
                                          random_working_set, reuse, working_set)

TOLERANCE = 0.15
ACCEPT_KS = (1, 2, 4, 8, 16)
BAND_POINTS = (2, 4, 8, 12, 16)  # shown in the table; the check covers every n = 2..16
REPORT_FILE = "specter_routing.json"


# -- targets ------------------------------------------------------------------------------------

def endpoint_17(family: str | None) -> float | None:
    """The paper's working set at 17 tokens (K = 16 drafts + the token they follow)."""
    from experiments.plots import paper

    if family not in paper.REAL_MOE:
        return None
    return paper.REAL_MOE[family][1] * paper.EXPLOSION_GROWTH_1_TO_16[family]


def pool_curve(experts_eff: float, k: int, n: int) -> float:
    return experts_eff * (1 - (1 - k / experts_eff) ** n)


def target_band(family: str | None) -> dict[int, tuple[float, float]]:
    """n -> (low, high) for n = 1..17: the two interpolations through the published ends."""
    from experiments.plots import paper

    w17 = endpoint_17(family)
    if w17 is None:
        return {}
    k = paper.REAL_MOE[family][1]
    lo, hi = k + 1e-9, 1e6  # the effective pool E' with pool_curve(E', k, 17) = w17 (bisection)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pool_curve(mid, k, 17) < w17 else (lo, mid)
    a = math.log(w17 / k) / math.log(17)
    out = {}
    for n in range(1, 18):
        pair = (pool_curve(hi, k, n), k * n ** a)
        out[n] = (min(pair), max(pair))
    return out


def check(curve: dict[int, float], family: str | None, tol: float = TOLERANCE) -> dict:
    """Deviation of a measured curve from the targets: at n = 17 from the published value, at
    n = 2..16 from the band (0 inside it)."""
    w17, band = endpoint_17(family), target_band(family)
    if w17 is None:
        return {}
    devs = {}
    for n in range(2, 17):
        lo, hi = band[n]
        w = curve[n]
        devs[n] = w / lo - 1 if w < lo else (w / hi - 1 if w > hi else 0.0)
    worst = max(devs, key=lambda n: abs(devs[n]))
    dev17 = curve[17] / w17 - 1
    return {"target_17": w17, "dev_17": dev17, "band": {n: list(b) for n, b in band.items()},
            "band_dev": devs, "worst_n": worst, "worst_dev": devs[worst],
            "within": abs(dev17) <= tol and all(abs(d) <= tol for d in devs.values())}


# -- the draft's side ---------------------------------------------------------------------------

def acceptance_at(matches: list[bool], k: int) -> float:
    """Accepted / drafted when greedy speculation at depth `k` walks a sequence whose draft
    token agrees with the target's at the positions `matches` (a window accepts its leading
    agreements; the target then adds one token)."""
    p = accepted = drafted = 0
    while p < len(matches):
        window = min(k, len(matches) - p)
        a = 0
        while a < window and matches[p + a]:
            a += 1
        accepted, drafted, p = accepted + a, drafted + window, p + a + 1
    return accepted / drafted if drafted else math.nan


@torch.no_grad()
def draft_side(model, tokenizer, prompts: list[list[int]], outputs: list[torch.Tensor],
               device: torch.device = torch.device("cpu")) -> dict:
    from experiments.fidelity import routing_fidelity
    from specter.config import QuantConfig
    from specter.models.zoo import default_cache_dir
    from specter.quant.build import resolve_backend, spec_of
    from specter.quant.calibrate import ensure_quantized
    from specter.decoding.draft_mode import DraftMode

    spec = spec_of(QuantConfig())
    experts, path, _ = ensure_quantized(model, tokenizer, spec, default_cache_dir(), device)
    # the groups from the saved draft's layout, no layer read; the backend then reads the
    # layers one at a time into its own copy (the host never holds the whole draft)
    groups = experts.groups()
    shared = DraftMode(model, experts, resolve_backend("auto", spec.bits, device, groups)[0],
                       device)
    fid, match, per_k = [], [], {k: [] for k in ACCEPT_KS}
    for ids, out in zip(prompts, outputs):
        r = routing_fidelity(shared, out[:, :-1].to(device), start=len(ids) - 1,
                             with_matches=True)
        fid.append(r["fidelity_topk"])
        match.append(r["draft_token_match"])
        for k in ACCEPT_KS:
            per_k[k].append(acceptance_at(r["draft_token_matches"], k))
    return {"draft": f"{spec.method} w{spec.bits}g{spec.group}", "draft_path": str(path),
            "fidelity_topk": _mean(fid), "draft_token_match": _mean(match),
            "acceptance": {k: _mean(v) for k, v in per_k.items()}}


def _mean(v: list[float]) -> float:
    v = [x for x in v if not math.isnan(x)]
    return sum(v) / len(v) if v else math.nan


# -- one model, the table -----------------------------------------------------------------------

def model_report(model, tokenizer, family: str | None, items: int, tokens: int,
                 draft: bool = True, device: torch.device = torch.device("cpu")) -> dict:
    from specter.models.routing_stats import benchmark_prompts, greedy_outputs

    prompts = benchmark_prompts(tokenizer, items)
    outputs = greedy_outputs(model, prompts, tokens, device)
    r = measure(model, prompts, tokens, outputs)
    r["stands_for"] = family
    r["target"] = check(r["working_set"], family)
    if draft:
        r.update(draft_side(model, tokenizer, prompts, outputs, device))
    return r


def report(rows: dict[str, dict]) -> str:
    from experiments.plots import paper

    band_cols = " | ".join(f"n={n}" for n in BAND_POINTS)
    lines = [
        "# Routing report: how the models route and draft, beside the real models", "",
        "Measured on the benchmark prompts (greedy outputs, teacher-forced routing of the output "
        "positions). Working set: distinct routed experts per MoE layer needed by n consecutive "
        "tokens; each cell reads `measured [target]`, the target at n = 17 published (the paper: "
        "DeepSeek-V2-Lite 6.0 -> 31.7; growth 7.18x Qwen1.5-MoE, 4.65x Phi-3.5-MoE), between the "
        "ends the band of two interpolations through them (docs/routing.md). `within 15%`: n = 17 "
        f"within 15% of the published value and every n = 2..16 within 15% of the band. Paper: "
        f"INT4 routing fidelity {', '.join(f'{k} {v:.1%}' for k, v in paper.FIDELITY_GPTQ4.items())}; "
        f"mean acceptance {paper.ACCEPTANCE['mean']:.1%}.", "",
        f"| model | stands for | E / top-k | {band_cols} | n=17 | n=33 | within 15% (worst n) "
        "| reuse t->t+1 | load entropy | distinct-4 | routing fidelity | token match "
        "| acceptance K=1/4/16 |",
        "| --- | --- | --- | " + " | ".join("---:" for _ in BAND_POINTS)
        + " | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, r in rows.items():
        ws, tg = r["working_set"], r.get("target") or {}

        def cell(n: int) -> str:
            if not tg:
                return f"{ws[n]:.1f}"
            lo, hi = tg["band"][n]
            return f"{ws[n]:.1f} [{lo:.1f}-{hi:.1f}]"

        within = (f"{'yes' if tg['within'] else 'no'} ({tg['worst_dev']:+.0%} at n={tg['worst_n']}; "
                  f"n=17 {tg['dev_17']:+.0%})") if tg else "-"
        n17 = f"{ws[17]:.1f} [{tg['target_17']:.1f}]" if tg else f"{ws[17]:.1f}"
        acc = r.get("acceptance")
        lines.append(
            f"| {name} | {r.get('stands_for') or '-'} | {r['experts']} / {r['top_k']} | "
            + " | ".join(cell(n) for n in BAND_POINTS)
            + f" | {n17} | {ws[33]:.1f} | {within} | {r['reuse']:.3f} | {r['load_entropy']:.3f} "
            f"| {r['distinct_4']:.3f} | "
            + (f"{r['fidelity_topk']:.1%} | {r['draft_token_match']:.1%} | "
               + "/".join(f"{acc[k]:.2f}" for k in (1, 4, 16)) if acc else "- | - | -") + " |")
    return "\n".join(lines) + "\n"


def record_row(entry: str, r: dict) -> dict:
    """One model's report as a flat result row (experiment "routing")."""
    tg = r.get("target") or {}
    row = {"model": entry, "stands_for": r.get("stands_for"), "experts": r["experts"],
           "top_k": r["top_k"], "moe_layers": r["moe_layers"], "prompts": r["prompts"],
           "tokens": r["tokens"], "reuse": r["reuse"], "load_entropy": r["load_entropy"],
           "distinct_4": r["distinct_4"], "growth_1_to_17": r["growth_1_to_17"],
           "fidelity_topk": r.get("fidelity_topk", math.nan),
           "draft_token_match": r.get("draft_token_match", math.nan),
           "draft": r.get("draft"), "target_17": tg.get("target_17", math.nan),
           "dev_17": tg.get("dev_17", math.nan), "worst_dev": tg.get("worst_dev", math.nan),
           "within": tg.get("within"),
           "router_balance": (r.get("recipe") or {}).get("router_balance", math.nan)}
    for n in WINDOWS:
        row[f"ws_{n}"] = r["working_set"][n]
        row[f"ws_random_{n}"] = r["random_working_set"][n]
    for n, (lo, hi) in (tg.get("band") or {}).items():
        row[f"band_lo_{n}"], row[f"band_hi_{n}"] = lo, hi
    for k, v in (r.get("acceptance") or {}).items():
        row[f"acceptance_k{k}"] = v
    return row


def write_record(out_dir: Path, entry: str, checkpoint: Path, r: dict) -> bool:
    """The row under `out_dir`/records (one case per model and checkpoint); False when that
    case is recorded already."""
    from experiments.provenance import provenance
    from experiments.records import CaseStore

    store = CaseStore(out_dir, {"experiment": "routing", "model": entry,
                                "checkpoint": checkpoint.name})
    if store.done(entry, 0):
        return False
    store.write({**record_row(entry, r), "experiment": "routing", "system": "routing_report",
                 "clock": "none", "hardware": "none", "checkpoint": str(checkpoint),
                 "case_id": store.case_id, "request_id": entry, "repeat": 0, **provenance()})
    return True


def _json_keys(obj):
    """int keys -> str, recursively (what json.dumps does), so a reloaded report compares equal."""
    if isinstance(obj, dict):
        return {str(k): _json_keys(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_keys(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.routing_report",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small_deepseek,small_qwen,small_phi",
                    help="comma-separated; NAME@COEF rebuilds NAME with router-balance "
                         "coefficient COEF (the recipe sweep, docs/routing.md)")
    ap.add_argument("--items", type=int, default=5, help="items per dataset (five datasets)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="results/routing_report")
    ap.add_argument("--no-draft", action="store_true", help="skip the INT4 draft's side")
    ap.add_argument("--path", action="append", default=[], metavar="NAME=DIR",
                    help="a local checkpoint folder for a real model (model.path)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    args = ap.parse_args(argv)
    from omegaconf import OmegaConf

    from specter.compose import HARDWARE_DIR
    from specter.config import ModelConfig
    from specter.errors import UserError
    from specter.models import zoo
    from specter.placement.loader import load_model

    paths = dict(p.split("=", 1) for p in args.path if "=" in p)
    device = torch.device(args.device)
    rows = {}
    for entry in args.models.split(","):
        name, _, coef = entry.partition("@")
        path = HARDWARE_DIR.parent / "model" / f"{name}.yaml"
        if not path.is_file():
            print(f"error: unknown model '{name}' (no conf/model/{name}.yaml).", file=sys.stderr)
            return 2
        mcfg = ModelConfig(**OmegaConf.to_container(OmegaConf.load(path)))
        if name in paths:
            mcfg = replace(mcfg, path=paths[name])
        try:
            if coef:
                if mcfg.source != "project":
                    raise UserError(f"{name} is not project-made; @COEF rebuilds project models only.")
                ckpt = zoo.ensure_project_model(name, progress=False, router_balance=float(coef))
                mcfg = replace(mcfg, source="hf", path=str(ckpt))
            loaded = load_model(mcfg, device, progress=False)
        except (UserError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        family = mcfg.stands_for or (name if name in ("deepseek", "qwen", "phi") else None)
        r = model_report(loaded.model, loaded.tokenizer, family, args.items, args.tokens,
                         draft=not args.no_draft, device=device)
        build = loaded.checkpoint / "specter_build.json"
        if build.is_file():  # a project-made model: its recipe beside, the report beside it
            # (not beside a shipped build: reference_models/ is read-only, and its
            # specter_build.json already holds the routing on the benchmark prompts)
            b = json.loads(build.read_text())
            r["recipe"] = {k: b.get(k) for k in ("router_balance", "recipe_version", "training",
                                                   "loss_last", "build_seconds")}
            if not zoo.is_reference(loaded.checkpoint):
                (loaded.checkpoint / REPORT_FILE).write_text(json.dumps(_json_keys(r), indent=1))
        rows[entry] = r
        write_record(Path(args.out), entry, loaded.checkpoint, r)
        tg = r["target"]
        print(f"[routing] {entry}: working set n=1 {r['working_set'][1]:.1f}, n=17 "
              f"{r['working_set'][17]:.1f} (growth {r['growth_1_to_17']:.2f}x"
              + (f", target {tg['target_17']:.1f}, within 15%: {tg['within']}" if tg else "")
              + f"), reuse {r['reuse']:.3f}, load entropy {r['load_entropy']:.3f}, "
              f"distinct-4 {r['distinct_4']:.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing_report.md").write_text(report(rows))
    (out / "routing_report.json").write_text(json.dumps(_json_keys(rows), indent=1))
    print(report(rows))
    print(f"wrote {out / 'routing_report.md'}, {out / 'routing_report.json'}, {out / 'records'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
