"""Speculative decoding (specter/decoding/): the self-draft shares everything but the routed
experts, greedy speculation is the target's greedy decoding token for token, sampling
repeats per seed, the K rule and the depth profiler."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS, TINY
from specter.config import ModelConfig
from specter.decoding.batch import DeviceMemory, eos_ids
from specter.errors import UserError
from specter.models.introspect import experts_modules
from specter.placement.loader import load_model
from specter.clock.timing import Timing
from specter.quant import calibrate
from specter.decoding.draft import speculative_greedy
from specter.decoding.draft_mode import DraftMode
from steering import steered_draft
from test_offload import A100

CPU = torch.device("cpu")


def _tiny(name="tiny_qwen"):
    return load_model(ModelConfig(name=name, source="project", dtype="float32"), CPU,
                      progress=False)


def _setup(name, bits=4):
    lm = load_model(ModelConfig(name=name, source="project", dtype="float32"), CPU, progress=False)
    qe = calibrate.quantize_experts(lm.model, calibrate.QuantSpec(method="rtn", bits=bits, group=32),
                                    None, CPU)
    return lm, DraftMode(lm.model, qe, backend="reference")


def _hf(model, ids, n, eos):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         eos_token_id=sorted(eos) or None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _spec(lm, sw, ids, n, k, stop):
    return speculative_greedy(lm.model, sw, ids, n, k, CPU, Timing.wall(CPU).link, stop,
                              DeviceMemory(lm.model, CPU))


@pytest.mark.parametrize("name", TINY)
def test_speculative_greedy_equals_hf_generate(name):
    lm, sw = _setup(name)
    stop = eos_ids(lm.model)
    for text in PROMPTS:
        ids = lm.tokenizer(text)["input_ids"][:16]
        with torch.no_grad():
            ref = _hf(lm.model, ids, 24, stop)
        for k in (1, 3, 8):
            gen = _spec(lm, sw, ids, 24, k, stop)
            assert gen.tokens == ref, (name, k)
            assert gen.stats["k"] == k and 0 <= gen.stats["acceptance_rate"] <= 1


def test_k_beyond_the_tokens_left_and_eos_inside_a_window():
    lm, sw = _setup("tiny_qwen", bits=2)  # 2-bit: rejections happen too
    ids = lm.tokenizer(PROMPTS[1])["input_ids"][:16]
    with torch.no_grad():
        free = _hf(lm.model, ids, 30, set())
    for n, k in ((1, 8), (3, 8), (5, 16)):
        assert _spec(lm, sw, ids, n, k, set()).tokens == free[:n]
    eos = {free[6]}  # a token the target emits 7th: the run must stop right there
    with torch.no_grad():
        ref = _hf(lm.model, ids, 30, eos)
    assert ref[-1] in eos and len(ref) <= 7
    for k in (2, 4, 12):
        gen = _spec(lm, sw, ids, 30, k, eos)
        assert gen.tokens == ref
    accepted = _spec(lm, sw, ids, 30, 4, set()).stats
    assert accepted["windows"] >= 30 / 5 and sum(accepted["accepted_lens"]) <= 30


def test_speculative_decoding_over_offloaded_experts_is_lossless():
    """Target experts through the offload runtime at top-k slots, draft from INT4."""
    from specter.compose import job_of
    from specter.budget import ResolvedBudget
    from specter.config import RunConfig
    from specter.clock.timing import timing_for
    from specter.offload.build import offload_model

    for name in ("tiny_deepseek", "tiny_phi"):
        lm, _ = _setup(name)
        stop = eos_ids(lm.model)
        ids = lm.tokenizer(PROMPTS[0])["input_ids"][:16]
        with torch.no_grad():
            ref = _hf(lm.model, ids, 20, stop)
        cfg = RunConfig.from_dict({
            "model": {"name": name, "source": "project"}, "budget": {"name": "high"},
            "system": {"name": "lru"}, "dataset": {"name": "gsm8k"},
            "hardware": {"name": "a100_pcie4_ideal", "device": "cpu", "clock": "virtual",
                         "charge": "own", "matrix_flops": 312e12, "mem_bandwidth_Bps": 1.555e12,
                         "launch_overhead_s": 5e-6, "h2d_bandwidth_Bps": 31.5e9,
                         "h2d_latency_s": 1e-5},
            "workload": {}, "progress": False})
        ctx = job_of(cfg, lm, ResolvedBudget("high", lm.spec.top_k, "test"), CPU)
        qe = calibrate.quantize_experts(lm.model, calibrate.QuantSpec(method="rtn", bits=4, group=32),
                                        None, CPU)
        timing = timing_for(ctx)
        runtime = offload_model(ctx, timing)
        sw = DraftMode(lm.model, qe, backend="reference")
        for k in (2, 5):
            runtime.reset()
            gen = speculative_greedy(lm.model, sw, ids, 20, k, CPU, timing.link, stop,
                                     DeviceMemory(lm.model, CPU))
            assert gen.tokens == ref, (name, k)
            assert runtime.stats.misses > 0  # the target really streamed experts


@pytest.mark.slow
def test_lru_s_system_through_the_runner(tmp_path):
    """system=lru_s at top-k slots under the virtual clock: resident's tokens, acceptance and
    window statistics recorded; a bad K is one sentence."""
    from conftest import run_cli
    from experiments import records

    common = ["model=tiny_deepseek", "dataset=humaneval", "workload.items=2",
              "workload.max_new_tokens=16", "workload.repeats=1", "hardware=a100_pcie4_ideal",
              "hardware.charge=own", "budget.slots=6", "quant.group=32", "quant.calib_tokens=512",
              "progress=false"]
    res = run_cli("-m", "system=resident,lru_s", "spec.k=3", f"out_dir={tmp_path}", *common)
    assert res.returncode == 0, res.stderr
    df = records.load(tmp_path)
    ref = df[df["system"] == "resident"].sort_values("request_id")
    spec = df[df["system"] == "lru_s"].sort_values("request_id")
    assert list(spec["output_tokens"].map(list)) == list(ref["output_tokens"].map(list))
    assert (spec["k"] == 3).all() and spec["acceptance_rate"].between(0, 1).all()
    assert (spec["draft_ms_per_window"] > 0).all() and (spec["verify_ms_per_window"] > 0).all()
    assert (spec["demand_misses"] > 0).all() and (spec["draft.method"] == "gptq").all()
    bad = run_cli("system=lru_s", "spec.k=0", f"out_dir={tmp_path}/bad", *common)
    assert bad.returncode == 2 and "spec.k" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


# -- sampling --------------------------------------------------------------------------------
def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square of counts against probs, cells with expected count < 5 lumped."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def chi2_crit_999(df: int) -> float:
    """Upper 0.1% point of chi-square(df) (Wilson-Hilferty; within 1% for df >= 3)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _first_token_counts(rule, p, q, trials, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[1])
    for _ in range(trials):
        proposals = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(q.shape[0])]
        n_acc, nxt = rule(p, q, proposals, g)
        counts[(proposals[:n_acc] + [nxt])[0]] += 1
    return counts


