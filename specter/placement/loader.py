"""The one loader: a placement plan carried out, tensor by tensor, for every system.

Owns: `load_model` (a model config -> its checkpoint folder -> the model on the device with
each tensor where the plan puts it), building the model's skeleton without weights
(parameters on `meta`; buffers such as RoPE's `inv_freq` computed by the modules themselves),
reading the checkpoint's safetensors files tensor by tensor and placing each non-expert tensor
on the device under the name transformers' own checkpoint conversion gives it
(`get_model_conversion_mapping`: Mixtral's and Phi's `block_sparse_moe` -> `mlp`, Phi's `gate`
-> `router`, ...). Each routed expert's tensors (per-expert `experts.N.{gate,up,down}_proj` /
`w1,w3,w2`, or fused `experts.{gate_up_proj,down_proj}`) go where the plan says: into the
experts module's fused parameters on the device (`experts="device"`), into its
`HostExpertStore` buffer (`"host"`, pinned beside a GPU: the host holds one copy of the
experts, the device never holds them; the experts modules keep meta tensors of their fused
shapes, what introspection reads, until the offloading runtime adopts them, and meanwhile the
model runs its experts from the store, offload/streamed.py), or nowhere (`"none"`: a second
instance whose experts are only an INT4 copy). `Placed` records what went where.
Random and inflated weights (`model.weights=random|inflated`, models/inflate.py) are made in
place by the same plan.
Does not own: finding or checking the folder (models/loading.py), the plan's rule (plan.py),
the device slots (offload/).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specter.config import ModelConfig
from specter.errors import UserError
from specter.models.introspect import MoESpec, experts_modules, moe_spec
from specter.models.loading import (load_tokenizer, native_classes, pick_attention, pick_dtype,
                                    resolve_checkpoint)
from specter.offload.store import STORE_ATTR, ExpertLayout, HostExpertStore
from specter.placement.bytes import is_routed_expert
from specter.placement.plan import RESIDENT, PlacementPlan

_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"^(?P<module>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
         "w2": "down", "gate_up_proj": "gate_up"}


@dataclass
class Placed:
    """Where the loader put every tensor: bytes placed on the device (tensor by tensor: on a
    CPU run the device is the host, so this is the only account of what went "to the
    device"), bytes copied into the host store, and the checkpoint names of each."""

    device_bytes: int = 0
    host_bytes: int = 0
    device_names: list[str] = field(default_factory=list)
    host_names: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # experts="none", and keys the model lacks


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    spec: MoESpec
    checkpoint: Path
    device: torch.device
    placed: Placed | None = None  # what the loader put where (None: made some other way)


def load_model(cfg: ModelConfig, device: torch.device, cache_dir: Path | None = None,
               seed: int = 0, progress: bool = True,
               plan: PlacementPlan = RESIDENT) -> LoadedModel:
    """The model of `cfg` on `device`, each tensor where `plan` puts it (plan.py; by default
    everything on the device), through this one loader for every system."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-tensor loading bars; the runner prints its own
    path = resolve_checkpoint(cfg, cache_dir, seed, progress)
    dtype = pick_dtype(cfg, device, path)
    config, model_class = native_classes(path)
    attn, attn_why = pick_attention(cfg, model_class, device)
    config._attn_implementation = attn
    if cfg.weights == "random":
        model, placed = load_random(model_class, config, dtype, device, plan, seed)
    elif cfg.weights == "inflated":
        model, placed = load_inflated(model_class, config, dtype, device, plan, path)
    else:
        model, placed = load_split(path, model_class, config, dtype, device, plan)
    _generation_config(model, path)
    model.config._specter_attn_why = attn_why
    return LoadedModel(model=model, tokenizer=load_tokenizer(path), spec=moe_spec(model),
                       checkpoint=path, device=device, placed=placed)


def _generation_config(model, path: Path) -> None:
    """The folder's generation_config.json, as `from_pretrained` reads it (its EOS ids)."""
    from transformers import GenerationConfig

    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))


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


def _param(value: torch.Tensor) -> nn.Parameter:
    """A loaded parameter as transformers' `from_pretrained` leaves it (a floating one requires
    grad: the model can be trained or differentiated after loading, as the zoo's tests do)."""
    return nn.Parameter(value, requires_grad=value.is_floating_point())


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf in module._parameters:
        module._parameters[leaf] = _param(value)
    else:
        module._buffers[leaf] = value


