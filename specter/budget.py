"""Memory budgets: named budgets to resident expert slots per MoE layer, and the byte accounting.

Owns: resolving `budget=xhigh|high|low|full` (or `budget.slots=N`) for a model to a slot count,
checking it is possible (at least top-k, at most the expert count; a dense model cut into
expert-sized blocks, where top-k = E, streams its blocks and needs one slot), resolving
`budget.gb=N` (GiB of device memory) into slots by the bytes of what a system keeps on the
device (`resolve_gb`: non-expert weights, the INT4 draft if it has one, a second instance if
it has one, KV, staging buffers, a reserve), and the device-memory accounting printed at the
start of every run.
A system that computes every routed expert on the host (`Footprint.host_experts`) holds no
slots under any budget (`held_slots`); its record keeps the case's slots, as resident's does.
Does not own: which experts occupy the slots (the residency policy of the offloading runtime).

The paper's budgets are per-layer slot counts (docs/paper-notes.md); models without a paper entry
use the same proportions as DeepSeek-V2-Lite and Qwen1.5-MoE: high = E/4, low = E/8, rounded
up, never below top-k. `xhigh` = E/2 is the largest budget of the hit-rate study (our reading
of DeepSeek-V2-Lite at 32 GB: twice the 24 GB case's slots). A real model no paper gives slots
for (Mixtral, Qwen3, OLMoE, GLM: conf/model/ names its budgets in GiB only) resolves a named
budget by the byte accounting, as `budget.gb` does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from specter.config import BudgetConfig, ModelConfig
from specter.errors import UserError
from specter.models.introspect import MoESpec
from specter.quant.formats import draft_expert_bytes

PROPORTION = {"xhigh": 1 / 2, "high": 1 / 4, "low": 1 / 8}


@dataclass(frozen=True)
class ResolvedBudget:
    name: str
    slots: int
    rule: str  # where the number came from, for the record
    note: str = ""  # a deviation from the paper's number, if any
    gb: float | None = None  # the device GiB this budget stands for (budget.gb or the paper's reference)
    staging: int = 0  # staging buffers (budget.staging)
    whole_layers: int | None = None  # Transformers baseline: MoE layers kept whole on the device ...
    whole_layers_of: int | None = None  # ... of this many (those of the model the bytes are of)
    accounting: str = ""  # the GiB arithmetic, printed and recorded
    # vLLM's cpu_offload_gb (system=vllm_offload): the decoder layers' bytes left on the host,
    # of all the decoder layers' bytes (both of the model the bytes are of)
    offload_bytes: int | None = None
    layer_bytes: int | None = None

    @property
    def offload_share(self) -> float:
        """The share of the decoder layers' bytes offloaded (0 when nothing is)."""
        return min(1.0, self.offload_bytes / self.layer_bytes) if self.layer_bytes else 0.0

    def as_record(self) -> dict:
        rec = {"budget_gb": self.gb if self.gb is not None else float("nan"),
               "budget_staging": self.staging,
               "budget_whole_layers": -1 if self.whole_layers is None else self.whole_layers,
               "budget_rule": self.rule}
        if self.offload_bytes is not None:
            rec.update({"budget_offload_bytes": self.offload_bytes,
                        "budget_offload_share": self.offload_share})
        return rec


