"""The host CPU's side of offloading: its job queue and its compute copies of experts.

Owns: `HostQueue`, the host CPU's FIFO of expert jobs on a real clock (one daemon thread that
runs host-computed misses beside the device's compute and copies; a link holds one, and the
virtual link models the same queue on its own timeline, clock/observer.py `VirtualLink`), `HostJob`, one
job's handle, and `HostWeights`, which copy of an expert the host computes from. On a CPU run
the host computes in the store's own dtype from the store's own buffers (the same arithmetic as
the device: lossless). Beside a GPU the store holds fp16/bf16 and the host computes in fp32
(CPUs lack fast half-precision kernels): a converted copy is made on the host thread, kept
most-recent-first up to `capacity` experts, so an expert the host computes again is converted
once, and one the draft's lookahead predicts and the plan could not load is converted during
the draft (`prepare`), before verification needs it.
`HostPath` is the runtime's host side: which experts the host computes (Fiddler's rule) and
the jobs that compute them.
Does not own: the layer's demand (runtime.py), the link's clock (offload/link.py,
clock/observer.py `VirtualLink`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque

import torch

from specter.offload.mlp import expert_mlp, host_layer_sum
from specter.offload.store import HostExpertStore


def sleep_until(deadline: float) -> None:
    """Sleep (never spin: a spinning thread holds the GIL) until perf_counter >= deadline."""
    while (remaining := deadline - time.perf_counter()) > 0:
        time.sleep(remaining)


class HostJob:
    """Handle of one host-CPU expert job: `value` once `finished` (or `error`); `estimate_s`:
    its modelled seconds on this link's clock."""

    def __init__(self, estimate_s: float) -> None:
        self.start: float | None = None  # seconds on the link's clock, once known
        self.end: float | None = None
        self.estimate_s = estimate_s
        self.value = None
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def done(self) -> bool:
        # virtual jobs are finished at issue (their data); their time is `end`
        return self.finished.is_set()


class HostQueue:
    """The host CPU's FIFO of expert jobs on a real clock: one daemon thread runs each job's
    function (torch releases the GIL in its kernels, so it overlaps the launching thread),
    holding it to at least its `estimate_s` when the link's clock is emulated. The thread
    gets the queue and a counter, not the link, so a dropped link can be collected."""

    def __init__(self, hold: bool, busy: list[float]) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._queued: deque[HostJob] = deque()
        self._thread = threading.Thread(target=_host_loop, args=(self._jobs, hold, busy),
                                        name="specter-host-experts", daemon=True)
        self._thread.start()

    def submit(self, job: HostJob, fn) -> None:
        self._queued.append(job)
        self._jobs.put((job, fn))

    def pending_s(self) -> float:
        while self._queued and self._queued[0].done():
            self._queued.popleft()
        return sum(j.estimate_s for j in self._queued)

    def stop(self, join: bool = True) -> None:
        self._jobs.put(None)
        if join:
            self._thread.join()


def _host_loop(jobs: queue.SimpleQueue, hold: bool, busy: list[float]) -> None:
    while (item := jobs.get()) is not None:
        job, fn = item
        item = None
        job.start = time.perf_counter()
        try:
            job.value = fn()
        except Exception as exc:  # surfaced to the caller by wait_host
            job.error = exc
        fn = None
        if hold:
            sleep_until(job.start + job.estimate_s)
        job.end = time.perf_counter()
        busy[0] += job.end - job.start
        job.finished.set()
        job = None