class _ExpertFiller:
    """Copies routed-expert tensors to where the plan puts them (`views(l, e)`: expert e of
    MoE layer l as (gate_up [2I, H], down [H, I]) views of its destination: a host store
    buffer, or the fused parameters on the device), checking each (layer, expert) gets every
    part exactly once."""

    def __init__(self, model: nn.Module, layout: ExpertLayout, layers: int, views):
        names = {id(m): n for n, m in model.named_modules()}
        self.moe_layer = {names[id(m)]: l for l, (_, m) in enumerate(experts_modules(model))}
        self.layout, self.layers, self.views = layout, layers, views
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
        layout = self.layout
        experts = [e] if e is not None else range(layout.num_experts)
        copied = 0
        for j in experts:
            src = read() if e is not None else read(j)
            gate_up, down = self.views(l, j)
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
        layout = self.layout
        for l in range(self.layers):
            for e in range(layout.num_experts):
                missing = {"gate", "up", "down"} - self.filled.get((l, e), set())
                if missing:
                    raise UserError(f"{folder}: the checkpoint has no {'/'.join(sorted(missing))} "
                                    f"weights for routed expert {e} of MoE layer {l}.")


def load_split(folder: Path, model_class, config, dtype: torch.dtype, device: torch.device,
               plan: PlacementPlan) -> tuple[nn.Module, Placed]:
    """The model of checkpoint `folder`, each tensor where `plan` puts it: non-expert weights
    on `device`; routed experts in the fused parameters on `device`, in a host store attached
    to the model (pinned when the plan says), or not loaded."""
    from safetensors import safe_open
    from transformers.core_model_loading import rename_source_key

    model = skeleton(model_class, config, dtype)
    mods = experts_modules(model)
    if not mods:
        raise UserError(f"{folder}: the model has no routed-experts modules to place.")
    layout = ExpertLayout.of(mods[0][1], dtype)
    store = _expert_destination(model, mods, layout, plan, device)
    filler = _ExpertFiller(model, layout, len(mods), _fused_views(mods) if store is None
                           else lambda l, e: layout.views(store.expert(l, e)))
    renamings, converters = _conversions(model)
    meta = model.state_dict()
    fp32 = _fp32_names(model, dtype)
    place = Placed()
    loaded: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if is_routed_expert(key):  # to where the plan puts the routed experts
                    where = plan.experts
                    renamed, _ = rename_source_key(key, renamings, [])
                    target = filler.target(renamed)
                    if target is None:
                        raise UserError(f"{file.name}: {key} looks like a routed expert's tensor "
                                        "but matches no experts module of the model.")
                    if where == "none":
                        place.skipped.append(key)
                        continue
                    sliced = f.get_slice(key)
                    copied = filler.fill(
                        key, target, lambda j=None, k=key: f.get_tensor(k) if j is None else sliced[j])
                    if where == "host":
                        place.host_bytes += copied
                        place.host_names.append(key)
                    else:
                        place.device_bytes += copied
                        place.device_names.append(key)
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
    if plan.experts != "none":
        filler.check_complete(folder)
    model.tie_weights()
    expert_params = {id(p) for _, m in mods for p in (m.gate_up_proj, m.down_proj)}
    missing = [n for n, p in model.named_parameters()
               if n not in loaded and id(p) not in expert_params]
    if missing:
        raise UserError(f"{folder}: the checkpoint has no weights for {len(missing)} parameter(s) "
                        f"of {model_class.__name__}, e.g. {missing[0]}.")
    _finish(model, device, store, place, loaded)
    return model, place


def _expert_destination(model: nn.Module, mods, layout: ExpertLayout, plan: PlacementPlan,
                        device: torch.device) -> HostExpertStore | None:
    """Where the routed experts will be copied: a host store (`"host"`), or the experts
    modules' fused parameters made empty on the device (`"device"`, returns None); nothing
    for `"none"`."""
    if plan.experts == "host":
        return HostExpertStore([i for i, _ in mods], layout, pin=plan.pin)
    if plan.experts == "device":
        for _, m in mods:
            m.gate_up_proj = _param(torch.empty(m.gate_up_proj.shape, dtype=layout.dtype,
                                                device=device))
            m.down_proj = _param(torch.empty(m.down_proj.shape, dtype=layout.dtype, device=device))
    return None


def _fused_views(mods):
    """`views(l, e)` of expert e in MoE layer l's fused parameters: (gate_up [2I, H], down [H, I])."""
    return lambda l, e: (mods[l][1].gate_up_proj.data[e], mods[l][1].down_proj.data[e])


def _finish(model: nn.Module, device: torch.device, store: HostExpertStore | None,
            place: Placed, placed: set[str] = frozenset()) -> None:
    """The buffers (computed on the CPU by their modules) to the device, and the store, when
    the experts went to one, attached: the model then runs its experts from it."""
    for name, buf in list(model.named_buffers()):
        if buf.device != device:
            _set(model, name, buf.to(device))
        if name not in placed:  # (a buffer read from the checkpoint is counted already)
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


