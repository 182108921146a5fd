"""Load a checkpoint with its routed experts straight into host memory, never on the device.

Owns: building the model's skeleton without weights (parameters on `meta`; buffers such as
RoPE's `inv_freq` computed by the modules themselves), reading the checkpoint's safetensors
files tensor by tensor, placing each non-expert tensor on the device under the name
transformers' own checkpoint conversion gives it (`get_model_conversion_mapping`:
Mixtral's and Phi's `block_sparse_moe` -> `mlp`, Phi's `gate` -> `router`, ...), and copying
each routed expert's tensors (per-expert `experts.N.{gate,up,down}_proj` / `w1,w3,w2`, or
fused `experts.{gate_up_proj,down_proj}`) into its `HostExpertStore` buffer (pinned beside a
GPU), so the host holds one copy of the experts and the device at most the non-expert
weights. The experts modules keep meta tensors of their fused shapes (what introspection
reads) until the offloading runtime adopts them; meanwhile the model runs its experts from
the store (offload/streamed.py). `experts="none"` loads no expert at all (a second instance
whose experts are only an INT4 copy).
Does not own: finding or checking the folder (loading.py), the device slots (offload/).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specter.errors import UserError
from specter.models.checkpoint_bytes import is_routed_expert
from specter.models.introspect import experts_modules
from specter.offload.store import STORE_ATTR, ExpertLayout, HostExpertStore

_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"^(?P<module>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
         "w2": "down", "gate_up_proj": "gate_up"}


@dataclass
class Placement:
    """Where the loader put every tensor: bytes placed on the device (tensor by tensor: on a
    CPU run the device is the host, so this is the only account of what went "to the
    device"), bytes copied into the host store, and the checkpoint names of each."""

    device_bytes: int = 0
    host_bytes: int = 0
    device_names: list[str] = field(default_factory=list)
    host_names: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # experts="none", and keys the model lacks


def skeleton(model_class, config, dtype: torch.dtype) -> nn.Module:
    """The model with every parameter on `meta` (no memory, no initialisation) and its
    buffers real, as its modules compute them."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_class._from_config(config, dtype=dtype)
    return model.eval()


def _fp32_names(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Name patterns transformers keeps in fp32 when loading at `dtype` (DeepSeek-V2's
    router `gate.weight`, GLM's `e_score_correction_bias`)."""
    keep = list(getattr(model, "_keep_in_fp32_modules_strict", None) or []) \
        if dtype in (torch.float16, torch.bfloat16) else []
    if dtype == torch.float16:
        keep += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return keep


def _conversions(model: nn.Module):
    """(renamings, converters) transformers applies to this model's checkpoint keys."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


class _ExpertFiller:
    """Copies routed-expert tensors into the store, checking each (layer, expert) gets every
    part exactly once."""

    def __init__(self, model: nn.Module, store: HostExpertStore | None):
        names = {id(m): n for n, m in model.named_modules()}
        self.moe_layer = {names[id(m)]: l for l, (_, m) in enumerate(experts_modules(model))}
        self.store = store
        self.filled: dict[tuple[int, int], set[str]] = {}

    def target(self, renamed: str) -> tuple[int, int | None, str] | None:
        """(MoE layer, expert or None for a fused tensor, part) of a renamed checkpoint key."""
        m = _PER_EXPERT.match(renamed) or _FUSED.match(renamed)
        if m is None or m.group("module") not in self.moe_layer:
            return None
        e = int(m.group("e")) if "e" in m.groupdict() else None
        return self.moe_layer[m.group("module")], e, _PART[m.group("proj")]

    def fill(self, key: str, where: tuple[int, int | None, str], read) -> int:
        """Copy one checkpoint tensor (`read()` gives it, or `read(e)` one expert's slice of a
        fused one) into the store; returns the bytes copied."""
        l, e, part = where
        layout = self.store.layout
        experts = [e] if e is not None else range(layout.num_experts)
        copied = 0
        for j in experts:
            src = read() if e is not None else read(j)
            gate_up, down = layout.views(self.store.expert(l, j))
            i = layout.inter
            dst = {"gate": gate_up[:i], "up": gate_up[i:], "gate_up": gate_up, "down": down}[part]
            if tuple(src.shape) != tuple(dst.shape):
                raise UserError(f"checkpoint tensor {key} has shape {tuple(src.shape)}; the "
                                f"model's config makes it {tuple(dst.shape)}.")
            dst.copy_(src)
            copied += dst.numel() * dst.element_size()
            parts = self.filled.setdefault((l, j), set())
            new = {"gate", "up"} if part == "gate_up" else {part}
            if parts & new:
                raise UserError(f"checkpoint tensor {key} fills expert {j} of MoE layer {l} "
                                "a second time.")
            parts |= new
        return copied

    def check_complete(self, folder: Path) -> None:
        layout = self.store.layout
        for l in range(self.store.num_moe_layers):
            for e in range(layout.num_experts):
                missing = {"gate", "up", "down"} - self.filled.get((l, e), set())
                if missing:
                    raise UserError(f"{folder}: the checkpoint has no {'/'.join(sorted(missing))} "
                                    f"weights for routed expert {e} of MoE layer {l}.")


def load_split(folder: Path, model_class, config, dtype: torch.dtype, device: torch.device,
               experts: str = "host") -> tuple[nn.Module, Placement]:
    """The model of checkpoint `folder`: non-expert weights on `device`; routed experts in a
    host store attached to the model (`experts="host"`, pinned beside a GPU) or not loaded
    (`"none"`)."""
    from safetensors import safe_open

    model = skeleton(model_class, config, dtype)
    mods = experts_modules(model)
    if not mods:
        raise UserError(f"{folder}: the model has no routed-experts modules to keep in host memory.")
    store = None
    if experts == "host":
        store = HostExpertStore([i for i, _ in mods], ExpertLayout.of(mods[0][1], dtype),
                                pin=device.type == "cuda")
    filler = _ExpertFiller(model, store)
    renamings, converters = _conversions(model)
    from transformers.core_model_loading import rename_source_key

    meta = model.state_dict()
    fp32 = _fp32_names(model, dtype)
    place = Placement()
    loaded: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if is_routed_expert(key):
                    renamed, _ = rename_source_key(key, renamings, [])
                    where = filler.target(renamed)
                    if where is None:
                        raise UserError(f"{file.name}: {key} looks like a routed expert's tensor "
                                        "but matches no experts module of the model.")
                    if store is None:
                        place.skipped.append(key)
                        continue
                    sliced = f.get_slice(key)
                    place.host_bytes += filler.fill(
                        key, where, lambda j=None, k=key: f.get_tensor(k) if j is None else sliced[j])
                    place.host_names.append(key)
                    continue
                target, converter = rename_source_key(key, renamings, converters,
                                                      model.base_model_prefix, meta)
                if converter is not None:
                    raise UserError(f"{file.name}: {key} needs transformers' weight conversion "
                                    f"({converter}), which this loader applies to routed experts only.")
                if target not in meta:
                    place.skipped.append(key)
                    continue
                value = f.get_tensor(key)
                if value.is_floating_point():
                    keep = any(p in target for p in fp32)
                    value = value.to(torch.float32 if keep else dtype)
                value = value.to(device)
                _set(model, target, value)
                loaded.add(target)
                place.device_bytes += value.numel() * value.element_size()
                place.device_names.append(key)
    if store is not None:
        filler.check_complete(folder)
    model.tie_weights()
    expert_params = {id(p) for _, m in mods for p in (m.gate_up_proj, m.down_proj)}
    missing = [n for n, p in model.named_parameters()
               if n not in loaded and id(p) not in expert_params]
    if missing:
        raise UserError(f"{folder}: the checkpoint has no weights for {len(missing)} parameter(s) "
                        f"of {model_class.__name__}, e.g. {missing[0]}.")
    _finish(model, device, store, place)
    return model, place


def _finish(model: nn.Module, device: torch.device, store: HostExpertStore | None,
            place: Placement) -> None:
    """The buffers (computed on the CPU by their modules) to the device, and the store, when
    the experts went to one, attached: the model then runs its experts from it."""
    for name, buf in list(model.named_buffers()):
        if buf.device != device:
            _set(model, name, buf.to(device))
            place.device_bytes += buf.numel() * buf.element_size()
    if store is not None:
        setattr(model, STORE_ATTR, store)
        from specter.offload.streamed import stream_from

        stream_from(model, store)


def _random_fill(name: str, value: torch.Tensor, std: float, gen: torch.Generator | None) -> None:
    """transformers' default initialisation by name: norms 1, biases 0, the rest N(0, std)."""
    if value.device.type == "meta":
        return
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and value.dim() == 1 and leaf == "weight":
        value.fill_(1.0)
    elif leaf == "bias" or leaf.endswith("_bias"):
        value.zero_()
    else:
        value.normal_(0.0, std, generator=gen)


def _random_expert(out: torch.Tensor, std: float, seed: int, l: int, e: int) -> None:
    """Expert `e` of MoE layer `l` as one flat buffer N(0, std), from its own generator: the
    same values wherever the expert is put (host store or device parameters)."""
    out.normal_(0.0, std, generator=torch.Generator().manual_seed(seed * 1_000_003 + l * 1_009 + e))


def _on_every_core(fn, jobs) -> None:
    """fn(job) for every job on every host core at once (torch releases the GIL; one
    generator fills on one core: DeepSeek-V2-Lite's 27 GiB of experts would take a minute)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(fn, jobs))


def _random_experts(store: HostExpertStore, std: float, seed: int) -> None:
    jobs = [(l, e) for l in range(store.num_moe_layers) for e in range(store.layout.num_experts)]
    _on_every_core(lambda le: _random_expert(store.expert(*le), std, seed, *le), jobs)


def _random_fused(mods, layout: ExpertLayout, device: torch.device, std: float,
                  seed: int) -> None:
    """The experts' fused parameters on `device`, holding the values `_random_experts` gives
    the store (each layer made on the host, on every core, and copied in)."""
    for l, (_, m) in enumerate(mods):
        host = torch.empty(layout.num_experts, layout.numel, dtype=layout.dtype)
        _on_every_core(lambda e: _random_expert(host[e], std, seed, l, e), range(layout.num_experts))
        views = [layout.views(host[e]) for e in range(layout.num_experts)]
        gate_up = torch.stack([g for g, _ in views]).to(device)
        down = torch.stack([d for _, d in views]).to(device)
        m.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        m.down_proj = nn.Parameter(down, requires_grad=False)


# The last random host store made, reused by the next run of the same model in this process (a
# sweep over systems and budgets: `run.py -m ...`): the experts of DeepSeek-V2-Lite are 27 GiB
# to draw. Keyed by everything that determines its values; systems only read a store.
_LAST_RANDOM_STORE: dict = {}


def _random_store(key: tuple, layers: list[int], layout: ExpertLayout, pin: bool, std: float,
                  seed: int) -> HostExpertStore:
    store = _LAST_RANDOM_STORE.get(key)
    if store is None:
        _LAST_RANDOM_STORE.clear()  # one at a time: free the last model's before drawing
        store = HostExpertStore(layers, layout, pin=pin)
        _random_experts(store, std, seed)
        store.checksum = random_checksum(key)
        _LAST_RANDOM_STORE[key] = store
    return store


def held_random_store_bytes() -> int:
    """Host bytes of the random store this process keeps for the next job (`_random_store`):
    that job either reuses it or frees it before drawing its own, so a preflight counts them
    as memory it can have."""
    return sum(store.reserved_bytes for store in _LAST_RANDOM_STORE.values())


def random_checksum(key: tuple) -> str:
    """The draft's source checksum (quant/calibrate.py `source_checksum`) of random experts:
    their values follow from `key` (config, dtype, seed, std) and torch's generator, so the key
    names them without hashing the store's bytes (DeepSeek-V2-Lite's 27 GiB: tens of seconds
    on one core)."""
    import hashlib

    blob = repr((key[0], key[1], key[2], key[4], torch.__version__)).encode()
    return "random-" + hashlib.sha256(blob).hexdigest()[:16]


def load_random(model_class, config, dtype: torch.dtype, device: torch.device,
                experts: str = "host", seed: int = 0) -> tuple[nn.Module, Placement]:
    """The model of `config` with random weights (`model.weights=random`: a real model's
    sizes without its checkpoint): the non-expert weights made on `device`, the routed experts
    made in the host store (`experts="host"`), on the device (`"device"`) or not at all
    (`"none"`). Norms 1, biases 0, the rest N(0, initializer_range), seeded."""
    model = skeleton(model_class, config, dtype)
    mods = experts_modules(model)
    expert_params = {id(p) for _, m in mods for p in (m.gate_up_proj, m.down_proj)}
    fp32 = _fp32_names(model, dtype)
    std = getattr(config, "initializer_range", None) or 0.02
    gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
    place = Placement()
    for name, p in list(model.named_parameters()):
        if id(p) in expert_params:
            continue
        keep = p.is_floating_point() and any(k in name for k in fp32)
        value = torch.empty(p.shape, dtype=torch.float32 if keep else p.dtype, device=device)
        _random_fill(name, value, std, gen)
        _set(model, name, value)
        place.device_bytes += value.numel() * value.element_size()
        place.device_names.append(name)
    model.tie_weights()
    layout = ExpertLayout.of(mods[0][1], dtype)
    store = None
    if experts == "device":
        _random_fused(mods, layout, device, std, seed)
        place.device_bytes += sum(
            t.numel() * t.element_size() for _, m in mods for t in (m.gate_up_proj, m.down_proj))
    if experts == "host":
        import json

        key = (json.dumps(config.to_dict(), sort_keys=True, default=str), str(dtype), seed,
               device.type == "cuda", std)
        store = _random_store(key, [i for i, _ in mods], layout, device.type == "cuda", std, seed)
        place.host_bytes = sum(t.numel() * t.element_size() for layer in store.flat for t in layer)
    _finish(model, device, store, place)
    return model, place


def skeleton_bytes(model_class, config, dtype: torch.dtype):
    """What a checkpoint of `config` holds, from its weightless skeleton (for a model made with
    random weights, which has no safetensors headers to read): routed experts and the rest, at
    `dtype` (fp32 where transformers keeps it)."""
    from specter.models.checkpoint_bytes import CheckpointBytes

    model = skeleton(model_class, config, dtype)
    mods = experts_modules(model)
    expert_params = {id(p) for _, m in mods for p in (m.gate_up_proj, m.down_proj)}
    fp32 = _fp32_names(model, dtype)
    expert = other = n = 0
    for name, p in model.named_parameters():
        elem = 4 if p.is_floating_point() and any(k in name for k in fp32) else p.element_size()
        if id(p) in expert_params:
            expert += p.numel() * elem
        else:
            other += p.numel() * elem
        n += 1
    return CheckpointBytes(expert, other, n, 2 * len(mods), expert_modules=len(mods))
