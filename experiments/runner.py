"""The runner: one typed `RunConfig` in, parquet records out.

Owns: the order of a run (validate everything cheap first, so bad input fails before any
weights load or any file is written; then load, account bytes, and decode every
(request, repeat) not yet recorded), the columns of a record, and the console output.
Jobs share one process (a Hydra `-m` sweep calls `run` once per job): each job frees its
model, engine, slots and draft when it ends (`compose.free`: gc, then CUDA's cached blocks), so
the next job's load-time device peak is its own; what the device held when a job began is
recorded (`load_base_device_bytes`). In-process rather than a process per job, so that the
host memory one sweep shares stays drawn: the last random host store
(specter/placement/loader.py `_LAST_RANDOM_STORE`: DeepSeek-V2-Lite's 27 GiB of experts, drawn,
pinned and checksummed once) is kept on purpose; the device keeps nothing of a finished job.
Does not own: turning the settings into a model and an engine (specter/compose.py, the
composition root the library shares), Hydra (specter/settings.py converts its config before
`run`), the systems (specter/recipes.py), the record layout (records.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments import records
from experiments.provenance import provenance
from specter import compose
from specter.config import RunConfig
from specter.errors import UserError
from specter.metrics import distinct_n, timing
from specter.models.routing_stats import checkpoint_record
from specter.models.zoo import build_id, default_cache_dir
from specter.clock.counted import counted_host_costs
from specter.recipes import depth_of, recipe
from specter.workloads import DATASETS, MIX, Workload, load_workload, truncate_prompt


@dataclass
class RunSummary:
    out_dir: Path
    case_id: str
    written: int
    skipped: int
    tpot_ms_mean: float


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
    if d["offload"].get("verify_pieces") == "auto" and not d["hardware"].get("kernel_floor_s"):
        # a virtual clock without a kernel floor verifies eagerly at auto: runs before the knob
        del d["offload"]["verify_pieces"]
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


def measured_config(cfg: RunConfig) -> dict[str, Any]:
    """The run's configuration without settings its system does not read: a system that
    does not speculate has no `spec` (so a sweep over spec.k runs it once, and its rows do
    not claim a K)."""
    d = cfg.to_dict()
    if not recipe(cfg.system.name).speculates:
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


def run(cfg: RunConfig, log=print, decode_context=None) -> RunSummary:
    """Every (request, repeat) of `cfg` not recorded yet, decoded and written as rows.
    `decode_context(engine)`: a context manager entered around each decode call only (not
    around loading or the per-request reset): a measurement's hook, e.g. experiments.hotpath
    counting the operations decoding issues. When it returns or raises, nothing of the job is
    left alive (`compose.free`)."""
    try:
        summary = _run_job(cfg, log, decode_context)
    except BaseException as e:
        compose.free(e)
        raise
    compose.free()
    return summary


def _run_job(cfg: RunConfig, log, decode_context) -> RunSummary:
    """`run`'s job: its locals (model, engine) die with this frame."""
    # 1. Everything that can be checked without weights (specter/compose.py): system, device,
    # workload, out_dir, checkpoint, sizes, budget; nothing is written before it passes.
    cfg, device = compose.settle(cfg, log)
    workload = _workload(cfg)
    check_writable(cfg)
    planned = compose.plan(cfg, device, log)
    budget = planned.budget
    log(f"[specter] dataset={workload.dataset} "
        f"({'project-written stand-in' if workload.standin else workload.source})")

    # 2. Load the model and build the system's engine, the device holding the KV of a batch
    # of the longest prompts.
    prompts = [truncate_prompt(planned.tokenizer, t, cfg.workload.prompt_tokens)
               for t in workload.texts]
    w = cfg.workload
    parts = compose.build(planned, log, kv_tokens=min(w.batch, len(prompts))
                          * (max(len(p) for p in prompts) + w.max_new_tokens))
    engine, acct, load_rec = parts.engine, parts.account, parts.load
    depth = depth_of(cfg)  # the engine's, settled by the one rule (decoding/depth.py)
    if depth is not None and depth.mode == "auto":  # spec.k=auto: the K measured on this engine
        from experiments.depth_profile import Profiled, profile

        engine = profile(Profiled(cfg, parts.loaded, budget), engine, log)
    attn = parts.loaded.model.config._attn_implementation
    checkpoint, ckpt_bytes = planned.checkpoint, planned.checkpoint_bytes

    # 3. Decode every (request, repeat) that is not recorded yet.
    case = case_of(cfg, budget.slots)
    if attn != "sdpa":  # sdpa: what every run before model.attn used
        case["attn_implementation"] = attn
    compiled = engine.compiled
    if compiled.get("draft_graphs"):
        case["draft_graphs"] = True  # replayed drafts: not the case of eager ones
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
        fixed["compile_warmup_s"] = compose.warm_up(engine, cfg, prompts[todo[0][1][0]], log)
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
