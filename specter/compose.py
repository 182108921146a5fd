"""The composition root: settings in, the parts of a job out, checked in this order.

    cfg, device = settle(cfg, log)      # 1. no files: the system, batch, device, clock
    planned = plan(cfg, device, log)    # 2. no weights: checkpoint, sizes, placement, budget
    parts = build(planned, log)         # 3. the model loaded and placed, the system's engine

Both the library (`specter.load`, specter/api.py) and the benchmark runner
(experiments/runner.py) build their jobs through these three calls, so a model loads, a
budget resolves and an engine is built the same way for a user's prompt and for a row of a
table. Every check that can run before weights load runs in 1-2, each failure one sentence
(`UserError`): a system that cannot decode this way, a device torch does not see, a context
too long for the model, a kernel the device lacks, a checkpoint the device or the host cannot
hold (counted from the safetensors headers), a budget that cannot hold top-k.

Owns: the order of those checks, the placement plan, the byte checks before loading, the load
meter, the untimed warm-up request, and freeing a finished job.
Does not own: the settings (specter/settings.py, specter/config.py), the registry of systems
(specter/recipes.py), workloads and records (the harness: experiments/).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specter import budget as budget_mod
from specter.config import HardwareConfig, RunConfig, hardware_from_dict
from specter.errors import UserError
from specter.models.loading import (load_tokenizer, pick_dtype, read_max_positions,
                                    read_moe_shape, remote_code_note, resolve_checkpoint)
from specter.offload.build import WALL_CLOCK_OFFLOAD
from specter.offload.policy import policy_named
from specter.placement.bytes import size_text
from specter.placement.loader import LoadedModel, load_model
from specter.placement.plan import PlacementPlan
from specter.settings import CONF
from specter.specs import ClockSpec, DraftSpec, Files, Job, OffloadSpec
from specter.recipes import build_engine, check_system, depth_of, footprint, recipe


@dataclass(frozen=True)
class Planned:
    """A job checked without its weights: where they are, what they weigh, where each goes,
    and the budget's slots."""

    cfg: RunConfig  # hardware resolved (settle)
    device: torch.device
    checkpoint: Path
    n_experts: int
    top_k: int
    placement: PlacementPlan
    checkpoint_bytes: Any  # placement/bytes.py CheckpointBytes, from the headers
    budget: budget_mod.ResolvedBudget
    tokenizer: Any


@dataclass(frozen=True)
class Parts:
    """A built job: the model placed, the system's engine, the device's byte account, and the
    load's measurements (`load` columns)."""

    planned: Planned
    loaded: LoadedModel
    job: Job  # what the engine was built from
    engine: Any
    account: Any  # budget.py ByteAccount
    held: int  # resident expert slots per MoE layer
    load: dict


def job_of(cfg: RunConfig, loaded: LoadedModel, budget: budget_mod.ResolvedBudget,
           device: torch.device) -> Job:
    """The settings as the core's specs (specs.py): what one system's engine is built from."""
    from specter.models.zoo import default_cache_dir

    w = cfg.workload
    return Job(
        loaded=loaded, device=device, system=cfg.system, budget=budget,
        offload=OffloadSpec(slots=budget.slots, staging=budget.staging,
                            policy=cfg.offload.policy, grouped=cfg.offload.grouped,
                            verify_pieces=cfg.offload.verify_pieces),
        draft=DraftSpec(quant=cfg.quant, depth=depth_of(cfg), compile=cfg.spec.compile,
                        compile_backend=cfg.spec.compile_backend),
        clock=ClockSpec(hardware=cfg.hardware, model=cfg.model.name,
                        stands_for=cfg.model.stands_for),
        files=Files(cache_dir=Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir(),
                    data_dir=Path(cfg.data_dir) if cfg.data_dir else None, model=cfg.model,
                    model_seed=cfg.model_seed, progress=cfg.progress),
        rows=w.batch, temperature=w.temperature, positions=w.prompt_tokens + w.max_new_tokens,
        stop_on_eos=w.stop_on_eos, seed=cfg.seed)