class HostWeights:
    def __init__(self, store: HostExpertStore, dtype: torch.dtype, capacity: int):
        self.store, self.dtype, self.capacity = store, dtype, capacity
        self.same = dtype == store.layout.dtype  # compute from the store's buffers
        self._copies: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()  # the host thread converts while the decoder reads
        self._queued: set[tuple[int, int]] = set()  # conversions queued, not yet made
        self.ready_hits = 0  # host jobs whose converted copy was already there
        self.prepares = 0  # conversions queued ahead of need by the lookahead

    def get(self, l: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) of expert `e` of MoE layer `l` in the host's dtype (converting now
        if no copy is kept). Runs on the host thread, inside a host job."""
        views = self.store.layout.views(self.store.flat[l][e])
        if self.same:
            return views
        with self._lock:
            w = self._copies.get((l, e))
            if w is not None:
                self._copies.move_to_end((l, e))
                self.ready_hits += 1
                return w
        w = tuple(t.to(self.dtype) for t in views)
        with self._lock:
            self._copies[(l, e)] = w
            self._queued.discard((l, e))
            while len(self._copies) > self.capacity:
                self._copies.popitem(last=False)
        return w

    def prepare(self, link, l: int, e: int, seconds: float) -> bool:
        """Queue expert `e`'s conversion on the host thread (modelled `seconds` for the host
        queue's estimate); False when there is nothing to convert."""
        with self._lock:
            if self.same or (l, e) in self._copies or (l, e) in self._queued:
                return False
            self._queued.add((l, e))
        self.prepares += 1

        def convert() -> None:
            self.get(l, e)

        link.host(convert, seconds)
        return True

    def reset_stats(self) -> None:
        self.ready_hits = self.prepares = 0


