"""quasi_hidden: lossless through the runner on every tiny architecture, default vectors
measured once (equal to a direct recomputation) and reused, and a next-layer guess that beats
chance and MO-SM's while a deliberately broken quasi-hidden state does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from conftest import PROMPTS, REPO
from baselines import quasi_hidden as qh
from experiments import records, runner
from specter.compose import job_of
from specter.budget import resolve_slots
from specter.config import RunConfig
from specter.models.introspect import experts_modules
from specter.placement.loader import load_model
from specter.quant.calibrate import QuantSpec, calibration_windows
from test_offload import A100

SMALL = QuantSpec(calib_tokens=512)  # two windows: enough for tests


def run_cfg(name: str, system: str, slots: int | None, out_dir: Path) -> RunConfig:
    model = yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())
    budget = {"name": "full"} if slots is None else {"name": "custom", "slots": slots}
    return RunConfig.from_dict({
        "model": model, "budget": budget, "system": {"name": system},
        "dataset": {"name": "gsm8k"}, "hardware": A100,
        "workload": {"items": 2, "max_new_tokens": 12, "repeats": 1},
        "out_dir": str(out_dir), "progress": False})


@pytest.mark.parametrize("name", ["tiny_deepseek", "tiny_qwen", "tiny_phi", "tiny_mixtral"])
def test_quasi_hidden_is_lossless_and_prefetches(name, tiny_models, tmp_path):
    spec = tiny_models(name).spec
    k, e = spec.top_k, spec.num_experts
    runner.run(run_cfg(name, "resident", None, tmp_path), log=lambda *_: None)
    for slots in (k, (k + e) // 2):
        runner.run(run_cfg(name, "quasi_hidden", slots, tmp_path), log=lambda *_: None)
    df = records.load(tmp_path)
    tokens = lambda g: [list(t) for t in g.sort_values("request_id")["output_tokens"]]  # noqa: E731
    ref = tokens(df[df["system"] == "resident"])
    for slots, g in df[df["system"] == "quasi_hidden"].groupby("budget_slots"):
        assert tokens(g) == ref, f"{name} at {slots} slots"
        if slots == k:  # at larger budgets a guess may always be resident already
            assert g["prefetches"].sum() > 0, f"{name} at {slots} slots"
        assert g["default_vectors"].map(lambda p: Path(p).is_file()).all()
        assert g["qh_precision"].between(0, 1).all()


def test_default_vectors_are_measured_once_and_equal_a_direct_recomputation(tiny_models, tmp_path):
    loaded = tiny_models("tiny_deepseek")
    model, cpu = loaded.model, torch.device("cpu")
    dv, path, reused = qh.ensure_default_vectors(model, loaded.tokenizer, SMALL, tmp_path, cpu)
    assert not reused and path.is_file() and path.parent == tmp_path / "default_vectors"
    mtime = path.stat().st_mtime_ns
    again, path2, reused2 = qh.ensure_default_vectors(model, loaded.tokenizer, SMALL, tmp_path, cpu)
    assert reused2 and path2 == path and path.stat().st_mtime_ns == mtime
    assert torch.equal(again.default, dv.default) and torch.equal(again.shared, dv.shared)
    s = loaded.spec
    assert dv.default.shape == (s.num_moe_layers, s.num_experts, s.hidden)
    assert dv.shared.shape == (s.num_moe_layers, s.hidden)

    # Direct: HF's own experts and shared expert on the tokens of the same windows.
    l = 1
    decoder, experts = experts_modules(model)[l]
    seen = []
    handle = experts.register_forward_pre_hook(lambda m, args: seen.append(args[:2]))
    with torch.no_grad():
        for w in calibration_windows(loaded.tokenizer, SMALL):
            model(input_ids=w, use_cache=False)
        handle.remove()
        hidden = torch.cat([h for h, _ in seen])  # [N, H]
        chosen = torch.cat([i for _, i in seen])  # [N, k]
        counts = torch.bincount(chosen.flatten(), minlength=s.num_experts)
        assert torch.equal(counts, dv.counts[l])
        e = int(counts.argmax())
        x = hidden[(chosen == e).any(-1)]  # [n, H]
        ones = torch.ones(len(x), 1)
        direct = experts(x, torch.full((len(x), 1), e), ones).mean(0)  # unweighted outputs
        shared = model.model.layers[decoder].mlp.shared_experts(hidden).mean(0)
    assert torch.allclose(dv.default[l, e], direct, atol=1e-5)
    assert torch.allclose(dv.shared[l], shared, atol=1e-5)
    # An expert no calibration token routed to gets the layer's mean output. 10 tokens of
    # top-6 reach at most 60 of the 64 experts, so every layer has such experts, on any weights.
    few, _, _ = qh.ensure_default_vectors(model, loaded.tokenizer, QuantSpec(calib_tokens=10),
                                          tmp_path, cpu)
    for l in range(s.num_moe_layers):
        counts = few.counts[l]
        unrouted = counts == 0
        assert unrouted.sum() >= s.num_experts - 10 * s.top_k
        layer_mean = (few.default[l] * counts[:, None]).sum(0) / counts.sum()
        assert torch.allclose(few.default[l][unrouted],
                              layer_mean.expand(int(unrouted.sum()), -1), atol=1e-5)


class RouterOnExpertInput(qh.QuasiHiddenPrefetch):
    """MO-SM's guess (router l+1 on layer l's expert input), scored the same way."""

    def after_demand(self, runtime, moe_layer, hidden, top_k_index, top_k_weights):
        self.hidden = hidden
        super().after_demand(runtime, moe_layer, hidden, top_k_index, top_k_weights)

    def quasi_hidden(self, l, top_k_index, top_k_weights):
        return self.hidden


class Broken(qh.QuasiHiddenPrefetch):
    """Noise for r_l (and, built with zero default vectors, nothing for d_l)."""

    def _capture(self, l, residual):
        self.residual[l] = torch.randn_like(residual)


def guess_precision(name: str, make_prefetch) -> tuple[float, float]:
    """Precision of the next-layer guess over the test prompts, and chance (k/E)."""
    cfg = run_cfg(name, "quasi_hidden", None, Path("unused"))
    loaded = load_model(cfg.model, torch.device("cpu"), progress=False)  # fresh: offloading mutates
    budget = resolve_slots(cfg.budget, cfg.model, loaded.spec.num_experts, loaded.spec.top_k)
    ctx = job_of(cfg, loaded, budget, torch.device("cpu"))
    dv, path = qh.default_vectors_for(ctx)
    engine = qh.build_with(ctx, make_prefetch(loaded.model, dv, path))
    hits = guessed = 0
    for text in PROMPTS:
        engine.reset()
        engine.generate(loaded.tokenizer(text)["input_ids"][:16], 20)
        hits, guessed = hits + engine.prefetcher.hits, guessed + engine.prefetcher.guessed
    return hits / guessed, loaded.spec.top_k / loaded.spec.num_experts


def test_quasi_hidden_guess_beats_chance_and_a_broken_state_does_not():
    """The guess is far above chance (3x chance is 0.28; trained builds measure 0.7-0.8) and a
    state made of noise falls to near chance. Whether it beats MO-SM's guess is a measured
    comparison, not a property: the two are within a guess of each other on the tiny model
    and flipped order between builds, so it is reported (printed here, and as both systems'
    prefetch_precision in scripts/bench_offload.sh) rather than asserted."""
    torch.manual_seed(0)
    zero = lambda dv: qh.DefaultVectors(  # noqa: E731
        torch.zeros_like(dv.default), torch.zeros_like(dv.shared), dv.counts)
    precision, chance = guess_precision("tiny_deepseek", qh.QuasiHiddenPrefetch)
    mo_sm, _ = guess_precision("tiny_deepseek", RouterOnExpertInput)
    broken, _ = guess_precision("tiny_deepseek", lambda m, dv, p: Broken(m, zero(dv), p))
    print(f"tiny_deepseek next-layer precision: quasi-hidden {precision:.3f}, MO-SM {mo_sm:.3f}, "
          f"broken {broken:.3f}, chance {chance:.3f}")
    assert precision > 3 * chance
    assert broken < (chance + precision) / 2
