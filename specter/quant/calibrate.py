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

Host memory: each layer's results go into that layer's own tensors (one allocation per
projection part, not one per expert, which left the heap fragmented: 2 GiB a DeepSeek-V2-Lite
layer), are saved as the layer finishes and dropped; the draft `ensure_quantized` returns
reads its layers back from their files one at a time (`SavedLayers`), so the host holds one
layer of the draft at a time while it is made or built into its device home, never the
whole draft (docs/measurements/host-memory-2026-12-05.md).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from specter import hermetic
from specter.errors import UserError
from specter.models.introspect import expert_layout, expert_weights, experts_modules, host_store
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
    """Every routed expert of a model, quantized: per MoE layer, per expert, two matrices.
    `gate_up[l]` / `down[l]` are lists of the layer's experts; each layer's matrices are views
    of two tensors per projection (codes [E, ...], scales [E, ...]). A draft read from its
    saved folder (`load`) holds no layer in memory: `SavedLayers` reads layer l from its file
    when asked, so a backend built layer by layer (draft_mode.py) holds one layer on the host
    at a time besides its own copy, never the whole draft."""

    spec: QuantSpec
    gate_up: Sequence[list[QuantizedMatrix]]  # [moe layer][expert], each [2I, H]
    down: Sequence[list[QuantizedMatrix]]  # [moe layer][expert], each [H, I]
    meta: dict = field(default_factory=dict)

    def layer(self, l: int) -> tuple[list[QuantizedMatrix], list[QuantizedMatrix]]:
        """(gate_up, down) of MoE layer `l` (a saved draft reads its file once)."""
        return self.gate_up[l], self.down[l]

    def packed_bytes(self) -> int:
        if isinstance(self.gate_up, SavedLayers):  # from the files' headers, nothing read
            return self.gate_up.reader.packed_bytes()
        return sum(m.packed_bytes() for layer in [*self.gate_up, *self.down] for m in layer)

    def groups(self) -> set[int]:
        """The group sizes of its matrices."""
        if isinstance(self.gate_up, SavedLayers):
            return set(self.gate_up.reader.layout["groups"].values())
        return {m.group for layer in [*self.gate_up, *self.down] for m in layer}

    def to(self, device: torch.device) -> "QuantizedExperts":
        move = lambda layers: [[m.to(device) for m in layer] for layer in layers]  # noqa: E731
        return QuantizedExperts(self.spec, move(self.gate_up), move(self.down), self.meta)


