"""What the core is built from: small frozen specs, made once from the settings by the
composition root (specter/compose.py `job`), never the run's whole configuration.

- `OffloadSpec`: the device's expert slots per MoE layer, the staging buffers, the eviction
  policy, the resident experts' kernel.
- `DraftSpec`: the INT4 draft's quantization, its compiled step, its depth K.
- `ClockSpec`: the hardware a run is timed for (its clock, link and cost profile) and the
  sizes it charges (the model's own, or the real model it stands for).
- `Files`: where models, drafts and calibration data are cached, and how a model is loaded
  again (a second instance).
- `Job`: one system's engine to build: the loaded model, the device, the system's own
  settings (its recipe's `Config`), the resolved budget, the specs above, and the shape of
  the requests it serves (rows decoded together, temperature, the longest request, stop).

Each knob is checked once, where the settings are (specter/config.py `RunConfig.validate`,
specter/compose.py's preflight); a part built from a spec trusts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specter.budget import ResolvedBudget
from specter.config import HardwareConfig, ModelConfig, QuantConfig, SystemConfig
from specter.placement.loader import LoadedModel


@dataclass(frozen=True)
class OffloadSpec:
    slots: int  # resident expert slots per MoE layer on the device
    staging: int = 0  # expert-sized staging buffers shared by all layers
    policy: str = "lru"  # eviction: a name in offload/policy.py POLICIES
    grouped: bool | str = "auto"  # resident experts' kernel: auto | True | "padded" | False
    verify_pieces: str = "auto"  # verification in pieces: auto | on | off (verify_pieces.py)


@dataclass(frozen=True)
class DraftSpec:
    quant: QuantConfig  # how the routed experts are quantized and executed
    depth: Any = None  # decoding/depth.py `Depth` (None: a greedy system)
    compile: str = "auto"  # the draft step compiled over a static cache: on | off | auto
    compile_backend: str = "inductor"


@dataclass(frozen=True)
class ClockSpec:
    hardware: HardwareConfig  # the machine timed for: clock, link, cost profile
    model: str  # the model's name, for the sizes charged
    stands_for: str | None = None  # the real model a project-made one scales down


@dataclass(frozen=True)
class Files:
    cache_dir: Path  # project-made models, drafts, default vectors
    data_dir: Path | None  # fetched datasets (calibration text)
    model: ModelConfig  # to load the same checkpoint a second time
    model_seed: int = 0
    progress: bool = False


@dataclass(frozen=True)
class Job:
    loaded: LoadedModel
    device: torch.device
    system: SystemConfig  # the system's own settings (its recipe's Config)
    budget: ResolvedBudget
    offload: OffloadSpec
    draft: DraftSpec
    clock: ClockSpec
    files: Files
    rows: int = 1  # requests decoded together
    temperature: float = 0.0  # > 0: speculative sampling (the systems that speculate)
    positions: int = 0  # the longest request's prompt + new tokens
    stop_on_eos: bool = True
    seed: int = 0  # sampling and the prefetch ablation's noise
