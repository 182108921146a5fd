"""Which proposals a row keeps: greedy or sampled acceptance, one part the window loop calls.

Owns: each way of choosing a token from logits (the draft's picks, the prefill's first token)
and of accepting a row's proposals against the verification logits. `Greedy`: the longest
prefix equal to the target's own argmax choices, then the target's token, so the output is the
target's greedy output token for token; its draft choices stay on the device. `Sampled`:
speculative sampling (`accept_sampled`), every committed token distributed as the target's
sampling at temperature T, one generator per request.
Does not own: the window loop (loop.py), the draft (draft.py).
"""

from __future__ import annotations

import torch


def accept_sampled(p: torch.Tensor, q: torch.Tensor, proposals: list[int],
                   gen: torch.Generator) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): p [n+1, V] target
    probabilities at each verified position, q [n, V] the draft's at the n proposals.
    Proposal i is kept with probability min(1, p_i(x) / q_i(x)); at the first rejection the
    next token is drawn from norm(max(0, p_i - q_i)); if all n are kept, from p_n. Every
    committed token is then distributed exactly as the target's. Returns (kept, next token)."""
    for i, x in enumerate(proposals):
        r = torch.rand((), generator=gen).item()
        if r * q[i, x] < p[i, x]:  # r < p/q without dividing by a zero q
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(dist, 1, generator=gen))
    return len(proposals), int(torch.multinomial(p[len(proposals)], 1, generator=gen))


class Greedy:
    """Temperature 0: the target's greedy tokens."""

    on_device = True  # the draft's argmax choices stay on the device (drafting.draft_steps)

    def start_window(self, requests: list[int]) -> None:
        """Before a window's draft (nothing to keep per request)."""

    def pick(self, request: int, logits: torch.Tensor) -> int:
        return int(logits.argmax())  # host sync: the next forward needs it

    def read(self, logits: torch.Tensor) -> None:
        """The verification logits [B, width, V] read once: every position's argmax."""
        self.targets = logits.argmax(dim=-1).tolist()  # host sync: acceptance is a host decision

    def accept(self, row: int, request: int, logits: torch.Tensor, at: int,
               proposals: list[int]) -> tuple[int, list[int]]:
        """Row `row`'s longest prefix of proposals equal to the target's choices (its block
        starts at column `at`), then the target's token: (kept, the tokens to commit)."""
        target = self.targets[row][at:]
        kept = 0
        while kept < len(proposals) and proposals[kept] == target[kept]:
            kept += 1
        return kept, proposals[:kept] + [target[kept]]


class Sampled:
    """Temperature T > 0: speculative sampling, request r drawing from `generators[r]`."""

    on_device = False  # the draft samples on the host and keeps its probabilities

    def __init__(self, temperature: float, generators: list[torch.Generator]):
        self.temperature, self.generators = temperature, generators
        self.q_rows: list[list[torch.Tensor]] = [[] for _ in generators]  # the draft's probs

    def start_window(self, requests: list[int]) -> None:
        for b in requests:
            self.q_rows[b] = []

    def pick(self, request: int, logits: torch.Tensor) -> int:
        q = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        self.q_rows[request].append(q)
        return int(torch.multinomial(q, 1, generator=self.generators[request]))

    def read(self, logits: torch.Tensor) -> None:
        """Nothing read ahead: each row's probabilities are taken in `accept`."""

    def accept(self, row: int, request: int, logits: torch.Tensor, at: int,
               proposals: list[int]) -> tuple[int, list[int]]:
        p = torch.softmax(logits[row, at:].float().cpu() / self.temperature, dim=-1)
        q = torch.stack(self.q_rows[request]) if self.q_rows[request] else p[:0]
        kept, nxt = accept_sampled(p, q, proposals, self.generators[request])
        return kept, proposals[:kept] + [nxt]
