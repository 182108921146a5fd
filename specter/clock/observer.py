"""The charging side of the clock, and the link whose time moves only by the charges.

Owns: `ComputeClock`, subscribed to a model's forwards by hooks (attention, dense MLPs, shared
experts, the lm head; HF's routed experts from the router's choice) and told by the offload
runtime of the steps it runs itself (router, its own host work, each expert or grouped call);
`NullClock`, the same calls doing nothing, for clocks that are the real thing (compute takes
the time it takes). Engines, drafts, the offload runtime and the orchestrator hold one and
call it; nothing else charges compute (clock/counted.py charges what the code issues).
And `VirtualLink`, the virtual clock's link: a simulated clock with three timelines, all from
0: the compute stream (`tc`), one FIFO copy engine (free at `te`) and the host CPU's expert
jobs (free at `th`). A copy's data moves for real at issue (so results are exact); its time is
the profile's bytes / bandwidth + latency on the copy engine. A wait on an unfinished copy
moves `tc` to its end (an exposed stall); `compute(seconds)` is what `ComputeClock` charges.
Deterministic: the same run gives the same times on any machine. So a window's clock reads in
one file: the loop's marks, the hooks' charges and the time they move.
Does not own: the cost of a step (costmodel.py), the link interface and the H2D-hiding
bookkeeping (offload/link.py `Link`), the real links (`WallLink`, `CudaLink` there).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from specter.clock.costmodel import CostModel
from specter.counting import charging_only, routed_counts
from specter.models.introspect import experts_modules
from specter.offload.host import HostJob
from specter.offload.link import Link, LinkProfile, Transfer, check_compute, copy_data


class NullClock:
    """A real clock (or a model the clock does not price): every call is a no-op."""

    def begin_forward(self, tokens: int, context: int, prefill: bool = False,
                      rows: int = 1) -> None:
        pass

    def forward(self, phase: str, tokens: int, context: int, rows: int = 1) -> None:
        """The loop's event before every forward (decoding/loop.py `Events`)."""
        self.begin_forward(tokens, context, phase == "prefill", rows)

    def router(self, tokens: int) -> None:
        pass

    def offload_layer(self, tokens: int) -> None:
        pass

    def expert(self, tokens: int) -> None:
        pass

    def grouped_experts(self, counts: list[int]) -> None:
        pass

    def draft_experts(self, tokens: int, per_expert: list[int], bits: int, group: int,
                      dequantized: bool) -> None:
        pass

    def host_experts(self, tokens: int, per_expert: list[int], hidden: int) -> None:
        pass

    def kv_copy(self, positions: int, layers: int) -> int | None:
        """None: a real clock measures the copy itself (the caller counts its bytes)."""
        return None

    def host_read(self) -> None:
        pass

    def captured_step(self, kernels: int = 0):
        return contextlib.nullcontext()

    def compiled_step(self, routes: torch.Tensor | None = None) -> None:
        pass

    def remove(self) -> None:
        pass


NULL_CLOCK = NullClock()


def runtime_clock(link: Link, cost: CostModel | None) -> NullClock:
    """The clock an offload runtime reports its own steps to: priced wherever there is a cost
    model (the virtual and emulated clocks), a no-op on real clocks."""
    return NULL_CLOCK if cost is None else ComputeClock(link, cost)


