"""The one engine protocol every system answers, and the greedy decode steps they share.

Owns: `Engine` (reset before a request, outside timing; generate a request), `Generation`
(committed tokens with their commit times and the system's own statistics), and the greedy
prefill / decode-one-token loop over a Hugging Face model and `DynamicCache`, timed by any
`Clock` (a link's compute-stream clock: virtual, emulated or real).
Does not own: where experts live (offloading runtime), the engines and speculation
(decoding/), metrics arithmetic (metrics.py).

Systems differ in policy, not in model code: each one drives the same transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class Generation:
    tokens: list[int]  # committed output tokens, prompt excluded
    commit_times_s: list[float]  # clock time at which each token was committed
    start_time_s: float  # clock time the request started (before prefill)
    peak_mem_bytes: int
    peak_mem_source: str  # "cuda_allocator" (measured) | "device_tensors" (measured sum, CPU)
    stats: dict[str, Any] = field(default_factory=dict)  # system-specific record columns


class Engine(Protocol):
    name: str
    samples: bool  # decodes by speculative sampling when workload.temperature > 0

    def reset(self) -> None:
        """Return to the fixed initial state before a request (outside timing)."""

    def seed_request(self, seed: int) -> None:
        """The random state of the next request (sampling engines; others ignore it)."""

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        ...


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_bytes(cache) -> int:
    """Bytes held by the tensors of a `DynamicCache`, measured from the tensors themselves."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def forward_logits(model, ids: torch.Tensor, cache, logits_to_keep: int = 1) -> torch.Tensor:
    """One forward over `ids` [1, T] appending to `cache`; returns logits [T', V] for the last
    `logits_to_keep` positions."""
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits[0]


def greedy_token(logits_row: torch.Tensor) -> int:
    return int(logits_row.argmax())  # host sync: the next step and EOS check need the id


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


class Clock(Protocol):
    kind: str

    def now(self) -> float: ...


@torch.no_grad()
def greedy_decode(model, prompt_ids: list[int], max_new_tokens: int, device: torch.device,
                  clock: Clock, stop: set[int], memory: "DeviceMemory",
                  before_forward=None) -> Generation:
    """Prefill, then one token at a time; each token's commit time read from `clock`.
    `before_forward(tokens, context, phase)` is told about each forward before it runs
    (phase: "prefill" | "decode"; the speculative loop's are "prefill" | "draft" | "verify")."""
    memory.start()
    cache = new_cache(model)
    ids = torch.tensor([prompt_ids], device=device)  # [1, P]
    start = clock.now()
    tokens: list[int] = []
    times: list[float] = []
    # 1. Prefill the prompt; its last logits give the first token.
    if before_forward:
        before_forward(len(prompt_ids), len(prompt_ids), "prefill")
    logits = forward_logits(model, ids, cache)  # [1, V]
    while True:
        # 2. Commit the greedy token.
        tok = greedy_token(logits[-1])
        tokens.append(tok)
        times.append(clock.now())
        if len(tokens) >= max_new_tokens or tok in stop:
            break
        # 3. Decode one step.
        if before_forward:
            before_forward(1, len(prompt_ids) + len(tokens), "decode")
        logits = forward_logits(model, torch.tensor([[tok]], device=device), cache)
    memory.observe_cache(cache)
    peak, source = memory.peak()
    return Generation(tokens=tokens, commit_times_s=times, start_time_s=start,
                      peak_mem_bytes=peak, peak_mem_source=source)


class DeviceMemory:
    """Peak device memory of one request: the CUDA allocator's peak when on CUDA; on CPU the
    measured bytes of the model's parameters plus the largest KV cache seen."""

    def __init__(self, model, device: torch.device, extra_bytes: int = 0):
        self.cuda = device.type == "cuda"
        # Parameters on the device, plus buffers the caller holds there (expert slots).
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                               if p.device.type == device.type) + extra_bytes
        self.peak_kv = 0

    def start(self) -> None:
        self.peak_kv = 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def observe_cache(self, cache) -> None:
        if not self.cuda:
            self.peak_kv = max(self.peak_kv, cache_bytes(cache))

    def peak(self) -> tuple[int, str]:
        if self.cuda:
            return torch.cuda.max_memory_allocated(), "cuda_allocator"
        return self.param_bytes + self.peak_kv, "device_tensors"