class LayerReader:
    """Reads the MoE layers of a draft saved one safetensors file per layer (`layer{l}`:
    gate_up.codes / .scales, down.codes / .scales) on demand. The layer last read is held
    only until both of its projections were taken (`take`), so reading gate_up[l] then
    down[l], as a backend built layer by layer does, reads the file once and keeps nothing."""

    def __init__(self, folder: Path, layers: int, bits: int, layout: dict):
        self.folder, self.layers, self.bits, self.layout = Path(folder), layers, bits, layout
        self._held: tuple[int, tuple, set] | None = None

    def read(self, l: int) -> tuple[list[QuantizedMatrix], list[QuantizedMatrix]]:
        from safetensors.torch import load_file

        t = load_file(str(self.folder / f"layer{l}.safetensors"))
        return tuple(
            [QuantizedMatrix(t[f"{name}.codes"][e], t[f"{name}.scales"][e], self.bits,
                             self.layout["groups"][name], tuple(self.layout["shapes"][name]))
             for e in range(t[f"{name}.codes"].shape[0])] for name in ("gate_up", "down"))

    def take(self, l: int, part: int) -> list[QuantizedMatrix]:
        held = self._held
        if held is not None and held[0] == l and part not in held[2]:
            held[2].add(part)
            if len(held[2]) == 2:
                self._held = None
            return held[1][part]
        layer = self.read(l)
        self._held = (l, layer, {part})
        return layer[part]

    def packed_bytes(self) -> int:
        """The codes' and scales' bytes of every layer, from the files' headers."""
        total = 0
        for l in range(self.layers):
            with open(self.folder / f"layer{l}.safetensors", "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                entries = json.loads(f.read(n))
            total += sum(b - a for k, v in entries.items() if k != "__metadata__"
                         for a, b in [v["data_offsets"]])
        return total


class SavedLayers(Sequence):
    """One projection's layers (`part` 0: gate_up, 1: down) of a saved draft, read from its
    files layer by layer (`LayerReader`); `+` gives a list of every layer (tests)."""

    def __init__(self, reader: LayerReader, part: int):
        self.reader, self.part = reader, part

    def __len__(self) -> int:
        return self.reader.layers

    def __getitem__(self, l):
        if isinstance(l, slice):
            return [self[i] for i in range(*l.indices(len(self)))]
        if l < 0:
            l += len(self)
        if not 0 <= l < len(self):
            raise IndexError(l)
        return self.reader.take(l, self.part)

    def __add__(self, other):
        return [*self, *other]

    def __radd__(self, other):
        return [*other, *self]


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
    resumes (layers made for another source or spec are not reused); then no layer stays in
    memory once saved, and the result reads them back from there layer by layer (the host
    holds one layer of the draft at a time, not the whole draft). Without it every layer is
    kept in memory. The progress bar moves per expert (GPTQ of one real-width expert takes
    seconds), after each layer's calibration forwards."""
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
    resumed, layout = 0, None
    for l, m in enumerate(mods):
        done = _finished_layer(partial, l, key) if partial is not None else None
        if done is not None:  # (tokens, fallback, layout): its codes stay in its file
            resumed += 1
            bar.update(n_exp)
            tok, fb, layout = done
        else:
            where = f"layer {l + 1}/{len(mods)}"
            hess = layer_hessians(
                model, l, windows, device,
                lambda i: bar.set_postfix_str(f"{where}: calibration window {i + 1}/{len(windows)}")
            ) if spec.method == "gptq" else None
            bar.set_postfix_str(where)
            gu, dn, tok, fb = _quantize_layer(model, l, spec, hess, bar, device)
            hess = None  # freed before the next layer's are made: one layer's at a time
            if partial is None:
                gate_up.append(gu)
                down.append(dn)
            else:
                _save_layer(partial, l, key, gu, dn, tok, fb)
                layout = _layout(gu, dn)
            del gu, dn  # saved: dropped before the next layer is made
        tokens.append(tok)
        fallback.append(fb)
    bar.close()
    meta = {**key, "calib_tokens_per_expert": tokens, "rtn_fallback": fallback,
            "calibration": "full-precision inputs, one MoE layer at a time (not sequential)",
            "resumed_layers": resumed}
    if partial is not None:
        reader = LayerReader(partial, len(mods), spec.bits, layout)
        return QuantizedExperts(spec, SavedLayers(reader, 0), SavedLayers(reader, 1), meta)
    return QuantizedExperts(spec, gate_up, down, meta)


def _quantize_layer(model: nn.Module, l: int, spec: QuantSpec, hess, bar,
                    device: torch.device):
    """(gate_up, down, calibration tokens, RTN fallback) of MoE layer `l`, expert by expert
    (each read to `device`, wherever it lives). Each result is copied at once into the
    layer's host tensors (`_LayerTensors`: codes and scales [E, ...] per projection, one
    allocation each), and the matrices returned are views of them: nothing the layer keeps
    sits between the quantizer's temporaries, which the allocator can then reuse for the next
    expert (kept one allocation an expert, they pinned the freed temporaries around them in
    the heap: 2.2 GiB of host memory a DeepSeek-V2-Lite layer for its 0.27 GiB of codes)."""
    n_exp = expert_layout(model).num_experts
    kept = {name: _LayerTensors(n_exp) for name in ("gate_up", "down")}
    tok_l, fb_l = [], []
    for e in range(n_exp):
        # Views where the weights live; each matrix goes to `device` only while it is
        # quantized, and its result to the host at once (the draft goes to the device later,
        # in its backend's layout).
        w_gu, w_dn = expert_weights(model, l, e)
        n = hess[0][e].n if hess else 0
        use_rtn = hess is None or n < spec.min_tokens
        for w, h, name in ((w_gu, 0, "gate_up"), (w_dn, 1, "down")):
            q = rtn_quantize(w.to(device), spec.bits, spec.group) if use_rtn else \
                gptq_quantize(w.to(device), hess[h][e].h, spec.bits, spec.group, spec.damp)
            kept[name].put(e, q)
            del q  # its device copy, before the next matrix's
        tok_l.append(n)
        fb_l.append(bool(use_rtn and spec.method == "gptq"))
        bar.update(1)
    return kept["gate_up"].matrices, kept["down"].matrices, tok_l, fb_l


class _LayerTensors:
    """One projection's quantized experts of one layer on the host: codes [E, ...] and scales
    [E, ...], allocated when the first expert arrives, each expert copied in (`put`)."""

    def __init__(self, experts: int):
        self.experts = experts
        self.codes: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.matrices: list[QuantizedMatrix] = []

    def put(self, e: int, q: QuantizedMatrix) -> None:
        if self.codes is None:
            self.codes = torch.empty((self.experts, *q.codes.shape), dtype=q.codes.dtype)
            self.scales = torch.empty((self.experts, *q.scales.shape), dtype=q.scales.dtype)
        if q.codes.shape != self.codes.shape[1:] or q.scales.shape != self.scales.shape[1:] \
                or q.scales.dtype != self.scales.dtype or e != len(self.matrices):
            raise ValueError(f"expert {e}: {tuple(q.codes.shape)} codes, "
                             f"{tuple(q.scales.shape)} {q.scales.dtype} scales, unlike expert 0's")
        self.codes[e].copy_(q.codes)
        self.scales[e].copy_(q.scales)
        self.matrices.append(QuantizedMatrix(self.codes[e], self.scales[e], q.bits, q.group,
                                             q.shape))


def _save_layer(partial: Path, l: int, key: dict, gu: list, dn: list, tok: list, fb: list) -> None:
    """One finished MoE layer, written whole (temp file, then renamed), in the saved draft's
    format (`save`), with its own metadata beside it (`layer{l}.json`) for a resumed run."""
    from safetensors.torch import save_file

    partial.mkdir(parents=True, exist_ok=True)
    tensors = {f"{name}.{part}": t for name, layer in (("gate_up", gu), ("down", dn))
               for part, t in _stacked(layer).items()}
    meta = dict(key, tokens=tok, fallback=fb, **_layout(gu, dn))
    tmp = partial / f".layer{l}.tmp{os.getpid()}.safetensors"
    save_file(tensors, str(tmp), metadata={"format": "specter-int"})
    os.replace(tmp, partial / f"layer{l}.safetensors")
    (partial / f"layer{l}.json").write_text(json.dumps(meta))


def _finished_layer(partial: Path, l: int, key: dict):
    """(tokens, fallback, layout) of a layer an earlier, interrupted run finished for the same
    source and spec, or None; its codes are not read."""
    meta_path, data = partial / f"layer{l}.json", partial / f"layer{l}.safetensors"
    if not (meta_path.is_file() and data.is_file()):
        return None
    meta = json.loads(meta_path.read_text())
    if any(meta.get(k) != v for k, v in key.items()):
        return None
    return meta["tokens"], meta["fallback"], {k: meta[k] for k in ("shapes", "groups")}


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
    """One layer's experts as two tensors, codes [E, ...] and scales [E, ...], on the host:
    the layer's own tensors when its matrices are their views in order (`_quantize_layer`,
    `LayerReader`), else a stacked copy."""
    out = {}
    for part in ("codes", "scales"):
        ts = [getattr(q, part) for q in layer]
        base = ts[0]._base
        if base is not None and base.device.type == "cpu" and base.is_contiguous() \
                and tuple(base.shape) == (len(ts), *ts[0].shape) \
                and all(t.shape == ts[0].shape and t.data_ptr() == base[e].data_ptr()
                        for e, t in enumerate(ts)):
            out[part] = base
        else:
            out[part] = torch.stack(ts).contiguous().cpu()
    return out


def _layout(gate_up: list[QuantizedMatrix], down: list[QuantizedMatrix]) -> dict:
    """The matrix shapes and groups a saved layer is read back with."""
    return {"shapes": {"gate_up": list(gate_up[0].shape), "down": list(down[0].shape)},
            "groups": {"gate_up": gate_up[0].group, "down": down[0].group}}


def save(qe: QuantizedExperts, out: Path) -> None:
    """The quantized experts under `out`, one safetensors file per MoE layer
    (`layer{l}.safetensors`: gate_up.codes / .scales, down.codes / .scales) and quant.json;
    written layer by layer, so the host holds one layer at a time, not the whole draft's
    (DeepSeek-V2-Lite: 0.27 of 6.9 GiB; one file of every layer took two more whole copies,
    the stacked tensors and the serialised bytes). `ensure_quantized` does not call it: its
    layers are saved as they are made (`_save_layer`) and the folder published (`_publish`)."""
    from safetensors.torch import save_file

    first = qe.layer(0)
    meta = dict(qe.meta, **_layout(*first), layers=len(qe.gate_up))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for l in range(len(qe.gate_up)):
        gu, dn = first if l == 0 else qe.layer(l)
        first = None
        tensors = {f"{name}.{part}": t for name, layer in (("gate_up", gu), ("down", dn))
                   for part, t in _stacked(layer).items()}
        save_file(tensors, str(tmp / f"layer{l}.safetensors"), metadata={"format": "specter-int"})
        del tensors, gu, dn
    (tmp / "quant.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def _publish(partial: Path, qe: QuantizedExperts, out: Path) -> None:
    """The folder of layers `quantize_experts` saved (`partial`) becomes the saved draft
    `out`: quant.json written into it, then the folder renamed (nothing is read or copied);
    the per-layer metadata for resuming is dropped after."""
    reader = qe.gate_up.reader
    meta = dict(qe.meta, **reader.layout, layers=reader.layers)
    tmp = partial / f".quant.tmp{os.getpid()}.json"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, partial / "quant.json")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    for f in [*out.glob("layer*.json"), *out.glob(".layer*.tmp*")]:  # and an interrupted write's
        f.unlink()


def load(path: Path) -> QuantizedExperts:
    """The saved draft under `path`, its layers read from their files when asked
    (`SavedLayers`), one at a time: nothing of it is in memory yet."""
    meta = json.loads((path / "quant.json").read_text())
    spec = QuantSpec(**meta["spec"])
    layout = {k: meta[k] for k in ("shapes", "groups")}
    reader = LayerReader(path, meta["layers"], spec.bits, layout)
    return QuantizedExperts(spec, SavedLayers(reader, 0), SavedLayers(reader, 1), meta)


def ensure_quantized(model: nn.Module, tokenizer, spec: QuantSpec, cache_dir: Path,
                     device: torch.device, data_dir: Path | None = None,
                     progress: bool = False) -> tuple[QuantizedExperts, Path, bool]:
    """The quantized experts of `model` under `spec`: loaded when a matching file exists
    (same source checksum and spec), else made and saved layer by layer. Either way the
    result reads its layers from the saved files when asked (`load`): the host never holds
    the whole draft. Returns (experts, path, reused)."""
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
        _publish(partial, qe, out)
    return load(out), out, False


def _spec_digest(spec: QuantSpec, device: torch.device) -> str:
    """The spec, the quantizer's sources (a cache made by another quantizer would be other
    codes) and, for a CPU quantization, the fixed thread count it ran on (likewise)."""
    import hashlib

    key = dict(asdict(spec), code=hermetic.source_digest("specter/quant"),
               **({"build_threads": hermetic.BUILD_THREADS}
                  if torch.device(device).type == "cpu" else {}))
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
