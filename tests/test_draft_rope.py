"""The compiled draft step's DeepSeek-V2 rotary embedding in real arithmetic
(models/draft_rope.py): the same rotation as transformers' complex one (other rounding), the
target's own code when off, and fewer kernels in the compiled step."""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache

from specter.models import draft_rope


def _logits(model, ids, cache):
    with torch.no_grad():
        return model(input_ids=ids, cache=cache, use_cache=True).logits


def test_the_real_rotation_is_the_complex_one(tiny_models):
    draft_rope.install()
    model = tiny_models("tiny_deepseek").model
    ids = torch.tensor([[5, 17, 300, 42, 9, 77, 101, 3]])
    ref_cache = DynamicCache(config=model.config)
    ref = _logits(model, ids, ref_cache)
    static = StaticCache(config=model.config, max_cache_len=32)
    with draft_rope.real_rope():
        got = _logits(model, ids, static)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    step = torch.tensor([[11]])
    ref2 = _logits(model, step, ref_cache)
    with draft_rope.real_rope():
        got2 = _logits(model, step, static)
    torch.testing.assert_close(got2, ref2, rtol=1e-5, atol=1e-5)


def test_off_it_is_transformers_own_code(tiny_models):
    draft_rope.install()
    draft_rope.install()  # once
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    wrapped = ds.apply_rotary_emb
    assert wrapped._specter_real_rope and not hasattr(wrapped.__wrapped__, "_specter_real_rope")
    model = tiny_models("tiny_deepseek").model
    ids = torch.tensor([[5, 17, 300, 42]])
    through = _logits(model, ids, DynamicCache(config=model.config))
    ds.apply_rotary_emb = wrapped.__wrapped__
    try:
        plain = _logits(model, ids, DynamicCache(config=model.config))
    finally:
        ds.apply_rotary_emb = wrapped
    assert torch.equal(through, plain)


def test_the_compiled_step_has_no_complex_multiply():
    """Counted as experiments.kernel_count counts (3 layers, narrow): the complex multiplies
    (library calls inductor cannot fuse) are gone from the step, and with them kernels."""
    from experiments.kernel_count import count

    row = count(3, True, log=lambda *_: None)
    assert row["compiled_kernels"] <= 92, row
