"""Importing GPTQ checkpoints (gptqmodel / AutoGPTQ layout) into the project's INT4 layout.

Owns: reading a GPTQ-format safetensors checkpoint's routed-expert tensors (`qweight` int32
[in * bits / 32, out] packed along the input, `qzeros` int32 [groups, out * bits / 32],
`scales` [groups, out], `g_idx`), unpacking them, checking they are symmetric with the
midpoint zero the project uses, and fusing gate and up (gate first, as Hugging Face fuses
`gate_up_proj`) into `QuantizedExperts`. Also running gptqmodel itself on a project model
(experts only) as the reference the built-in GPTQ is checked against.
Does not own: the quantized layout (formats.py) or our own GPTQ (gptq.py).

Checkpoints store unfused per-expert projections: `...experts.{e}.gate_proj/up_proj/down_proj`
(DeepSeek, Qwen-MoE) or `...experts.{e}.w1/w3/w2` (Mixtral, Phi-3.5-MoE).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from specter.errors import UserError
from specter.models.introspect import experts_modules
from specter.quant.calibrate import QuantizedExperts, QuantSpec, source_checksum
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


def gptq_matrix(t: dict[str, torch.Tensor], prefix: str, bits: int, group: int,
                zero_offset: int) -> QuantizedMatrix:
    """One GPTQ linear (`prefix`.qweight/qzeros/scales/g_idx) as a QuantizedMatrix."""
    qweight, qzeros, scales = t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"], t[f"{prefix}.scales"]
    codes = _unpack_int32(qweight, bits, dim=0).T.contiguous()  # [out, in]
    out, inp = codes.shape
    g_idx = t.get(f"{prefix}.g_idx")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64),
                                             torch.arange(inp) // group):
        raise UserError(f"{prefix}: act-order (permuted g_idx) GPTQ checkpoints are not supported; "
                        "quantize with desc_act=False.")
    zeros = _unpack_int32(qzeros, bits, dim=1)[:, :out] + zero_offset  # [groups, out]
    if not bool((zeros == (1 << (bits - 1))).all()):
        raise UserError(f"{prefix}: asymmetric GPTQ (zero points other than "
                        f"{1 << (bits - 1)}) is not supported; quantize with sym=True.")
    return QuantizedMatrix(pack_codes(codes.to(torch.uint8), bits), scales.T.contiguous(),
                           bits, group, (out, inp))


def _fuse(gate: QuantizedMatrix, up: QuantizedMatrix) -> QuantizedMatrix:
    codes = torch.cat([gate.unpacked(), up.unpacked()], dim=0)
    return QuantizedMatrix(pack_codes(codes, gate.bits), torch.cat([gate.scales, up.scales]),
                           gate.bits, gate.group, (gate.shape[0] + up.shape[0], gate.shape[1]))


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
    """The routed experts of a GPTQ checkpoint of `model`'s architecture."""
    from safetensors.torch import load_file

    qcfg = quantization_config(checkpoint)
    bits, group = int(qcfg["bits"]), int(qcfg["group_size"])
    if bits != 4:
        raise UserError(f"only 4-bit GPTQ checkpoints import into the INT4 layout (got {bits}).")
    # "gptq" (v1) stores zero points minus one; "gptq_v2" stores them as they are.
    zero_offset = 0 if qcfg.get("checkpoint_format", "gptq") == "gptq_v2" else 1
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    gate_up, down = [], []
    for layer_idx, module in experts_modules(model):
        n_exp = module.gate_up_proj.shape[0]
        base = next((k.rsplit(".experts.", 1)[0] for k in tensors
                     if k.startswith(f"model.layers.{layer_idx}.") and ".experts." in k), None)
        if base is None:
            raise UserError(f"{checkpoint}: no quantized experts for decoder layer {layer_idx}.")
        names = next((n for n in NAMES if f"{base}.experts.0.{n[0]}.qweight" in tensors), None)
        if names is None:
            raise UserError(f"{checkpoint}: layer {layer_idx} experts are not GPTQ-quantized "
                            "gate/up/down (or w1/w3/w2) projections.")
        gl, dl = [], []
        for e in range(n_exp):
            g, u, d = (gptq_matrix(tensors, f"{base}.experts.{e}.{n}", bits, group, zero_offset)
                       for n in names)
            fused = _fuse(g, u)
            if fused.shape != tuple(module.gate_up_proj.shape[1:]) or \
                    d.shape != tuple(module.down_proj.shape[1:]):
                raise UserError(f"{checkpoint}: expert {e} of decoder layer {layer_idx} is "
                                f"{fused.shape[0] // 2}x{fused.shape[1]}, this model's "
                                f"{module.gate_up_proj.shape[1] // 2}x"
                                f"{module.gate_up_proj.shape[2]}: a GPTQ checkpoint of "
                                "another model.")
            if dtype is not None:
                fused.scales, d.scales = fused.scales.to(dtype), d.scales.to(dtype)
            gl.append(fused)
            dl.append(d)
        gate_up.append(gl)
        down.append(dl)
    spec = QuantSpec(method="gptqmodel", bits=bits, group=group)
    meta = {"spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
            "imported_from": str(checkpoint), "quantize_config": qcfg,
            "source_checksum": source_checksum(model)}
    return QuantizedExperts(spec, gate_up, down, meta)


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
