"""What a checkpoint needs, read from its safetensors headers alone (no weights loaded): the
bytes of the routed experts and of everything else, in the dtype the run loads them in, and
whether the host and the device can hold them.

Owns: recognising a routed expert's tensor by its name in every hub layout the project knows
(per-expert `...experts.N.{gate,up,down}_proj` / `w1,w2,w3`, and fused
`...experts.{gate_up_proj,down_proj}[_blocks,_scales,_bias]`), the header byte count, and the
one-sentence refusals before loading.
Does not own: loading (loading.py) or the per-request budget (specter/budget.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from specter.errors import UserError

GiB = 2**30
RUNTIME_RESERVE = GiB  # Python, torch and the tokenizer of a CPU run, outside the weights
_ROUTED = re.compile(r"\.experts\.(\d+\.|gate_up_proj|down_proj|gate_proj|up_proj)")
_ELEMENT = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def size_text(n: int) -> str:
    """Bytes as GiB (MiB below one GiB), for log lines."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def is_routed_expert(name: str) -> bool:
    """A routed expert's tensor (not a shared expert's, not the router's)."""
    return bool(_ROUTED.search(name))


def header(path: Path) -> dict[str, dict]:
    """The tensor entries of one safetensors file's header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entries = json.loads(f.read(n))
    entries.pop("__metadata__", None)
    return entries


@dataclass(frozen=True)
class CheckpointBytes:
    expert_bytes: int  # routed experts, in the dtype they are loaded in
    non_expert_bytes: int  # embeddings, attention, norms, routers, shared experts, head
    tensors: int
    expert_tensors: int

    def as_record(self) -> dict:
        return {"ckpt_expert_bytes": self.expert_bytes,
                "ckpt_non_expert_bytes": self.non_expert_bytes}


def checkpoint_bytes(folder: Path, element_size: int | None = None) -> CheckpointBytes:
    """Byte counts from the headers of every safetensors file in `folder`; floating tensors
    counted at `element_size` bytes (the load dtype's), others as stored."""
    expert = other = n = n_exp = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        for name, t in header(file).items():
            numel = 1
            for d in t["shape"]:
                numel *= d
            stored = _ELEMENT.get(t["dtype"], 1)
            floating = t["dtype"] in ("F64", "F32", "F16", "BF16")
            size = numel * (element_size if element_size and floating else stored)
            n += 1
            if is_routed_expert(name):
                expert += size
                n_exp += 1
            else:
                other += size
    return CheckpointBytes(expert, other, n, n_exp)


def host_memory_bytes() -> int:
    """The memory this machine's processes can have (total physical memory)."""
    import psutil

    return psutil.virtual_memory().total


def check_fits(model_name: str, b: CheckpointBytes, experts_on_host: bool,
               device_bytes: int | None, host_bytes: int | None = None,
               loads_whole: bool = False) -> None:
    """One sentence when the host cannot hold the routed experts (offloading: every expert's
    one copy lives there) or the device cannot hold what it must (offloading: the non-expert
    weights; resident: everything). `device_bytes`: the device's memory or the run's budget;
    None: not checked (the CPU, where the device is the host). `loads_whole`: the loader puts
    the whole model on the device before the experts move to the host, so the device must
    hold everything once even for an offloading system."""
    host = host_memory_bytes() if host_bytes is None else host_bytes
    on_host = b.expert_bytes if experts_on_host else 0
    if experts_on_host and on_host > host:
        raise UserError(f"model={model_name} needs {on_host / GiB:.1f} GiB of host memory for "
                        f"its routed experts; this machine has {host / GiB:.1f} GiB.")
    if device_bytes is not None:
        whole = loads_whole or not experts_on_host
        need = b.non_expert_bytes + (b.expert_bytes if whole else 0)
        what = ("its non-expert weights" if not whole else
                "all its weights (resident)" if not experts_on_host else
                "all its weights while loading (the loader places the whole model on the device "
                "before the experts move to host memory)")
        if need > device_bytes:
            raise UserError(f"model={model_name} needs {need / GiB:.1f} GiB of device memory "
                            f"for {what}; the device has {device_bytes / GiB:.1f} GiB.")


def check_cpu_offload_fits(model_name: str, b: CheckpointBytes, slots: int, num_experts: int,
                           host_bytes: int | None = None, fp32: bool = False) -> None:
    """On the CPU the device is the host: an offloading run holds the host store (every
    expert), the device's slots (`slots` of `num_experts` per layer) and the non-expert
    weights in one memory, beside the process's own runtime (`RUNTIME_RESERVE`). One
    sentence when that memory cannot (`fp32`: the weights load in fp32, bfloat16 would halve
    them)."""
    host = host_memory_bytes() if host_bytes is None else host_bytes
    slot_bytes = b.expert_bytes * slots // num_experts
    need = b.expert_bytes + slot_bytes + b.non_expert_bytes + RUNTIME_RESERVE
    if need > host:
        raise UserError(f"model={model_name} offloaded on the CPU needs {need / GiB:.1f} GiB of "
                        f"memory (its experts {b.expert_bytes / GiB:.1f} GiB in the host store, "
                        f"{slots} slots/layer of them {slot_bytes / GiB:.1f} GiB on the 'device', "
                        f"the rest {b.non_expert_bytes / GiB:.1f} GiB and "
                        f"{RUNTIME_RESERVE / GiB:.1f} GiB for the process); this machine has "
                        f"{host / GiB:.1f} GiB: lower the budget"
                        + (" or load in bfloat16 (model.dtype=bfloat16)." if fp32 else "."))