def _biased_resample_from_p(p, q, proposals, g):
    """A wrong rule: after a rejection, draw from p instead of the residual."""
    for i, x in enumerate(proposals):
        if torch.rand((), generator=g).item() * q[i, x] < p[i, x]:
            continue
        return i, int(torch.multinomial(p[i], 1, generator=g))
    return len(proposals), int(torch.multinomial(p[-1], 1, generator=g))


def _accept_every_proposal(p, q, proposals, g):
    """A wrong rule: keep every proposal (the output follows the draft, not the target)."""
    return len(proposals), int(torch.multinomial(p[-1], 1, generator=g))


def test_speculative_sampling_rule_reproduces_the_target_distribution():
    from specter.decoding.loop import accept_sampled

    p = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05]] * 4)
    q = torch.tensor([[0.1, 0.1, 0.5, 0.1, 0.1, 0.1]] * 3)
    stat, df = _chi2(_first_token_counts(accept_sampled, p, q, 20000), p[0])
    assert stat < chi2_crit_999(df), stat
    bad, df_bad = _chi2(_first_token_counts(_biased_resample_from_p, p, q, 20000), p[0])
    assert bad > chi2_crit_999(df_bad), bad  # the test has the power to catch a biased rule


@pytest.mark.slow
def test_speculative_sampling_on_a_model_matches_the_targets_next_token_distribution():
    """Tiny model, T = 1, a deliberately poor draft (experts with noise added, then INT4):
    the first speculated tokens (the 2nd and 3rd outputs; the 1st comes from the prefill) over
    many seeds follow softmax(target logits / T) given their prefixes, however the draft
    proposes; the same check rejects a rule that keeps the draft's proposals."""
    import specter.decoding.loop as decode
    from specter.models.introspect import experts_modules
    from specter.quant.formats import rtn_quantize

    lm = load_model(ModelConfig(name="tiny_qwen", source="project", dtype="float32"), CPU,
                    progress=False)
    g = torch.Generator().manual_seed(0)
    noisy = lambda w: rtn_quantize(w + 8 * w.std() * torch.randn(w.shape, generator=g), 4, 32)  # noqa: E731
    mods = [m for _, m in experts_modules(lm.model)]
    qe = calibrate.QuantizedExperts(
        calibrate.QuantSpec(method="rtn"),
        [[noisy(m.gate_up_proj[e].detach()) for e in range(m.gate_up_proj.shape[0])] for m in mods],
        [[noisy(m.down_proj[e].detach()) for e in range(m.down_proj.shape[0])] for m in mods])
    sw = DraftMode(lm.model, qe, backend="reference")
    ids = lm.tokenizer(PROMPTS[0])["input_ids"][:12]
    target_after: dict[tuple, torch.Tensor] = {}  # output prefix -> target's next-token probs

    def p_after(prefix: tuple) -> torch.Tensor:
        if prefix not in target_after:
            with torch.no_grad():
                logits = lm.model(input_ids=torch.tensor([ids + list(prefix)])).logits[0, -1]
            target_after[prefix] = torch.softmax(logits, dim=-1)
        return target_after[prefix]

    def counts_with(rule, trials=400):
        """Observed 2nd and 3rd output tokens, and their expected frequencies given each one's
        prefix (under a correct rule each is a draw from the target given its prefix)."""
        saved, decode.accept_sampled = decode.accept_sampled, rule
        try:
            vocab = lm.model.config.vocab_size
            c, expected = torch.zeros(vocab), torch.zeros(vocab)
            for seed in range(trials):
                g = torch.Generator().manual_seed(seed)
                gen = speculative_greedy(lm.model, sw, ids, 6, 4, CPU, Timing.wall(CPU).link,
                                         set(), DeviceMemory(lm.model, CPU), temperature=1.0,
                                         generator=g)
                assert gen.stats["windows"] >= 1  # the first window drafted 4 tokens (6 - 1 - 1 > 4)
                for i in (1, 2):  # the first two speculated tokens, each given its prefix
                    c[gen.tokens[i]] += 1
                    expected += p_after(tuple(gen.tokens[:i]))
            return c, expected / expected.sum()
        finally:
            decode.accept_sampled = saved

    stat, df = _chi2(*counts_with(decode.accept_sampled))
    assert stat < chi2_crit_999(df), (stat, df)
    # The subtle wrong rule (resample from p) is caught by the rule-level test above with
    # 20000 draws; through the model, whose weights differ between builds, a rule that keeps the
    # noisy draft's tokens is caught with room to spare at this sample size.
    bad, df_bad = _chi2(*counts_with(_accept_every_proposal))
    assert bad > chi2_crit_999(df_bad), (bad, df_bad)


