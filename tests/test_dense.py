"""The dense twin (the working-set comparison): a dense FFN of the MoE's size, offloaded in
the same expert-sized blocks, decoded losslessly by the same systems."""

from __future__ import annotations

import torch

from conftest import PROMPTS
from specter.budget import resolve_slots
from specter.config import BudgetConfig, ModelConfig
from specter.decoding.batch import eos_ids
from specter.errors import UserError
from specter.models.introspect import experts_modules
from test_offload import decode_all, make_engine


def test_dense_twin_is_one_dense_ffn(tiny_models):
    """Routers frozen at zero, every token on all 64 blocks with weight 1/64: the MoE layer is
    a SwiGLU FFN whose weights are the blocks side by side (down scaled by 1/64)."""
    lm = tiny_models("tiny_dense")
    spec = lm.spec
    assert spec.top_k == spec.num_experts == 64 and spec.shared_experts
    layer_i, experts = experts_modules(lm.model)[0]
    mlp = lm.model.model.layers[layer_i].mlp
    assert torch.count_nonzero(mlp.gate.weight) == 0
    torch.manual_seed(0)
    x = torch.randn(5, spec.hidden)
    with torch.no_grad():
        _, w, idx = mlp.gate(x)
        assert torch.equal(w, torch.full_like(w, 1 / 64))
        assert all(sorted(row) == list(range(64)) for row in idx.tolist())
        routed = experts(x, idx, w)
        gate_up = experts.gate_up_proj.reshape(-1, spec.hidden)  # [64 * 2I, H]
        two_i = experts.gate_up_proj.shape[1]
        h = (x @ gate_up.T).reshape(5, 64, two_i)  # per block: [gate | up] halves
        act = experts._apply_gate(h.reshape(5 * 64, two_i)).reshape(5, 64, -1)  # [5, 64, I]
        down = experts.down_proj.permute(1, 0, 2).reshape(spec.hidden, -1)  # [H, 64 * I]
        dense = act.reshape(5, -1) @ down.T / 64
    assert torch.allclose(routed, dense, atol=1e-5)


def test_dense_twin_streams_through_fewer_slots_than_its_blocks():
    dense = ModelConfig(name="tiny_dense", source="project", budget_slots={"high": 16})
    assert resolve_slots(BudgetConfig(name="high"), dense, 64, 64).slots == 16
    assert resolve_slots(BudgetConfig(name="low", slots=1), dense, 64, 64).slots == 1
    try:
        resolve_slots(BudgetConfig(name="low", slots=0), dense, 64, 64)
    except UserError as e:
        assert "at least" in str(e)
    else:
        raise AssertionError("0 slots accepted")
    moe = ModelConfig(name="tiny_deepseek", source="project")
    try:
        resolve_slots(BudgetConfig(name="low", slots=5), moe, 64, 6)
    except UserError:
        pass
    else:
        raise AssertionError("fewer slots than top-k accepted for a MoE")


def test_dense_twin_is_lossless_against_hf_generate(tiny_models):
    lm = tiny_models("tiny_dense")
    stop = sorted(eos_ids(lm.model))
    ref = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = lm.tokenizer(text)["input_ids"][:16]
            out = lm.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                    eos_token_id=stop or None, pad_token_id=0)
            ref.append(out[0, len(ids):].tolist())
    for system, slots, k in (("lru", 16, None), ("lru", 1, None), ("lru_s", 16, 8),
                             ("lru_s", 4, 3), ("specter", 16, 8)):
        eng, loaded = make_engine("tiny_dense", system, slots, spec={"k": k} if k else None)
        gens = decode_all(eng, loaded.tokenizer)
        assert [g.tokens for g in gens] == ref, (system, slots, k)
        # Every forward needs every block: the working set is all 64, whatever K.
        assert all(g.stats["distinct_experts_per_forward"] == 64 for g in gens)
