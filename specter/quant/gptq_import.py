"""Importing GPTQ checkpoints (gptqmodel / AutoGPTQ layout) into the project's INT4 layout.

Owns: reading a GPTQ-format safetensors checkpoint's routed-expert tensors (`qweight` int32
[in * bits / 32, out] packed along the input, `qzeros` int32 [groups, out * bits / 32],
`scales` [groups, out], `g_idx`), checking they are symmetric with the midpoint zero the
project uses, and writing them in the project's packed layout (a 4-bit word's bytes are its
packed codes), gate and up fused (gate first, as Hugging Face fuses `gate_up_proj`), into
`QuantizedExperts`, one MoE layer at a time: the import reads the files' headers, and a
layer's tensors are read when a backend asks for that layer (`GptqLayers`), so the host holds
one layer of the draft at a time, as for a draft quantized here. Also running gptqmodel
itself on a project model (experts only) as the reference the built-in GPTQ is checked
against.
Does not own: the quantized layout (formats.py) or our own GPTQ (gptq.py).

Checkpoints store unfused per-expert projections: `...experts.{e}.gate_proj/up_proj/down_proj`
(DeepSeek, Qwen-MoE) or `...experts.{e}.w1/w3/w2` (Mixtral, Phi-3.5-MoE).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

from specter.errors import UserError
from specter.models.introspect import expert_layout, experts_modules
from specter.quant.calibrate import (LayerReader, QuantizedExperts, QuantSpec, SavedLayers,
                                     source_checksum)
from specter.quant.formats import QuantizedMatrix, pack_codes

NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits codes each (low bits first) -> codes, along `dim`."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    x = packed.to(torch.int32).unsqueeze(-1 if dim == 1 else 1)
    if dim == 0:  # [rows, cols] -> [rows * per, cols]
        q = (x >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
        return q.reshape(-1, packed.shape[1])
    q = (x >> shifts) & ((1 << bits) - 1)  # [rows, cols, per]
    return q.reshape(packed.shape[0], -1)


def _put_linear(t: dict[str, torch.Tensor], prefix: str, group: int, zero_offset: int,
                codes: torch.Tensor, scales: torch.Tensor) -> None:
    """One 4-bit GPTQ linear (`prefix`.qweight/qzeros/scales/g_idx) written into the layer's
    tensors: `codes` [out, in / 2] uint8 in `pack_codes`'s layout, `scales` [out, groups] (in
    their dtype); nothing of it is copied but into them."""
    qweight, qzeros, s = t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"], t[f"{prefix}.scales"]
    out, inp = qweight.shape[1], qweight.shape[0] * 8
    _check_plain(qzeros, t.get(f"{prefix}.g_idx"), prefix, 4, group, zero_offset, out, inp)
    if sys.byteorder == "little":
        # A word holds the codes of 8 consecutive inputs, lowest bits first, so its bytes in
        # memory order are input pairs, the lower input in the low nibble: `pack_codes`'s
        # layout. The transposed words are the packed codes as they are, with no unpacked
        # copy (an int32 a code: 8x the packed bytes).
        codes.view(torch.int32).copy_(qweight.T)
    else:
        unpacked = _unpack_int32(qweight, 4, dim=0).T.contiguous()  # [out, in], an int32 a code
        codes.copy_(pack_codes(unpacked.to(torch.uint8), 4))
    scales.copy_(s.T)


def _check_plain(qzeros: torch.Tensor, g_idx: torch.Tensor | None, prefix: str, bits: int,
                 group: int, zero_offset: int, out: int, inp: int) -> None:
    """One sentence unless the linear is symmetric with the midpoint zero and in input order
    (no act-order)."""
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64),
                                             torch.arange(inp) // group):
        raise UserError(f"{prefix}: act-order (permuted g_idx) GPTQ checkpoints are not supported; "
                        "quantize with desc_act=False.")
    zeros = _unpack_int32(qzeros, bits, dim=1)[:, :out] + zero_offset  # [groups, out]
    if not bool((zeros == (1 << (bits - 1))).all()):
        raise UserError(f"{prefix}: asymmetric GPTQ (zero points other than "
                        f"{1 << (bits - 1)}) is not supported; quantize with sym=True.")


def quantization_config(checkpoint: Path) -> dict:
    """The GPTQ settings of a checkpoint: AutoGPTQ's quantize_config.json, or the
    `quantization_config` of its config.json (GPTQModel and transformers write it there)."""
    qcfg_path, cfg_path = checkpoint / "quantize_config.json", checkpoint / "config.json"
    if qcfg_path.is_file():
        return json.loads(qcfg_path.read_text())
    if cfg_path.is_file():
        qcfg = json.loads(cfg_path.read_text()).get("quantization_config") or {}
        if qcfg.get("quant_method", "gptq") == "gptq" and "bits" in qcfg:
            return qcfg
    raise UserError(f"{checkpoint} has neither quantize_config.json nor a GPTQ "
                    "quantization_config in config.json: not a GPTQ checkpoint.")


def import_gptq(checkpoint: Path, model: nn.Module, dtype: torch.dtype | None = None) -> QuantizedExperts:
    """The routed experts of a GPTQ checkpoint of `model`'s architecture, read one MoE layer at
    a time: only the files' headers are read here (every expert's tensors are found and their
    shapes checked against `model`), and each layer's tensors when a backend asks for that
    layer (`GptqLayers`), so the host holds one layer of the draft at a time, as for a draft
    quantized here (calibrate.py `SavedLayers`), never the whole draft."""
    from safetensors import safe_open

    qcfg = quantization_config(checkpoint)
    bits, group = int(qcfg["bits"]), int(qcfg["group_size"])
    if bits != 4:
        raise UserError(f"only 4-bit GPTQ checkpoints import into the INT4 layout (got {bits}).")
    # "gptq" (v1) stores zero points minus one; "gptq_v2" stores them as they are.
    zero_offset = 0 if qcfg.get("checkpoint_format", "gptq") == "gptq_v2" else 1
    headers: dict[str, tuple[Path, list[int], str]] = {}  # name: (file, shape, dtype)
    for f in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                headers[k] = (f, s.get_shape(), s.get_dtype())
    # the experts' shapes wherever they live: a model whose experts went into its host store
    # (`HostExpertStore.from_model`) has empty fused parameters
    lay = expert_layout(model)
    n_exp, want_gu, want_dn = lay.num_experts, (2 * lay.inter, lay.hidden), (lay.hidden, lay.inter)
    layout = {"shapes": {"gate_up": list(want_gu), "down": list(want_dn)},
              "groups": {"gate_up": group, "down": group}}
    plan, packed = [], 0
    for layer_idx, _ in experts_modules(model):
        base = next((k.rsplit(".experts.", 1)[0] for k in headers
                     if k.startswith(f"model.layers.{layer_idx}.") and ".experts." in k), None)
        if base is None:
            raise UserError(f"{checkpoint}: no quantized experts for decoder layer {layer_idx}.")
        names = next((n for n in NAMES if f"{base}.experts.0.{n[0]}.qweight" in headers), None)
        if names is None:
            raise UserError(f"{checkpoint}: layer {layer_idx} experts are not GPTQ-quantized "
                            "gate/up/down (or w1/w3/w2) projections.")
        for e in range(n_exp):
            (g, gs), (u, us), (d, ds) = (_header_shape(headers, f"{base}.experts.{e}.{n}", bits,
                                                       checkpoint, dtype) for n in names)
            fused = (g[0] + u[0], g[1])
            if g[1] != u[1] or fused != want_gu or d != want_dn:
                raise UserError(f"{checkpoint}: expert {e} of decoder layer {layer_idx} is "
                                f"{fused[0] // 2}x{fused[1]}, this model's "
                                f"{want_gu[0] // 2}x{want_gu[1]}: a GPTQ checkpoint of "
                                "another model.")
            # what the imported matrices hold: packed codes and the scales in their dtype
            packed += (fused[0] * fused[1] + d[0] * d[1]) * bits // 8 + gs + us + ds
        if not plan:  # the checkpoint's settings, from one linear's small tensors: a
            # checkpoint made with act-order or asymmetric zeros is refused here, not when
            # its first layer is read (every linear is checked again then)
            prefix = f"{base}.experts.0.{names[0]}"
            with safe_open(str(headers[f"{prefix}.qzeros"][0]), framework="pt") as h:
                qzeros = h.get_tensor(f"{prefix}.qzeros")
            g_idx = None
            if f"{prefix}.g_idx" in headers:
                with safe_open(str(headers[f"{prefix}.g_idx"][0]), framework="pt") as h:
                    g_idx = h.get_tensor(f"{prefix}.g_idx")
            _check_plain(qzeros, g_idx, prefix, bits, group, zero_offset,
                         want_gu[0] // 2, want_gu[1])
        plan.append((base, names, n_exp))
    reader = GptqLayers(checkpoint, plan, bits, layout, {k: v[0] for k, v in headers.items()},
                        group, zero_offset, dtype, packed)
    spec = QuantSpec(method="gptqmodel", bits=bits, group=group)
    meta = {"spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
            "imported_from": str(checkpoint), "quantize_config": qcfg,
            "source_checksum": source_checksum(model)}
    return QuantizedExperts(spec, SavedLayers(reader, 0), SavedLayers(reader, 1), meta)


_ELEMENT_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def _header_shape(headers: dict, prefix: str, bits: int, checkpoint: Path,
                  dtype: torch.dtype | None) -> tuple[tuple[int, int], int]:
    """((out, in), the bytes of its scales as imported) of one GPTQ linear, from the headers."""
    for part in ("qweight", "qzeros", "scales"):
        if f"{prefix}.{part}" not in headers:
            raise UserError(f"{checkpoint}: {prefix}.{part} is missing: not a GPTQ checkpoint "
                            "of this model's experts.")
    rows, out = headers[f"{prefix}.qweight"][1]
    _, shape, kind = headers[f"{prefix}.scales"]
    size = dtype.itemsize if dtype is not None else _ELEMENT_BYTES.get(kind, 2)
    return (out, rows * 32 // bits), shape[0] * shape[1] * size


class GptqLayers(LayerReader):
    """The MoE layers of a 4-bit GPTQ checkpoint, read from its safetensors files when asked
    (`LayerReader.take`): layer l's linears, one at a time, are read (`safe_open`, the files
    opened for that layer only) and written into the layer's own tensors (`_put_linear`:
    codes and scales [E, ...] per projection, one allocation each, as calibrate.py's
    `_LayerTensors`; gate and up fused into gate_up's rows); nothing of the layer is kept once
    both projections were taken."""

    def __init__(self, checkpoint: Path, plan: list, bits: int, layout: dict,
                 files: dict[str, Path], group: int, zero_offset: int,
                 dtype: torch.dtype | None, packed: int):
        super().__init__(checkpoint, len(plan), bits, layout)
        self.plan, self.files, self.group, self.zero_offset = plan, files, group, zero_offset
        self.dtype, self._packed = dtype, packed

    def read(self, l: int) -> tuple[list[QuantizedMatrix], list[QuantizedMatrix]]:
        from contextlib import ExitStack

        from safetensors import safe_open

        base, names, n_exp = self.plan[l]
        shapes = {k: tuple(v) for k, v in self.layout["shapes"].items()}
        (two_i, hidden), (_, inter) = shapes["gate_up"], shapes["down"]
        # where each linear goes: gate, then up, in gate_up's rows (as Hugging Face fuses
        # them), down in down's
        rows = {names[0]: ("gate_up", slice(0, two_i // 2)),
                names[1]: ("gate_up", slice(two_i // 2, two_i)), names[2]: ("down", slice(None))}
        codes = {"gate_up": torch.empty((n_exp, two_i, hidden // 2), dtype=torch.uint8),
                 "down": torch.empty((n_exp, hidden, inter // 2), dtype=torch.uint8)}
        scales: dict[str, torch.Tensor] = {}  # [E, out, groups], in the first expert's dtype
        with ExitStack() as stack:
            handles: dict[Path, object] = {}

            def tensors(prefix: str) -> dict[str, torch.Tensor]:
                out = {}
                for part in ("qweight", "qzeros", "scales", "g_idx"):
                    key = f"{prefix}.{part}"
                    f = self.files.get(key)
                    if f is None:
                        continue
                    if f not in handles:  # read with pread: no mapped file pages stay
                        # in the process's memory while the layer is read
                        handles[f] = stack.enter_context(
                            safe_open(str(f), framework="pt", backend="pread"))
                    out[key] = handles[f].get_tensor(key)
                return out

            for e in range(n_exp):
                for n in names:
                    prefix = f"{base}.experts.{e}.{n}"
                    t = tensors(prefix)
                    name, r = rows[n]
                    if name not in scales:
                        s = t[f"{prefix}.scales"]
                        kind = s.dtype if self.dtype is None else self.dtype
                        scales[name] = torch.empty((n_exp, codes[name].shape[1], s.shape[0]),
                                                   dtype=kind)
                    _put_linear(t, prefix, self.group, self.zero_offset, codes[name][e, r],
                                scales[name][e, r])
                    del t  # what was read: written into the layer's tensors
        return tuple([QuantizedMatrix(codes[name][e], scales[name][e], self.bits, self.group,
                                      shapes[name]) for e in range(n_exp)]
                     for name in ("gate_up", "down"))

    def packed_bytes(self) -> int:
        """The imported codes' and scales' bytes of every layer, from the files' headers."""
        return self._packed