def resolve_slots(budget: BudgetConfig, model: ModelConfig, num_experts: int,
                  top_k: int) -> ResolvedBudget:
    # A token holds its top-k experts at once; a dense FFN cut into expert-sized blocks (top-k
    # = E, the dense twin) computes its blocks one after another, so they stream through 1 slot.
    minimum = 1 if top_k == num_experts else top_k
    if budget.slots is not None:
        slots, rule, note = budget.slots, "budget.slots override", ""
    elif budget.name == "full":
        slots, rule, note = num_experts, "all experts resident", ""
    elif budget.name in model.budget_slots:
        slots, rule, note = model.budget_slots[budget.name], f"model.budget_slots.{budget.name}", ""
        if slots < minimum:  # Phi-3.5-MoE low: the paper keeps 1 of 16 resident with top-2
            note = (f"paper budget of {slots} slot(s) is below top-k={top_k}; raised to {minimum} "
                    "because experts in use are never evicted")
            slots, rule = minimum, rule + " (raised to top-k)"
    elif budget.name in PROPORTION:
        slots = max(minimum, math.ceil(num_experts * PROPORTION[budget.name]))
        rule, note = f"proportional: ceil(E*{PROPORTION[budget.name]}), at least top-k", ""
    else:
        raise UserError(f"budget '{budget.name}' has no slot count for model={model.name}; "
                        "use budget=high|low|full or set budget.slots=N.")
    if slots < minimum:
        need = (f"every token needs {top_k} experts resident at once" if minimum == top_k
                else "its dense blocks stream through one slot at a time")
        raise UserError(f"budget of {slots} expert slot(s) per layer is below top-k={top_k} for "
                        f"model={model.name}; {need}, so set budget.slots to at least {minimum}.")
    if slots > num_experts:
        raise UserError(f"budget of {slots} expert slots per layer exceeds the {num_experts} "
                        f"routed experts of model={model.name}; use at most {num_experts} "
                        "(budget=full).")
    return ResolvedBudget(name=budget.name, slots=slots, rule=rule, note=note)


@dataclass(frozen=True)
class ByteAccount:
    non_expert_bytes: int
    resident_expert_bytes: int  # slots x MoE layers x one expert
    all_expert_bytes: int  # every routed expert (what a no-offload system holds)
    kv_bytes: int  # KV cache at the longest sequence of the workload
    kv_tokens: int

    def table(self, slots: int, spec: MoESpec) -> str:
        gib = 1 << 30
        rows = [
            ("non-expert weights (embeddings, attention, norms, routers, shared experts, head)",
             self.non_expert_bytes),
            (f"resident expert slots: {slots} x {spec.num_moe_layers} MoE layers x "
             f"{spec.expert_bytes / 2**20:.3f} MiB", self.resident_expert_bytes),
            (f"KV cache at {self.kv_tokens} tokens", self.kv_bytes),
        ]
        total = sum(b for _, b in rows)
        lines = [f"  {name:<86} {b / gib:10.4f} GiB" for name, b in rows]
        lines.append(f"  {'total device bytes under this budget':<86} {total / gib:10.4f} GiB")
        lines.append(f"  {'(all routed experts, for reference)':<86} "
                     f"{self.all_expert_bytes / gib:10.4f} GiB")
        return "\n".join(lines)


def account(spec: MoESpec, slots: int, kv_tokens: int) -> ByteAccount:
    return ByteAccount(
        non_expert_bytes=spec.non_expert_bytes,
        resident_expert_bytes=spec.slot_bytes(slots),
        all_expert_bytes=spec.slot_bytes(spec.num_experts),
        kv_bytes=spec.kv_bytes_per_token * kv_tokens,
        kv_tokens=kv_tokens,
    )


# ----------------------------------------------------------------------------- budget.gb
GIB = 1 << 30


@dataclass(frozen=True)
class Footprint:
    """What a system keeps on the device besides its resident expert slots."""

    int4_draft: bool = False  # the INT4 copy of every routed expert (a device-resident draft)
    second_instance: bool = False  # a second copy of the non-expert weights and a second KV cache
    whole_layers: bool = False  # accelerate's device map: whole experts modules, not slots
    offloads_weights: bool = False  # vLLM's cpu_offload_gb: whatever does not fit, by bytes
    host_experts: bool = False  # every routed expert computed on the host: no expert slots