def _depth_run(tmp_path, system, ks, prompts):
    """run.py arguments of a spec.k=auto run of `system` on tiny_deepseek, profiling `ks` on
    `prompts` prompts, with a fresh depth store beside the shared cache's model, tokenizer and
    INT4 draft (linked: no rebuild)."""
    from specter.models.zoo import default_cache_dir

    shared, cache = default_cache_dir(), tmp_path / "cache"
    for sub in ("models", "tokenizer", "quant"):
        (shared / sub).mkdir(parents=True, exist_ok=True)
        (cache / sub).parent.mkdir(exist_ok=True)
        (cache / sub).symlink_to(shared / sub, target_is_directory=True)
    return [f"system={system}", "model=tiny_deepseek", "dataset=gsm8k", "workload.items=1",
            "workload.max_new_tokens=8", "workload.repeats=1", "hardware=a100_pcie4_ideal",
            "budget.slots=6", "quant.group=32", "quant.calib_tokens=512", "spec.k=auto",
            f"spec.profile_ks={ks}", f"spec.profile_prompts={prompts}", "spec.profile_runs=1",
            f"cache_dir={cache}", "progress=false"]


def test_depth_profiler_picks_measures_stores_and_reuses_k(tmp_path):
    from conftest import run_cli
    from experiments import records

    common = _depth_run(tmp_path, "lru_s", "[1,3]", 2)
    first = run_cli(f"out_dir={tmp_path}/a", *common)
    assert first.returncode == 0, first.stderr
    assert "depth profile: K= 1" in first.stdout and "depth profile: K= 3" in first.stdout
    stored = list((tmp_path / "cache" / "depth").glob("*.json"))
    assert len(stored) == 1
    import json

    profile = json.loads(stored[0].read_text())
    best = min(profile["sweep"], key=lambda r: (r["tpot_ms"], r["k"]))["k"]
    assert profile["best_k"] == best
    df = records.load(tmp_path / "a")
    assert (df["k"] == best).all() and df["k_source"].str.contains("profiled").all()
    second = run_cli(f"out_dir={tmp_path}/b", *common)
    assert second.returncode == 0 and "depth profile: K=" not in second.stdout
    assert records.load(tmp_path / "b")["k_source"].str.contains("reused").all()
    bad = run_cli(f"out_dir={tmp_path}/c", *common[:-6], "spec.k=deep", "progress=false")
    assert bad.returncode == 2 and "spec.k must be a positive integer, auto or adaptive" in bad.stderr


