"""The host store's pinned plan (specter/offload/pinned.py) and the host preflight
(specter/placement/bytes.py): torch's rounding rule read from its installed headers,
what the old and new schemes reserve at real models' sizes (arithmetic, nothing allocated),
a small real store on the CPU, the memory a process can have under a fake cgroup, and the
refusal sentences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specter.errors import UserError
from specter.placement.bytes import (GiB, CheckpointBytes, cgroup_available_bytes,
                                             check_cpu_offload_fits, check_fits,
                                             draft_expert_bytes, host_memory, run_extras,
                                             store_reserved_bytes)
from specter.models.real_configs import REAL_CONFIGS
from specter.offload.pinned import (MiB, NO_LIMIT, allocator_limits, per_expert_pinned_bytes,
                                    pinned_reserved_bytes, plan_store, pow2_ceil, store_plan,
                                    store_pinned_bytes)
from specter.offload.store import ExpertLayout, HostExpertStore

UNLIMITED = (NO_LIMIT, NO_LIMIT)
TORCH = Path(torch.__file__).parent


# -- torch's rule, from the installed torch ----------------------------------------------------
def _text(rel: str) -> str:
    path = TORCH / "include" / rel
    if not path.is_file():
        pytest.skip(f"this torch ships no {rel}")
    return path.read_text()


def test_torch_rounds_pinned_requests_as_pinned_reserved_bytes_says():
    """CachingHostAllocatorImpl::allocate: PowerOf2Ceil(size) unless the size is above the
    round threshold or the max cached size, and the rounded size is what it allocates. A
    torch that changes this fails here, and pinned.py must follow it."""
    src = _text("ATen/core/CachingHostAllocator.h")
    body = src[src.index("virtual std::pair<void*, void*> allocate(size_t size)"):]
    body = body[:body.index("virtual void free(")]
    rule = body[body.index("const auto roundSize"):body.index("get_free_block(roundSize")]
    assert "size <= pinned_max_round_threshold()" in rule
    assert "size <= pinned_max_cached_size()" in rule
    assert "return c10::llvm::PowerOf2Ceil(size);" in rule
    assert rule.count("return") == 2 and "return size;" in rule
    assert "allocate_host_memory(roundSize, &ptr);" in body
    config = _text("c10/core/AllocatorConfig.h")
    assert "pinned_max_round_threshold_{std::numeric_limits<size_t>::max()}" in config
    assert "pinned_max_cached_size_{std::numeric_limits<size_t>::max()}" in config


def test_the_allocator_settings_keys_are_torchs():
    """The keys allocator_limits parses are the ones libc10 recognises (their parser is in
    AllocatorConfig.cpp, not shipped)."""
    lib = next(iter(sorted((TORCH / "lib").glob("libc10.*"))), None)
    if lib is None:
        pytest.skip("no libc10 to read")
    data = lib.read_bytes()
    for key in (b"pinned_max_round_threshold_mb", b"pinned_max_cached_size_mb"):
        assert key in data, key


def test_pinned_reserved_bytes():
    assert pinned_reserved_bytes(0) == 0
    assert pinned_reserved_bytes(1) == 1
    assert pinned_reserved_bytes(16 * MiB) == 16 * MiB
    assert pinned_reserved_bytes(16 * MiB + 1) == 32 * MiB
    assert pinned_reserved_bytes(3 * 1408 * 2048 * 2) == 32 * MiB  # DeepSeek-V2-Lite's expert
    assert pinned_reserved_bytes(1056 * MiB) == 2048 * MiB  # one of its layers, whole
    assert pinned_reserved_bytes(33 * MiB, round_threshold=32 * MiB) == 33 * MiB
    assert pinned_reserved_bytes(33 * MiB, max_cached=32 * MiB) == 33 * MiB
    assert pinned_reserved_bytes(32 * MiB, round_threshold=32 * MiB) == 32 * MiB
    assert pinned_reserved_bytes(31 * MiB, round_threshold=32 * MiB) == 32 * MiB


def test_allocator_limits_read_the_environment():
    assert allocator_limits({}) == UNLIMITED
    assert allocator_limits({"PYTORCH_CUDA_ALLOC_CONF":
                             "expandable_segments:True, pinned_max_round_threshold_mb:64"}) \
        == (64 * MiB, NO_LIMIT)
    both = {"PYTORCH_ALLOC_CONF": "pinned_max_cached_size_mb:8",
            "PYTORCH_CUDA_ALLOC_CONF": "pinned_max_round_threshold_mb:64"}
    assert allocator_limits(both) == (NO_LIMIT, 8 * MiB)  # PYTORCH_ALLOC_CONF first


# -- the two schemes at real models' sizes (nothing allocated) ---------------------------------
def _real(key: str, dtype: torch.dtype) -> tuple[ExpertLayout, int]:
    c = REAL_CONFIGS[key]
    experts = c.get("n_routed_experts") or c.get("num_local_experts") or c["num_experts"]
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    layers = c["num_hidden_layers"] - c.get("first_k_dense_replace", 0)
    return ExpertLayout(experts, inter, c["hidden_size"], dtype), layers


REAL = [("deepseek", torch.float16, 26, 16.5, 1.939),  # DeepSeek-V2-Lite
        ("phi", torch.bfloat16, 32, 150.0, 1.707),  # Phi-3.5-MoE
        ("mixtral", torch.bfloat16, 32, 336.0, 1.524)]  # Mixtral-8x7B


@pytest.mark.parametrize("key,dtype,moe_layers,expert_mib,old_ratio", REAL)
def test_the_store_reserves_at_most_5_percent_over_its_experts(key, dtype, moe_layers,
                                                               expert_mib, old_ratio):
    layout, layers = _real(key, dtype)
    assert layers == moe_layers and layout.nbytes == expert_mib * MiB
    experts = layers * layout.num_experts * layout.nbytes
    old = per_expert_pinned_bytes(layout, layers, UNLIMITED)
    new = store_pinned_bytes(layout, layers, UNLIMITED)
    assert old / experts == pytest.approx(old_ratio, abs=1e-3)  # the old scheme: ~2x
    assert old / experts > 1.5
    assert new <= 1.05 * experts < old
    plan = store_plan(layout, layers)
    assert plan.experts == layers * layout.num_experts
    assert plan.reserved_bytes(True, UNLIMITED) == plan.request_bytes == new  # no rounding left
    for c in plan.chunks:
        assert c.nbytes == pow2_ceil(c.nbytes) and 1 <= c.slots <= c.nbytes // plan.slot_bytes
    # the preflight counts the same plan from the header figures
    b = CheckpointBytes(experts, 0, 0, 0, expert_modules=layers)
    assert store_reserved_bytes(b, layout.num_experts) == plan.reserved_bytes(True)


def test_deepseek_numbers():
    layout, layers = _real("deepseek", torch.float16)
    assert per_expert_pinned_bytes(layout, layers, UNLIMITED) == 52 * GiB
    assert store_pinned_bytes(layout, layers, UNLIMITED) < 27 * GiB  # 26.8 GiB of experts


@pytest.mark.parametrize("expert_bytes,experts", [
    (512, 1), (3 * 32 * 64 * 4, 16), (7 * MiB + 3, 300), (464 * MiB, 11), (1200 * MiB, 64),
    (9 * MiB, 6144), (45 * 1000, 5)])
def test_a_plan_holds_every_expert_and_never_reserves_more_than_one_tensor_each(expert_bytes,
                                                                                experts):
    plan = plan_store(expert_bytes, experts)
    assert plan.experts == experts and plan.slot_bytes >= expert_bytes
    assert plan.slot_bytes % 512 == 0
    assert plan.reserved_bytes(True, UNLIMITED) <= experts * pinned_reserved_bytes(expert_bytes)
    places = list(plan.places())
    assert len(places) == len(set(places)) == experts
    for i, off in places:
        assert off + expert_bytes <= plan.chunks[i].nbytes
    # a lower round threshold rounds none of the chunks further
    assert plan.reserved_bytes(True, (MiB, NO_LIMIT)) == plan.request_bytes


def test_the_plan_is_the_environments_limits_when_none_are_given(monkeypatch):
    plan = plan_store(100 * MiB, 3)  # a 512 MiB chunk
    assert plan.reserved_bytes(True) == plan.request_bytes
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_max_round_threshold_mb:64")
    layout = ExpertLayout(4, 1000, 1000, torch.float16)  # 5.7 MiB: rounded, under 64 MiB
    assert per_expert_pinned_bytes(layout, 1) == 4 * 8 * MiB
    layout = ExpertLayout(4, 10000, 1000, torch.float16)  # 57 MiB: rounded
    assert per_expert_pinned_bytes(layout, 1) == 4 * 64 * MiB
    layout = ExpertLayout(4, 20000, 1000, torch.float16)  # 114 MiB: above it, as requested
    assert per_expert_pinned_bytes(layout, 1) == 4 * layout.nbytes


# -- a small real store (pageable, on the CPU) -------------------------------------------------
def test_the_stores_experts_are_contiguous_views_of_its_chunks_at_the_plans_places():
    layout = ExpertLayout(num_experts=5, inter=6, hidden=8, dtype=torch.float32)
    store = HostExpertStore([1, 3, 4], layout, pin=False)
    assert store.plan == store_plan(layout, 3)
    assert [c.numel() * c.element_size() for c in store.chunks] == \
        [c.nbytes for c in store.plan.chunks]
    assert store.reserved_bytes == store.plan.request_bytes
    places = list(store.plan.places())
    for l in range(3):
        for e in range(layout.num_experts):
            flat = store.expert(l, e)
            assert flat.is_contiguous() and flat.numel() == layout.numel
            assert flat.dtype == layout.dtype and not flat.is_pinned()
            chunk, offset = places[l * layout.num_experts + e]
            assert flat.data_ptr() == store.chunks[chunk].data_ptr() + offset
            gate_up, down = layout.views(flat)  # filled as host_load fills it
            i = layout.inter
            gate_up[:i].fill_(100 * l + e)
            gate_up[i:].fill_(100 * l + e + 0.25)
            down.fill_(100 * l + e + 0.5)
    for l in range(3):  # no expert overwrote another
        for e in range(layout.num_experts):
            g, d = store.weights(l, e)
            assert g.shape == (2 * layout.inter, layout.hidden) and d.shape == (layout.hidden,
                                                                                layout.inter)
            assert torch.all(g[:layout.inter] == 100 * l + e)
            assert torch.all(g[layout.inter:] == 100 * l + e + 0.25)
            assert torch.all(d == 100 * l + e + 0.5)


# -- the memory a process can have -------------------------------------------------------------
def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_less_use_page_cache_reclaimable(tmp_path):
    root, me = tmp_path / "cg", tmp_path / "self_cgroup"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(me, "0::/box/job\n")
    _write(root / "box" / "memory.max", "max\n")
    _write(root / "box" / "job" / "memory.max", f"{8 * GiB}\n")
    _write(root / "box" / "job" / "memory.current", f"{3 * GiB}\n")
    _write(root / "box" / "job" / "memory.stat",
           f"anon {GiB}\nactive_file {GiB // 2}\ninactive_file {3 * GiB // 2}\n")
    assert cgroup_available_bytes(root, me) == 7 * GiB  # 8 - (3 - 2)
    assert host_memory(root, me, available=16 * GiB) == (7 * GiB, "what its memory cgroup's "
                                                                   "limit leaves")
    assert host_memory(root, me, available=4 * GiB) == (4 * GiB, "the memory available now")
    # an ancestor's limit binds the whole subtree
    _write(root / "box" / "memory.max", f"{5 * GiB}\n")
    _write(root / "box" / "memory.current", f"{4 * GiB}\n")
    assert cgroup_available_bytes(root, me) == GiB
    # no limit anywhere
    for d in (root / "box", root / "box" / "job"):
        _write(d / "memory.max", "max\n")
    assert cgroup_available_bytes(root, me) is None
    assert host_memory(root, me, available=4 * GiB)[0] == 4 * GiB


def test_cgroup_v2_namespace_root_is_this_cgroup(tmp_path):
    root, me = tmp_path / "cg", tmp_path / "self_cgroup"
    _write(root / "cgroup.controllers", "memory\n")
    _write(me, "0::/\n")
    _write(root / "memory.max", f"{2 * GiB}\n")
    _write(root / "memory.current", f"{GiB // 2}\n")
    assert cgroup_available_bytes(root, me) == 3 * GiB // 2
    _write(me, "0::/not/mounted/here\n")  # a path from outside the namespace
    assert cgroup_available_bytes(root, me) == 3 * GiB // 2


def test_cgroup_v1(tmp_path):
    root, me = tmp_path / "cg", tmp_path / "self_cgroup"
    _write(me, "5:cpu,cpuacct:/\n4:memory:/jobs/42\n0::/\n")
    base = root / "memory"
    _write(base / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    _write(base / "memory.usage_in_bytes", f"{20 * GiB}\n")
    job = base / "jobs" / "42"
    _write(job / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(job / "memory.usage_in_bytes", f"{GiB}\n")
    _write(job / "memory.stat", "total_inactive_file 0\nhierarchical_memory_limit "
                                "9223372036854771712\n")
    assert cgroup_available_bytes(root, me) is None
    _write(job / "memory.limit_in_bytes", f"{4 * GiB}\n")
    _write(job / "memory.stat", f"cache {GiB}\ntotal_active_file {GiB // 4}\n"
                                f"total_inactive_file {GiB // 4}\n")
    assert cgroup_available_bytes(root, me) == 4 * GiB - GiB // 2
    _write(job / "memory.stat", f"hierarchical_memory_limit {2 * GiB}\n")  # a parent's, tighter
    assert cgroup_available_bytes(root, me) == GiB
    assert cgroup_available_bytes(tmp_path / "none", me) is None


# -- what a run holds besides its weights, and the refusals ------------------------------------
def test_draft_expert_bytes_are_the_quantized_layouts():
    from specter.quant.formats import rtn_quantize

    hidden, inter = 256, 96  # down's 96-wide rows take groups of 32
    for bits, group in ((4, 128), (3, 64), (8, 128)):
        w_gu = torch.randn(2 * inter, hidden, dtype=torch.bfloat16)
        w_dn = torch.randn(hidden, inter, dtype=torch.bfloat16)
        packed = rtn_quantize(w_gu, bits, group).packed_bytes() + \
            rtn_quantize(w_dn, bits, group).packed_bytes()
        assert draft_expert_bytes(hidden, inter, bits, group, 2) == packed, (bits, group)


def test_run_extras_count_the_draft_and_one_layers_hessians_where_they_live():
    from specter.quant.gptq import Hessian

    layout, layers = _real("deepseek", torch.float16)
    b = CheckpointBytes(layers * 64 * layout.nbytes, 0, 0, 0, expert_modules=layers)
    one_layer = 64 * draft_expert_bytes(2048, 1408, 4, 128, 2)  # the host's, at a time
    copy = layers * one_layer  # the backend's, on the device (the CPU's: the host)
    hess = 64 * (Hessian(2048, "meta").h.numel() + Hessian(1408, "meta").h.numel()) * 8
    assert hess == 64 * (2048**2 + 1408**2) * 8  # about 3 GiB
    host, device = run_extras(b, 64, 2048, 2, "cuda", draft=True, gptq=True)
    assert host == (("one MoE layer of the INT4 draft", one_layer),)
    assert device == (("one MoE layer's GPTQ Hessians", hess),)
    host, device = run_extras(b, 64, 2048, 2, "cpu", draft=True, gptq=True)
    assert [v for _, v in host] == [one_layer, copy, hess] and device == ()
    assert run_extras(b, 64, 2048, 2, "cuda", draft=False, gptq=True) == ((), ())
    assert run_extras(b, 64, 2048, 2, "cuda", draft=True, gptq=False)[1] == ()
    unknown = CheckpointBytes(b.expert_bytes, 0, 0, 0)  # MoE layers not counted: nothing
    assert run_extras(unknown, 64, 2048, 2, "cuda", draft=True, gptq=True) == ((), ())
    assert store_reserved_bytes(unknown, 64) == b.expert_bytes


def test_a_64_gib_workstation_refuses_deepseek_in_one_sentence_with_its_numbers():
    """The old check passed 26.8 GiB of experts against 64 GiB total, then pinned 52 GiB. Now:
    the store's reserved chunks and one layer of the draft (what the host holds of it at a
    time, calibrate.py), against what is available."""
    layout, layers = _real("deepseek", torch.float16)
    b = CheckpointBytes(layers * 64 * layout.nbytes, int(3.5 * GiB), 0, 0, expert_modules=layers)
    store = store_reserved_bytes(b, 64)
    host, _ = run_extras(b, 64, 2048, 2, "cuda", draft=True, gptq=True)
    b = CheckpointBytes(b.expert_bytes, b.non_expert_bytes, 0, 0, layers, host)
    check_fits("deepseek", b, True, 80 * GiB, host_bytes=28 * GiB, store_bytes=store)  # fits
    with pytest.raises(UserError) as err:
        check_fits("deepseek", b, True, 80 * GiB, host_bytes=27 * GiB, store_bytes=store)
    msg = str(err.value)
    assert msg == ("model=deepseek needs 27.1 GiB of host memory for its routed experts "
                   "(26.8 GiB, pinned as 26.9 GiB) and one MoE layer of the INT4 draft "
                   "(0.3 GiB); this process can have 27.0 GiB.")
    with pytest.raises(UserError, match=r"needs 6.4 GiB of device memory for its non-expert "
                                        r"weights and one MoE layer's GPTQ Hessians \(2.9 GiB\); "
                                        r"the device has 6.0 GiB\.$"):
        check_fits("deepseek", b, True, 6 * GiB, host_bytes=40 * GiB, store_bytes=store,
                   device_extra=run_extras(b, 64, 2048, 2, "cuda", draft=True, gptq=True)[1])


def test_host_checks_use_the_measured_memory_when_none_is_given(monkeypatch):
    import specter.placement.bytes as cb

    monkeypatch.setattr(cb, "host_memory", lambda: (10 * GiB, "the memory available now"))
    b = CheckpointBytes(12 * GiB, GiB, 0, 0)
    with pytest.raises(UserError, match=r"for its routed experts; this process can have "
                                        r"10.0 GiB \(the memory available now\)\.$"):
        check_fits("olmoe", b, True, None)
    extra = CheckpointBytes(4 * GiB, GiB, 0, 0, 16, (("the INT4 draft's host copy", GiB),))
    with pytest.raises(UserError, match=r"needs 11.0 GiB of memory .*, the INT4 draft's host "
                                        r"copy 1.0 GiB and 1.0 GiB for the process\); this "
                                        r"process can have 10.0 GiB \(the memory available "
                                        r"now\): lower the budget\.$"):
        check_cpu_offload_fits("olmoe", extra, 64, 64)
    check_cpu_offload_fits("olmoe", extra, 8, 64)  # 4 + 0.5 + 1 + 1 + 1 GiB fit in 10


def test_a_held_random_store_counts_as_memory_the_next_job_can_have(monkeypatch):
    """A sweep's next job reuses the last job's random host store or frees it before drawing
    its own: its preflight adds the store's bytes to what the process can have now."""
    from specter.compose import host_with_held_store
    from specter.placement import bytes as checkpoint_bytes, loader as host_load

    monkeypatch.setattr(checkpoint_bytes, "host_memory_bytes", lambda: 10 * 2**30)
    monkeypatch.setattr(host_load, "_LAST_RANDOM_STORE", {})
    assert host_with_held_store() is None  # nothing held: the checks read memory themselves

    class Held:
        reserved_bytes = 27 * 2**30

    monkeypatch.setattr(host_load, "_LAST_RANDOM_STORE", {"key": Held()})
    assert host_with_held_store() == 37 * 2**30
