"""`system=fidelity` (`experiment=fidelity`): how closely the INT4 self-draft routes like the
target (docs/paper-notes.md, "routing fidelity").

Per request: the target decodes greedily (its own output, the workload's prefix); then one
teacher-forced forward over prompt + output in each mode of the shared instance gives every
MoE layer's top-k expert ids at every position, for target and draft on the same prefix.
Fidelity at (position, layer) = |top-k(draft) ∩ top-k(target)| / k, over the positions that
produce output tokens. Records carry the per-layer and per-position distributions, the top-1
match, and how often the draft's greedy token equals the target's (a bound on acceptance).
"""

from __future__ import annotations

import torch

from specter.decoding.batch import DeviceMemory, Generation, eos_ids
from specter.decoding.loop import greedy_decode
from specter.models.introspect import router_topk
from specter.clock.timing import Timing
from specter.quant.build import int4_experts_for
from specter.decoding.draft_mode import DraftMode


@torch.no_grad()
def routing_fidelity(shared: DraftMode, ids: torch.Tensor, start: int,
                     with_matches: bool = False) -> dict:
    """Top-k agreement of draft and target over positions `start`.. of `ids` [1, S];
    `with_matches` adds `draft_token_matches`, per position whether the draft's greedy token
    is the target's."""
    model = shared.model
    target = router_topk(model, ids)  # per MoE layer: [S, k]
    target_logits = model(input_ids=ids).logits[0, start:]
    with shared.draft():
        draft = router_topk(model, ids)
        draft_logits = model(input_ids=ids).logits[0, start:]
    k = target[0].shape[1]
    per_layer, per_position, top1 = [], torch.zeros(ids.shape[1] - start), []
    for t, d in zip(target, draft):
        t, d = t[start:], d[start:]
        overlap = (t.unsqueeze(2) == d.unsqueeze(1)).any(dim=2).sum(dim=1).float() / k  # [P]
        per_layer.append(float(overlap.mean()))
        per_position += overlap / len(target)
        top1.append(float((t[:, 0] == d[:, 0]).float().mean()))
    matches = target_logits.argmax(-1) == draft_logits.argmax(-1)
    extra = {"draft_token_matches": matches.tolist()} if with_matches else {}
    return {**extra, "fidelity_topk": sum(per_layer) / len(per_layer),
            "fidelity_top1": sum(top1) / len(top1),
            "fidelity_per_layer": per_layer,
            "fidelity_per_position": per_position.tolist(),
            "draft_token_match": float(matches.float().mean()),
            "fidelity_positions": ids.shape[1] - start}


class FidelityEngine:
    speculates = samples = False  # greedy only
    compiled: dict = {}  # nothing compiled
    name = "fidelity"

    def __init__(self, model, device: torch.device, shared: DraftMode, draft_record: dict,
                 stop_on_eos: bool = True):
        self.model, self.device, self.shared = model, device, shared
        self.draft_record = draft_record
        self.timing = Timing.wall(device)  # the target's decode is not what is measured here
        self.stop = eos_ids(model) if stop_on_eos else set()
        self.memory = DeviceMemory(model, device, extra_bytes=shared.draft_bytes)

    batches = False  # one request at a time: routing fidelity is per sequence

    def seed_requests(self, seeds: list[int]) -> None:
        """Greedy decoding draws nothing."""

    def reset(self) -> None:
        self.timing.link.reset_stats()

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 on_commit=None) -> Generation:
        """The target's greedy output, then the routing fidelity over it. `on_commit(tokens)`
        (the `Engine` protocol) hears each token as the greedy decode commits it (before the
        fidelity forwards, which commit nothing)."""
        gen = greedy_decode(self.model, prompt_ids, max_new_tokens, self.device,
                            self.timing.link, self.stop, self.memory, on_commit=on_commit)
        seq = prompt_ids + gen.tokens[:-1]  # the prefix of every output token
        ids = torch.tensor([seq], device=self.device)
        gen.stats.update(routing_fidelity(self.shared, ids, start=len(prompt_ids) - 1))
        gen.stats.update(self.draft_record)
        gen.stats["clock"] = self.timing.clock
        return gen


def build(job) -> FidelityEngine:
    from specter.decoding.draft_mode import account_model

    draft = int4_experts_for(job)
    shared = DraftMode(job.loaded.model, draft.experts, draft.backend, job.device)
    memory = account_model(f"own:{job.clock.model}", job.loaded.spec, job.budget.slots,
                           job.positions, shared.draft_bytes)
    return FidelityEngine(job.loaded.model, job.device, shared,
                          {**draft.as_record(), **memory.as_record()}, stop_on_eos=job.stop_on_eos)


ENGINE = FidelityEngine
OFFLOADS = False  # a measurement of routing on the device