def test_a_depth_profile_is_keyed_by_the_codes_sources(tmp_path):
    """A profile measured by other code is measured again: the key holds a digest of the
    specter and baselines sources, which any edit changes."""
    from types import SimpleNamespace

    from specter.settings import compose_run_config
    from specter import hermetic
    from experiments import depth_profile as depth

    (tmp_path / "specter").mkdir()
    (tmp_path / "specter" / "a.py").write_text("X = 1\n")
    before = hermetic.source_digest("specter", root=tmp_path)
    (tmp_path / "specter" / "a.py").write_text("X = 2\n")
    hermetic.source_digest.cache_clear()
    assert hermetic.source_digest("specter", root=tmp_path) != before
    ctx = SimpleNamespace(cfg=compose_run_config([]), loaded=SimpleNamespace(checkpoint="c"),
                          budget=SimpleNamespace(slots=4))
    assert depth.profile_key(ctx)["code"] == hermetic.source_digest("specter", "baselines")


def test_auto_depth_keeps_a_baselines_own_k_unless_it_is_tuned(tmp_path):
    """spec.k=auto profiles the systems without a K of their own; SpecMoEOff keeps its paper's
    K = 3 (and says why), unless spec.tune_own_k=true makes it a tuned-depth variant."""
    from conftest import run_cli
    from experiments import records

    common = _depth_run(tmp_path, "specmoeoff", "[1,2]", 1)
    own = run_cli(f"out_dir={tmp_path}/own", *common)
    assert own.returncode == 0, own.stderr
    assert "depth profile: K=" not in own.stdout
    df = records.load(tmp_path / "own")
    assert (df["k"] == 3).all() and df["k_source"].str.contains("keeps a system's own K").all()
    tuned = run_cli(f"out_dir={tmp_path}/tuned", *common, "spec.tune_own_k=true")
    assert tuned.returncode == 0, tuned.stderr
    assert "depth profile: K= 1" in tuned.stdout
    assert records.load(tmp_path / "tuned")["k"].isin([1, 2]).all()


def test_verification_block_equals_token_by_token_within_fp32_rounding():
    """The verify forward groups the block's tokens by expert (one GEMM per expert over its
    tokens, scattered back) in the offload runtime: its logits equal K+1 single-token
    forwards within fp32 rounding."""
    from specter.decoding.batch import forward_logits, new_cache
    from test_offload import make_engine

    lru, loaded = make_engine("tiny_deepseek", "lru", 6)
    lru.reset()
    ids = loaded.tokenizer(PROMPTS[2])["input_ids"][:14]
    with torch.no_grad():
        cache = new_cache(lru.model)
        forward_logits(lru.model, torch.tensor([ids[:6]]), cache)
        block = forward_logits(lru.model, torch.tensor([ids[6:]]), cache, logits_to_keep=8)
        cache = new_cache(lru.model)
        forward_logits(lru.model, torch.tensor([ids[:6]]), cache)
        single = torch.cat([forward_logits(lru.model, torch.tensor([[t]]), cache) for t in ids[6:]])
    assert torch.allclose(block, single, atol=1e-5, rtol=1e-5)
    assert lru.runtime.stats.forward_distinct  # the block really went through the runtime