class ComputeClock(NullClock):
    """The virtual clock's observer: forward hooks charging each compute step of the model to
    the link's clock, and the steps the offload runtime reports (`router`, `offload_layer`,
    `expert`, `grouped_experts`), priced by the cost model.

    Attention (+norms) at each decoder layer's `self_attn`, dense MLPs, shared experts and the
    lm head at their modules; routed experts are charged by whoever runs them (the offload
    runtime per expert, or this clock from the router's choice when experts stay HF's).
    """

    def __init__(self, link: Link, cost: CostModel, model: nn.Module | None = None,
                 charge_experts: bool = False):
        self.link, self.cost = link, cost
        self.tokens, self.context, self.rows = 1, 1, 1  # tokens: of all rows together
        self.row_tokens = 1
        self.handles = []
        self.parts = []  # what the hooks charge, in their order (`compiled_step`)
        if model is not None:
            self._subscribe(model, charge_experts)

    def _subscribe(self, model: nn.Module, charge_experts: bool) -> None:
        link, cost = self.link, self.cost
        moe_ids = {id(m) for _, m in experts_modules(model)}
        for layer in model.model.layers:
            self._hook(layer.self_attn, self._attention_s)
            mlp = layer.mlp
            if not any(id(m) in moe_ids for m in mlp.modules()):
                self._hook(mlp, lambda: cost.dense_mlp_s(self.tokens))
                continue
            for name, sub in mlp.named_children():
                if name in ("shared_expert", "shared_experts"):  # (a sigmoid gate's cost is negligible)
                    self._hook(sub, lambda: cost.shared_s(self.tokens))
                elif id(sub) in moe_ids and charge_experts:
                    self.handles.append(sub.register_forward_pre_hook(self._charge_hf_experts))
        self.parts.append(lambda: cost.lm_head_s(self.rows))  # a compiled step keeps one position
        self.handles.append(model.lm_head.register_forward_hook(  # rows x kept positions
            lambda m, i, o: None if torch.compiler.is_compiling()
            else link.compute(cost.lm_head_s(o.shape[:-1].numel()))))

    def _attention_s(self) -> float:
        """Every row's tokens through the projections, each row reading its own KV."""
        if self.rows == 1:
            return self.cost.attention_s(self.row_tokens, self.context)
        return self.cost.attention_batch_s([(self.row_tokens, self.context)] * self.rows)

    def _hook(self, module: nn.Module, seconds) -> None:
        # Inside a compiled region the hook is traced, not run: the step is charged after it.
        self.parts.append(seconds)
        self.handles.append(module.register_forward_hook(
            lambda m, i, o: None if torch.compiler.is_compiling() else self.link.compute(seconds())))

    @contextlib.contextmanager
    def captured_step(self, kernels=0):
        """The charges of one compiled step, made inside this block (the hooks' replay, the
        draft's listeners), as the modelled GPU runs a captured graph: each kernel's compute
        and memory time (`HardwareProfile.captured`), then the floor of each of the graph's
        `kernels` (counted at capture, graph_kernels.py) and one launch for its replay.
        The cost model is shared, so every charge in the block is priced so."""
        hw = self.cost.hw
        self.cost.hw = hw.captured()
        try:
            yield
        finally:
            self.cost.hw = hw
        kernels = kernels() if callable(kernels) else kernels  # (counted inside the block)
        self.link.compute(hw.launch_overhead_s + (self.cost.kernels_s(kernels) if kernels else 0.0))

    def compiled_step(self, routes: torch.Tensor | None = None) -> None:
        """What the hooks charge for one forward that ran compiled (compiled_draft.py: one
        position per row kept), after it ran; `routes` [L, T, k] (compiled_decode.py): every MoE
        layer's routing, for the experts the pre-hooks would have charged."""
        for seconds in self.parts:
            self.link.compute(seconds())
        if routes is not None:
            for tokens, per_expert in routed_counts(routes):
                self._charge_counts(tokens, per_expert)

    def _charge_counts(self, tokens: int, per_expert: list[int]) -> None:
        self.router(tokens)
        for n in per_expert:
            self.expert(n)

    def router(self, tokens: int) -> None:
        self.link.compute(self.cost.router_s(tokens))

    def offload_layer(self, tokens: int) -> None:
        self.link.compute(self.cost.offload_layer_s(tokens))

    def expert(self, tokens: int) -> None:
        self.link.compute(self.cost.expert_s(tokens))

    def grouped_experts(self, counts: list[int]) -> None:
        self.link.compute(self.cost.grouped_experts_s(counts))

    def draft_experts(self, tokens: int, per_expert: list[int], bits: int, group: int,
                      dequantized: bool) -> None:
        """One INT4 draft layer: its router, then one fused kernel over every routed expert
        (`per_expert`: the tokens of each expert chosen; `dequantized`: each pair's weights
        written out and read back, gather_int4)."""
        self.link.compute(self.cost.router_s(tokens))
        self.link.compute(self.cost.draft_experts_s(per_expert, bits, group, dequantized))

    def host_experts(self, tokens: int, per_expert: list[int], hidden: int) -> None:
        """One draft layer whose routed experts run on the host (SpecMoE's draft): the router,
        each expert at the host's rates, and the activation (`hidden` wide) over the link and
        back."""
        cost, link = self.cost, self.link
        link.compute(cost.router_s(tokens))
        for n in per_expert:
            link.compute(cost.host_expert_s(n))
        hw, sizes = cost.hw, cost.sizes
        nbytes = tokens * hidden * sizes.elem_bytes
        link.compute(2 * (hw.h2d_latency_s + nbytes / hw.h2d_bandwidth_Bps) * sizes.moe_multiplier)

    def kv_copy(self, positions: int, layers: int) -> int:
        """One device-to-device copy of `positions` KV positions (rows x tokens, holes
        included: the copy is the whole rectangle) of `layers` decoder layers: the charged
        sizes' KV bytes (the real model's under charge=real) read and written at the device's
        memory bandwidth, plus one copy kernel per layer's K and V. Returns the bytes."""
        s, hw = self.cost.sizes, self.cost.hw
        layers = layers * s.attn_multiplier
        nbytes = int(round(positions * s.kv_elems_per_token * s.elem_bytes * layers))
        self.link.compute(2 * nbytes / hw.mem_bandwidth_Bps + 2 * layers * hw.launch_overhead_s)
        return nbytes

    def host_read(self) -> None:
        """The host reading a value the device computed (the orchestrator's snapshot of the
        draft's routing): one launch's time."""
        self.link.compute(self.cost.hw.launch_overhead_s)

    def _charge_hf_experts(self, module, args) -> None:
        if torch.compiler.is_compiling():  # traced, not run: compiled_step charges it
            return
        _, top_k_index, _ = args
        with charging_only():
            counts = torch.bincount(top_k_index.flatten())  # tokens per expert
            per_expert = counts[counts > 0].tolist()  # host sync: charging only
        self._charge_counts(self.tokens, per_expert)

    def begin_forward(self, tokens: int, context: int, prefill: bool = False,
                      rows: int = 1) -> None:
        """The next forward: `rows` sequences of `tokens` positions each (padding included),
        each attending over `context` positions (holes included: the kernel reads them)."""
        self.tokens, self.context, self.rows = tokens * rows, context, rows
        self.row_tokens = tokens

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class VirtualTransfer(Transfer):
    def __init__(self, nbytes: int, start: float, end: float, link: VirtualLink) -> None:
        super().__init__(nbytes)
        self.start, self.end = start, end
        self._link = link

    def done(self) -> bool:
        # complete once the compute clock has reached its end
        return self.end <= self._link.now()


