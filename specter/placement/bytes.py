"""What a checkpoint needs, read from its safetensors headers alone (no weights loaded): the
bytes of the routed experts and of everything else, in the dtype the run loads them in, and
whether the host and the device can hold them.

Owns: recognising a routed expert's tensor by its name in every hub layout the project knows
(per-expert `...experts.N.{gate,up,down}_proj` / `w1,w2,w3`, and fused
`...experts.{gate_up_proj,down_proj}[_blocks,_scales,_bias]`), the header byte count, the
memory this process can have (`host_memory`: what is available now, within its cgroup's
limit), what else a run holds besides the weights (`run_extras`: the INT4 draft's copies,
GPTQ's Hessians), and the one-sentence refusals before loading.
Does not own: loading (loader.py), where each tensor goes (plan.py), the per-request budget (specter/budget.py), the host
store's chunk plan (offload/pinned.py, whose reserved bytes the host check counts).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specter.errors import UserError
from specter.quant.formats import draft_expert_bytes

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


Extra = tuple[str, int]  # (what, bytes): one more thing a memory holds during the run


@dataclass(frozen=True)
class CheckpointBytes:
    expert_bytes: int  # routed experts, in the dtype they are loaded in
    non_expert_bytes: int  # embeddings, attention, norms, routers, shared experts, head
    tensors: int
    expert_tensors: int
    expert_modules: int = 0  # MoE layers holding routed experts (0: not counted)
    # What else the run holds in host memory (the INT4 draft's copies, GPTQ's Hessians on the
    # CPU): set by the run's preflight (`run_extras`), counted by both host checks.
    host_extra: tuple[Extra, ...] = ()

    def as_record(self) -> dict:
        return {"ckpt_expert_bytes": self.expert_bytes,
                "ckpt_non_expert_bytes": self.non_expert_bytes}


def checkpoint_bytes(folder: Path, element_size: int | None = None) -> CheckpointBytes:
    """Byte counts from the headers of every safetensors file in `folder`; floating tensors
    counted at `element_size` bytes (the load dtype's), others as stored."""
    expert = other = n = n_exp = 0
    modules: set[str] = set()
    for file in sorted(Path(folder).glob("*.safetensors")):
        for name, t in header(file).items():
            numel = 1
            for d in t["shape"]:
                numel *= d
            stored = _ELEMENT.get(t["dtype"], 1)
            floating = t["dtype"] in ("F64", "F32", "F16", "BF16")
            size = numel * (element_size if element_size and floating else stored)
            n += 1
            routed = _ROUTED.search(name)
            if routed:
                expert += size
                n_exp += 1
                modules.add(name[:routed.start()])
            else:
                other += size
    return CheckpointBytes(expert, other, n, n_exp, len(modules))


# -- the memory this process can have --------------------------------------------------------
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
_V1_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as 2^63 - 1 rounded down to a page


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None when it is absent or says "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.split() for line in lines)
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def _own_cgroup(self_cgroup: Path, v2: bool) -> str:
    """This process's cgroup path from /proc/self/cgroup: the `0::` line (v2) or the line
    naming the memory controller (v1); "" when unknown."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and ((v2 and parts[0] == "0" and parts[1] == "")
                                or (not v2 and "memory" in parts[1].split(","))):
            return parts[2].strip().strip("/")
    return ""


def cgroup_available_bytes(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int | None:
    """What this process's memory cgroup still lets it have: over its cgroup and each
    ancestor up to `root`, the smallest limit less what that cgroup uses, its page cache
    (active and inactive file pages, which the kernel reclaims before it refuses) not
    counted as used. cgroup v2 (`root`/cgroup.controllers: memory.max, memory.current) or v1
    (`root`/memory: memory.limit_in_bytes, memory.usage_in_bytes, memory.stat's
    hierarchical_memory_limit). None when no cgroup limits memory ("max", or v1's 2^63)."""
    v2 = (root / "cgroup.controllers").is_file()
    base = root if v2 else root / "memory"
    if not base.is_dir():
        return None
    own = _own_cgroup(self_cgroup, v2)
    d = base / own if own else base
    if not d.is_dir():  # a cgroup namespace: what is mounted at `root` is this cgroup
        d = base
    dirs = [d, *[p for p in d.parents if p.is_relative_to(base)]] if d != base else [base]
    best = None
    for d in dirs:
        stat = _read_stat(d / "memory.stat")
        if v2:
            limit, used = _read_int(d / "memory.max"), _read_int(d / "memory.current")
            cache = stat.get("active_file", 0) + stat.get("inactive_file", 0)
        else:
            limit, used = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
            hier = stat.get("hierarchical_memory_limit")
            if hier is not None and (limit is None or hier < limit):
                limit = hier
            if limit is not None and limit >= _V1_NO_LIMIT:
                limit = None
            cache = (stat.get("total_active_file", stat.get("active_file", 0))
                     + stat.get("total_inactive_file", stat.get("inactive_file", 0)))
        if limit is None:
            continue
        left = max(0, limit - max(0, (used or 0) - cache))
        best = left if best is None else min(best, left)
    return best


def host_memory(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP,
                available: int | None = None) -> tuple[int, str]:
    """(bytes, where the figure comes from): the memory this process can have now, the
    smaller of what the kernel says is available (MemAvailable: free memory and reclaimable
    page cache; psutil's `available`, or `available` when given) and what its memory
    cgroup's limit leaves it (`cgroup_available_bytes`). Not the machine's total: a
    workstation's other processes and a container's limit both take from that."""
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    cgroup = cgroup_available_bytes(cgroup_root, self_cgroup)
    if cgroup is not None and cgroup < available:
        return cgroup, "what its memory cgroup's limit leaves"
    return available, "the memory available now"


def host_memory_bytes(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP,
                      available: int | None = None) -> int:
    """The memory this process can have now (`host_memory`)."""
    return host_memory(cgroup_root, self_cgroup, available)[0]


# -- what a run holds besides the weights ---------------------------------------------------
def _layout(b: CheckpointBytes, num_experts: int, element_size: int, hidden: int):
    """(experts in all, bytes of one, its intermediate width I) from the header counts; None
    when the headers did not say how many MoE layers there are."""
    n = b.expert_modules * num_experts
    if not n or not hidden or not b.expert_bytes:
        return None
    per_expert = b.expert_bytes // n
    return n, per_expert, per_expert // element_size // (3 * hidden)


def store_reserved_bytes(b: CheckpointBytes, num_experts: int, pinned: bool = True) -> int:
    """What the host store of these experts takes: offload/pinned.py's plan of it, as torch's
    pinned allocator reserves it when `pinned` (the store on CUDA); the experts' bytes when
    the headers did not say how many MoE layers hold them."""
    from specter.offload.pinned import plan_store

    n = b.expert_modules * num_experts
    if not n or not b.expert_bytes:
        return b.expert_bytes
    return plan_store(-(-b.expert_bytes // n), n).reserved_bytes(pinned)


def run_extras(b: CheckpointBytes, num_experts: int, hidden: int, element_size: int,
               device_type: str, draft: bool, bits: int = 4, group: int = 128,
               gptq: bool = False) -> tuple[tuple[Extra, ...], tuple[Extra, ...]]:
    """(host, device): what else a run holds besides its weights, from the header counts.
    `draft` (the system drafts with INT4 experts): the host holds one MoE layer of the
    quantized experts at a time, while it is made (calibrate.py saves each layer and drops
    it) or read back from its file (calibrate.py `SavedLayers`; a GPTQ checkpoint's,
    gptq_import.py `GptqLayers`), and the backend makes its own copy on the device layer by
    layer (draft_mode.py; budget.py counts it there); on the CPU the device is the host, so
    the host holds that copy too. `gptq` (the draft is quantized in this run with GPTQ; a
    reused saved draft needs none): one MoE layer's Hessians at a time, E x (H^2 + I^2)
    float64, made on the run's device (calibrate.py `layer_hessians`)."""
    layout = _layout(b, num_experts, element_size, hidden)
    if layout is None or not draft:
        return (), ()
    n, _, inter = layout
    per_expert = draft_expert_bytes(hidden, inter, bits, group, element_size)
    host: list[Extra] = [("one MoE layer of the INT4 draft", num_experts * per_expert)]
    device: list[Extra] = []
    if device_type == "cpu":
        host.append(("the INT4 draft backend's copy", n * per_expert))
    if gptq:
        hessians = ("one MoE layer's GPTQ Hessians", num_experts * (hidden**2 + inter**2) * 8)
        (host if device_type == "cpu" else device).append(hessians)
    return tuple(host), tuple(device)


# -- the refusals ------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _listing(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def check_fits(model_name: str, b: CheckpointBytes, experts_on_host: bool,
               device_bytes: int | None, host_bytes: int | None = None,
               loads_whole: bool = False, store_bytes: int | None = None,
               device_extra: Sequence[Extra] = ()) -> None:
    """One sentence when the host cannot hold the routed experts (offloading: every expert's
    one copy lives there) beside `b.host_extra`, or the device cannot hold what it must
    (offloading: the non-expert weights; resident: everything; and `device_extra`).
    `device_bytes`: the device's memory or the run's budget; None: not checked (the CPU,
    where the device is the host). `host_bytes`: the memory this process can have
    (`host_memory` when None). `store_bytes`: what the host store's allocations take (its
    pinned chunks as torch reserves them: `store_reserved_bytes`), the experts' bytes when
    None. `loads_whole`: the loader puts the whole model on the device before the experts
    move to the host, so the device must hold everything once even for an offloading
    system."""
    host, why = host_memory() if host_bytes is None else (host_bytes, "")
    store = b.expert_bytes if store_bytes is None else store_bytes
    items = ([("its routed experts", store)] if experts_on_host else []) + list(b.host_extra)
    need = sum(v for _, v in items)
    if items and need > host:
        words = []
        for what, v in items:
            if what == "its routed experts" and len(items) == 1 and store == b.expert_bytes:
                words.append(what)
            elif what == "its routed experts" and store != b.expert_bytes:
                words.append(f"{what} ({_gib(b.expert_bytes)}, pinned as {_gib(store)})")
            else:
                words.append(f"{what} ({_gib(v)})")
        raise UserError(f"model={model_name} needs {_gib(need)} of host memory for "
                        f"{_listing(words)}; this process can have {_gib(host)}"
                        + (f" ({why})." if why else "."))
    if device_bytes is not None:
        whole = loads_whole or not experts_on_host
        extra = sum(v for _, v in device_extra)
        need = b.non_expert_bytes + (b.expert_bytes if whole else 0) + extra
        what = ("its non-expert weights" if not whole else
                "all its weights (resident)" if not experts_on_host else
                "all its weights while loading (the loader places the whole model on the device "
                "before the experts move to host memory)")
        if device_extra:
            what += " and " + _listing([f"{w} ({_gib(v)})" for w, v in device_extra])
        if need > device_bytes:
            raise UserError(f"model={model_name} needs {need / GiB:.1f} GiB of device memory "
                            f"for {what}; the device has {device_bytes / GiB:.1f} GiB.")


def check_cpu_offload_fits(model_name: str, b: CheckpointBytes, slots: int, num_experts: int,
                           host_bytes: int | None = None, fp32: bool = False) -> None:
    """On the CPU the device is the host: an offloading run holds the host store (every
    expert), the device's slots (`slots` of `num_experts` per layer), the non-expert
    weights and `b.host_extra` (the INT4 draft's copies, GPTQ's Hessians) in one memory,
    beside the process's own runtime (`RUNTIME_RESERVE`). One sentence when the memory this
    process can have (`host_bytes`; `host_memory` when None) cannot (`fp32`: the weights
    load in fp32, bfloat16 would halve them)."""
    host, why = host_memory() if host_bytes is None else (host_bytes, "")
    slot_bytes = b.expert_bytes * slots // num_experts
    extra = sum(v for _, v in b.host_extra)
    need = b.expert_bytes + slot_bytes + b.non_expert_bytes + extra + RUNTIME_RESERVE
    if need > host:
        extras = "".join(f", {what} {_gib(v)}" for what, v in b.host_extra)
        raise UserError(f"model={model_name} offloaded on the CPU needs {need / GiB:.1f} GiB of "
                        f"memory (its experts {b.expert_bytes / GiB:.1f} GiB in the host store, "
                        f"{slots} slots/layer of them {slot_bytes / GiB:.1f} GiB on the 'device', "
                        f"the rest {b.non_expert_bytes / GiB:.1f} GiB{extras} and "
                        f"{RUNTIME_RESERVE / GiB:.1f} GiB for the process); this process can have "
                        f"{host / GiB:.1f} GiB" + (f" ({why})" if why else "")
                        + ": lower the budget"
                        + (" or load in bfloat16 (model.dtype=bfloat16)." if fp32 else "."))