@pytest.mark.parametrize("model", ["tiny_deepseek", "tiny_qwen"])
def test_specmoeoff_is_lossless_and_prefetches(tmp_path, model):
    from conftest import run_cli
    from experiments import records

    res = run_cli("-m", "system=resident,specmoeoff", f"model={model}", "dataset=humaneval",
                  "workload.items=2", "workload.max_new_tokens=16", "workload.repeats=1",
                  "hardware=a100_pcie4_ideal", "budget=low", "quant.group=32", "quant.calib_tokens=512",
                  f"out_dir={tmp_path}", "progress=false")
    assert res.returncode == 0, res.stderr
    df = records.load(tmp_path)
    ref = df[df["system"] == "resident"].sort_values("request_id")
    smo = df[df["system"] == "specmoeoff"].sort_values("request_id")
    assert list(smo["output_tokens"].map(list)) == list(ref["output_tokens"].map(list))
    assert (smo["k"] == 3).all() and (smo["prefetches"] > 0).all()
    assert smo["k_source"].str.contains("K=3").all()


def test_sampling_through_the_runner_repeats_per_seed_and_offloading_draws_residents_tokens(
        tmp_path):
    """Specter samples by speculative sampling, the same seed the same samples; a system that
    does not speculate samples as plain `generate(do_sample=True)` draws, each token from
    softmax(logits / T), and offloading keeps the logits, so LRU draws resident's tokens
    (issue 58: a client's usual temperature works on every decoding system); a system that
    cannot sample (transformers' own offload) refuses it in one sentence."""
    import yaml

    from conftest import REPO
    from experiments import records, runner
    from specter.config import RunConfig

    def cfg(system, temperature, seed, out):
        return RunConfig.from_dict({
            "model": yaml.safe_load((REPO / "conf/model/tiny_qwen.yaml").read_text()),
            "budget": {"name": "low"}, "system": {"name": system}, "dataset": {"name": "gsm8k"},
            "hardware": A100, "spec": {"k": 4}, "seed": seed, "out_dir": str(tmp_path / out),
            "workload": {"items": 2, "max_new_tokens": 16, "repeats": 2,
                         "temperature": temperature}, "progress": False})

    quiet = lambda *_: None  # noqa: E731
    for out, seed in (("a", 0), ("b", 0), ("c", 1)):
        runner.run(cfg("specter", 1.5, seed, out), log=quiet)
    runner.run(cfg("specter", 0.0, 0, "greedy"), log=quiet)
    toks = {o: [list(t) for t in records.load(tmp_path / o).sort_values(["request_id", "repeat"])
                ["output_tokens"]] for o in ("a", "b", "c", "greedy")}
    assert toks["a"] == toks["b"]  # the same seed: the same samples
    assert toks["a"] != toks["c"] and toks["a"] != toks["greedy"]
    assert toks["a"][0] != toks["a"][1]  # repeats draw differently
    for system in ("lru", "resident"):
        runner.run(cfg(system, 1.5, 0, system), log=quiet)
        toks[system] = [list(t) for t in records.load(tmp_path / system).sort_values(
            ["request_id", "repeat"])["output_tokens"]]
    assert toks["lru"] == toks["resident"]  # the same draws from the same logits
    assert toks["lru"][0] != toks["lru"][1]  # repeats draw differently
    runner.run(cfg("resident", 0.0, 0, "resident_greedy"), log=quiet)
    greedy = [list(t) for t in records.load(tmp_path / "resident_greedy").sort_values(
        ["request_id", "repeat"])["output_tokens"]]
    assert toks["lru"] != greedy
    with pytest.raises(UserError, match="decodes greedily only"):
        runner.run(cfg("transformers", 1.0, 0, "bad"), log=quiet)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_deepseek", "tiny_phi"])