def settle(cfg: RunConfig, log=print) -> tuple[RunConfig, torch.device]:
    """Step 1, before any file is read or written: the system decodes this way (greedy or
    sampled, one request or a batch), the device exists, and `hardware=auto` without a GPU
    takes its virtual clock."""
    check_system(cfg.system, cfg.workload.temperature)
    check_batch(cfg)
    policy_named(cfg.offload.policy)
    device = resolve_device(cfg.hardware.device)
    return resolve_auto_hardware(cfg, device, log), device


def plan(cfg: RunConfig, device: torch.device, log=print) -> Planned:
    """Step 2, before any weight loads: the checkpoint (a project-made model is built on
    first use), the preflight, the placement, the bytes against the device and the host, the
    budget's slots, and the tokenizer."""
    checkpoint = resolve_checkpoint(cfg.model, Path(cfg.cache_dir) if cfg.cache_dir else None,
                                    cfg.model_seed, cfg.progress)
    note = remote_code_note(checkpoint)
    if note:
        log(f"[specter] {note}")
    n_experts, top_k = read_moe_shape(cfg.model, checkpoint)
    preflight(cfg, checkpoint, device, n_experts)
    placement = placement_of(cfg, device)  # where every tensor goes, decided once
    ckpt_bytes = checkpoint_fits(cfg, checkpoint, device, placement, log)
    w = cfg.workload  # the device holds the KV of a whole batch
    budget = budget_mod.resolve(cfg.budget, cfg.model, checkpoint, n_experts, top_k,
                                footprint(cfg.system),
                                kv_tokens=w.batch * (w.prompt_tokens + w.max_new_tokens),
                                group=cfg.quant.group, charged_real=charged_real(cfg))
    if device.type == "cpu" and placement.experts == "host":
        from specter.placement.bytes import check_cpu_offload_fits

        check_cpu_offload_fits(cfg.model.name, ckpt_bytes,
                               budget_mod.held_slots(budget, footprint(cfg.system)), n_experts,
                               host_bytes=host_with_held_store(),
                               fp32=pick_dtype(cfg.model, device, checkpoint) == torch.float32)
    return Planned(cfg, device, checkpoint, n_experts, top_k, placement, ckpt_bytes, budget,
                   load_tokenizer(checkpoint))


def build(planned: Planned, log=print, kv_tokens: int | None = None) -> Parts:
    """Step 3: the model loaded into its placement, the device's byte account
    (the KV of `kv_tokens` positions; None: a whole batch of the workload's longest
    requests), and the system's engine."""
    cfg, device = planned.cfg, planned.device
    torch.manual_seed(cfg.seed)
    # what the device holds before loading (the CUDA peak below starts from it): 0 when the
    # last job was freed
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else float("nan")
    meter = LoadMeter(device)
    loaded = load_model(cfg.model, device, Path(cfg.cache_dir) if cfg.cache_dir else None,
                        cfg.model_seed, cfg.progress, planned.placement)
    attn = loaded.model.config._attn_implementation
    meter.placed(loaded)
    spec = loaded.spec
    w, budget = cfg.workload, planned.budget
    if kv_tokens is None:
        kv_tokens = w.batch * (w.prompt_tokens + w.max_new_tokens)
    held = budget_mod.held_slots(budget, footprint(cfg.system))
    account = budget_mod.account(spec, held, kv_tokens)
    why = getattr(loaded.model.config, "_specter_attn_why", "")
    log(f"[specter] model={cfg.model.name} ({spec.arch}: {spec.num_experts} experts, "
        f"top-{spec.top_k}, {spec.num_moe_layers} MoE layers, attention {attn}: {why}) "
        f"system={cfg.system.name} budget={budget.name} "
        f"-> {held} slots/layer ({budget.rule}) device={device}")
    if budget.note:
        log(f"[specter] budget note: {budget.note}")
    if budget.accounting:
        log("[specter] budget in GiB:\n" + budget.accounting)
    log("[specter] device byte accounting:\n" + account.table(held, spec))
    built = job_of(cfg, loaded, budget, device)
    engine = build_engine(built)
    load = {**meter.done(), "load_base_device_bytes": base}
    log(f"[specter] loaded in {load['load_s']:.1f} s (ready in {load['setup_s']:.1f} s): "
        f"device peak {size_text(load['load_peak_device_bytes'])} "
        f"({load['load_peak_device_source']}), host peak "
        f"{size_text(load['load_peak_host_bytes'])} (process RSS)")
    return Parts(planned, loaded, built, engine, account, held, load)


