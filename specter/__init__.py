"""Specter: MoE decoding with routed experts in host memory, an INT4 self-draft running ahead
so the experts verification needs are copied while it drafts, and output identical to the
target's own greedy decoding. `specter.load(...)` is the library's call (specter/api.py);
`python -m specter generate|chat` the same from a shell; `python run.py` the benchmark."""

from specter.api import LLM, Output, load

__all__ = ["LLM", "Output", "load"]