def resolve_gb(gb: float, spec: MoESpec, sizes_of: str, footprint: Footprint, kv_tokens: int,
               staging: int, reserve_gb: float, minimum: int, group: int = 128,
               name: str = "gb") -> ResolvedBudget:
    """`gb` GiB of device memory -> resident slots per MoE layer (or whole layers, for
    accelerate's device map), from the FP16 bytes of `spec` (the real model a project-made
    one stands for, or the model itself: `sizes_of` says which)."""
    per_expert = spec.expert_bytes
    fixed = [("reserve (CUDA context, allocator slack, activations)", int(reserve_gb * GIB)),
             ("non-expert weights (FP16)", spec.non_expert_bytes),
             (f"KV cache at {kv_tokens} tokens", spec.kv_bytes_per_token * kv_tokens)]
    if footprint.int4_draft:
        fixed.append(("INT4 draft: every routed expert", spec.num_moe_layers * spec.num_experts
                      * draft_expert_bytes(spec.hidden, spec.expert_inter, 4, group, 2)))
    if footprint.second_instance:
        fixed += [("second instance: non-expert weights", spec.non_expert_bytes),
                  ("second instance: KV cache", spec.kv_bytes_per_token * kv_tokens)]
    if staging:
        fixed.append((f"staging buffers: {staging} x one expert", staging * per_expert))
    left = int(gb * GIB) - sum(b for _, b in fixed)
    lines = [f"  budget.gb={gb:g} GiB, bytes of {sizes_of}:"]
    lines += [f"    - {what:<58} {b / GIB:9.3f} GiB" for what, b in fixed]
    if footprint.offloads_weights:  # vLLM: every weight on the device that fits, the rest offloaded
        experts = spec.num_moe_layers * spec.num_experts * per_expert
        outside = spec.outside_layer_bytes
        layer_bytes = spec.non_expert_bytes - outside + experts
        offload = max(0, min(layer_bytes, experts - left))
        lines.append(f"    = {left / GIB:.3f} GiB for the routed experts' {experts / GIB:.3f} GiB "
                     f"-> cpu_offload_gb = {offload / GIB:.3f} GiB of the decoder layers' "
                     f"{layer_bytes / GIB:.3f} GiB, first layers first")
        if left + offload < experts:
            raise UserError(f"budget.gb={gb:g} GiB does not hold the weights outside the decoder "
                            f"layers, the KV cache and the reserve ({sizes_of}); raise budget.gb.")
        return ResolvedBudget(name=name, slots=minimum, rule=f"budget.gb={gb:g} (cpu_offload_gb)",
                              gb=gb, staging=staging, offload_bytes=int(offload),
                              layer_bytes=int(layer_bytes), accounting="\n".join(lines))
    if footprint.whole_layers:
        per_layer = spec.num_experts * per_expert
        layers = max(0, min(spec.num_moe_layers, left // per_layer)) if left > 0 else 0
        lines.append(f"    = {left / GIB:.3f} GiB for whole experts modules of {per_layer / GIB:.3f} GiB "
                     f"-> {layers} of {spec.num_moe_layers} MoE layers resident")
        return ResolvedBudget(name=name, slots=minimum, rule=f"budget.gb={gb:g} (device map)", gb=gb,
                              staging=staging, whole_layers=int(layers),
                              whole_layers_of=spec.num_moe_layers, accounting="\n".join(lines))
    per_slot = spec.slot_bytes(1)
    slots = min(spec.num_experts, left // per_slot) if left > 0 else 0
    lines.append(f"    = {left / GIB:.3f} GiB for slots of {per_slot / GIB:.3f} GiB "
                 f"({spec.num_moe_layers} MoE layers x {per_expert / 2**20:.2f} MiB) -> {slots} slots/layer")
    if slots < minimum:
        raise UserError(f"budget.gb={gb:g} GiB leaves {max(left, 0) / GIB:.2f} GiB for expert slots "
                        f"after the fixed bytes ({sizes_of}), room for {max(slots, 0)} slot(s) per "
                        f"layer, below the {minimum} this model needs at once; raise budget.gb or "
                        "lower budget.staging / budget.reserve_gb.")
    return ResolvedBudget(name=name, slots=int(slots), rule=f"budget.gb={gb:g} (byte accounting)",
                          gb=gb, staging=staging, accounting="\n".join(lines))


def fp16_spec(config) -> MoESpec:
    """The FP16 byte facts of a model from its config alone (meta device: no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specter.models.introspect import moe_spec

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    return moe_spec(meta)


def bytes_spec(model: ModelConfig, checkpoint, charged_real: bool = False) -> tuple[MoESpec, str]:
    """Whose bytes a GiB budget is counted in: the real model a project-made one stands for
    (its public config), or the real model a narrowed one (`model.narrow`) is charged as
    (`charged_real`: a virtual clock charging the real sizes, so that its slots are the real
    model's at that budget), else the checkpoint's own config; FP16 either way (the
    deployment the paper's budgets describe)."""
    from transformers import AutoConfig

    from specter.models.real_configs import REAL_CONFIGS

    real = REAL_CONFIGS.get(model.stands_for or "") if model.source == "project" else None
    if real is None and charged_real and model.narrow:
        real = REAL_CONFIGS.get(model.name)
    if real is not None:
        return fp16_spec(AutoConfig.for_model(**real)), f"real:{real['_name_or_path']} (FP16)"
    from pathlib import Path

    from specter.models.loading import native_classes

    cfg, _ = native_classes(Path(checkpoint))  # never the folder's own code (auto_map)
    return fp16_spec(cfg), f"own:{model.name} (FP16)"


def held_slots(budget: ResolvedBudget, footprint: Footprint) -> int:
    """The expert slots a system holds on the device under `budget` (none for host_experts)."""
    return 0 if footprint.host_experts else budget.slots


def resolve(budget: BudgetConfig, model: ModelConfig, checkpoint, num_experts: int, top_k: int,
            footprint: Footprint, kv_tokens: int, group: int = 128,
            charged_real: bool = False) -> ResolvedBudget:
    """The run's budget: `budget.gb` by the byte accounting, else the named/overridden slots;
    either way with the reference GiB it stands for, the staging buffers, and, for a system
    that keeps whole layers (accelerate), the layers that GiB holds."""
    minimum = 1 if top_k == num_experts else top_k
    if footprint.host_experts:  # the device holds no routed expert under any budget
        named = budget.name != "gb" or budget.slots is not None
        case = resolve_slots(budget, model, num_experts, top_k).slots if named else 0
        return ResolvedBudget(name=budget.name, slots=case, gb=budget.gb if budget.gb is not None
                              else model.budget_gb.get(budget.name), staging=0,
                              rule="none held: every routed expert computed on the host",
                              note=f"the case's {case} slots per layer stay unused" if case else "")
    if budget.name == "gb" and budget.gb is None:
        raise UserError("budget=gb needs the device memory: add budget.gb=N (GiB), e.g. budget.gb=24.")
    ref_gb = budget.gb if budget.gb is not None else \
        None if budget.slots is not None else model.budget_gb.get(budget.name)
    # A model no paper gives slots for (model.budget_slots empty) names its budgets in GiB
    # only: those resolve by the byte accounting, as budget.gb does.
    by_gb = budget.gb is not None or (ref_gb is not None and not model.budget_slots)
    by_bytes = footprint.whole_layers or footprint.offloads_weights  # a device map, not slots
    if not by_gb and not by_bytes:
        r = resolve_slots(budget, model, num_experts, top_k)
        return dataclasses.replace(r, gb=ref_gb, staging=budget.staging)
    if ref_gb is None and footprint.offloads_weights:
        raise UserError(f"system=vllm_offload sizes cpu_offload_gb from device GiB, and "
                        f"budget={budget.name} of model={model.name} names none: give "
                        "budget=gb budget.gb=N.")
    if ref_gb is None:  # accelerate with no GiB to size its map from: the slots' bytes, as layers
        r = resolve_slots(budget, model, num_experts, top_k)
        return dataclasses.replace(r, staging=budget.staging, note=(r.note + "; " if r.note else "")
                                   + f"no reference GiB for budget={budget.name}: whole layers "
                                   "from the slot count")
    spec, sizes_of = bytes_spec(model, checkpoint, charged_real)
    r = resolve_gb(ref_gb, spec, sizes_of, footprint, kv_tokens, budget.staging, budget.reserve_gb,
                   minimum, group, name=budget.name)
    if by_bytes and budget.gb is None:  # keep the named budget's slots for the record
        slots = resolve_slots(budget, model, num_experts, top_k)
        r = dataclasses.replace(r, slots=slots.slots,
                                rule=f"model.budget_gb.{budget.name}={ref_gb:g} (device map)")
    return r