class HostPath:
    """The host CPU's share of the target's routed experts, for the offload runtime: with
    `misses` (host-computed misses, Fiddler's rule) each miss, or expert still in flight,
    whose host job would end before its copy lands and computes (`choose`, `decide`; seconds
    from `rates`: the virtual clock's cost model, or a real clock's profile, never charged);
    with `every` (system=host_experts) every routed expert of a layer (`layer_sum`). Jobs run
    on the link's host queue (`HostQueue`, or the virtual link's timeline) from the host's
    compute copies (`HostWeights`, made on first use)."""

    def __init__(self, cache, link, rates, stats, *, device: torch.device, layers: int,
                 misses: bool, every: bool, serial: bool):
        self.cache, self.link, self.rates, self.stats = cache, link, rates, stats
        self.device, self.layers = device, layers
        self.misses, self.every, self.serial = misses, every, serial
        self.weights: HostWeights | None = None

    def choose(self, layer, hits: list[int], misses: list[int]) -> list[int]:
        """The experts of `layer` (the runtime's `Layer`) the host computes (`misses` only:
        `decide`), counted in the request's demand statistics."""
        if not self.misses:
            return []
        cache, l, counts = self.cache, layer.l, layer.groups.counts
        late = {e: cache.arrival(l, e) for e in hits if not cache.ready(l, e)}
        host = self.decide(misses, counts, late)
        if host and self.stats.counting:
            self.stats.host_experts += len(host)
            self.stats.host_tokens += sum(counts[e] for e in host)
        return host

    def decide(self, misses: list[int], tokens_of: dict[int, int],
               late: dict[int, float | None] | None = None) -> list[int]:
        """The experts the host computes: each expert still in flight (`late`: when its copy
        lands) whose host job would end before it lands and computes (the copy goes on and
        stays resident), then in order each miss whose host job (after the host's earlier
        jobs) would end before its copy (after the copies queued) lands and computes.
        Seconds from `rates` (the virtual clock's cost model, or a real clock's profile),
        scaled to the link's clock; on a real clock the queues are the link's estimates, read
        on the host's own clock (`host_now`: no device wait)."""
        if not misses and not any(t is not None for t in (late or {}).values()):
            return []  # nothing to decide
        rates, link = self.rates, self.link
        scale = link.time_scale
        now = link.host_now()
        host_free, copy_free = max(now, link.host_free()), max(now, link.copy_engine_free())
        copy_s = rates.transfer_s(rates.expert_transfer_bytes()) * scale
        chosen = []
        for e, lands in (late or {}).items():
            host_end = host_free + rates.host_expert_job_s(tokens_of[e]) * scale
            if lands is not None and host_end < lands + rates.expert_s(tokens_of[e]) * scale:
                chosen.append(e)
                host_free = host_end
        for e in misses:
            n = tokens_of[e]
            host_end = host_free + rates.host_expert_job_s(n) * scale
            if host_end < copy_free + copy_s + rates.expert_s(n) * scale:
                chosen.append(e)
                host_free = host_end
            else:
                copy_free += copy_s
        return chosen

    def layer_sum(self, module, l: int, hidden: torch.Tensor, groups,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        """Every routed expert of MoE layer `l` on the host (`every`): the weights and the T
        tokens' activations [T, H] down once each (beside a GPU: reads, the routing `groups`
        grouped on the host), each needed expert's weighted products summed on the host in
        expert-id order (as HF's eager loop sums: bitwise resident's on a CPU run), the sum
        [T, H] back once. One host job; the compute stream waits for it."""
        cpu, weights = torch.device("cpu"), self.weights_for()
        x = hidden.to(cpu, weights.dtype)  # beside a GPU: the activations' D2H (a sync)
        w = top_k_weights.to(cpu, weights.dtype)
        act, serial = module._apply_gate, self.serial

        def job() -> torch.Tensor:
            return host_layer_sum(x, groups, w, lambda e: weights.get(l, e), act, serial)

        seconds = self.rates.host_layer_job_s(list(groups.counts.values()), hidden.shape[0]) \
            if self.rates is not None else 0.0  # a real clock without a profile: the job's own time
        return self.link.wait_host(self.link.host(job, seconds)).to(hidden.device, hidden.dtype)

    def expert_job(self, layer, e: int) -> HostJob:
        """Expert `e` of `layer` queued on the host CPU from its host copy: the host job whose
        value is the weighted output [n, H] on the CPU. The host computes in the model's dtype
        on a CPU run (the same arithmetic as the device: lossless) and in fp32 beside a GPU
        (CPUs lack fast fp16/bf16 kernels; the tokens may then differ)."""
        pos, token_idx = layer.groups.of(e)
        cpu, weights = torch.device("cpu"), self.weights_for()
        x = layer.hidden[token_idx].to(cpu, weights.dtype)  # beside a GPU: the activations' D2H (a sync)
        w = layer.top_k_weights[token_idx, pos, None].to(cpu, weights.dtype)
        act, serial, l = layer.module._apply_gate, self.serial, layer.l

        def job() -> torch.Tensor:
            return expert_mlp(x, *weights.get(l, e), act, serial) * w

        return self.link.host(job, self.rates.host_expert_job_s(token_idx.numel()))

    def weights_for(self) -> HostWeights:
        """The host's compute copies: the model's dtype on a CPU run, fp32 beside a GPU (made
        once; converted copies kept for up to 4 experts per MoE layer: for DeepSeek-V2-Lite
        104 fp32 experts, 3.6 GB of host memory)."""
        if self.weights is None:
            store = self.cache.store
            # `every` computes each expert from the store's own dtype, as llama.cpp computes
            # from the stored format (fp32 copies of every expert would double the host's bytes)
            same = self.device.type == "cpu" or self.every
            dtype = store.layout.dtype if same else torch.float32
            self.weights = HostWeights(store, dtype, 4 * self.layers)
        return self.weights

    def prepare(self, l: int, experts) -> int:
        """The draft's lookahead: experts of MoE layer `l` the draft predicts that will not be
        resident are converted to the host's compute dtype now, on the host thread, so a host
        job for them at verification skips that pass (nothing to do on a CPU run)."""
        weights = self.weights_for()
        if weights.same or self.link.charged:  # the virtual host reads half precision
            return 0
        # one read of the half-precision copy and one write of the fp32 one
        seconds = 3 * self.cache.store.layout.nbytes / self.rates.hw.host_mem_bandwidth_Bps
        return sum(weights.prepare(self.link, l, e, seconds) for e in experts
                   if not self.cache.resident(l, e))
