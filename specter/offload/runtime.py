"""The offloaded-experts runtime: the target seat of the experts dispatcher -> store, cache,
link, clock.

Owns: executing a layer's routed experts from device slots (`experts_forward`, in the target
seat of specter/experts.py: transformers calls it once per MoE layer with the router's
choice; routers, attention, norms and shared experts stay Hugging Face's and untouched): one
host read of the routing, the misses' copies issued together, then the ready batches the
cache streams (offload/cache.py `ExpertCache.stream`: resident first while the misses land),
each computed one way (`Rounds` of one fixed-launch kernel, offload/grouped.py, or
`OneByOne`), results summed in expert order exactly as HF's eager path does; `prefetch`; and
the per-request demand statistics (`DemandStats`, an observer of the loop's events, which
also notes each layer's last forward). The steps it
runs itself (router, its own host work, each expert or grouped call) are reported to its
clock (specter/clock/observer.py; a no-op on real clocks).
Does not own: the host's share (offload/host.py `HostPath`), an expert's arithmetic
(offload/mlp.py), what to prefetch (a `LayerPrefetcher` passed in: offload/prefetch.py), what
to evict (policy.py), how bytes move and time passes (link.py), the decode loops (decoding/).

T = tokens in this forward, k = top-k, H = hidden, E = routed experts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from specter.experts import experts_of
from specter.errors import UserError
from specter.grouping import group_by_expert, read_groups
from specter.models.introspect import experts_modules
from specter.offload.cache import ExpertCache, Picker
from specter.clock.costmodel import CostModel
from specter.clock.observer import runtime_clock
from specter.offload.grouped import LayerSum, grouped_products, pick_kernel
from specter.offload.host import HostPath
from specter.offload.link import Link
from specter.offload.mlp import expert_output, sum_in_expert_order
from specter.offload.prefetch import LayerPrefetcher

COUNTED_PHASES = ("decode", "verify")  # the target's decoding demand: not prefill, not the draft


@dataclass
class DemandStats:
    """A request's demand on the expert cache (the hit rate and its parts). It hears the loop's
    forwards (decoding/loop.py `Events`) and counts only the target's decoding ones
    (`COUNTED_PHASES`: greedy decode steps, speculative verification), so the hit rate
    excludes the prefill and the draft; `counting` says whether the current forward counts
    (a caller that tells it nothing is always counted)."""

    counting: bool = True
    hits: int = 0
    misses: int = 0
    inflight_hits: int = 0  # needed while its (prefetch) copy was still in flight
    pair_hits: int = 0  # (token, expert) requests whose expert was resident
    pair_requests: int = 0  # (token, expert) requests: tokens x top-k
    layer_prefetches: int = 0  # copies a layer prefetcher issued (`prefetch`, counted)
    # The most hits a slot-limited cache could score: per (layer, forward) at most `slots` of
    # the experts it needs can be resident when it starts (plus every staging buffer, which
    # budget.staging may add), so hits <= min(slots + staging, needed).
    cap_hits: int = 0
    host_experts: int = 0  # misses and in-flight experts computed on the host (host_compute)
    host_tokens: int = 0  # ... and the (token, expert) pairs they served
    distinct: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    forward_distinct: list[int] = field(default_factory=list)  # experts needed, per layer call
    # each MoE layer's last forward, counted or not (its experts, the tokens routed to each,
    # its (tokens, top-k)): what the prefetchers and the adaptive depth read
    last_needed: dict[int, list[int]] = field(default_factory=dict)
    last_counts: dict[int, dict[int, int]] = field(default_factory=dict)
    last_shape: dict[int, tuple[int, int]] = field(default_factory=dict)

    def forward(self, phase: str, tokens: int, context: int, rows: int = 1) -> None:
        self.counting = phase in COUNTED_PHASES

    def demand(self, l: int, groups, shape: tuple[int, int], hits: list[int],
               cache: ExpertCache) -> None:
        """Layer `l`'s forward needs `groups.needed` (routing [T, k] = `shape`), of which `hits`
        are resident (or their copy in flight) in `cache`."""
        if self._seen(l, groups, shape):
            self.hits += len(hits)
            self.misses += len(groups.needed) - len(hits)
            self.cap_hits += min(cache.slots + cache.staging, len(groups.needed))
            self.inflight_hits += sum(not cache.ready(l, e) for e in hits)
            self.pair_requests += shape[0] * shape[1]
            self.pair_hits += sum(groups.counts[e] for e in hits)

    def host_layer(self, l: int, groups, shape: tuple[int, int]) -> None:
        """Layer `l`'s forward computes every expert it needs on the host (system=host_experts)."""
        if self._seen(l, groups, shape):
            self.host_experts += len(groups.needed)
            self.host_tokens += shape[0] * shape[1]

    def _seen(self, l: int, groups, shape: tuple[int, int]) -> bool:
        """Note the layer's last forward; whether it counts."""
        self.last_needed[l], self.last_counts[l], self.last_shape[l] = \
            groups.needed, groups.counts, shape
        if self.counting:
            self.distinct[l].update(groups.needed)
            self.forward_distinct.append(len(groups.needed))
        return self.counting

    def clear(self) -> None:
        """Every count back to zero, before a request (`counting` stays as the last forward
        left it)."""
        self.__init__(counting=self.counting)

    def as_record(self) -> dict:
        total = self.hits + self.misses
        per_layer = [len(self.distinct[l]) for l in sorted(self.distinct)]
        return {"demand_hits": self.hits, "demand_misses": self.misses,
                "hit_rate": self.hits / total if total else float("nan"),
                "hit_rate_cap": self.cap_hits / total if total else float("nan"),
                "hit_rate_tokens": self.pair_hits / self.pair_requests if self.pair_requests
                else float("nan"),
                "inflight_hits": self.inflight_hits, "layer_prefetches": self.layer_prefetches,
                "host_experts": self.host_experts, "host_tokens": self.host_tokens,
                # of the experts not ready when needed (misses and copies still in flight)
                "host_frac": (self.host_experts / (self.misses + self.inflight_hits)
                              if self.misses + self.inflight_hits else float("nan")),
                "distinct_experts_per_layer": per_layer,
                "distinct_experts_mean": sum(per_layer) / len(per_layer) if per_layer else 0.0,
                "distinct_experts_per_forward": (sum(self.forward_distinct) / len(self.forward_distinct)
                                                 if self.forward_distinct else float("nan"))}


