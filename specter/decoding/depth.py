"""The draft depth K: the one rule every speculative system follows, and the depth profiler.

The rule (`settle_k`): `spec.k=N` -> N; `spec.k=auto` -> the profiled K (below), except for a
system with its own K, which keeps it (a baseline runs at the depth its paper or artifact
uses) unless `spec.tune_own_k=true` (a tuned-depth baseline, reported as its own variant);
`spec.k=adaptive` -> a K per window (`AdaptiveDepth`, starting from the unset rule's K, at most
`spec.k_max`); unset -> the system's own K if its recipe has one (SpecMoEOff: 3, SpecMoE: 4,
as their papers run them), else the model's paper K (`model.paper_k`), else DEFAULT_K. Every
record says which one applied (`k_source`).

The profiler owns `spec.k=auto`. For a (model, budget, hardware, system, draft) it runs the system's
engine at every K of `spec.profile_ks` over `spec.profile_prompts` prompts (the workload's five
datasets, round-robin, after the evaluated items) x `spec.profile_runs` runs, picks the K
with the lowest mean TPOT (ties: the smaller K), and stores the sweep as JSON under
`<cache>/depth/`; later runs with the same key reuse it without measuring.
Does not own: the engine (systems), timing (the engine's clock: virtual TPOTs make the choice
deterministic).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from specter.metrics import timing

DEFAULT_KS = (2, 4, 6, 8, 12, 16, 20, 24, 32)
DEFAULT_K = 4  # spec.k unset, no system K, no paper K


def settle_k(ctx, engine, default_k: int | None = None, default_k_name: str = "") -> None:
    """Set `engine.k` and `engine.k_source` by the rule above (auto: profiled on `engine`
    itself, after it is built)."""
    k = ctx.cfg.spec.k
    engine.depth = None
    if isinstance(k, int):
        engine.k, engine.k_source = k, "spec.k"
        return
    if default_k is not None:
        engine.k, engine.k_source = default_k, default_k_name or f"the system's K={default_k}"
    elif ctx.cfg.model.paper_k:
        engine.k, engine.k_source = ctx.cfg.model.paper_k, "model.paper_k"
    else:
        engine.k, engine.k_source = DEFAULT_K, f"default {DEFAULT_K}"
    if k == "adaptive":
        k_max = ctx.cfg.spec.k_max
        engine.k = min(engine.k, k_max)
        engine.depth = AdaptiveDepth(engine.k, k_max)
        engine.k_source = f"adaptive (from K={engine.k}, {engine.k_source}; k_max={k_max})"
    if k == "auto" and default_k is not None and not ctx.cfg.spec.tune_own_k:
        engine.k_source += " (spec.k=auto keeps a system's own K; spec.tune_own_k=true tunes it)"
        return
    if k == "auto":
        from specter.models.zoo import default_cache_dir

        cache = Path(ctx.cfg.cache_dir) if ctx.cfg.cache_dir else default_cache_dir()
        engine.k, path, reused = auto_depth(ctx, engine, cache)
        engine.k_source = f"auto ({'reused' if reused else 'profiled'}: {path})"


class AdaptiveDepth:
    """`spec.k=adaptive`: the draft depth of each window, from what the run has measured.

    Before a window it picks the K in 1..k_max with the most expected committed tokens per
    second of window: E(K) / (K * t_draft + t_verify(K)), where E(K) = (1 - a^(K+1)) / (1 - a)
    is the expected committed tokens of a row when each draft token is accepted with
    probability a (the accepted prefix plus the target's token), t_draft the measured time of
    one draft step and t_verify(K) = c + s * (K + 1) a line fitted to the measured
    verification times (least squares, slope >= 0; one depth measured: its mean time). a is
    the running acceptance, accepted / (accepted + rejections) with half a token of each as
    its prior (a rejection ends a row's window, so drafted tokens after it say nothing). The
    acceptance counts decay by `acceptance_decay` per window (a slow decay: a run of fully
    accepted windows must be long to argue for a deep K), the times by `time_decay` (the first
    windows run on a cold expert cache). A depth not measured yet is priced by the line, so
    the rule explores deeper while verification looks cheap and learns its slope there. Until
    both times are measured it keeps the starting K. Any K is lossless (verification decides):
    the rule changes speed only. Time is the run's clock (virtual: the cost model's)."""

    def __init__(self, k0: int, k_max: int, acceptance_decay: float = 0.95,
                 time_decay: float = 0.8):
        if not 1 <= k0 <= k_max:
            raise ValueError(f"starting K {k0} must lie in 1..{k_max}")
        self.k0, self.k_max = k0, k_max
        self.acceptance_decay, self.time_decay = acceptance_decay, time_decay
        self.reset()

    def reset(self) -> None:
        """Before each request: the starting K and no measurements."""
        self.k = self.k0
        self.accepted = self.rejected = 0.0
        self.step_s: float | None = None
        self.fit = [0.0] * 5  # decayed sums of w, w x, w x^2, w y, w x y; x = K + 1, y = seconds

    def acceptance(self) -> float:
        return (self.accepted + 0.5) / (self.accepted + self.rejected + 1.0)

    @staticmethod
    def expected_tokens(a: float, k: int) -> float:
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def verify_time(self, k: int) -> float:
        """The fitted verification time of a window of depth K."""
        w, wx, wxx, wy, wxy = self.fit
        mx, my = wx / w, wy / w
        var = wxx / w - mx * mx
        slope = max(0.0, (wxy / w - mx * my) / var) if var > 1e-12 else 0.0
        return max(my + slope * (k + 1 - mx), 1e-12)

    def rate(self, k: int) -> float:
        """Expected committed tokens per second of a window of depth K."""
        return self.expected_tokens(self.acceptance(), k) / (k * self.step_s + self.verify_time(k))

    def next_k(self) -> int:
        if self.step_s is not None and self.fit[0] > 0:
            self.k = max(range(1, self.k_max + 1), key=lambda k: (self.rate(k), -k))
        return self.k

    def observe(self, k: int, accepted: int, rejected: int, draft_s: float, draft_steps: int,
                verify_s: float) -> None:
        """One window at depth `k`: tokens accepted and rows that rejected one (over the
        batch), the draft's time over its steps, the verification's time."""
        da, dt = self.acceptance_decay, self.time_decay
        self.accepted = da * self.accepted + accepted
        self.rejected = da * self.rejected + rejected
        if draft_steps > 0:
            step = draft_s / draft_steps
            self.step_s = step if self.step_s is None else dt * self.step_s + (1 - dt) * step
        x = k + 1
        self.fit = [dt * v + add for v, add in
                    zip(self.fit, (1.0, x, x * x, verify_s, x * verify_s))]


def profile_key(ctx) -> dict:
    cfg = ctx.cfg
    return {"model": cfg.model.name, "checkpoint": str(ctx.loaded.checkpoint),
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
    """Mean TPOT of `engine` at each K (engine.k is set per K)."""
    rows = []
    for k in ks:
        engine.k = k
        tpots, acc = [], []
        for ids in prompts:
            for _ in range(runs):
                engine.reset()
                gen = engine.generate(ids, max_new_tokens)
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
