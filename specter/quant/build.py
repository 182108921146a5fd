"""Assembly of the INT4 self-draft for a run: the quantized experts (made, reused or imported
from gptqmodel) and the backend that executes them. Systems call `int4_experts_for(job)` (specs.py `Job`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from specter.errors import UserError
from specter.models.introspect import experts_modules
from specter.models.zoo import default_cache_dir
from specter.quant import calibrate
from specter.quant.calibrate import QuantizedExperts, QuantSpec
from specter.quant.formats import effective_group
from specter.quant.kernels import BACKENDS, triton_available
from specter.quant.step_form import counted_clock, draft_step_form


@dataclass
class Int4Experts:
    experts: QuantizedExperts
    path: Path
    reused: bool
    backend: str
    backend_choice: str = "quant.backend"  # why this backend (auto: measured or the default)
    graphs: bool = False  # draft layers replayed as CUDA graphs
    graphs_choice: str = "quant.graphs"  # why

    def as_record(self) -> dict:
        m = self.experts.meta
        fallback = m.get("rtn_fallback") or []
        n = sum(len(layer) for layer in fallback)
        groups = sorted(self.experts.groups())  # from the layout: no layer is read
        return {"draft.method": self.experts.spec.method, "draft.bits": self.experts.spec.bits,
                "draft.group": self.experts.spec.group, "draft.effective_groups": str(groups),
                "draft.backend": self.backend, "draft.backend_choice": self.backend_choice,
                "draft.graphs": self.graphs, "draft.graphs_choice": self.graphs_choice,
                "draft.bytes": self.experts.packed_bytes(), "draft.path": str(self.path),
                "draft.rtn_fallback_frac": sum(map(sum, fallback)) / n if n else math.nan}


def spec_of(q) -> QuantSpec:
    return QuantSpec(method=q.method, bits=q.bits, group=q.group, damp=q.damp,
                     min_tokens=q.min_tokens, calib_tokens=q.calib_tokens)


def kernel_choice_path(cache_dir: Path, device: torch.device) -> Path:
    """Where `python -m experiments.kernel_bench --write-choice` records which INT4 backend
    was fastest on this kind of GPU (read by quant.backend=auto)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return cache_dir / "kernels" / ("choice-" + "".join(c if c.isalnum() else "_" for c in name)
                                    + ".json")


def resolve_backend(name: str, bits: int, device: torch.device, groups: set[int],
                    cache_dir: Path | None = None, counted: bool = False,
                    compiles: bool = False) -> tuple[str, str]:
    """(backend, why): `quant.backend`, or for `auto` the fastest INT4 backend measured on this
    kind of device (kernel_bench --write-choice, at a real model's expert shape and one token:
    a draft step) among those that can run here, when that measurement exists; else triton on
    CUDA, cpu_int4 on the CPU. `counted`: a counted profile's virtual clock on the CPU
    (specter/clock/counted.py) charges the operations the draft issues, so auto takes
    gather_int4, whose operations are a GPU's (cpu_int4's per-expert GEMMs are the CPU's).
    `compiles`: the draft step is to run as one compiled graph (`spec.compile`, see
    quant/step_form.py `draft_step_form`), which only gather_int4 and fused_int4 allow (the others read the
    routing on the host or call a kernel the compiler does not trace), so auto takes one:
    on CUDA fused_int4 (one opaque custom op per layer, two fused Triton kernels reading the
    packed codes, where gather_int4 writes each pair's dequantized weights out and reads them
    back); on the CPU gather_int4, which inductor fuses there into one reduction per
    projection reading the codes (FUSED_CPU_WHY), or on CUDA without triton."""
    if name not in BACKENDS + ("auto",):
        raise UserError(f"unknown quant.backend '{name}'; choose one of: auto, {', '.join(BACKENDS)}.")
    if name != "auto":
        return name, "quant.backend"
    if bits != 4:
        return "reference", "auto: not 4-bit"
    if counted and device.type == "cpu":
        return "gather_int4", "auto: a counted profile on the CPU charges a GPU's operations"
    if compiles:
        if device.type == "cpu":
            return "gather_int4", (f"auto: the draft step compiles whole on it ({COMPILED_WHY}); "
                                   f"not fused_int4 ({FUSED_CPU_WHY})")
        if triton_available():
            return "fused_int4", ("auto: the draft step is captured whole as one CUDA graph, "
                                  "fused_int4's (its fused INT4 kernels inside) can be")
        return "gather_int4", ("auto: the draft step is captured whole as one CUDA graph and "
                               "triton is missing: gather_int4's can be")
    int4_groups = groups <= {32, 64, 128, 256}
    if device.type == "cuda":
        usable = {"reference", "gather_int4", *(["triton"] if triton_available() else []),
                  *(["cuda_int4"] if int4_groups else [])}
        default = "triton" if "triton" in usable else "reference"
    else:
        usable = {"reference", "gather_int4", *(["cpu_int4"] if int4_groups else [])}
        default = "cpu_int4" if int4_groups else "reference"
    path = kernel_choice_path(cache_dir or default_cache_dir(), device)
    if path.is_file():
        import json

        ms = {b: t for b, t in json.loads(path.read_text()).get("ms", {}).items()
              if b in usable and isinstance(t, (int, float)) and math.isfinite(t)}
        if ms:
            return min(ms, key=ms.get), f"auto: fastest measured ({path})"
    return default, "auto: no measurement"


