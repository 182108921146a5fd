"""The runner: one typed `RunConfig` in, parquet records out.

Owns: the order of a run (validate everything cheap first, so bad input fails before any
weights load or any file is written; then load, account bytes, and decode every
(request, repeat) not yet recorded), the columns of a record, and the console output.
Jobs share one process (a Hydra `-m` sweep calls `run` once per job): each job frees its
model, engine, slots and draft when it ends (`free_job`: gc, then CUDA's cached blocks), so
the next job's load-time device peak is its own; what the device held when a job began is
recorded (`load_base_device_bytes`). In-process rather than a process per job, so that the
host memory one sweep shares stays drawn: the last random host store
(specter/placement/loader.py `_LAST_RANDOM_STORE`: DeepSeek-V2-Lite's 27 GiB of experts, drawn,
pinned and checksummed once) is kept on purpose; the device keeps nothing of a finished job.
Does not own: Hydra (experiments/configs.py converts its config before `run`), systems (systems.py),
the record layout (records.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from experiments import records
from experiments.provenance import provenance
from experiments.registry import (BuildContext, build_engine, check_system, depth_of, footprint,
                                 recipe)
from specter import budget as budget_mod
from specter.config import HardwareConfig, RunConfig, hardware_from_dict
from specter.errors import UserError
from specter.metrics import distinct_n, timing
from specter.models.loading import (load_tokenizer, pick_dtype, read_max_positions,
                                    read_moe_shape, remote_code_note, resolve_checkpoint)
from specter.placement.bytes import size_text
from specter.placement.loader import load_model
from specter.placement.plan import PlacementPlan
from specter.models.routing_stats import checkpoint_record
from specter.models.zoo import build_id, default_cache_dir
from specter.offload.build import WALL_CLOCK_OFFLOAD
from specter.offload.counted import counted_host_costs
from specter.workloads import DATASETS, MIX, Workload, load_workload, truncate_prompt


@dataclass
class RunSummary:
    out_dir: Path
    case_id: str
    written: int
    skipped: int
    tpot_ms_mean: float


def resolve_device(kind: str, asked_by: str = "hardware",
                   instead: str = "hardware=cpu") -> torch.device:
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{asked_by} asks for a CUDA device but torch sees none; use {instead} "
                        "or install a CUDA build of torch.")
    if kind not in ("cpu", "cuda"):
        raise UserError(f"hardware.device must be auto, cpu or cuda (got '{kind}').")
    return torch.device(kind)


HARDWARE_DIR = Path(__file__).resolve().parents[1] / "conf" / "hardware"


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
    if not hw.cpu_fallback or device.type != "cpu" or hw.clock != "wall" or cfg.system.name == "fidelity":
        return cfg
    profile = dataclasses.replace(load_hardware(hw.cpu_fallback), device="cpu")
    if hw.host_matrix_flops > 0:  # host=NAME chose the host CPU's rates: they stay
        profile = dataclasses.replace(profile, host=hw.host, host_matrix_flops=hw.host_matrix_flops,
                                      host_mem_bandwidth_Bps=hw.host_mem_bandwidth_Bps)
    log(f"[specter] hardware={hw.name}: no GPU here, so time comes from the virtual clock of "
        f"hardware={profile.name} ({profile.engine} engine); hardware=cpu measures this CPU's "
        "wall-clock time instead.")
    return dataclasses.replace(cfg, hardware=profile)


def _workload(cfg: RunConfig) -> Workload:
    ds = cfg.dataset
    if ds.name == "custom":
        if not ds.prompts:
            raise UserError("dataset=custom needs prompts: pass dataset.prompts='[\"text\", ...]'.")
        return Workload(dataset="custom", source="command line", standin=False,
                        texts=tuple(ds.prompts[:cfg.workload.items]))  # the first `items`
    if ds.name not in DATASETS + (MIX,):
        raise UserError(f"unknown dataset '{ds.name}'; choose one of: "
                        f"{', '.join(DATASETS + (MIX, 'custom'))}.")
    data_dir = Path(cfg.data_dir) if cfg.data_dir else None
    return load_workload(ds.name, cfg.workload.items, data_dir)


def case_of(cfg: RunConfig, slots: int) -> dict[str, Any]:
    """What determines the measurement (not where it is written or how it is displayed)."""
    d = measured_config(cfg)
    for key in ("out_dir", "progress", "cache_dir", "data_dir"):
        d.pop(key)
    d["resolved_slots"] = slots
    if d["workload"]["batch"] == 1:  # one request at a time: the case of runs before batching
        del d["workload"]["batch"]
    if d["quant"]["path"] is None:  # quantized here: the case of runs before imports
        del d["quant"]["path"]
    if d["model"]["weights"] == "checkpoint":  # the case of runs before random weights
        del d["model"]["weights"]
    for key in ("inflate_from", "layers", "narrow"):  # the case of runs before inflated weights
        if d["model"][key] is None:
            del d["model"][key]
    if d["model"]["attn"] == "auto":  # resolved at load: the runner adds it unless sdpa
        del d["model"]["attn"]
    if d["quant"]["graphs"] == "auto":  # resolved with the draft: the runner adds it when on
        del d["quant"]["graphs"]
    if d["offload"]["grouped"] == "auto":  # the same timeline either way: runs before the knob
        del d["offload"]["grouped"]
    if "spec" in d and not d["spec"]["tune_own_k"]:  # the case of runs before the knob
        del d["spec"]["tune_own_k"]
    # spec.compile / system.compile: a setting (auto compiles where it can); the case holds
    # what was resolved (the runner adds `draft_compiled` / `decode_compiled` with the backend
    # when a step ran compiled), so an eager row is the case of runs before the knobs
    if "spec" in d:
        d["spec"].pop("compile")
        d["spec"].pop("compile_backend")
    d["system"].pop("compile", None)
    d["system"].pop("compile_backend", None)
    hw = d["hardware"]
    if not hw["expert_bits"] and not hw["attn_bits"]:  # unquantized: the case of runs before
        for key in ("expert_bits", "attn_bits", "quant_group"):
            del hw[key]
    for key, default in (("quant_meta_bytes", 4), ("attn_quant_group", 0)):
        if hw[key] == default or "expert_bits" not in hw:  # the case of runs before the knob
            del hw[key]
    return d


WARMUP_TOKENS = 8  # enough for a decode step, and a draft window's steps, to run compiled


def warm_up(engine, cfg: RunConfig, prompt: list[int], log) -> float:
    """On a real clock, one untimed request before the timed ones: a compiled step
    (`spec.compile`, `system.compile`) compiles and captures there, and on a GPU every system
    pays its first request's one-off costs there (the H200's LRU paid 216 ms a token in its
    first timed request and 99 in its second, docs/measurements/h200-2026-12-04-inflated; not
    broken down), so no row's TPOT holds
    them and every system is timed warm alike. Its wall seconds: the `compile_warmup_s` column
    (0.0 when nothing ran)."""
    compiled = getattr(engine, "compiled", {})
    on_gpu = getattr(getattr(engine, "device", None), "type", None) == "cuda"
    if cfg.hardware.clock != "wall" or not (compiled.get("draft_compiled") or on_gpu
                                            or compiled.get("decode_compiled")):
        return 0.0
    began = time.perf_counter()
    engine.reset()
    engine.generate(prompt, min(cfg.workload.max_new_tokens, WARMUP_TOKENS))
    seconds = time.perf_counter() - began
    what = "compiled step" if (compiled.get("draft_compiled") or
                               compiled.get("decode_compiled")) else "engine"
    log(f"[specter] {what} warmed up in {seconds:.1f} s (an untimed request)")
    return seconds


def measured_config(cfg: RunConfig) -> dict[str, Any]:
    """The run's configuration without settings its system does not read: a system that
    does not speculate has no `spec` (so a sweep over spec.k runs it once, and its rows do
    not claim a K)."""
    d = cfg.to_dict()
    if not recipe(cfg.system.name).ENGINE.samples:  # not speculative
        d.pop("spec")
    elif cfg.spec.k != "adaptive":  # the bound of adaptive K only
        d["spec"].pop("k_max")
    return d


def flatten(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = json.dumps(v)
        else:
            out[key] = v
    return out


def window_tokens(cfg: RunConfig) -> int:
    """The most positions one speculative window adds beyond the committed tokens (its
    verification block, K+1 at the deepest K the run's `Depth` allows); 0 for greedy systems."""
    depth = depth_of(cfg)
    return 0 if depth is None else depth.k_max + 1


def preflight(cfg: RunConfig, checkpoint: Path, device: torch.device, n_experts: int) -> None:
    """What can be checked before the weights load, each failure one sentence: the context
    length, knobs against the expert count, the draft kernel against the device, the charged
    sizes against the model, and that out_dir and the cache can be written."""
    from specter.offload.build import charges_real_sizes

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
                        f"{device.type}); use quant.backend=auto, cpu_int4, gather_int4 or "
                        "reference.")
    if cfg.quant.graphs == "on" and device.type != "cuda" and footprint(cfg.system).int4_draft:
        raise UserError(f"quant.graphs=on replays CUDA graphs, and this run is on {device.type}; "
                        "use quant.graphs=auto or off.")
    if cfg.hardware.clock in ("virtual", "emulated"):
        charges_real_sizes(cfg.hardware.charge, cfg.model.name, cfg.model.stands_for)
    offloads = getattr(recipe(cfg.system.name), "OFFLOADS", True)
    if offloads and cfg.hardware.clock == "wall" and device.type == "cpu" \
            and cfg.budget.name != "full" and not footprint(cfg.system).host_experts:
        raise UserError(f"system={cfg.system.name}: {WALL_CLOCK_OFFLOAD}")
    check_host_holds(cfg, checkpoint, device, n_experts)


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
    from specter.models.loading import native_classes
    from specter.placement.bytes import (cgroup_available_bytes, checkpoint_bytes, run_extras,
                                         store_reserved_bytes)
    from specter.placement.loader import held_random_store_bytes, skeleton_bytes

    dtype = pick_dtype(cfg.model, device, checkpoint)
    element_size = torch.finfo(dtype).bits // 8
    if cfg.model.weights in ("random", "inflated"):
        config, model_class = native_classes(checkpoint)
        b = skeleton_bytes(model_class, config, dtype)
    else:
        b = checkpoint_bytes(checkpoint, element_size)
    plan, fp = placement_of(cfg, device), footprint(cfg.system)
    cpu = device.type == "cpu"
    items: list[tuple[str, int]] = []
    if plan.experts == "host":
        items.append(("the routed experts in the host store",
                      store_reserved_bytes(b, n_experts, pinned=plan.pin)))
    elif getattr(recipe(cfg.system.name), "OFFLOADS", True) or cpu:
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