# -- the reference: gptqmodel itself ---------------------------------------------------------
def gptqmodel_available() -> bool:
    try:
        import gptqmodel  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def quantize_with_gptqmodel(checkpoint: Path, windows: list[torch.Tensor], bits: int, group: int,
                            out: Path) -> Path:
    """Quantize the routed experts of a local checkpoint with gptqmodel (attention, shared
    experts and dense MLPs excluded), on the given calibration windows; cached at `out`.

    Runs in a child process: gptqmodel (through `defuser`) patches transformers' MoE classes
    for the whole process, after which this process's models would have no fused experts."""
    from filelock import FileLock

    if (out / "quantize_config.json").exists():
        return out
    if not gptqmodel_available():
        raise UserError("the gptqmodel reference needs the gptqmodel package "
                        "(make setup installs the pinned version).")
    out.parent.mkdir(parents=True, exist_ok=True)
    # One process quantizes; a concurrent one waits and reuses (the child replaces `out`,
    # which would pull the folder from under a reader).
    with FileLock(str(out) + ".lock"):
        if not (out / "quantize_config.json").exists():
            _run_gptqmodel_child(checkpoint, windows, bits, group, out)
    return out


def _run_gptqmodel_child(checkpoint: Path, windows: list[torch.Tensor], bits: int, group: int,
                         out: Path) -> None:
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        calib = Path(tmp) / "calib.pt"
        torch.save([w[0].tolist() for w in windows], calib)
        # cwd: the temporary folder, since gptqmodel writes its logs/ into the working directory
        res = subprocess.run([sys.executable, "-m", "specter.quant.gptq_import", str(checkpoint.resolve()),
                              str(calib), str(bits), str(group), str(out.resolve())],
                             capture_output=True, text=True, cwd=tmp,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                 [str(Path(__file__).resolve().parents[2]),
                                  os.environ.get("PYTHONPATH", "")])))
    if res.returncode != 0:
        raise RuntimeError(f"gptqmodel failed on {checkpoint}:\n{res.stderr[-4000:]}")


def _gptqmodel_child(checkpoint: str, calib_file: str, bits: int, group: int, out: str) -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, min(2, os.cpu_count() or 1))))
    from gptqmodel import GPTQModel, QuantizeConfig

    skip = {r"-:.*self_attn.*": {}, r"-:.*shared_expert.*": {},
            r"-:.*\.mlp\.(gate|up|down)_proj.*": {}}  # dense MLP layers (DeepSeek's first)
    # Plain GPTQ as the project implements it: no act-order, no group-aware reordering
    # (gptqmodel 7 turns GAR on by default), the same 1% damping.
    qc = QuantizeConfig(bits=bits, group_size=group, desc_act=False, sym=True, dynamic=skip,
                        act_group_aware=False, damp_percent=0.01)
    calib = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in torch.load(calib_file)]
    out_path = Path(out)
    tmp = out_path.with_name(out_path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = GPTQModel.load(checkpoint, qc)
    model.quantize(calib, batch_size=1)
    model.save(str(tmp))
    shutil.rmtree(out_path, ignore_errors=True)
    os.replace(tmp, out_path)


if __name__ == "__main__":
    import sys

    c, f, b, g, o = sys.argv[1:6]
    _gptqmodel_child(c, f, int(b), int(g), o)