def resolve_device(device: str, asked_by: str = "hardware",
                   instead: str = "hardware=cpu") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{asked_by} asks for a CUDA device but torch sees none; use {instead} "
                        "or install a CUDA build of torch.")
    if device not in ("cpu", "cuda"):
        raise UserError(f"hardware.device must be auto, cpu or cuda (got '{device}').")
    return torch.device(device)


HARDWARE_DIR = CONF / "hardware"


def load_hardware(name: str) -> HardwareConfig:
    """A hardware profile by name, from conf/hardware/<name>.yaml."""
    from omegaconf import OmegaConf  # as Hydra reads it (PyYAML reads "989.0e12" as a string)

    path = HARDWARE_DIR / f"{name}.yaml"
    if not path.is_file():
        options = ", ".join(sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml")))
        raise UserError(f"unknown hardware profile '{name}'; choose one of: {options}.")
    return hardware_from_dict(OmegaConf.to_container(OmegaConf.load(path)))


def resolve_auto_hardware(cfg: RunConfig, device: torch.device, log=print) -> RunConfig:
    """hardware=auto without a GPU: decoding systems run on the virtual clock of the fallback
    GPU profile (offloading needs a modelled link; one line says so)."""
    hw = cfg.hardware
    if (not hw.cpu_fallback or device.type != "cpu" or not hw.kind.real
            or cfg.system.name == "fidelity"):
        return cfg
    profile = dataclasses.replace(load_hardware(hw.cpu_fallback), device="cpu")
    if hw.host_matrix_flops > 0:  # host=NAME chose the host CPU's rates: they stay
        profile = dataclasses.replace(profile, host=hw.host, host_matrix_flops=hw.host_matrix_flops,
                                      host_mem_bandwidth_Bps=hw.host_mem_bandwidth_Bps)
    log(f"[specter] hardware={hw.name}: no GPU here, so time comes from the virtual clock of "
        f"hardware={profile.name} ({profile.engine} engine); hardware=cpu measures this CPU's "
        "wall-clock time instead.")
    return dataclasses.replace(cfg, hardware=profile)


WARMUP_TOKENS = 8  # enough for a decode step, and a draft window's steps, to run compiled


def warm_up(engine, cfg: RunConfig, prompt: list[int], log) -> float:
    """On a real clock, one untimed request before the timed ones: a compiled step
    (`spec.compile`, `system.compile`) compiles and captures there, and on a GPU every system
    pays its first request's one-off costs there (the H200's LRU paid 216 ms a token in its
    first timed request and 99 in its second, docs/measurements/h200-2026-12-04-inflated; not
    broken down), so no row's TPOT holds
    them and every system is timed warm alike. Its wall seconds: the `compile_warmup_s` column
    (0.0 when nothing ran)."""
    compiled, on_gpu = engine.compiled, engine.device.type == "cuda"
    if not cfg.hardware.kind.real or not (compiled.get("draft_compiled") or on_gpu
                                            or compiled.get("decode_compiled")):
        return 0.0
    began = time.perf_counter()
    engine.reset()
    if cfg.workload.temperature > 0:  # a sampling engine draws from a seeded generator
        engine.seed_requests([cfg.seed])
    engine.generate(prompt, min(cfg.workload.max_new_tokens, WARMUP_TOKENS))
    seconds = time.perf_counter() - began
    what = "compiled step" if (compiled.get("draft_compiled") or
                               compiled.get("decode_compiled")) else "engine"
    log(f"[specter] {what} warmed up in {seconds:.1f} s (an untimed request)")
    return seconds


def window_tokens(cfg: RunConfig) -> int:
    """The most positions one speculative window adds beyond the committed tokens (its
    verification block, K+1 at the deepest K the run's `Depth` allows); 0 for greedy systems."""
    depth = depth_of(cfg)
    return 0 if depth is None else depth.k_max + 1


def preflight(cfg: RunConfig, checkpoint: Path, device: torch.device, n_experts: int) -> None:
    """What can be checked before the weights load, each failure one sentence: the context
    length, knobs against the expert count, the draft kernel against the device, the charged
    sizes against the model, and that out_dir and the cache can be written."""
    positions = read_max_positions(checkpoint)
    w = cfg.workload
    spec = window_tokens(cfg)
    need = w.prompt_tokens + w.max_new_tokens + spec
    if positions is not None and need > positions:
        raise UserError(
            f"workload.prompt_tokens ({w.prompt_tokens}) + workload.max_new_tokens "
            f"({w.max_new_tokens})" + (f" + a speculative window of {spec}" if spec else "")
            + f" = {need} positions exceed model={cfg.model.name}'s {positions}; lower them.")
    top_m = getattr(cfg.system, "top_m", None)
    if top_m is not None and top_m > n_experts:
        raise UserError(f"system.top_m ({top_m}) exceeds model={cfg.model.name}'s {n_experts} "
                        "routed experts per layer.")
    if cfg.quant.backend in ("triton", "cuda_int4") and device.type != "cuda" \
            and footprint(cfg.system).int4_draft:
        raise UserError(f"quant.backend={cfg.quant.backend} needs a CUDA device (this run's is "
                        f"{device.type}); use quant.backend=auto, cpu_int4, gather_int4, "
                        "fused_int4 or reference.")
    if cfg.quant.graphs == "on" and device.type != "cuda" and footprint(cfg.system).int4_draft:
        raise UserError(f"quant.graphs=on replays CUDA graphs, and this run is on {device.type}; "
                        "use quant.graphs=auto or off.")
    charged_real(cfg)  # hardware.charge checked
    offloads = recipe(cfg.system.name).offloads
    if offloads and cfg.hardware.kind.real and device.type == "cpu" \
            and cfg.budget.name != "full" and not footprint(cfg.system).host_experts:
        raise UserError(f"system={cfg.system.name}: {WALL_CLOCK_OFFLOAD}")
    check_host_holds(cfg, checkpoint, device, n_experts)


def charged_real(cfg: RunConfig) -> bool:
    """Whether the run's clock charges the real model's sizes (a modelled clock; hardware.charge
    refused in one sentence where it names no real model)."""
    from specter.clock.timing import charges_real_sizes

    return cfg.hardware.kind.modelled and \
        charges_real_sizes(cfg.hardware.charge, cfg.model.name, cfg.model.stands_for)


MEMINFO = Path("/proc/meminfo")  # its MemAvailable: what `check_host_holds` counts against


def check_host_holds(cfg: RunConfig, checkpoint: Path, device: torch.device, n_experts: int,
                     meminfo: Path | None = None) -> list[tuple[str, int]]:
    """What the system will hold in host memory, counted from the checkpoint's headers (the
    published config's skeleton for random and inflated weights) before anything loads,
    against what the host has available: MemAvailable (`meminfo`, /proc/meminfo), within the
    memory cgroup's limit, plus a random store this process holds for the next job. Counted:
    the routed experts of a system that offloads them (the host store, as its pinned chunks
    take it on CUDA); on the CPU, where the device is the host, also the weights the device
    holds (the non-expert weights, a second instance's, a resident system's experts); and
    what the INT4 draft keeps there (placement/bytes.py `run_extras`: one MoE layer of it at
    a time, the backend's copy on the CPU, GPTQ's Hessians of one layer on the CPU). Not
    counted: the CPU's expert slots, which the budget resolves later
    (`check_cpu_offload_fits`). Returns the items; one sentence when they do not fit."""
    from specter.placement.bytes import cgroup_available_bytes, run_extras, store_reserved_bytes
    from specter.placement.loader import held_random_store_bytes

    b, dtype = header_bytes(cfg, checkpoint, device)
    element_size = torch.finfo(dtype).bits // 8
    plan, fp = placement_of(cfg, device), footprint(cfg.system)
    cpu = device.type == "cpu"
    items: list[tuple[str, int]] = []
    if plan.experts == "host":
        items.append(("the routed experts in the host store",
                      store_reserved_bytes(b, n_experts, pinned=plan.pin)))
    elif recipe(cfg.system.name).offloads or cpu:
        items.append(("the routed experts", b.expert_bytes))
    if cpu:
        items.append(("the non-expert weights", b.non_expert_bytes))
        if fp.second_instance:
            items.append(("the draft instance's non-expert weights", b.non_expert_bytes))
    hidden = json.loads((checkpoint / "config.json").read_text()).get("hidden_size") or 0
    q = cfg.quant
    items += run_extras(b, n_experts, hidden, element_size, device.type, draft=fp.int4_draft,
                        bits=q.bits, group=q.group, gptq=q.method == "gptq" and not q.path)[0]
    try:
        text = (meminfo or MEMINFO).read_text()
        available = next(int(line.split()[1]) * 1024 for line in text.splitlines()
                         if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return items  # no MemAvailable to count against (not Linux): the later checks stand
    why = "MemAvailable"
    cgroup = cgroup_available_bytes()
    if cgroup is not None and cgroup < available:
        available, why = cgroup, "what its memory cgroup's limit leaves"
    held = held_random_store_bytes()
    if held:
        available, why = available + held, why + ", and the random store it holds for this job"
    need = sum(v for _, v in items)
    if need > available:
        listing = ", ".join(f"{what} {size_text(v)}" for what, v in items)
        fp32 = cpu and dtype == torch.float32 and cfg.model.dtype != "float32"
        raise UserError(
            f"system={cfg.system.name} with model={cfg.model.name} needs {size_text(need)} "
            f"of host memory ({listing}) and this host has {size_text(available)} available "
            f"({why}): free memory or use a host with more"
            + (", or load in bfloat16 (model.dtype=bfloat16)." if fp32 else "."))
    return items


def host_with_held_store() -> int | None:
    """The host memory this job can have when the last job's random store is still held
    (placement/loader.py `_random_store`: this job reuses it or frees it before drawing its
    own, so its bytes count as available); None (the checks read the memory themselves)
    otherwise."""
    from specter.placement.bytes import host_memory_bytes
    from specter.placement.loader import held_random_store_bytes

    held = held_random_store_bytes()
    return host_memory_bytes() + held if held else None


def header_bytes(cfg: RunConfig, checkpoint: Path, device: torch.device):
    """(the checkpoint's bytes by kind, from its safetensors headers, or for random and
    inflated weights the published config's skeleton; the dtype they load in)."""
    from specter.placement.bytes import checkpoint_bytes

    dtype = pick_dtype(cfg.model, device, checkpoint)
    if cfg.model.weights in ("random", "inflated"):  # no headers: the skeleton's bytes
        from specter.models.loading import native_classes
        from specter.placement.loader import skeleton_bytes

        config, model_class = native_classes(checkpoint)
        return skeleton_bytes(model_class, config, dtype), dtype
    return checkpoint_bytes(checkpoint, torch.finfo(dtype).bits // 8), dtype


def checkpoint_fits(cfg: RunConfig, checkpoint: Path, device: torch.device,
                    plan: PlacementPlan, log):
    """From the safetensors headers alone, before any weight loads: the routed experts' bytes
    where `plan` puts them (the host, for a system that offloads them: on CUDA as the host
    store's pinned chunks take them) and the rest's (the device), each checked against what
    holds it, the host against the memory this process can have; the INT4 draft's copies and
    GPTQ's Hessians counted where they live (placement/bytes.py `run_extras`; returned in
    `host_extra` for the CPU offloading check). One sentence when they cannot fit."""
    from specter.placement.bytes import (check_fits, host_memory_bytes, run_extras,
                                         store_reserved_bytes)

    b, dtype = header_bytes(cfg, checkpoint, device)
    element_size = torch.finfo(dtype).bits // 8
    offloads = recipe(cfg.system.name).offloads
    n_experts, _ = read_moe_shape(cfg.model, checkpoint)
    hidden = json.loads((checkpoint / "config.json").read_text()).get("hidden_size") or 0
    q = cfg.quant
    host_extra, device_extra = run_extras(
        b, n_experts, hidden, element_size, device.type, draft=footprint(cfg.system).int4_draft,
        bits=q.bits, group=q.group, gptq=q.method == "gptq" and not q.path)
    b = dataclasses.replace(b, host_extra=host_extra)
    host = host_with_held_store()
    if device.type == "cuda":
        check_fits(cfg.model.name, b, offloads,
                   torch.cuda.get_device_properties(device).total_memory, host_bytes=host,
                   loads_whole=plan.experts == "device",
                   store_bytes=store_reserved_bytes(b, n_experts, pinned=True),
                   device_extra=device_extra)
    elif plan.experts == "device":  # the device is the host: it holds everything, extras too
        check_fits(cfg.model.name, b, experts_on_host=False,
                   device_bytes=host or host_memory_bytes(), device_extra=host_extra)
    # (on the CPU an offloading run is checked with its slots once the budget is resolved:
    # check_cpu_offload_fits, which counts b.host_extra)
    source = (f"{cfg.model.weights} weights: the published config's skeleton"
              if cfg.model.weights in ("random", "inflated") else f"{b.tensors} tensors' headers")
    log(f"[specter] checkpoint: routed experts {size_text(b.expert_bytes)} "
        f"({plan.experts}), the rest "
        f"{size_text(b.non_expert_bytes)} (device), from {source}")
    return b


def placement_of(cfg: RunConfig, device: torch.device) -> PlacementPlan:
    """The job's placement plan (specter/placement/plan.py) for its system: the routed
    experts in the host store (read from the safetensors files, the device never holding
    them) for a system that offloads them, on the device for a resident one and for one that
    offloads a model loaded whole (the transformers baseline: accelerate's hooks,
    `LOADS_EXPERTS`)."""
    from specter.placement.plan import plan_for

    r = recipe(cfg.system.name)
    return plan_for(r.offloads, r.loads_experts, device)


class LoadMeter:
    """Load time and the peaks from before loading to the first request: the CUDA allocator's
    peak on CUDA (on the CPU, the bytes of the parameters placed on the device: every tensor
    the loader put there), and the process's peak resident memory (the host). `load_s`: the
    weights; `setup_s`: to the first request (the draft's quantization or its reuse, the
    offloading's host store)."""

    def __init__(self, device: torch.device):
        self.device, self.t0 = device, time.perf_counter()
        self.device_bytes = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def placed(self, loaded) -> None:
        self.load_s = time.perf_counter() - self.t0
        if loaded.placed is not None:  # the loader's own account, tensor by tensor
            placed = loaded.placed.device_bytes
        else:
            placed = sum(p.numel() * p.element_size() for p in loaded.model.parameters()
                         if p.device.type == self.device.type)
        self.device_bytes = max(self.device_bytes, placed)

    def done(self) -> dict:
        import resource

        cuda = self.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(self.device) if cuda else self.device_bytes
        return {"load_s": self.load_s, "setup_s": time.perf_counter() - self.t0,
                "load_peak_device_bytes": int(peak),
                "load_peak_device_source": "cuda_allocator" if cuda else "device_tensors",
                "load_peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def check_batch(cfg: RunConfig) -> None:
    """workload.batch > 1 needs a system that decodes requests together."""
    if cfg.workload.batch > 1 and not recipe(cfg.system.name).batches:
        raise UserError(f"system={cfg.system.name} decodes one request at a time; use "
                        "workload.batch=1 with it.")


def free(error: BaseException | None = None) -> None:
    """Free what a finished job held: the frames of its exception's traceback (which would
    keep its model and engine alive while the error propagates), its reference cycles
    (modules, engines and their callbacks refer to each other: only a collection frees them),
    and, on CUDA, the allocator's cached blocks, so the device holds nothing of it."""
    import traceback

    if error is not None:
        traceback.clear_frames(error.__traceback__)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