def checkpoint_fits(cfg: RunConfig, checkpoint: Path, device: torch.device,
                    plan: PlacementPlan, log):
    """From the safetensors headers alone, before any weight loads: the routed experts' bytes
    where `plan` puts them (the host, for a system that offloads them: on CUDA as the host
    store's pinned chunks take them) and the rest's (the device), each checked against what
    holds it, the host against the memory this process can have; the INT4 draft's copies and
    GPTQ's Hessians counted where they live (placement/bytes.py `run_extras`; returned in
    `host_extra` for the CPU offloading check). One sentence when they cannot fit."""
    from specter.placement.bytes import (check_fits, checkpoint_bytes, host_memory_bytes,
                                         run_extras, store_reserved_bytes)

    dtype = pick_dtype(cfg.model, device, checkpoint)
    element_size = torch.finfo(dtype).bits // 8
    if cfg.model.weights in ("random", "inflated"):  # no headers: the skeleton's bytes
        from specter.models.loading import native_classes
        from specter.placement.loader import skeleton_bytes

        config, model_class = native_classes(checkpoint)
        b = skeleton_bytes(model_class, config, dtype)
    else:
        b = checkpoint_bytes(checkpoint, element_size)
    offloads = getattr(recipe(cfg.system.name), "OFFLOADS", True)
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
    return plan_for(getattr(r, "OFFLOADS", True), getattr(r, "LOADS_EXPERTS", "host"), device)


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
    if cfg.workload.batch > 1 and not getattr(recipe(cfg.system.name).ENGINE, "batches", False):
        raise UserError(f"system={cfg.system.name} decodes one request at a time; use "
                        "workload.batch=1 with it.")