# what `auto` gains by compiling on the CPU, measured on its own clock (small_deepseek, K = 4)
# why auto keeps gather_int4 for a compiled step on the CPU: fused_int4's CPU body is eager torch
FUSED_CPU_WHY = ("its CPU body dequantizes each pair's weights in fp32 eagerly: 1305 ms a "
                 "compiled layer call against 95 ms for gather_int4, whose dequantization "
                 "inductor fuses into its reductions (DeepSeek-V2-Lite's expert shape, top 6, "
                 "one token, 2 shared CPU cores)")
COMPILED_WHY = ("measured on a 2-core EPYC's own clock, 4.1 ms a draft step compiled against "
                "9.0 ms for cpu_int4 eager: docs/measurements/compile-2026-12-04.md")


def int4_experts_for(job) -> Int4Experts:
    """The quantized routed experts of `job.loaded.model` under the job's `DraftSpec`."""
    q, model, device = job.draft.quant, job.loaded.model, job.device
    compiles = draft_step_form(job).compiled  # (refuses quant.graphs=on with spec.compile=on)
    spec = spec_of(q)
    cache_dir, data_dir = job.files.cache_dir, job.files.data_dir
    if q.path:  # a shipped GPTQ draft: imported, nothing quantized
        from specter.quant.gptq_import import import_gptq

        path = Path(q.path).expanduser()
        if not path.is_dir():
            raise UserError(f"quant.path={q.path} is not a folder; point it at a GPTQ checkpoint "
                            "(qweight/qzeros/scales safetensors and its quantization config).")
        experts = import_gptq(path, model)
        reused = True
    elif q.method == "gptqmodel":
        from specter.quant.gptq_import import import_gptq, quantize_with_gptqmodel

        if q.bits != 4:
            raise UserError("quant.method=gptqmodel is imported into the INT4 layout: use quant.bits=4.")
        _, m = experts_modules(model)[0]
        hidden, inter = m.gate_up_proj.shape[2], m.down_proj.shape[2]
        group = min(effective_group(hidden, q.group), effective_group(inter, q.group))
        windows = calibrate.calibration_windows(job.loaded.tokenizer, spec, data_dir)
        out = cache_dir / "quant" / (f"gptqmodel-plain-{calibrate.source_checksum(model)}"
                                     f"-w4g{group}-t{q.calib_tokens}")
        reused = (out / "quantize_config.json").exists()
        path = quantize_with_gptqmodel(job.loaded.checkpoint, windows, 4, group, out)
        experts = import_gptq(path, model)
    else:  # made or reused: its layers stay in their files until the backend reads them,
        # one at a time, into its own copy on the device (draft_mode.py): the host never
        # holds the whole draft
        experts, path, reused = calibrate.ensure_quantized(
            model, job.loaded.tokenizer, spec, cache_dir, device, data_dir, job.files.progress)
    groups = experts.groups()
    counted = counted_clock(job.clock.hardware)
    backend, why = resolve_backend(q.backend, q.bits, device, groups, cache_dir, counted,
                                   compiles)
    form = draft_step_form(job, backend)
    graphs, graphs_why = form.layer_graphs, form.graphs_why
    return Int4Experts(experts, path, reused, backend, why, graphs, graphs_why)
