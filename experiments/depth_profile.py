"""The depth profiler of `spec.k=auto`: the K with the lowest mean TPOT on this engine.

Owns: for a (model, budget, hardware, system, draft) it runs the built engine at every K of
`spec.profile_ks` over `spec.profile_prompts` prompts (the workload's five datasets,
round-robin, after the evaluated items) x `spec.profile_runs` runs, picks the K with the lowest
mean TPOT (ties: the smaller K), and stores the sweep as JSON under `<cache>/depth/`; later
runs with the same key reuse it without measuring. The key holds the configuration and a
digest of the code's sources (`hermetic.source_digest`), so a profile measured by other code
(another commit, an edit) is measured again, never reused. The harness calls it on an engine
whose `Depth` says `auto` (experiments/runner.py, once specter/compose.py has built it);
the library refuses spec.k=auto, whose prompts are the benchmark's datasets.
Does not own: the K rule (depth.py), the engine (systems), timing (the engine's clock:
virtual TPOTs make the choice deterministic).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from dataclasses import dataclass
from typing import Any

from specter import hermetic
from specter.metrics import timing


@dataclass(frozen=True)
class Profiled:
    """What a profile is of (`ctx` below): the run's settings, its loaded model, its budget."""

    cfg: Any  # RunConfig
    loaded: Any  # placement/loader.py LoadedModel
    budget: Any  # budget.py ResolvedBudget



def profile(ctx, engine, log=print):
    """`engine` (built with an `auto` depth) at its profiled K, measured or reused: an engine
    over the same parts (`with_depth`)."""
    from specter.models.zoo import default_cache_dir

    cache = Path(ctx.cfg.cache_dir) if ctx.cfg.cache_dir else default_cache_dir()
    k, path, reused = auto_depth(ctx, engine, cache, log)
    return engine.with_depth(k, f"auto ({'reused' if reused else 'profiled'}: {path})")


# What a stored profile's TPOTs depend on beyond its configuration: the sources that build,
# run and charge an engine.
CODE = ("specter", "baselines")


def profile_key(ctx) -> dict:
    cfg = ctx.cfg
    return {"code": hermetic.source_digest(*CODE), "model": cfg.model.name,
            "checkpoint": str(ctx.loaded.checkpoint),
            "slots": ctx.budget.slots, "hardware": cfg.to_dict()["hardware"],
            "system": cfg.to_dict()["system"], "quant": cfg.to_dict()["quant"],
            "ks": list(cfg.spec.profile_ks), "prompts": cfg.spec.profile_prompts,
            "runs": cfg.spec.profile_runs, "max_new_tokens": cfg.workload.max_new_tokens,
            "prompt_tokens": cfg.workload.prompt_tokens}


def profile_path(ctx, cache_dir: Path) -> Path:
    key = json.dumps(profile_key(ctx), sort_keys=True)
    return cache_dir / "depth" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def profile_prompts(ctx) -> list[list[int]]:
    from specter.workloads import DATASETS, load_workload, truncate_prompt

    data_dir = Path(ctx.cfg.data_dir) if ctx.cfg.data_dir else None
    skip = ctx.cfg.workload.items
    pools = [list(load_workload(d, None, data_dir).texts)[skip:] for d in DATASETS]
    texts: list[str] = []
    i = 0
    while len(texts) < ctx.cfg.spec.profile_prompts and any(i < len(p) for p in pools):
        texts.extend(p[i] for p in pools if i < len(p))
        i += 1
    tok = ctx.loaded.tokenizer
    return [truncate_prompt(tok, t, ctx.cfg.workload.prompt_tokens)
            for t in texts[:ctx.cfg.spec.profile_prompts]]


def sweep(engine, prompts: list[list[int]], ks, runs: int, max_new_tokens: int,
          log=print) -> list[dict]:
    """Mean TPOT of `engine`'s parts at each K (`with_depth`)."""
    rows = []
    for k in ks:
        at_k = engine.with_depth(k, "depth profile")
        tpots, acc = [], []
        for ids in prompts:
            for _ in range(runs):
                at_k.reset()
                gen = at_k.generate(ids, max_new_tokens)
                t = timing(gen)["tpot_ms"]
                if not math.isnan(t):
                    tpots.append(t)
                acc.append(gen.stats.get("acceptance_rate", math.nan))
        mean = sum(tpots) / len(tpots) if tpots else math.nan
        rows.append({"k": k, "tpot_ms": mean, "acceptance_rate": sum(acc) / len(acc),
                     "samples": len(tpots)})
        log(f"[specter] depth profile: K={k:>2} mean TPOT {mean:.3f} ms "
            f"(acceptance {rows[-1]['acceptance_rate']:.3f}, {len(tpots)} samples)")
    return rows


def best_k(rows: list[dict]) -> int:
    valid = [r for r in rows if not math.isnan(r["tpot_ms"])]
    return min(valid, key=lambda r: (r["tpot_ms"], r["k"]))["k"]


def auto_depth(ctx, engine, cache_dir: Path, log=print) -> tuple[int, Path, bool]:
    """The stored best K for this key, or measure it now. Returns (K, file, reused).
    One worker measures a key; concurrent ones (a sweep's workers, other machines on the
    same cache) wait on the lock and reuse its K."""
    from filelock import FileLock

    path = profile_path(ctx, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.exists():
            k = json.loads(path.read_text())["best_k"]
            log(f"[specter] spec.k=auto: K={k} from {path}")
            return k, path, True
        prompts = profile_prompts(ctx)
        rows = sweep(engine, prompts, ctx.cfg.spec.profile_ks, ctx.cfg.spec.profile_runs,
                     ctx.cfg.workload.max_new_tokens, log)
        k = best_k(rows)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": profile_key(ctx), "sweep": rows, "best_k": k,
                                   "clock": ctx.cfg.hardware.clock}, indent=1))
        os.replace(tmp, path)
    log(f"[specter] spec.k=auto: K={k} (lowest mean TPOT), stored in {path}")
    return k, path, False