def _on_every_core(fn, jobs) -> None:
    """fn(job) for every job on every host core at once (torch releases the GIL; one
    generator fills on one core: DeepSeek-V2-Lite's 27 GiB of experts would take a minute)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(fn, jobs))


class _Maker:
    """How a model without a checkpoint gets its values (`model.weights=random` or
    `inflated`): each non-expert parameter (`fill`), each routed expert's flat buffer
    (`expert`, by MoE layer index and expert, the same values wherever it is put), the buffers
    it sets (`buffers`), and the key naming every value (the host store is reused by the next
    job with the same key; the draft's source checksum follows from it)."""

    kind = ""

    def fill(self, name: str, value: torch.Tensor) -> None:
        raise NotImplementedError

    def expert(self, layout: ExpertLayout, l: int, e: int, out: torch.Tensor) -> None:
        raise NotImplementedError

    def buffers(self, model: nn.Module) -> None:
        pass


class _RandomMaker(_Maker):
    """Norms 1, biases 0, the rest N(0, initializer_range), seeded; expert (l, e) from its own
    generator."""

    kind = "random"

    def __init__(self, config, device: torch.device, seed: int):
        self.std = getattr(config, "initializer_range", None) or 0.02
        self.seed = seed
        self.gen = None if device.type == "meta" else \
            torch.Generator(device=device).manual_seed(seed)

    def fill(self, name, value):
        _random_fill(name, value, self.std, self.gen)

    def expert(self, layout, l, e, out):
        out.normal_(0.0, self.std,
                    generator=torch.Generator().manual_seed(self.seed * 1_000_003 + l * 1_009 + e))

    def key(self, config, dtype, plan) -> tuple:
        import json

        return (json.dumps(config.to_dict(), sort_keys=True, default=str), str(dtype), self.seed,
                plan.pin, self.std)


class _InflatedMaker(_Maker):
    """The real model's values inflated from a project-made model's (models/inflate.py)."""

    kind = "inflated"

    def __init__(self, config, folder: Path):
        import json

        from specter.models.inflate import Inflation
        from specter.placement.plan import RESIDENT

        meta = json.loads((folder / "specter_inflated.json").read_text())
        src = Path(meta["source_folder"])
        src_config, src_class = native_classes(src)
        small, _ = load_split(src, src_class, src_config, torch.float32, torch.device("cpu"),
                              RESIDENT)
        self.small_buffers = {n: b.detach().clone() for n, b in small.named_buffers()}
        self.source_sha = meta.get("source_weights_sha256", "")
        self.recipe = meta.get("recipe", "")
        self.inf = Inflation({k: v.detach() for k, v in small.state_dict().items()},
                             src_config.to_dict(), config.to_dict())
        self.layers = self.inf.moe_layers()

    def fill(self, name, value):
        if value.device.type != "meta":
            value.copy_(self.inf.tensor(name, tuple(value.shape)))

    def expert(self, layout, l, e, out):
        gate_up, down = layout.views(out)
        self.inf.expert(self.layers[l], e, gate_up, down)

    def buffers(self, model):
        from specter.models.inflate import set_rotary

        with torch.no_grad():
            set_rotary(model, self.small_buffers, self.inf)

    def key(self, config, dtype, plan) -> tuple:
        import json

        return (json.dumps(config.to_dict(), sort_keys=True, default=str), str(dtype),
                f"{self.source_sha}/{self.recipe}", plan.pin, "inflated")


def _made_experts(store: HostExpertStore, maker: _Maker) -> None:
    jobs = [(l, e) for l in range(store.num_moe_layers) for e in range(store.layout.num_experts)]
    _on_every_core(lambda le: maker.expert(store.layout, *le, store.expert(*le)), jobs)


def _made_fused(mods, layout: ExpertLayout, device: torch.device, maker: _Maker) -> None:
    """The experts' fused parameters on `device`, holding the values the maker gives the store
    (each layer made on the host, on every core, and copied in)."""
    for l, (_, m) in enumerate(mods):
        host = torch.empty(layout.num_experts, layout.numel, dtype=layout.dtype)
        _on_every_core(lambda e: maker.expert(layout, l, e, host[e]), range(layout.num_experts))
        views = [layout.views(host[e]) for e in range(layout.num_experts)]
        gate_up = torch.stack([g for g, _ in views]).to(device)
        down = torch.stack([d for _, d in views]).to(device)
        m.gate_up_proj = _param(gate_up)
        m.down_proj = _param(down)


# The last made host store, reused by the next run of the same model in this process (a
# sweep over systems and budgets: `run.py -m ...`): the experts of DeepSeek-V2-Lite are 27 GiB
# to make. Keyed by everything that determines its values; systems only read a store.
_LAST_RANDOM_STORE: dict = {}


def _made_store(key: tuple, layers: list[int], layout: ExpertLayout, pin: bool,
                maker: _Maker) -> HostExpertStore:
    store = _LAST_RANDOM_STORE.get(key)
    if store is None:
        _LAST_RANDOM_STORE.clear()  # one at a time: free the last model's before making
        store = HostExpertStore(layers, layout, pin=pin)
        _made_experts(store, maker)
        store.checksum = random_checksum(key)
        _LAST_RANDOM_STORE[key] = store
    return store


def held_random_store_bytes() -> int:
    """Host bytes of the made store this process keeps for the next job (`_made_store`):
    that job either reuses it or frees it before making its own, so a preflight counts them
    as memory it can have."""
    return sum(store.reserved_bytes for store in _LAST_RANDOM_STORE.values())


def random_checksum(key: tuple) -> str:
    """The draft's source checksum (quant/calibrate.py `source_checksum`) of made experts:
    their values follow from `key` (config, dtype, seed or source checksum, how made) and
    torch, so the key names them without hashing the store's bytes (DeepSeek-V2-Lite's 27 GiB:
    tens of seconds on one core)."""
    import hashlib

    blob = repr((key[0], key[1], key[2], key[4], torch.__version__)).encode()
    prefix = "inflated-" if key[4] == "inflated" else "random-"
    return prefix + hashlib.sha256(blob).hexdigest()[:16]


def load_random(model_class, config, dtype: torch.dtype, device: torch.device,
                plan: PlacementPlan, seed: int = 0) -> tuple[nn.Module, Placed]:
    """The model of `config` with random weights (`model.weights=random`: a real model's
    sizes without its checkpoint), each tensor made where `plan` puts it. Norms 1, biases 0,
    the rest N(0, initializer_range), seeded."""
    return load_made(model_class, config, dtype, device, plan, _RandomMaker(config, device, seed))


def load_inflated(model_class, config, dtype: torch.dtype, device: torch.device,
                  plan: PlacementPlan, folder: Path) -> tuple[nn.Module, Placed]:
    """The real model of `config` inflated from the project-made model that `folder`'s
    specter_inflated.json names (`model.weights=inflated`, models/inflate.py), each tensor
    made where `plan` puts it."""
    return load_made(model_class, config, dtype, device, plan, _InflatedMaker(config, folder))


def load_made(model_class, config, dtype: torch.dtype, device: torch.device,
              plan: PlacementPlan, maker: _Maker) -> tuple[nn.Module, Placed]:
    """A model without a checkpoint, each tensor made by `maker` where `plan` puts it: the
    non-expert weights on `device`, the routed experts in the host store (`"host"`), on the
    device (`"device"`) or not at all (`"none"`)."""
    model = skeleton(model_class, config, dtype)
    mods = experts_modules(model)
    expert_params = {id(p) for _, m in mods for p in (m.gate_up_proj, m.down_proj)}
    fp32 = _fp32_names(model, dtype)
    place = Placed()
    for name, p in list(model.named_parameters()):
        if id(p) in expert_params:
            continue
        keep = p.is_floating_point() and any(k in name for k in fp32)
        value = torch.empty(p.shape, dtype=torch.float32 if keep else p.dtype, device=device)
        maker.fill(name, value)
        _set(model, name, value)
        place.device_bytes += value.numel() * value.element_size()
        place.device_names.append(name)
    model.tie_weights()
    maker.buffers(model)
    layout = ExpertLayout.of(mods[0][1], dtype)
    store = None
    if plan.experts == "device":
        _made_fused(mods, layout, device, maker)
        place.device_bytes += sum(
            t.numel() * t.element_size() for _, m in mods for t in (m.gate_up_proj, m.down_proj))
    if plan.experts == "host":
        store = _made_store(maker.key(config, dtype, plan), [i for i, _ in mods], layout,
                            plan.pin, maker)
        place.host_bytes = sum(t.numel() * t.element_size() for layer in store.flat for t in layer)
    _finish(model, device, store, place)
    return model, place


def skeleton_bytes(model_class, config, dtype: torch.dtype):
    """What a checkpoint of `config` holds, from its weightless skeleton (for a model made with
    random weights, which has no safetensors headers to read): routed experts and the rest, at
    `dtype` (fp32 where transformers keeps it)."""
    from specter.placement.bytes import CheckpointBytes

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