def test_shared_instance_shares_everything_but_the_routed_experts(name):
    from specter.decoding.draft_mode import DraftMode

    lm = _tiny(name)
    ids = torch.tensor([lm.tokenizer(PROMPTS[0])["input_ids"][:16]])
    with torch.no_grad():
        target_before = lm.model(input_ids=ids).logits
    qe = calibrate.quantize_experts(lm.model, calibrate.QuantSpec(method="rtn", bits=4, group=32),
                                    None, torch.device("cpu"))
    tensors_before = {n: p.data_ptr() for n, p in lm.model.named_parameters()}
    sw = DraftMode(lm.model, qe, backend="reference")
    with torch.no_grad():
        target = lm.model(input_ids=ids).logits
        with sw.draft():
            draft = lm.model(input_ids=ids).logits
        target_again = lm.model(input_ids=ids).logits
    # One instance: not a parameter was copied or replaced by attaching the draft.
    assert {n: p.data_ptr() for n, p in lm.model.named_parameters()} == tensors_before
    assert torch.equal(target, target_before) and torch.equal(target_again, target_before)
    assert not torch.equal(draft, target)  # the routed experts really are the INT4 copy
    # The draft is the target with its routed experts replaced by their dequantized INT4 copy.
    ref = _tiny(name)
    with torch.no_grad():
        for l, (_, m) in enumerate(experts_modules(ref.model)):
            m.gate_up_proj.copy_(torch.stack([q.dequantize() for q in qe.gate_up[l]]))
            m.down_proj.copy_(torch.stack([q.dequantize() for q in qe.down[l]]))
        expect = ref.model(input_ids=ids).logits
    assert torch.allclose(draft, expect, atol=1e-4, rtol=1e-4)
    assert sw.draft_bytes == qe.packed_bytes() > 0


def test_memory_account_of_the_shared_instance():
    from specter.models.introspect import moe_spec
    from specter.decoding.draft_mode import account_model

    lm = _tiny("tiny_qwen")
    acct = account_model("own:tiny_qwen", lm.spec, slots=15, context=512)
    assert acct.separate_bytes - acct.shared_bytes == acct.non_expert_bytes + acct.kv_bytes
    assert 0 < acct.saving < 1
    assert moe_spec(lm.model).non_expert_bytes == acct.non_expert_bytes


def test_adaptive_depth_rule_against_hand_arithmetic():
    from specter.decoding.depth import AdaptiveDepth

    d = AdaptiveDepth(4, 16)
    assert d.next_k() == 4  # nothing measured: the starting K
    # A perfect draft whose steps cost nothing beside a fixed verification: the deepest K.
    d.observe(4, accepted=40, rejected=0, draft_s=0.0004, draft_steps=4, verify_s=0.1)
    assert d.acceptance() == pytest.approx(40.5 / 41)
    assert d.next_k() == 16
    # E(K) = (1 - a^(K+1)) / (1 - a): at a = 0.5 and K = 2, 1 + 0.5 + 0.25.
    assert AdaptiveDepth.expected_tokens(0.5, 2) == pytest.approx(1.75)
    # A draft that is always rejected, with steps as costly as verification: K = 1.
    bad = AdaptiveDepth(8, 16)
    bad.observe(8, accepted=0, rejected=10, draft_s=0.8, draft_steps=8, verify_s=0.1)
    assert bad.next_k() == 1
    # Verification time: one depth measured, its time; two, the line through them.
    assert bad.verify_time(3) == pytest.approx(0.1)
    bad.observe(4, accepted=0, rejected=0, draft_s=0.0, draft_steps=0, verify_s=0.06)
    assert bad.verify_time(6) == pytest.approx(0.08)  # 0.06 at K = 4, + 0.01 per position
    bad.observe(2, accepted=0, rejected=0, draft_s=0.0, draft_steps=0, verify_s=0.5)
    assert bad.verify_time(1) == bad.verify_time(12)  # a falling fit is clamped flat
    bad.reset()
    assert bad.next_k() == 8 and bad.fit[0] == 0