def batches(cfg: RunConfig, n_prompts: int) -> list[tuple[int, list[int]]]:
    """(repeat, request indices) of each batch: consecutive requests, `workload.batch` at a
    time (the last batch may be smaller), for every repeat."""
    b = cfg.workload.batch
    return [(r, list(range(i, min(i + b, n_prompts))))
            for r in range(cfg.workload.repeats) for i in range(0, n_prompts, b)]


def batch_record(gens: list, batch: list[int], repeat: int) -> dict[str, Any]:
    """The columns every row of one decoded batch shares: its size and id, and its
    throughput (committed tokens of the batch / the batch's time from start to last commit,
    on the run's clock)."""
    start = gens[0].start_time_s
    end = max(g.commit_times_s[-1] for g in gens)
    tokens = sum(len(g.tokens) for g in gens)
    return {"batch_size": len(batch), "batch_id": f"r{repeat}-{batch[0]:03d}",
            "batch_tokens": tokens, "batch_e2e_ms": (end - start) * 1e3,
            "batch_tokens_per_s": tokens / (end - start) if end > start else math.nan}


def check_writable(cfg: RunConfig) -> None:
    """out_dir and the model cache can be created and written (before anything is built)."""
    for key, folder in (("out_dir", Path(cfg.out_dir)),
                        ("cache_dir", Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir())):
        if folder.exists() and not folder.is_dir():
            raise UserError(f"{key}={folder} is a file, not a folder.")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            raise UserError(f"{key}={folder} cannot be written: {e.strerror or e}.") from None


