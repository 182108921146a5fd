"""Quantizing a model's routed experts: calibration, GPTQ / RTN per expert, the saved result.

Owns: the calibration tokens (from the workload loaders, skipping the items a benchmark
evaluates), per-expert Hessians from the tokens the router actually sends to each expert
(gate_up's input is the hidden state, down's the gated intermediate), the quantization of
every routed expert (GPTQ, with RTN for experts that saw fewer than `min_tokens` tokens), and
`QuantizedExperts`: saved as safetensors plus metadata (bits, group, method, checksum of
the source weights) and reused while the source weights and spec are unchanged.
Does not own: executing quantized experts (kernels.py, draft.py).

Calibration runs one MoE layer at a time (one pass over the calibration windows per layer),
and a layer's Hessians are freed before the next layer's are made, so one layer's exist at
once: E x (H^2 + I^2) float64, 3.16 GB for DeepSeek-V2-Lite. Each expert matrix goes to the
device only while it is quantized. A layer's peak on the device (`gptq_peak_device_bytes`) is
its Hessians plus one matrix's GPTQ working set: 3.31 GB for DeepSeek-V2-Lite on a GPU.
Inputs come from the full-precision model (no sequential re-quantization of earlier layers),
a common GPTQ simplification, recorded in the metadata.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from specter import hermetic
from specter.errors import UserError
from specter.models.introspect import experts_modules
from specter.offload.store import expert_layout, expert_weights, host_store
from specter.quant.formats import (QuantizedMatrix, effective_group, rtn_quantize,
                                   weights_checksum, weights_checksum_parts)
from specter.quant.gptq import Hessian, gptq_quantize, gptq_working_bytes

METHODS = ("gptq", "rtn", "gptqmodel")  # gptqmodel: imported from its checkpoint
CALIB_DATASETS = ("gsm8k", "wikitext2", "humaneval", "gpqa", "c4")


@dataclass(frozen=True)
class QuantSpec:
    method: str = "gptq"
    bits: int = 4
    group: int = 128
    damp: float = 0.01
    min_tokens: int = 32  # fewer calibration tokens than this: RTN for that expert
    calib_tokens: int = 8192
    calib_skip: int = 5  # items per dataset a benchmark evaluates; never calibrated on
    seq_len: int = 256

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"unknown quantization method '{self.method}'; choose one of: "
                            f"{', '.join(METHODS)}.")
        if self.bits not in (2, 3, 4, 8):
            raise UserError(f"quantization bits must be 2, 3, 4 or 8 (got {self.bits}).")

    @property
    def tag(self) -> str:
        return f"{self.method}-w{self.bits}g{self.group}"


@dataclass
class QuantizedExperts:
    """Every routed expert of a model, quantized: per MoE layer, per expert, two matrices."""

    spec: QuantSpec
    gate_up: list[list[QuantizedMatrix]]  # [moe layer][expert], each [2I, H]
    down: list[list[QuantizedMatrix]]  # [moe layer][expert], each [H, I]
    meta: dict = field(default_factory=dict)

    def packed_bytes(self) -> int:
        return sum(m.packed_bytes() for layer in self.gate_up + self.down for m in layer)

    def to(self, device: torch.device) -> "QuantizedExperts":
        move = lambda layers: [[m.to(device) for m in layer] for layer in layers]  # noqa: E731
        return QuantizedExperts(self.spec, move(self.gate_up), move(self.down), self.meta)


# -- calibration data ---------------------------------------------------------------------
def calibration_windows(tokenizer, spec: QuantSpec, data_dir: Path | None = None) -> list[torch.Tensor]:
    """Token windows [1, <= seq_len] from the five workloads' texts after the evaluated items,
    interleaved by dataset, up to `calib_tokens` tokens."""
    from specter.workloads import load_workload

    per_dataset = [list(load_workload(name, items=None, cache_dir=data_dir).texts)[spec.calib_skip:]
                   for name in CALIB_DATASETS]
    ids: list[int] = []
    for i in range(max(len(t) for t in per_dataset)):
        for texts in per_dataset:
            if i < len(texts):
                ids.extend(tokenizer(texts[i])["input_ids"])
        if len(ids) >= spec.calib_tokens:
            break
    ids = ids[:spec.calib_tokens]
    return [torch.tensor([ids[s:s + spec.seq_len]]) for s in range(0, len(ids), spec.seq_len)]


# -- per-expert Hessians -------------------------------------------------------------------
@torch.no_grad()
def layer_hessians(model: nn.Module, moe_layer: int, windows: list[torch.Tensor],
                   device: torch.device, on_window=None) -> tuple[list[Hessian], list[Hessian]]:
    """Hessians of every expert of one MoE layer from the tokens routed to it;
    `on_window(i)` after each calibration window's forward."""
    _, module = experts_modules(model)[moe_layer]
    n_exp, two_i, hid = module.gate_up_proj.shape
    h_gu = [Hessian(hid, device) for _ in range(n_exp)]
    h_dn = [Hessian(two_i // 2, device) for _ in range(n_exp)]

    def hook(m, args):
        hidden, top_k_index, _ = args
        for e in torch.unique(top_k_index).tolist():
            token_idx = (top_k_index == e).any(dim=-1).nonzero().squeeze(-1)
            x = hidden[token_idx]
            h_gu[e].add(x)
            gate_up = expert_weights(model, moe_layer, e)[0].to(x.device)  # down is not needed
            h_dn[e].add(m._apply_gate(nn.functional.linear(x, gate_up)))

    handle = module.register_forward_pre_hook(hook)
    try:
        for i, w in enumerate(windows):
            model(input_ids=w.to(device), use_cache=False)
            if on_window is not None:
                on_window(i)
    finally:
        handle.remove()
    return h_gu, h_dn


def gptq_peak_device_bytes(experts: int, hidden: int, inter: int, group: int = 128,
                           bits: int = 4, weight_bytes: int = 2, copied: bool = True,
                           tokens: int = 256, results_held: bool = False) -> int:
    """The most device bytes one MoE layer's GPTQ holds at once (`quantize_experts` on
    `device`), from what the code allocates: the layer's Hessians, float64 E (H^2 + I^2),
    for the whole layer, plus the larger of
    - quantizing one matrix: its copy on the device in the model's dtype (`weight_bytes` an
      element; `copied`: False when the experts already live there) and `gptq_working_bytes`
      of the larger of gate_up [2I, H] and down [H, I]; with `results_held` (the device is
      the host) every expert's finished codes and scales too;
    - accumulating a window of `tokens` tokens: an expert's gate_up copy, the routed hidden
      states and intermediates, their float64 copies and one x^T x product.
    Not counted: the model forward's own activations for the calibration windows."""
    hess = 8 * experts * (hidden ** 2 + inter ** 2)
    mats = ((2 * inter, hidden), (hidden, inter))
    copy = weight_bytes if copied else 0
    quant = max(copy * o * c + gptq_working_bytes(o, c, group, bits) for o, c in mats)
    if results_held:
        per = 8 // bits if bits in (2, 4, 8) else 1
        quant += experts * sum(o * c // per + o * (c // effective_group(c, group)) * weight_bytes
                               for o, c in mats)
    n = tokens
    calib = copy * 2 * inter * hidden + n * weight_bytes * (hidden + 4 * inter) + \
        max(16 * n * hidden + 8 * hidden ** 2, 16 * n * inter + 8 * inter ** 2)
    return hess + max(quant, calib)


def quantize_experts(model: nn.Module, spec: QuantSpec, windows: list[torch.Tensor] | None,
                     device: torch.device, progress: bool = False,
                     partial: Path | None = None) -> QuantizedExperts:
    """Quantize every routed expert of `model` (weights left untouched). `partial`: a folder
    where each finished MoE layer is saved as it completes, and from which an interrupted run
    resumes (layers made for another source or spec are not reused). The progress bar moves
    per expert (GPTQ of one real-width expert takes seconds), after each layer's calibration
    forwards."""
    from tqdm import tqdm

    mods = [m for _, m in experts_modules(model)]
    if spec.method == "gptq" and not windows:
        raise UserError("GPTQ needs calibration windows; none were given.")
    key = {"spec": asdict(spec), "source_checksum": source_checksum(model),
           "calib_windows": len(windows or [])}
    n_exp = mods[0].gate_up_proj.shape[0]
    bar = tqdm(total=len(mods) * n_exp, desc=f"quantizing experts ({spec.tag})",
               disable=not progress, leave=False, unit="expert")
    gate_up, down, tokens, fallback = [], [], [], []
    resumed = 0
    for l, m in enumerate(mods):
        done = _load_layer(partial, l, key) if partial is not None else None
        if done is not None:
            resumed += 1
            bar.update(n_exp)
        else:
            where = f"layer {l + 1}/{len(mods)}"
            hess = layer_hessians(
                model, l, windows, device,
                lambda i: bar.set_postfix_str(f"{where}: calibration window {i + 1}/{len(windows)}")
            ) if spec.method == "gptq" else None
            bar.set_postfix_str(where)
            done = _quantize_layer(model, l, spec, hess, bar, device)
            hess = None  # freed before the next layer's are made: one layer's at a time
            if partial is not None:
                _save_layer(partial, l, key, *done)
        for out, part in zip((gate_up, down, tokens, fallback), done):
            out.append(part)
    bar.close()
    meta = {**key, "calib_tokens_per_expert": tokens, "rtn_fallback": fallback,
            "calibration": "full-precision inputs, one MoE layer at a time (not sequential)",
            "resumed_layers": resumed}
    return QuantizedExperts(spec, gate_up, down, meta)


def _quantize_layer(model: nn.Module, l: int, spec: QuantSpec, hess, bar,
                    device: torch.device):
    """(gate_up, down, calibration tokens, RTN fallback) of MoE layer `l`, expert by expert
    (each read to `device`, wherever it lives)."""
    gu_l, dn_l, tok_l, fb_l = [], [], [], []
    for e in range(expert_layout(model).num_experts):
        # Views where the weights live; each matrix goes to `device` only while it is
        # quantized, and its result to the host at once (the draft goes to the device later,
        # in its backend's layout).
        w_gu, w_dn = expert_weights(model, l, e)
        n = hess[0][e].n if hess else 0
        use_rtn = hess is None or n < spec.min_tokens
        for w, h, out in ((w_gu, 0, gu_l), (w_dn, 1, dn_l)):
            q = rtn_quantize(w.to(device), spec.bits, spec.group) if use_rtn else \
                gptq_quantize(w.to(device), hess[h][e].h, spec.bits, spec.group, spec.damp)
            out.append(q.to("cpu"))
            del q  # its device copy, before the next matrix's
        tok_l.append(n)
        fb_l.append(bool(use_rtn and spec.method == "gptq"))
        bar.update(1)
    return gu_l, dn_l, tok_l, fb_l


def _save_layer(partial: Path, l: int, key: dict, gu: list, dn: list, tok: list, fb: list) -> None:
    """One finished MoE layer, written whole (temp file, then renamed)."""
    from safetensors.torch import save_file

    partial.mkdir(parents=True, exist_ok=True)
    tensors = {f"{name}.{part}": t for name, layer in (("gate_up", gu), ("down", dn))
               for part, t in _stacked(layer).items()}
    meta = dict(key, tokens=tok, fallback=fb, **_layout(gu, dn))
    tmp = partial / f".layer{l}.tmp{os.getpid()}.safetensors"
    save_file(tensors, str(tmp))
    os.replace(tmp, partial / f"layer{l}.safetensors")
    (partial / f"layer{l}.json").write_text(json.dumps(meta))


def _load_layer(partial: Path, l: int, key: dict):
    """A layer an earlier, interrupted run finished for the same source and spec, or None."""
    from safetensors.torch import load_file

    meta_path, data = partial / f"layer{l}.json", partial / f"layer{l}.safetensors"
    if not (meta_path.is_file() and data.is_file()):
        return None
    meta = json.loads(meta_path.read_text())
    if any(meta.get(k) != v for k, v in key.items()):
        return None
    t = load_file(str(data))
    bits = key["spec"]["bits"]
    layers = [[QuantizedMatrix(t[f"{name}.codes"][e], t[f"{name}.scales"][e], bits,
                               meta["groups"][name], tuple(meta["shapes"][name]))
               for e in range(t[f"{name}.codes"].shape[0])] for name in ("gate_up", "down")]
    return layers[0], layers[1], meta["tokens"], meta["fallback"]


def source_checksum(model: nn.Module) -> str:
    """Identifies the full-precision experts a quantization is made from: each MoE layer's
    fused gate_up [E, 2I, H] and down [E, H, I], the same digest whether they are the
    model's parameters or its host store's per-expert buffers."""
    store = host_store(model)
    if store is None:
        return weights_checksum([t for _, m in experts_modules(model)
                                 for t in (m.gate_up_proj, m.down_proj)])
    if getattr(store, "checksum", None) is None:  # once per store: 27 GiB take a while
        lay = store.layout
        shapes = ((lay.num_experts, 2 * lay.inter, lay.hidden),
                  (lay.num_experts, lay.hidden, lay.inter))
        store.checksum = weights_checksum_parts(
            [(shape, [lay.views(flat)[part] for flat in layer])
             for layer in store.flat for part, shape in enumerate(shapes)])
    return store.checksum


# -- saving and reuse ----------------------------------------------------------------------
def _stacked(layer: list[QuantizedMatrix]) -> dict[str, torch.Tensor]:
    """One layer's experts as two tensors: codes [E, ...] and scales [E, ...], on the host."""
    return {part: torch.stack([getattr(q, part) for q in layer]).contiguous().cpu()
            for part in ("codes", "scales")}


def _layout(gate_up: list[QuantizedMatrix], down: list[QuantizedMatrix]) -> dict:
    """The matrix shapes and groups a saved layer is read back with."""
    return {"shapes": {"gate_up": list(gate_up[0].shape), "down": list(down[0].shape)},
            "groups": {"gate_up": gate_up[0].group, "down": down[0].group}}


def save(qe: QuantizedExperts, out: Path) -> None:
    """The quantized experts under `out`, one safetensors file per MoE layer
    (`layer{l}.safetensors`: gate_up.codes / .scales, down.codes / .scales) and quant.json;
    written layer by layer, so the host holds one layer's stacked copy at a time, not the whole
    draft's (DeepSeek-V2-Lite: 0.27 of 6.9 GiB; one file of every layer took two more whole
    copies, the stacked tensors and the serialised bytes)."""
    from safetensors.torch import save_file

    meta = dict(qe.meta, **_layout(qe.gate_up[0], qe.down[0]), layers=len(qe.gate_up))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for l, (gu, dn) in enumerate(zip(qe.gate_up, qe.down)):
        tensors = {f"{name}.{part}": t for name, layer in (("gate_up", gu), ("down", dn))
                   for part, t in _stacked(layer).items()}
        save_file(tensors, str(tmp / f"layer{l}.safetensors"), metadata={"format": "specter-int"})
        del tensors
    (tmp / "quant.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def load(path: Path) -> QuantizedExperts:
    from safetensors.torch import load_file

    meta = json.loads((path / "quant.json").read_text())
    spec = QuantSpec(**meta["spec"])
    out: dict[str, list] = {"gate_up": [], "down": []}
    for l in range(meta["layers"]):
        t = load_file(str(path / f"layer{l}.safetensors"))
        for name in ("gate_up", "down"):
            shape, group = tuple(meta["shapes"][name]), meta["groups"][name]
            codes, scales = t[f"{name}.codes"], t[f"{name}.scales"]
            out[name].append([QuantizedMatrix(codes[e], scales[e], spec.bits, group, shape)
                              for e in range(codes.shape[0])])
    return QuantizedExperts(spec, out["gate_up"], out["down"], meta)


def ensure_quantized(model: nn.Module, tokenizer, spec: QuantSpec, cache_dir: Path,
                     device: torch.device, data_dir: Path | None = None,
                     progress: bool = False) -> tuple[QuantizedExperts, Path, bool]:
    """The quantized experts of `model` under `spec`: loaded when a matching file exists
    (same source checksum and spec), else made and saved. Returns (experts, path, reused)."""
    from filelock import FileLock

    out = cache_dir / "quant" / f"{source_checksum(model)}-{spec.tag}-{_spec_digest(spec, device)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "quant.json").exists():
            return load(out), out, True
        windows = calibration_windows(tokenizer, spec, data_dir) if spec.method == "gptq" else None
        partial = out.with_name(out.name + ".partial")  # finished layers: a rerun resumes
        with hermetic.build_threads():  # on the CPU the Hessians' sums depend on the threads
            qe = quantize_experts(model, spec, windows, device, progress, partial)
            qe.meta["environment"] = dict(hermetic.environment(), device=str(device))
        save(qe, out)
        shutil.rmtree(partial, ignore_errors=True)
    return qe, out, False


def _spec_digest(spec: QuantSpec, device: torch.device) -> str:
    """The spec, the quantizer's sources (a cache made by another quantizer would be other
    codes) and, for a CPU quantization, the fixed thread count it ran on (likewise)."""
    import hashlib

    key = dict(asdict(spec), code=hermetic.source_digest("specter/quant"),
               **({"build_threads": hermetic.BUILD_THREADS}
                  if torch.device(device).type == "cpu" else {}))
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
