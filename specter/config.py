"""Typed run configuration: the only shape configuration takes inside the code.

Hydra composes YAML at the edge (`run.py`); `RunConfig.from_dict` converts it once, checking
every key, and nothing past that point sees a DictConfig or calls `cfg.get(..., default)`.
Validation that needs no model (names, counts) happens here; validation that needs the
model's expert count (budget slots) happens in `budget.py`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from specter.clock.kinds import HARDWARE_CLOCKS, ClockKind, clock_kind
from specter.errors import UserError
from specter.registry import SYSTEMS, recipe_module

# model.weights=inflated: the project-made model each real model inflates from, by the real
# model's config key (specter/models/inflate.py grows it).
INFLATE_SOURCES = {"deepseek": "small_deepseek"}


@dataclass
class ModelConfig:
    name: str
    source: str  # "project": made by specter.models.zoo; "hf": a real Hugging Face checkpoint
    hub_id: str | None = None
    path: str | None = None  # local checkpoint folder for source=hf
    dtype: str = "auto"  # auto: float32 on CPU; on a GPU the checkpoint's bfloat16 where it computes it, else float16
    # Resident expert slots per MoE layer for the named budgets (docs/paper-notes.md); a budget
    # name missing here falls back to the proportional rule in budget.py.
    budget_slots: dict[str, int] = field(default_factory=dict)
    # The paper's reference device memory (GiB) of the named budgets (docs/paper-notes.md: DeepSeek
    # 24/18, Qwen 20/16, Phi 40/32). Recorded beside the slots; the Transformers baseline
    # sizes its device map from it (accelerate's max_memory), not from the slot count.
    budget_gb: dict[str, float] = field(default_factory=dict)
    paper_k: int | None = None  # the paper's chosen speculation depth, for reference
    stands_for: str | None = None  # for project-made models: the real model they scale down
    # "checkpoint": the weights of `path` / `hub_id`; "random": the named real model built from
    # its published config.json with random weights (its real sizes, no download: measuring
    # the engine on a GPU; random weights do not route like the trained model)
    weights: str = "checkpoint"
    # "inflated": the named real model at its real sizes, built from a project-made model of
    # its architecture, every MoE layer live and routing with that model's trained routers
    # (specter/models/inflate.py; DeepSeek-V2-Lite from small_deepseek). `inflate_from` names
    # another source (e.g. tiny_deepseek); `layers` cuts a random or inflated model's depth
    # (real widths, fewer layers: CPU measurements at real size).
    inflate_from: str | None = None
    layers: int | None = None
    # Widths of a random or inflated model other than the published ones (config.json keys,
    # e.g. {hidden_size: 96}): reduced-size checks of the same chain on the CPU
    narrow: dict | None = None
    # The attention implementation: auto (flash_attention_2 on CUDA where the flash-attn extra
    # is installed and the architecture supports it, else sdpa; sdpa on the CPU), or eager,
    # sdpa, flash_attention_2 (refused in one sentence where it cannot run)
    attn: str = "auto"
    # Project-made models: "reference" decodes the build shipped under reference_models/ when
    # its recipe is today's (the same weights on every machine), "local" trains the recipe on
    # this CPU (cached under $SPECTER_CACHE); rows say which (`model.origin`)
    build: str = "reference"

    def validate(self) -> None:
        if self.attn not in ("auto", "eager", "sdpa", "flash_attention_2"):
            raise UserError(f"model.attn must be auto, eager, sdpa or flash_attention_2 "
                            f"(got '{self.attn}').")
        if self.weights not in ("checkpoint", "random", "inflated"):
            raise UserError(f"model.weights must be checkpoint, random or inflated (got "
                            f"'{self.weights}').")
        if self.weights != "checkpoint" and self.source == "project":
            raise UserError(f"model.weights={self.weights} builds a real model from its "
                            f"published config; model={self.name} is project-made (its "
                            "weights are built already): use model=deepseek, qwen, phi, "
                            "mixtral, qwen3, olmoe or glm.")
        if self.weights == "inflated":
            if self.name not in INFLATE_SOURCES:
                raise UserError(f"model.weights=inflated builds {', '.join(INFLATE_SOURCES)} "
                                f"from a project-made model; model={self.name} has no "
                                "inflation rule (model.weights=random gives its sizes).")
        if (self.layers is not None or self.inflate_from or self.narrow) \
                and self.weights == "checkpoint":
            raise UserError("model.layers, model.narrow and model.inflate_from apply to "
                            "model.weights=random or inflated only.")
        if self.layers is not None and self.layers < 2:
            raise UserError(f"model.layers must be at least 2 (got {self.layers}).")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise UserError(f"model.dtype must be auto, float32, float16 or bfloat16 "
                            f"(got '{self.dtype}').")
        for key, value in [("model.paper_k", self.paper_k),
                           *((f"model.budget_slots.{n}", v) for n, v in self.budget_slots.items())]:
            if value is not None and value < 1:
                raise UserError(f"{key} must be at least 1 (got {value}).")
        for n, value in self.budget_gb.items():
            if not value > 0:
                raise UserError(f"model.budget_gb.{n} must be a positive number (got {value}).")


@dataclass
class BudgetConfig:
    name: str  # high | low | full | custom
    slots: int | None = None  # overrides the per-model table
    # Device memory in GiB: resolved into resident slots by the byte accounting of what the
    # system keeps on the device (specter/budget.py `resolve_gb`); exclusive with `slots`.
    gb: float | None = None
    staging: int = 0  # expert-sized staging buffers (a pool shared by all layers) where
    # prefetches land when every resident slot of their layer is held; counted in the bytes
    reserve_gb: float = 1.0  # CUDA context, allocator slack and activations, kept out of `gb`

    def validate(self) -> None:
        if self.slots is not None and self.slots < 1:
            raise UserError(f"budget.slots must be at least 1 (got {self.slots}).")
        if self.gb is not None and not (0 < self.gb < float("inf")):
            raise UserError(f"budget.gb must be a positive number of GiB (got {self.gb}).")
        if self.gb is not None and self.slots is not None:
            raise UserError("set budget.gb or budget.slots, not both: each decides the resident "
                            "slots per layer.")
        if self.staging < 0:
            raise UserError(f"budget.staging must be >= 0 (got {self.staging}).")
        if not (0 <= self.reserve_gb < float("inf")):
            raise UserError(f"budget.reserve_gb must be >= 0 (got {self.reserve_gb}).")


@dataclass
class SystemConfig:
    """The decoding system: its `name`, and its own knobs. A system with knobs declares them
    as a subclass (`Config` in its recipe module, e.g. specter/specter_recipe.py `SpecterConfig`),
    which `RunConfig.from_dict` builds for that system, so a knob the system does not have
    is refused by construction; conf/system/<name>.yaml lists the same knobs."""

    name: str

    def validate(self) -> None:
        """Range checks of the knobs (none here)."""


def system_config_class(name: str) -> type[SystemConfig]:
    """System `name`'s typed settings: its recipe's `Config` (a SystemConfig subclass with its
    knobs; the recipe named in specter/registry.py), else the bare SystemConfig (no knobs)."""
    if name not in SYSTEMS:
        return SystemConfig
    return vars(recipe_module(name)).get("Config", SystemConfig)


def settings_of(name: str) -> list[str]:
    return [f.name for f in fields(system_config_class(name)) if f.name != "name"]


def check_setting(name: str, knob: str) -> None:
    """`system.<knob>` given for system `name`: one sentence if it has no such setting."""
    if name not in SYSTEMS or knob in settings_of(name):
        return
    owners = [s for s in SYSTEMS if knob in settings_of(s)]
    if owners:
        raise UserError(f"system.{knob} applies to {', '.join(owners)} only, not to system={name}.")
    own = settings_of(name)
    raise UserError(f"unknown setting 'system.{knob}'; system={name} has "
                    + (f"the settings {', '.join('system.' + k for k in own)}." if own
                       else "no settings."))


@dataclass
class DatasetConfig:
    name: str  # gsm8k | wikitext2 | humaneval | gpqa | c4 | custom
    prompts: list[str] = field(default_factory=list)  # dataset=custom only

    def validate(self) -> None:
        prompts = self.prompts
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(t, str) for t in prompts):
            raise UserError("dataset.prompts must be a list of texts, e.g. "
                            f"dataset.prompts='[\"first prompt\", \"second\"]' (got {prompts!r}).")
        blank = [i for i, t in enumerate(prompts) if not t.strip()]
        if blank:
            raise UserError(f"dataset.prompts has an empty prompt (entry {blank[0]}); every "
                            "prompt needs text.")
        if prompts and self.name != "custom":
            raise UserError(f"dataset.prompts applies to dataset=custom only, not to "
                            f"dataset={self.name}.")


@dataclass
class HardwareConfig:
    """The machine a run executes on (`device`) and the one its time is measured for.

    clock: "wall" real time; "virtual" time from the cost model of the profile below (the
    system still runs for real); "emulated" real time with transfers emulated by a sleeping
    copy-engine thread, slowed as much as this machine's compute is slower than the profile's.
    """

    name: str
    device: str = "auto"  # auto | cpu | cuda
    clock: str = "wall"  # wall | virtual | emulated (specter/clock/kinds.py)
    charge: str = "own"  # auto | own | real: the real model's sizes (auto: where the model stands for one)
    matrix_flops: float = 0.0  # the modelled device (virtual / emulated clocks)
    mem_bandwidth_Bps: float = 0.0
    launch_overhead_s: float = 0.0
    # The engine the profile models (docs/calibration.md): "ideal" (a roofline plus kernel
    # launches: an optimised engine) or "hf" (an eager framework: Hugging Face / PyTorch eager).
    engine: str = "ideal"
    layer_overhead_s: float = 0.0  # framework cost per decoder layer per forward (attention, norms, router glue)
    expert_overhead_s: float = 0.0  # framework cost per MLP call (a routed or shared expert, a dense MLP)
    # Framework cost of one fused INT4 draft layer call (the Triton kernel and its host-side
    # routing prep); null: expert_overhead_s, as for any MLP call (the public-fit profiles).
    draft_overhead_s: float | None = None
    # Host cost the offload runtime adds per MoE layer per forward over HF's own experts loop
    # (routing read on the host, residency bookkeeping, copy issue and wait); 0 in the
    # public-fit profiles, fit on a GPU by scripts/calibrate_gpu.py (LRU vs resident).
    offload_layer_overhead_s: float = 0.0
    # A counted profile (specter/clock/counted.py): the host's cost of each launching
    # operation the code dispatches and of each host sync, charged as the run decodes,
    # instead of the constants above (which a counted profile sets to 0).
    host_op_s: float = 0.0
    sync_s: float = 0.0
    # The device's cost of each kernel it runs, beside the kernel's roofline time (docs/clocks.md,
    # "The kernel floor"): charged for every kernel inside a captured graph (counted when it is
    # captured, specter/clock/graph_kernels.py); an eager kernel costs max(host_op_s, this).
    kernel_floor_s: float = 0.0
    # Charged as a publication deploys the model (0: the model's own dtype): bits per weight
    # of the routed experts and of the attention, one scale and zero per quant_group weights
    # (e.g. Mixtral-offloading's HQQ: expert_bits=2 or 3, attn_bits=4). quant_meta_bytes: the
    # scale and zero of one group together (4: two fp16 values; HQQ's 8-bit quantized scale and
    # zero: 2); attn_quant_group: the attention's group size where it differs (0: quant_group).
    expert_bits: int = 0
    attn_bits: int = 0
    quant_group: int = 64
    quant_meta_bytes: int = 4
    attn_quant_group: int = 0
    h2d_bandwidth_Bps: float = 0.0
    h2d_latency_s: float = 0.0
    # hardware=auto on a machine without a GPU: decoding systems run on the virtual clock of
    # this GPU profile instead (conf/hardware/<name>.yaml), said in one line; null: wall clock.
    cpu_fallback: str | None = None
    host_matrix_flops: float = 0.0  # the host CPU (systems that compute experts on the host)
    host_mem_bandwidth_Bps: float = 0.0
    host: str = "assumed"  # whose host rates those are: a conf/host/ profile (host=NAME) or assumed

    @property
    def kind(self) -> ClockKind:
        """What `clock` is, by trait (charged, modelled, measured, real, sleeps)."""
        if self.clock not in HARDWARE_CLOCKS:
            raise UserError(f"hardware.clock must be wall, virtual or emulated (got '{self.clock}').")
        return clock_kind(self.clock)

    def validate(self) -> None:
        for key in ("quant_group", "quant_meta_bytes"):
            if getattr(self, key) < 1:
                raise UserError(f"hardware.{key} must be at least 1 (got "
                                f"{getattr(self, key)}).")
        if self.attn_quant_group < 0:
            raise UserError(f"hardware.attn_quant_group must be 0 (quant_group's) or a group size "
                            f"(got {self.attn_quant_group}).")
        for key in ("expert_bits", "attn_bits"):
            if getattr(self, key) not in (0, 2, 3, 4, 8):
                raise UserError(f"hardware.{key} must be 0 (unquantized), 2, 3, 4 or 8 (got "
                                f"{getattr(self, key)}).")


@dataclass
class WorkloadConfig:
    items: int = 5
    prompt_tokens: int = 16
    max_new_tokens: int = 128
    repeats: int = 3
    stop_on_eos: bool = True
    # 0: greedy (the protocol). > 0: speculative sampling, for the systems that speculate; each
    # (request, repeat) draws from its own generator seeded from `seed`, so reruns repeat.
    temperature: float = 0.0
    # Requests decoded together: consecutive items in batches of `batch` (the last may be
    # smaller), each (batch, repeat) decoded as one; 1: one request at a time.
    batch: int = 1

    def validate(self) -> None:
        for key, value in (("workload.items", self.items),
                           ("workload.max_new_tokens", self.max_new_tokens),
                           ("workload.repeats", self.repeats),
                           ("workload.prompt_tokens", self.prompt_tokens),
                           ("workload.batch", self.batch)):
            if value < 1:
                raise UserError(f"{key} must be at least 1 (got {value}).")
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise UserError(f"workload.temperature must be >= 0 (got {self.temperature}).")


@dataclass
class QuantConfig:
    """The INT4 self-draft: how the target's routed experts are quantized and executed."""

    method: str = "gptq"  # gptq | rtn | gptqmodel (made by gptqmodel, imported)
    bits: int = 4  # 2 | 3 | 4 | 8 (the draft kernels run 4; others for the precision study)
    group: int = 128
    damp: float = 0.01
    min_tokens: int = 32  # experts seeing fewer calibration tokens fall back to RTN
    calib_tokens: int = 8192
    # auto | reference | cpu_int4 | cuda_int4 | triton | gather_int4 | fused_int4
    backend: str = "auto"
    graphs: str = "auto"  # auto | on | off: replay each draft layer as a CUDA graph (CUDA, a
    # fixed-shape backend: triton, gather_int4 or fused_int4; auto: on where both hold)
    path: str | None = None  # a GPTQ checkpoint (GPTQModel / AutoGPTQ layout) to import as is

    def validate(self) -> None:
        for key, value in [("quant.group", self.group), ("quant.calib_tokens", self.calib_tokens)]:
            if value is not None and value < 1:
                raise UserError(f"{key} must be at least 1 (got {value}).")
        if not self.damp > 0:
            raise UserError(f"quant.damp must be a positive number (got {self.damp}).")
        if self.bits not in (2, 3, 4, 8):
            raise UserError(f"quant.bits must be 2, 3, 4 or 8 (got {self.bits}).")
        backends = ("auto", "reference", "cpu_int4", "cuda_int4", "triton", "gather_int4",
                    "fused_int4")
        if self.backend not in backends:  # specter/quant/kernels.py BACKENDS, and auto
            raise UserError(f"unknown quant.backend '{self.backend}'; choose one of: "
                            f"{', '.join(backends)}.")
        if self.graphs not in ("auto", "on", "off"):
            raise UserError(f"unknown quant.graphs '{self.graphs}'; choose one of: "
                            "auto, on, off.")