class VirtualLink(Link):
    """Simulated clock: compute time `tc`, one FIFO copy engine free at `te`, both from 0."""

    kind = "virtual"
    charged = True

    def __init__(self, profile: LinkProfile, device: torch.device) -> None:
        super().__init__(profile, device)
        self._tc = 0.0
        self._te = 0.0
        self._th = 0.0  # the host CPU's expert jobs

    def now(self) -> float:
        return self._tc

    def mark(self) -> float:  # the clock's value: a mark is known at once
        return self._tc

    def host_free(self) -> float:
        return self._th

    def copy_engine_free(self) -> float:
        return self._te

    def host(self, fn, seconds: float) -> HostJob:
        # the data now (the same arithmetic as later), the time on the host's own timeline
        check_compute(seconds)
        job = HostJob(seconds)
        job.start = max(self._tc, self._th)
        job.end = self._th = job.start + seconds
        self._host_busy[0] += seconds
        job.value = fn()
        job.finished.set()
        return job

    def wait_host(self, job: HostJob):
        if job.end > self._tc:
            self.host_wait_s += job.end - self._tc
            self._tc = job.end
        return job.value

    def _issue(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, after=None) -> Transfer:
        # issued at tc, it starts when the engine is free and occupies it for the modelled time
        start = max(self._tc, self._te)
        end = start + self.profile.transfer_s(nbytes)
        self._te = end
        copy_data(dst, src)  # data correctness now; time moves only by the model
        return VirtualTransfer(nbytes, start, end, self)

    def wait(self, t: Transfer) -> None:
        # a wait on an unfinished copy moves compute time to its end: an exposed stall
        if t.end > self._tc:
            self._waits.append((self._tc, t.end))
            self._tc = t.end

    def compute(self, seconds: float) -> None:
        check_compute(seconds)
        self._tc += seconds

    def synchronize(self) -> None:
        # every copy's data is already in place and its times known; the compute clock is
        # left alone (the engine may be ahead of it, which is fine between requests)
        return None