def test_adaptive_depth_follows_the_slots_and_the_link():
    """issue 45 item 5: with the slots in view the first K is the deepest whose window touches
    no more experts than the slots, and verification is priced by the copies a deeper K would
    stream, so on a slow link K stays near the slots and on a free one it goes deep; `why`
    says so."""
    from types import SimpleNamespace

    from specter.decoding.depth import AdaptiveDepth, SlotView, distinct_experts, effective_pool

    # the pool inverts the distinct count; uniform routing over 64 experts: the pool is 64
    assert effective_pool(17, round(distinct_experts(17, 6, 20.0)), 6, 64) == \
        pytest.approx(20.0, rel=0.05)
    assert effective_pool(17, 64, 6, 64) == 64
    # a prefill of 40 tokens touching 30 of 64 experts in each of 2 MoE layers: pool ~30
    runtime = SimpleNamespace(stats=SimpleNamespace(
        last_needed={0: list(range(30)), 1: list(range(30))}, last_shape={0: (40, 6), 1: (40, 6)}))

    def depth(copy_s, slots=13):
        return AdaptiveDepth(16, 16, view=SlotView(runtime, slots, 64, copy_s))

    d = depth(copy_s=1e-3)
    k0 = d.next_k()
    within = d.view.distinct(k0)
    assert 1 <= k0 < 16 and sum(within) <= 2 * 13 < sum(d.view.distinct(k0 + 1))
    assert f"K={k0}" in d.why and "13 slots" in d.why
    # one window measured at K0: a good draft (acceptance 0.9), steps of 1 ms, 10 ms verify
    for copy_s, deep in ((1e-2, False), (1e-7, True)):
        d = depth(copy_s)
        d.next_k()
        d.observe(k0, accepted=9 * k0, rejected=1, draft_s=k0 * 1e-3, draft_steps=k0,
                  verify_s=0.01 + copy_s * d.view.sample(), streamed=d.view.sample())
        k = d.next_k()
        # acceptance ~0.86: a free link's best K is about 8 (E(K) saturates near 7 tokens)
        assert (k >= k0 + 4) if deep else (k == k0), (copy_s, k, k0)
        assert "streaming" in d.why
    # without a view: the line alone (the rule above)
    assert AdaptiveDepth(16, 16).next_k() == 16


@pytest.mark.parametrize("name", TINY)
def test_adaptive_k_is_lossless_and_records_each_windows_k(name, monkeypatch):
    """spec.k=adaptive on offloaded experts: resident's tokens; the K of every window recorded;
    a draft made wrong on purpose drives K down to the shallowest windows."""
    from specter.compose import job_of
    from specter.recipes import build_engine
    from specter.budget import ResolvedBudget
    from specter.config import RunConfig
    from specter.decoding.engines import resident_engine

    lm = load_model(ModelConfig(name=name, source="project"), CPU, progress=False)
    ids = lm.tokenizer(PROMPTS[0])["input_ids"][:12]
    # No stop at EOS: 40 tokens, so enough windows for K to move, whatever the weights emit.
    ref = resident_engine(lm.model, CPU, stop_on_eos=False).generate(ids, 40).tokens
    cfg = RunConfig.from_dict({
        "model": {"name": name, "source": "project"}, "budget": {"name": "high"},
        "system": {"name": "specter"}, "dataset": {"name": "gsm8k"},
        "hardware": A100, "workload": {}, "spec": {"k": "adaptive", "k_max": 8},
        "progress": False})
    for wrong in (False, True):
        lm = load_model(ModelConfig(name=name, source="project"), CPU, progress=False)
        engine = build_engine(job_of(cfg, lm, ResolvedBudget("high", lm.spec.top_k, "test"), CPU))
        assert engine.adaptive is not None and "adaptive" in engine.k_source
        engine.stop = set()
        if wrong:  # every window's first proposal is one the target does not emit
            expected = steered_draft(monkeypatch, [ids], [ref], lm.model.config.vocab_size,
                                     lambda b, w: 0)
        engine.reset()
        gen = engine.generate(ids, 40)
        assert gen.tokens == ref
        ks = gen.stats["k_windows"]
        assert len(ks) == gen.stats["windows"] and all(1 <= k <= 8 for k in ks)
        if wrong:  # every draft rejected: the windows shrink to the shallowest
            assert set(expected[0]) == {0} == set(gen.stats["accepted_lens"])
            assert ks[-1] <= ks[0] and ks[-1] <= 2