@dataclass
class OffloadConfig:
    """How offloaded experts' device slots are managed (every offloading system)."""

    policy: str = "lru"  # eviction: a name in specter/offload/policy.py POLICIES (lru | lfu)
    grouped: bool | str = "auto"  # resident experts' kernel: auto | true (grouped_mm) | padded | false (a loop)
    # verification's DeepSeek-V2 layers in fixed-shape pieces (decoding/verify_pieces.py): auto
    # (captured on CUDA; charged as captured on a virtual clock whose profile has a kernel
    # floor) | on | off
    verify_pieces: str = "auto"

    def validate(self) -> None:
        if self.verify_pieces not in ("auto", "on", "off"):
            raise UserError(f"offload.verify_pieces must be auto, on or off "
                            f"(got {self.verify_pieces!r}).")
        if self.grouped not in ("auto", True, False, "padded"):
            raise UserError(f"offload.grouped must be auto, true, false or padded "
                            f"(got {self.grouped!r}).")


@dataclass
class SpecConfig:
    """Self-speculative decoding (systems that speculate)."""

    k: int | str | None = None  # draft depth K; "auto": the depth profiler; "adaptive": per
    # window (specter/decoding/depth.py AdaptiveDepth); None: model.paper_k, else 4
    k_max: int = 32  # spec.k=adaptive: the deepest window
    # The depth profiler (k=auto): K values swept, prompts (the five datasets round-robin, after
    # the evaluated items) and runs per prompt; its choice is stored and reused.
    profile_ks: list[int] = field(default_factory=lambda: [2, 4, 6, 8, 12, 16, 20, 24, 32])
    profile_prompts: int = 25
    profile_runs: int = 3
    # spec.k=auto profiles a system with its own K (SpecMoEOff, SpecMoE) too: a tuned-depth
    # baseline, a variant beside the one at its paper's depth
    tune_own_k: bool = False
    # The draft step as one compiled graph over a static draft cache (decoding/compiled_draft.py):
    # on | off | auto (compiled where its shapes are static: one row, greedy, gather_int4 or
    # fused_int4; on CUDA captured whole as one CUDA graph; quant.backend=auto takes fused_int4
    # for it on CUDA, gather_int4 on the CPU, on a real clock: quant/build.py)
    compile: str = "auto"
    compile_backend: str = "inductor"  # torch.compile's backend ("eager": graph check only)

    def validate(self) -> None:
        k = self.k
        if isinstance(k, str) and k not in ("auto", "adaptive"):
            raise UserError(f"spec.k must be a positive integer, auto or adaptive (got '{k}').")
        if self.k_max < 1:
            raise UserError(f"spec.k_max must be at least 1 (got {self.k_max}).")
        if isinstance(k, int) and k < 1:
            raise UserError(f"spec.k (the draft depth K) must be at least 1 (got {k}).")
        if not self.profile_ks or min(self.profile_ks) < 1:
            raise UserError("spec.profile_ks must list draft depths of at least 1.")
        if self.profile_prompts < 1 or self.profile_runs < 1:
            raise UserError("spec.profile_prompts and spec.profile_runs must be at least 1.")
        if self.compile not in COMPILE_MODES:
            raise UserError(f"spec.compile must be one of {', '.join(COMPILE_MODES)} "
                            f"(got '{self.compile}').")


