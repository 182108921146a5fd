"""`system=transformers`: Hugging Face `generate` with accelerate's offloading of the experts.

The peers' own code path, not ours: decoding is `model.generate(do_sample=False)` with the
model's stock experts implementation, and the offloaded experts are moved by accelerate's
`AlignDevicesHook(offload=True)`, which copies a module's weights from a CPU state dict to
the execution device before every forward and drops them after (accelerate 1.15,
hooks.py). That hook is what `dispatch_model` / `from_pretrained(device_map=...)` attach to
every module a device map sends to "cpu"; it is attached here directly because
`dispatch_model` offloads nothing when the main device is the CPU itself.

What stays on the device is what `device_map="auto"` with `max_memory` = the budget's GiB
keeps: whole experts modules, first layers first (accelerate fills the device in module
order). The GiB is the run's `budget.gb`, else the paper's reference GiB of the named budget
(`model.budget_gb`: DeepSeek 24/18, Qwen 20/16, Phi 40/32); after the non-expert weights, the
KV cache and the reserve it holds `whole_layers` experts modules of the real model's bytes
(specter/budget.py `resolve_gb`; no INT4 draft is charged: this system has none). Only
without a reference GiB does it fall back to the slots' bytes, `floor(slots * L / E)` layers.
The rest are offloaded. In transformers 5.x a layer's routed experts are ONE module with
fused 3D weights, so accelerate's hook copies all E experts of an offloaded layer on every
forward, prefill and decode alike; the engine measures the bytes each hook really copies and
records what moved (`accelerate_moves`: all experts of the layer, or fewer).

Time. Under the virtual and emulated clocks every offloaded forward pays its weights on the
same link as every other system: one transfer of the layer's charged bytes, waited for at
once (accelerate's copy is synchronous: nothing is hidden). With the real model's sizes
charged, the bytes of the real model's offloaded layers are spread over the modelled
offloaded layers, so a token moves what the real model would. On CUDA the copies are real;
they are timed with events around accelerate's pre-forward.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from specter.budget import Footprint
from specter.decoding.batch import DeviceMemory, Generation, eos_ids, pad_id
from specter.errors import UserError
from specter.models.introspect import experts_modules
from specter.clock.timing import Timing, timing_for
from specter.offload.build import refuse_wall_clock_offload


def resident_layers(slots: int, num_experts: int, moe_layers: int) -> int:
    """Whole experts modules the budget holds: `slots * moe_layers` expert slots in all."""
    return min(moe_layers, slots * moe_layers // num_experts)


def _accelerate():
    try:
        from accelerate.hooks import AlignDevicesHook, ModelHook, add_hook_to_module
    except ImportError as e:  # pinned in pyproject; say so rather than trace back
        raise UserError("system=transformers needs the accelerate package "
                        "(pip install -e . installs the pinned version).") from e
    return AlignDevicesHook, ModelHook, add_hook_to_module


class _ClockStreamer:
    """`generate`'s streamer: the first `put` is the prompt, each later one a committed token;
    stamps each token with a mark of the clock (read as seconds after the request: no device
    wait per token). `on_commit` (one request only: `generate`'s) hears each token as it is
    put (a tensor `generate` already read to the host), up to and including its first `stop`
    token, so its calls add up to the request's `Generation.tokens`."""

    def __init__(self, clock, on_commit=None, stop=()):
        self.clock, self.times, self.prompt_seen = clock, [], False
        self.on_commit, self.stop = on_commit, stop

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(self.clock.mark())
        if self.on_commit is not None:
            token = int(value.reshape(-1)[0])
            self.on_commit([token])
            if token in self.stop:  # (a batch of one ends here; nothing after it is a token)
                self.on_commit = None

    def end(self) -> None:
        pass


class TransformersOffloadEngine:
    speculates = samples = False  # greedy only
    batches = True  # generate's own batching: left padding, finished rows fed padding
    compiled: dict = {}  # nothing compiled
    name = "transformers"

    def __init__(self, model: nn.Module, device: torch.device, timing: Timing, slots: int,
                 stop_on_eos: bool = True, whole_layers: int | None = None,
                 whole_layers_of: int | None = None):
        """`whole_layers` of `whole_layers_of` MoE layers (the bytes' model) fit the budget's
        GiB; None: derive whole layers from `slots`."""
        AlignDevicesHook, ModelHook, add_hook_to_module = _accelerate()
        self.model, self.device, self.timing = model, device, timing
        self.link = timing.link
        self.real_clock = timing.kind.real and device.type == "cuda"  # copies timed by events
        self.stop_on_eos = stop_on_eos
        moe = experts_modules(model)
        num_experts = moe[0][1].gate_up_proj.shape[0]
        if whole_layers is None:
            self.n_resident = resident_layers(slots, num_experts, len(moe))
        else:  # the same share of this model's layers as of the bytes' model
            self.n_resident = len(moe) * whole_layers // whole_layers_of
            if whole_layers < whole_layers_of:  # something is offloaded: so is one modelled layer
                self.n_resident = min(self.n_resident, len(moe) - 1)
        self.whole = (whole_layers, whole_layers_of)
        offloaded = [m for _, m in moe[self.n_resident:]]
        self.n_offloaded = len(offloaded)
        self.layer_expert_bytes = sum(p.numel() * p.element_size() for p in moe[0][1].parameters())
        self.bytes_per_move = self._charged_layer_bytes(num_experts, slots, len(moe))
        self.moved_bytes = 0  # real bytes accelerate copied (this machine's tensors)
        self.moves = 0  # hook copies (offloaded layer forwards)
        self.cuda_copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._pending: torch.cuda.Event | None = None
        engine = self

        class MarkCopied(ModelHook):
            """Runs right after accelerate's pre-forward, i.e. once the weights are there."""

            def pre_forward(self, module, *args, **kwargs):
                engine._copied(module)
                return args, kwargs

        for m in offloaded:
            weights = {name: t.detach().to("cpu") for name, t in m.state_dict().items()}
            add_hook_to_module(m, AlignDevicesHook(execution_device=device, offload=True,
                                                   weights_map=weights))
            add_hook_to_module(m, MarkCopied(), append=True)
            # Before every other pre-hook (the compute clock's): the copy comes first.
            m.register_forward_pre_hook(self._before_copy, prepend=True)
        self.memory = DeviceMemory(model, device)  # offloaded experts are on "meta" now
        self.clock = timing.observer(model, charge_experts=True)
        model.register_forward_pre_hook(self._begin_forward, with_kwargs=True)

    def _charged_layer_bytes(self, num_experts: int, slots: int, moe_layers: int) -> int:
        """Link bytes charged per offloaded layer forward on a modelled clock."""
        cost = self.timing.cost
        if cost is None or self.n_offloaded == 0:
            return 0
        real_layers = round(cost.sizes.moe_multiplier * moe_layers)
        whole, of = self.whole
        if whole is not None and of == real_layers:  # the GiB's layers are the charged model's
            real_offloaded = real_layers - whole
        elif whole is not None:  # charged sizes of another model: the same offloaded share
            real_offloaded = round(real_layers * (of - whole) / of)
        else:
            real_offloaded = real_layers - resident_layers(slots, num_experts, real_layers)
        per_real_layer = num_experts * cost.sizes.expert_bytes
        return int(round(real_offloaded * per_real_layer / self.n_offloaded))

    # -- hooks -------------------------------------------------------------------------
    def _begin_forward(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache")
        rows, tokens = ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        self.clock.begin_forward(tokens, past + tokens, prefill=past == 0, rows=rows)

    def _before_copy(self, module, args) -> None:
        if self.real_clock:
            self._pending = torch.cuda.Event(enable_timing=True)
            self._pending.record()
        elif self.bytes_per_move:
            # One transfer of the layer's charged bytes on the shared link, waited for now.
            t = self.link.copy(self._scratch_dst, self._scratch_src, nbytes=self.bytes_per_move)
            self.link.wait(t)

    def _copied(self, module) -> None:
        self.moved_bytes += sum(p.numel() * p.element_size() for p in module.parameters())
        self.moves += 1
        if self._pending is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.cuda_copies.append((self._pending, end))
            self._pending = None

    _scratch_src = torch.zeros(1)
    _scratch_dst = torch.zeros(1)

    # -- engine protocol ---------------------------------------------------------------
    def seed_requests(self, seeds: list[int]) -> None:
        """Greedy decoding draws nothing."""

    def reset(self) -> None:
        """Nothing resident changes between requests; statistics cleared."""
        self.link.synchronize()
        self.link.reset_stats()
        self.moved_bytes = 0
        self.moves = 0
        self.cuda_copies = []

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 on_commit=None) -> Generation:
        """One request; `on_commit(tokens)` hears each token as `generate` commits it (the
        `Engine` protocol), one `[token]` per decoding step, from the streamer `generate`
        already feeds (`_ClockStreamer`)."""
        if on_commit is None:  # through generate_batch, as ever (a measurement may wrap it)
            return self.generate_batch([prompt_ids], max_new_tokens)[0]
        return self._decode([prompt_ids], max_new_tokens, on_commit)[0]

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[Generation]:
        """`generate` over the batch, left-padded with an attention mask as a user of
        transformers would batch; as `generate` does, a finished row keeps being computed
        (fed padding) until every row is done. Each row's output ends at its stop token."""
        return self._decode(prompts, max_new_tokens)

    @torch.no_grad()
    def _decode(self, prompts: list[list[int]], max_new_tokens: int,
                on_commit=None) -> list[Generation]:
        """`generate_batch`; `on_commit` (a batch of one: `generate`'s) hears each token."""
        gc = copy.deepcopy(self.model.generation_config)
        gc.do_sample, gc.max_new_tokens, gc.min_new_tokens = False, max_new_tokens, None
        gc.temperature = gc.top_p = gc.top_k = None
        stop = sorted(eos_ids(self.model)) if self.stop_on_eos else []
        gc.eos_token_id = stop or None
        gc.pad_token_id = pad_id(self.model)
        gc.return_dict_in_generate = True
        self.memory.start()
        streamer = _ClockStreamer(self.link, on_commit, set(stop))
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[gc.pad_token_id] * (width - len(p)) + list(p) for p in prompts],
                           device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)
        start = self.link.mark()
        out = self.model.generate(input_ids=ids, attention_mask=mask,
                                  generation_config=gc, streamer=streamer)
        assert len(streamer.times) == out.sequences.shape[1] - width, \
            "the streamer saw every decoding step"
        times = [self.link.timestamp(m) for m in streamer.times]
        start = self.link.timestamp(start)
        self.memory.observe_cache(out.cache)
        peak, source = self.memory.peak()
        per_move = self.moved_bytes / self.moves if self.moves else 0.0
        shared = {**self.timing.link_record(),
                  "resident_expert_layers": self.n_resident,
                  "offloaded_expert_layers": self.n_offloaded,
                  "accelerate_moved_bytes": self.moved_bytes,
                  "accelerate_moves": self.moves,
                  # measured: what one hook copy moved, against the layer's experts
                  "accelerate_moves_what": ("-" if not self.moves else
                                            "all experts of the layer"
                                            if per_move >= self.layer_expert_bytes
                                            else "routed experts only"),
                  "transformers_charged_bytes_per_move": self.bytes_per_move}
        if self.real_clock:
            shared.update(self._cuda_copy_record())
        gens = []
        for row in out.sequences[:, width:].tolist():
            tokens = row
            for i, t in enumerate(row):  # after its stop token a row holds padding
                if t in stop:
                    tokens = row[:i + 1]
                    break
            gen = Generation(tokens=tokens, commit_times_s=times[:len(tokens)],
                             start_time_s=start, peak_mem_bytes=peak, peak_mem_source=source)
            gen.stats.update(shared)
            gens.append(gen)
        return gens

    def _cuda_copy_record(self) -> dict:
        if self.cuda_copies:  # after the request: the compute stream's last copy event
            self.cuda_copies[-1][1].synchronize()
        h2d_s = sum(a.elapsed_time(b) for a, b in self.cuda_copies) / 1e3
        return {"n_transfers": len(self.cuda_copies), "h2d_bytes": self.moved_bytes,
                "h2d_ms": h2d_s * 1e3, "exposed_wait_ms": h2d_s * 1e3,  # synchronous copies
                "h2d_hidden_frac": 0.0 if self.cuda_copies else math.nan}


def build(job) -> TransformersOffloadEngine:
    timing = timing_for(job)  # before any hook: the emulated clock calibrates on the model
    refuse_wall_clock_offload(timing.kind, job.device, job.budget.slots,
                              job.loaded.spec.num_experts)
    return TransformersOffloadEngine(job.loaded.model, job.device, timing, job.budget.slots,
                                     stop_on_eos=job.stop_on_eos,
                                     whole_layers=job.budget.whole_layers,
                                     whole_layers_of=job.budget.whole_layers_of)


ENGINE = TransformersOffloadEngine
FOOTPRINT = Footprint(whole_layers=True)  # accelerate's device map: whole experts modules
# accelerate offloads whole layers of a model loaded whole (its own path, as a user of
# transformers would run it): the device holds every expert while loading.
LOADS_EXPERTS = "device"