@dataclass
class Routed:
    """A layer's routing grouped on the device before its experts call, by whoever ran the
    router (verification's router piece, decoding/verify_pieces.py, captured with it): the
    call reads the groups' counts (its one host read) and skips the launches that made them,
    and leaves the sum to the caller (a later piece): it returns the per-rank products
    [k T, H] (`LayerSum.parts`) and says so in `deferred`."""

    index: torch.Tensor  # the top_k_index the experts call gets
    counts: torch.Tensor  # grouping.route_order's
    pos: torch.Tensor
    token: torch.Tensor
    made: tuple  # LayerSum.make's
    deferred: bool = False


@dataclass(frozen=True)
class Layer:
    """One call of a MoE layer's routed experts: its inputs and its routing, grouped on the host
    once (`groups`, specter/grouping.py)."""

    l: int
    module: nn.Module
    hidden: torch.Tensor  # [T, H]
    top_k_index: torch.Tensor  # [T, k]
    top_k_weights: torch.Tensor  # [T, k]
    groups: object  # grouping.ExpertGroups
    made: tuple | None = None  # its sum's device tensors made already (`Routed.made`)

    def expert(self, e: int, views: tuple[torch.Tensor, torch.Tensor], serial: bool = False):
        """Expert `e` over its tokens from the (gate_up, down) `views`: (token_idx, out)."""
        return expert_output(self.hidden, self.groups.of(e), self.top_k_weights, *views,
                             self.module._apply_gate, serial)