COMPILE_MODES = ("auto", "on", "off")  # spec.compile and system.compile


@dataclass
class RunConfig:
    model: ModelConfig
    budget: BudgetConfig
    system: SystemConfig
    dataset: DatasetConfig
    hardware: HardwareConfig
    workload: WorkloadConfig
    quant: QuantConfig = field(default_factory=QuantConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    experiment: str = "default"
    out_dir: str = "results/default"
    seed: int = 0  # run randomness (sampling); does not change a project-made model
    model_seed: int = 0  # seed a project-made model was built with
    cache_dir: str | None = None  # project-made models; default ~/.cache/specter
    data_dir: str | None = None  # fetched datasets; default data/cache
    progress: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        cfg = _build(cls, d, "")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Each group checks its own knobs (its `validate`), then what spans groups."""
        if not str(self.out_dir).strip():
            raise UserError("out_dir is empty; name a folder for the records (e.g. out_dir=results/x).")
        for key in ("out_dir", "cache_dir", "data_dir"):  # `~` means the home folder
            value = getattr(self, key)
            if isinstance(value, str) and value.startswith("~"):
                setattr(self, key, os.path.expanduser(value))
        for group in (self.dataset, self.model, self.hardware, self.quant, self.workload,
                      self.spec):
            group.validate()
        for key in ("seed", "model_seed"):
            if getattr(self, key) < 0:
                raise UserError(f"{key} must be >= 0 (got {getattr(self, key)}).")
        self.system.validate()
        # offload.policy names a class of specter/offload/policy.py: the composition root
        # checks it (compose.settle), so this module imports nothing of the core
        self.offload.validate()
        self.budget.validate()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(cls, d: Any, prefix: str):
    """Construct dataclass `cls` from a plain dict, rejecting unknown keys by name."""
    if not isinstance(d, dict):
        raise UserError(f"config '{prefix.rstrip('.')}' must be a mapping, got {d!r}.")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown and issubclass(cls, SystemConfig):
        for key in unknown:
            check_setting(str(d.get("name")), key)
    if unknown:
        raise UserError(f"unknown config key(s) {', '.join(prefix + u for u in unknown)}; "
                        f"valid keys here: {', '.join(prefix + k for k in known)}.")
    kwargs = {}
    for name, f in known.items():
        if name not in d:
            continue
        sub = _NESTED.get((cls.__name__, name))
        if sub is SystemConfig and isinstance(d[name], dict):
            sub = system_config_class(str(d[name].get("name")))
        kwargs[name] = _build(sub, d[name], f"{prefix}{name}.") if sub else _check(f, d[name], prefix)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise UserError(f"incomplete config at '{prefix or 'top level'}': {e}.") from None


_SCALARS = {"int": (int,), "str": (str,), "bool": (bool,), "float": (int, float)}
INT_LIMIT = 2**63  # every integer setting fits a signed 64-bit integer (torch's, for seeds)


def _check(f, value: Any, prefix: str) -> Any:
    """Reject a value of the wrong scalar type (annotations are strings here), and a number
    no setting accepts (`check_number`); lists and mappings of numbers are checked by entry."""
    kinds = [k.strip() for k in str(f.type).split("|")]
    name = f"{prefix}{f.name}"
    if value is None and "None" in kinds:
        return value
    if isinstance(value, (list, tuple)) and "int" in str(f.type):
        for v in value:
            check_number(name, v, integer=True)
    if isinstance(value, dict) and ("int" in str(f.type) or "float" in str(f.type)):
        for k, v in value.items():
            check_number(f"{name}.{k}", v, integer="float" not in str(f.type))
    for k in kinds:
        ok = _SCALARS.get(k)
        if ok and isinstance(value, ok) and not (k == "int" and isinstance(value, bool)):
            if k in ("int", "float"):
                check_number(name, value, integer=k == "int")
            return value
    if any(k in _SCALARS for k in kinds):
        raise UserError(f"{name} must be {f.type} (got {value!r}).")
    return value


def check_number(name: str, value: Any, integer: bool) -> None:
    """What every numeric setting of this project shares: a number (a whole one where an
    integer is meant), finite, not negative, and for integers below 2**63. A setting's own
    range beyond that is checked by its section's `validate`."""
    kind = "a whole number" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (integer and not isinstance(value, int)):
        raise UserError(f"{name} must be {kind} (got {value!r}).")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{name} must be a finite number (got {value!r}).")
    if value < 0:
        raise UserError(f"{name} must be >= 0 (got {value!r}).")
    if integer and value >= INT_LIMIT:
        raise UserError(f"{name} = {value} is too large (at most {INT_LIMIT - 1}).")


def hardware_from_dict(d: dict[str, Any]) -> HardwareConfig:
    """A hardware profile (conf/hardware/<name>.yaml as a dict), checked like a run's."""
    return _build(HardwareConfig, d, "hardware.")


_NESTED = {("RunConfig", "model"): ModelConfig, ("RunConfig", "budget"): BudgetConfig,
           ("RunConfig", "system"): SystemConfig, ("RunConfig", "dataset"): DatasetConfig,
           ("RunConfig", "hardware"): HardwareConfig, ("RunConfig", "workload"): WorkloadConfig,
           ("RunConfig", "quant"): QuantConfig, ("RunConfig", "spec"): SpecConfig,
           ("RunConfig", "offload"): OffloadConfig}


def section_classes() -> dict[str, type]:
    """The run configuration's sections (`workload`, `spec`, ...) and their typed classes."""
    return {name: cls for (owner, name), cls in _NESTED.items() if owner == "RunConfig"}