ROWS_WRITTEN = [0]  # rows this process wrote, over every run (a Ctrl-C reports it)


def free_job(error: BaseException | None = None) -> None:
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


def run(cfg: RunConfig, log=print, decode_context=None) -> RunSummary:
    """Every (request, repeat) of `cfg` not recorded yet, decoded and written as rows.
    `decode_context(engine)`: a context manager entered around each decode call only (not
    around loading or the per-request reset): a measurement's hook, e.g. experiments.hotpath
    counting the operations decoding issues. When it returns or raises, nothing of the job is
    left alive (`free_job`)."""
    try:
        summary = _run_job(cfg, log, decode_context)
    except BaseException as e:
        free_job(e)
        raise
    free_job()
    return summary


def _run_job(cfg: RunConfig, log, decode_context) -> RunSummary:
    """`run`'s job: its locals (model, engine) die with this frame."""
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else None
    # 1. Everything that can be checked without weights: system, device, workload, budget.
    check_system(cfg.system, cfg.workload.temperature)
    check_batch(cfg)
    device = resolve_device(cfg.hardware.device)
    cfg = resolve_auto_hardware(cfg, device, log)
    workload = _workload(cfg)
    check_writable(cfg)
    checkpoint = resolve_checkpoint(cfg.model, cache_dir, cfg.model_seed, cfg.progress)
    note = remote_code_note(checkpoint)
    if note:
        log(f"[specter] {note}")
    n_experts, top_k = read_moe_shape(cfg.model, checkpoint)
    preflight(cfg, checkpoint, device, n_experts)
    plan = placement_of(cfg, device)  # where every tensor goes, decided once
    ckpt_bytes = checkpoint_fits(cfg, checkpoint, device, plan, log)
    w = cfg.workload  # the device holds the KV of a whole batch
    budget = budget_mod.resolve(cfg.budget, cfg.model, checkpoint, n_experts, top_k,
                                footprint(cfg.system),
                                kv_tokens=w.batch * (w.prompt_tokens + w.max_new_tokens),
                                group=cfg.quant.group)
    if device.type == "cpu" and plan.experts == "host":
        from specter.placement.bytes import check_cpu_offload_fits

        check_cpu_offload_fits(cfg.model.name, ckpt_bytes,
                               budget_mod.held_slots(budget, footprint(cfg.system)), n_experts,
                               host_bytes=host_with_held_store(),
                               fp32=pick_dtype(cfg.model, device, checkpoint) == torch.float32)
    torch.manual_seed(cfg.seed)

    tokenizer = load_tokenizer(checkpoint)
    prompts = [truncate_prompt(tokenizer, t, cfg.workload.prompt_tokens) for t in workload.texts]

    # 2. Load the model and account its device bytes.
    # what the device holds before loading (the CUDA peak below starts from it): 0 when the
    # last job was freed
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else math.nan
    load = LoadMeter(device)
    loaded = load_model(cfg.model, device, cache_dir, cfg.model_seed, cfg.progress, plan)
    attn = loaded.model.config._attn_implementation
    load.placed(loaded)
    spec = loaded.spec
    kv_tokens = min(w.batch, len(prompts)) * (max(len(p) for p in prompts) + w.max_new_tokens)
    held = budget_mod.held_slots(budget, footprint(cfg.system))
    acct = budget_mod.account(spec, held, kv_tokens)
    log(f"[specter] model={cfg.model.name} ({spec.arch}: {spec.num_experts} experts, top-{spec.top_k}, "
        f"{spec.num_moe_layers} MoE layers, attention {attn}: "
        f"{getattr(loaded.model.config, '_specter_attn_why', '')}) "
        f"system={cfg.system.name} budget={budget.name} "
        f"-> {held} slots/layer ({budget.rule}) device={device} dataset={workload.dataset} "
        f"({'project-written stand-in' if workload.standin else workload.source})")
    if budget.note:
        log(f"[specter] budget note: {budget.note}")
    if budget.accounting:
        log("[specter] budget in GiB:\n" + budget.accounting)
    log("[specter] device byte accounting:\n" + acct.table(held, spec))

    # 3. Decode every (request, repeat) that is not recorded yet.
    engine = build_engine(BuildContext(cfg=cfg, loaded=loaded, budget=budget, device=device), log)
    load_rec = {**load.done(), "load_base_device_bytes": base}
    log(f"[specter] loaded in {load_rec['load_s']:.1f} s (ready in {load_rec['setup_s']:.1f} s): "
        f"device peak {size_text(load_rec['load_peak_device_bytes'])} "
        f"({load_rec['load_peak_device_source']}), host peak "
        f"{size_text(load_rec['load_peak_host_bytes'])} (process RSS)")
    case = case_of(cfg, budget.slots)
    if attn != "sdpa":  # sdpa: what every run before model.attn used
        case["attn_implementation"] = attn
    if getattr(getattr(getattr(engine, "draft", None), "draft", None), "graphs", False):
        case["draft_graphs"] = True  # replayed drafts: not the case of eager ones
    compiled = getattr(engine, "compiled", {})
    for kind, knob in (("draft", cfg.spec), ("decode", cfg.system)):
        if compiled.get(f"{kind}_compiled"):  # a compiled step: not the case of eager ones
            case[f"{kind}_compiled"] = knob.compile_backend
    if cfg.model.source == "project":  # a rebuilt model with another recipe, or the shipped
        case["model_build"] = build_id(checkpoint)  # build, is another case
    store = records.CaseStore(cfg.out_dir, case)
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    fixed = {
        "run_id": run_id, "case_id": store.case_id, "system": cfg.system.name,
        "model": cfg.model.name, "budget": budget.name, "budget_slots": budget.slots,
        "budget_note": budget.note, **budget.as_record(), "dataset": workload.dataset,
        "dataset_source": workload.source, "dataset_standin": workload.standin,
        "hardware": cfg.hardware.name, "device": str(device), "clock": cfg.hardware.clock,
        "experiment": cfg.experiment, "seed": cfg.seed, "checkpoint": str(checkpoint),
        "acct_non_expert_bytes": acct.non_expert_bytes,
        "acct_resident_expert_bytes": acct.resident_expert_bytes,
        "acct_kv_bytes": acct.kv_bytes, **ckpt_bytes.as_record(), **load_rec,
        "weights": cfg.model.weights,
        "attn_implementation": attn,
        **checkpoint_record(checkpoint),
        **flatten(measured_config(cfg), "cfg."), **provenance(),
    }
    jobs = batches(cfg, len(prompts))
    missing = lambda r, batch: [i for i in batch  # noqa: E731
                                if not store.done(_request_id(workload, i), r)]
    left = [(r, batch, missing(r, batch)) for r, batch in jobs]
    todo = [(r, batch) for r, batch, m in left if m]
    rows = len(prompts) * cfg.workload.repeats
    done = rows - sum(len(m) for _, _, m in left)
    if done:
        log(f"[specter] resuming: {done} of {rows} rows already in {store.dir}")
    if todo:
        fixed["compile_warmup_s"] = warm_up(engine, cfg, prompts[todo[0][1][0]], log)
    tpots: list[float] = []
    throughputs: list[float] = []
    written = 0
    from tqdm import tqdm

    for r, batch in tqdm(todo, desc=f"{cfg.system.name}/{cfg.model.name}/{workload.dataset}",
                         disable=not cfg.progress, file=sys.stderr):
        wanted = missing(r, batch)  # a concurrent worker on this case may have done some
        if not wanted:
            continue
        engine.reset()  # outside timing
        if cfg.workload.temperature > 0:  # one generator per (request, repeat): reruns repeat
            engine.seed_requests([cfg.seed * 1_000_003 + i * 1_009 + r for i in batch])
        with decode_context(engine) if decode_context else contextlib.nullcontext(), \
                counted_host_costs(engine) as counted:  # a counted profile: what decoding issues
            if len(batch) == 1:
                gens = [engine.generate(prompts[batch[0]], cfg.workload.max_new_tokens)]
            else:  # a batch is decoded whole; rows already recorded are not written again
                gens = engine.generate_batch([prompts[i] for i in batch],
                                             cfg.workload.max_new_tokens)
        shared = batch_record(gens, batch, r)
        if counted is not None:
            shared.update(counted.as_record())
        throughputs.append(shared["batch_tokens_per_s"])
        for i, gen in zip(batch, gens):
            if i not in wanted:
                continue
            t = timing(gen)
            row = {**fixed, "request_id": _request_id(workload, i), "repeat": r,
                   "prompt_tokens": prompts[i], "output_tokens": gen.tokens, **t,
                   "distinct_4": distinct_n(gen.tokens, 4), "peak_mem_bytes": gen.peak_mem_bytes,
                   "peak_mem_source": gen.peak_mem_source, "finished_at": time.time(),
                   **shared, **gen.stats}
            try:
                store.write(row)
                written += 1
                ROWS_WRITTEN[0] += 1
            except FileExistsError:  # a concurrent worker on this case recorded this row first
                continue
            except OSError as e:  # a full disk, a quota, a folder made read-only meanwhile
                raise UserError(f"out_dir={cfg.out_dir} stopped taking rows ({e.strerror or e}); "
                                f"the {written} row(s) written by this run are kept: free space "
                                "or fix permissions and rerun to resume.") from None
            if not math.isnan(t["tpot_ms"]):
                tpots.append(t["tpot_ms"])
    mean = sum(tpots) / len(tpots) if tpots else math.nan
    batched = (f", mean batch throughput {sum(throughputs) / len(throughputs):.1f} tokens/s "
               f"at batch {cfg.workload.batch}" if cfg.workload.batch > 1 and throughputs else "")
    log(f"[specter] wrote {written} row(s), skipped {rows - written}; "
        f"mean TPOT {mean:.2f} ms{batched} ({cfg.hardware.clock} clock) -> {store.dir}")
    summary = RunSummary(out_dir=Path(cfg.out_dir), case_id=store.case_id, written=written,
                         skipped=rows - written, tpot_ms_mean=mean)
    log("RESULT " + json.dumps({"case_id": summary.case_id, "written": summary.written,
                                "skipped": summary.skipped, "tpot_ms_mean": round(mean, 4),
                                "dir": str(store.dir)}))
    return summary


def _request_id(workload: Workload, i: int) -> str:
    return f"{workload.dataset}-{i:03d}"