class Rounds:
    """Verification's experts in rounds of one fixed-launch kernel each (`kernel`, one of
    offload/grouped.py KERNELS) while the misses stream in: every miss's copy is issued before
    anything computes. The default wherever a kernel runs without a host sync.

    A way of computing a layer (this and `OneByOne`) answers three questions of the one path
    in `OffloadRuntime.experts_forward`: `start` (the layer's empty sum), `picker` (the batch
    rule of the cache's stream: offload/cache.py `ExpertCache.stream`) and `run` (a ready
    batch's compute); `add` and `result` place the host's experts and finish the sum."""

    serial, overlap = False, True

    # A layer's copies in flight (prefetches and misses) compute in this many rounds: each
    # round's experts compute while the next round's copies land (one round: every expert waits
    # for the last copy; one per expert: the most overlap, and about 10 launches per expert).
    MISS_ROUNDS = 2

    def __init__(self, kernel: str):
        self.kernel = kernel

    def start(self, layer: Layer) -> LayerSum:
        """The layer's sum, empty."""
        return LayerSum(layer.hidden, layer.top_k_index, layer.groups, layer.top_k_weights,
                        layer.made)

    def picker(self, todo: list[int]) -> Picker:
        """The batch rule for the layer's stream (offload/cache.py `ExpertCache.stream`) over
        `todo` (hits, then misses): whatever has landed (no wait; a chunk of it while misses
        wait for the slots it frees), else the next chunk of copies in issue order
        (prefetches still in flight, then the misses: MISS_ROUNDS chunks of them), so a chunk
        computes while the next one's copies land."""
        chunk = max(1, -(-len(todo) // self.MISS_ROUNDS))

        def pick(cache: ExpertCache, l: int, todo: list[int], waiting: list[int]):
            resident = [e for e in todo if cache.resident(l, e)]
            if not resident:
                raise RuntimeError(f"layer {l}: no slot can be freed for expert {todo[0]}")
            landed = [e for e in resident if cache.landed(l, e)]
            return ((landed[:chunk] if waiting else landed) or
                    sorted(resident, key=lambda e: cache.issued(l, e))[:chunk]), waiting
        return pick

    def run(self, clock, cache: ExpertCache, layer: Layer, batch: list[int],
            total: LayerSum) -> None:
        """One round: the batch's slots in one `grouped_products` call, charged as one (the
        clock follows the engine); a staged expert (beyond the slots) on its own. Host work
        per round, not per expert: one upload, no host read."""
        l, groups, slot_of = layer.l, layer.groups, {}
        for e in batch:
            s = cache.slot(l, e)
            if s is None:  # a staging buffer (beyond the slots): on its own
                clock.expert(groups.counts[e])
                _, out = layer.expert(e, cache.weights(l, e))
                total.place(*groups.of(e), out)
            else:
                slot_of[e] = s
        if slot_of:
            clock.grouped_experts([groups.counts[e] for e in slot_of])
            grouped_products(self.kernel, groups, slot_of, cache.slot_buffers(l),
                             layer.module._apply_gate, total)

    @staticmethod
    def add(total: LayerSum, layer: Layer, experts: list[int], outs: list[torch.Tensor]) -> None:
        """Every host-computed expert's products placed at once."""
        if experts:
            pairs = [layer.groups.of(e) for e in experts]
            total.place(*(torch.cat(t) if len(t) > 1 else t[0] for t in zip(*pairs)),
                        torch.cat(outs) if len(outs) > 1 else outs[0])

    @staticmethod
    def result(total: LayerSum, layer: Layer) -> torch.Tensor:
        return total.result()


class OneByOne:
    """Verification's experts one at a time, one GEMM per expert and projection, each after its
    own copy: offload.grouped=false, and the runtime's two ablations, `serial` (one GEMV per
    (token, expert), no grouping) and overlap off (serial demand loading: each miss is copied
    only when its turn comes and waited for before anything else computes)."""

    kernel = None

    def __init__(self, serial: bool = False, overlap: bool = True):
        self.serial, self.overlap = serial, overlap

    def start(self, layer: Layer) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """(token_idx, weighted out) per expert, filled in `hits + misses` order."""
        return {}

    def picker(self, todo: list[int]) -> Picker:
        return self.pick

    def pick(self, cache: ExpertCache, l: int, todo: list[int], waiting: list[int]):
        """The next expert alone; not resident: the misses still waiting are copied first
        (overlap off: only this one, now)."""
        e = todo[0]
        if not cache.resident(l, e):
            waiting = cache.issue(l, waiting) if self.overlap else cache.issue(l, [e])
            if not cache.resident(l, e):
                raise RuntimeError(f"layer {l}: no slot can be freed for expert {e}")
        return [e], waiting

    def run(self, clock, cache: ExpertCache, layer: Layer, batch: list[int], outs: dict) -> None:
        (e,) = batch
        n = layer.groups.counts[e]
        for _ in range(n if self.serial else 1):
            clock.expert(1 if self.serial else n)
        outs[e] = layer.expert(e, cache.weights(layer.l, e), self.serial)

    @staticmethod
    def add(outs: dict, layer: Layer, experts: list[int], back: list[torch.Tensor]) -> None:
        outs.update({e: (layer.groups.of(e)[1], out) for e, out in zip(experts, back)})

    @staticmethod
    def result(outs: dict, layer: Layer) -> torch.Tensor:
        return sum_in_expert_order(layer.hidden, outs, layer.groups.needed)


def verification(device: torch.device, dtype: torch.dtype, grouped: bool | str = "auto",
                 serial: bool = False, overlap: bool = True) -> Rounds | OneByOne:
    """How verification computes a layer's resident experts, chosen once: in rounds of the
    fixed-launch kernel (`Rounds`) or one expert at a time (`OneByOne`: offload.grouped=false
    and the ablations `serial` and overlap off). `grouped`: "auto" = `pick_kernel`'s choice for
    the device and dtype (the fused round where it runs), True = grouped_mm required (refused
    where it would sync), "padded"."""
    if serial or grouped is False or not overlap:
        return OneByOne(serial, overlap)
    if grouped is True:
        if pick_kernel(device, dtype, fused=False) != "grouped_mm":
            raise UserError(f"offload.grouped=true, but torch's grouped GEMM does not run "
                            f"{dtype} on {device} without a host sync (specter/offload/"
                            "grouped.py): use offload.grouped=auto.")
        return Rounds("grouped_mm")
    return Rounds("padded" if grouped == "padded" else pick_kernel(device, dtype))


class OffloadRuntime:
    """Routed experts in host memory, `slots` per layer on the device, every forward through
    `experts_forward`. Built complete: `compute` (a `Rounds` or `OneByOne`, `verification`)
    says how a layer's experts compute; `host_misses`: a miss whose host computation (host
    rates, activations over the link) would end before its copy would land and compute is
    computed on the host from its host copy, never admitted (Fiddler's rule; `rates`, the cost
    model that decides: the virtual clock's, or on a real clock a profile's, never charged);
    `host_all` (system=host_experts): every routed expert computed on the host, none ever
    copied (the cache has no slots: `HostPath.layer_sum`)."""

    def __init__(self, model: nn.Module, cache: ExpertCache, link: Link, cost: CostModel | None,
                 prefetcher: LayerPrefetcher | None = None, *,
                 compute: Rounds | OneByOne | None = None, rates: CostModel | None = None,
                 host_misses: bool = False, host_all: bool = False):
        self.model, self.cache, self.link, self.cost = model, cache, link, cost
        # the steps this runtime runs itself, charged where there is a cost model
        self.clock = runtime_clock(link, cost)
        self.device = next(model.parameters()).device
        self.prefetcher = prefetcher
        self.compute = compute or verification(self.device, cache.layout.dtype)
        self.rates = rates or cost
        self.host_compute, self.host_all = host_misses, host_all
        self.stats = DemandStats()  # an observer of the loop's forwards: engines list it
        self.routed: Routed | None = None  # the next call's routing, grouped by its caller
        self.modules = [m for _, m in experts_modules(model)]
        # the host's side: which experts it computes, its jobs and compute copies
        self.host = HostPath(cache, link, self.rates, self.stats, device=self.device,
                             layers=len(self.modules), misses=host_misses, every=host_all,
                             serial=self.compute.serial)
        for l, m in enumerate(self.modules):
            m._specter_moe_layer = l
            # The fused copies are already gone: the store (store.py) took every expert.
            assert m.gate_up_proj.numel() == 0, "build the HostExpertStore before the runtime"
        experts = experts_of(model)  # the target seat of the one dispatcher (specter/experts.py)
        experts.target, experts.runtime = self.experts_forward, self

    @property
    def takes_routed(self) -> bool:
        """Whether a caller may hand the next call its routing grouped (`routed`)."""
        return isinstance(self.compute, Rounds) and not self.host_all

    @property
    def serial(self) -> bool:
        return self.compute.serial

    @property
    def overlap(self) -> bool:
        return self.compute.overlap

    def reset(self) -> None:
        self.cache.reset()
        self.stats.clear()
        if self.host.weights is not None:
            self.host.weights.reset_stats()
        self.link.reset_stats()

    @torch.no_grad()
    def experts_forward(self, l: int, module: nn.Module, hidden: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], top_k_index / top_k_weights [T, k] -> [T, H]: route, demand, host,
        copy, compute, sum."""
        cache = self.cache
        routed, self.routed = self.routed, None
        if routed is not None and (routed.index is not top_k_index or not self.takes_routed):
            routed = None
        self.clock.router(hidden.shape[0])  # the router that just ran
        self.clock.offload_layer(hidden.shape[0])  # this method's own host work
        if self.host_all:  # every expert on the host (one job), the routing grouped there
            groups = group_by_expert(top_k_index.to(torch.device("cpu")),
                                     cache.store.layout.num_experts)
            self.stats.host_layer(l, groups, tuple(top_k_index.shape))
            return self.host.layer_sum(module, l, hidden, groups, top_k_weights)
        # 1. Route: the layer's one host read (residency is a host decision: specter/grouping.py).
        groups = (read_groups(routed.counts, routed.pos, routed.token) if routed is not None
                  else group_by_expert(top_k_index, cache.store.layout.num_experts))
        layer = Layer(l, module, hidden, top_k_index, top_k_weights, groups,
                      routed.made if routed is not None else None)
        needed = layer.groups.needed
        # 2. Demand: hits stay, misses are admitted (never evicting a needed expert).
        hits, misses = cache.split(l, needed)
        self.stats.demand(l, groups, tuple(top_k_index.shape), hits, cache)
        # 3. Host: misses, and prefetches still in flight, the host would finish sooner.
        host = self.host.choose(layer, hits, misses)
        if host:
            misses = [e for e in misses if e not in host]
            hits = [e for e in hits if e not in host]
        jobs = [self.host.expert_job(layer, e) for e in host]
        cache.protect(l, needed)  # needed (an in-flight one the host computes too): never evicted
        cache.release_holds(l)  # the router has decided: plans for this layer stop holding slots
        # 4. Copy: the misses' copies issued together (those that found no slot yet wait; overlap
        # off: none yet, each is copied when its turn comes), the layer prefetcher's
        # speculative loads for later layers behind them.
        waiting = cache.issue(l, misses) if self.compute.overlap else []
        if self.prefetcher is not None:
            self.prefetcher.after_demand(self, l, hidden, top_k_index, top_k_weights)
        # 5. Compute: the cache streams ready batches (resident first while the misses land),
        # each computed the chosen way (`Rounds`, `OneByOne`); then the host's experts.
        way, part = self.compute, self.compute.start(layer)
        for batch in cache.stream(l, hits + misses, waiting, way.picker(hits + misses)):
            way.run(self.clock, cache, layer, batch, part)
        self.compute.add(part, layer, host, [self.link.wait_host(job).to(hidden.device)
                                             for job in jobs])
        for e in host:
            cache.unprotect(l, e)
        # 6. Sum in expert-id order, as HF's eager loop does (bitwise-equal outputs), or leave
        # the sum to the caller (`Routed`: its next piece sums them the same way).
        if routed is not None:
            routed.deferred, final = True, part.parts
        else:
            final = self.compute.result(part, layer)
        cache.release_staged(l)  # staging buffers serve one forward of their layer
        cache.end_forward(l)  # later copies into this layer's slots wait for these reads only
        return final

    def kernel(self) -> str | None:
        """The fixed-launch kernel (offload/grouped.py KERNELS) a layer's resident experts
        compute with, in rounds (`Rounds`); None: one GEMM per expert and projection
        (`OneByOne`)."""
        return self.compute.kernel

    def grouping(self) -> bool:
        """Whether a layer's resident experts compute in fixed-launch rounds (`kernel`)."""
        return self.kernel() is not None

    def as_record(self) -> dict:
        """This request's demand statistics, and the host's converted copies when it had some
        (`host_ready_hits`: host jobs that found their expert converted already;
        `host_prepares`: conversions the draft's lookahead queued)."""
        rec = self.stats.as_record()
        w = self.host.weights
        rec["host_ready_hits"] = w.ready_hits if w is not None and not w.same else 0
        rec["host_prepares"] = w.prepares if w is not None and not w.same else 0
        rec["grouped_experts"] = self.grouping()
        rec["experts_kernel"] = self.kernel() or "loop"
        return rec

    def prefetch(self, layer: int, experts, count: bool = True) -> int:
        """Load `experts` of MoE layer `layer` that are not resident, in order, while a slot
        can be freed (never evicting an expert the current forward needs); returns how many
        copies were issued. `count`: add them to this request's `layer_prefetches` statistic when
        the target's demand is being recorded (not during prefill or drafting)."""
        issued = 0
        for e in experts:
            if not self.cache.resident(layer, e) and self.cache.load(layer, e) is not None:
                issued += 1
        if count and self.stats.counting:
            self.stats.layer_prefetches += issued
        return issued
