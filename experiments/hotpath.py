"""What decoding asks of the device, counted: aten operations, the ones that launch kernels,
and host syncs, per system and per phase, per committed token.

A GPU's decode step is bound by what the host issues as much as by copies and arithmetic: each
launching operation costs a kernel launch (7-9 us on the H200, docs/measurements/
h200-2026-11-30), and each host sync drains the queue. These can be counted on any machine:
a `TorchDispatchMode` sees every aten operation the engines dispatch while decoding (not while
loading, quantizing or resetting: the runner's `decode_context` hook), attributed to the phase
the loop's events told (`Events.forward`: `prefill`, `decode`, `draft`, `verify`) until that
forward returns, then to `bookkeeping` (acceptance, the orchestrator's plans, the window's end).

Columns per (system, phase), each also per committed token (tokens after the first, as TPOT):
`ops`, `launching`, `copies`, `syncs`, `host_reads`, `host_side`, `graph_replays`,
`graph_kernels` (the kernels inside verification's replayed pieces), as specter/counting.py
defines them, and `experts_launching` / `experts_calls`: the launching
operations (copies apart) inside the offload runtime's MoE layers, and how many layer calls
(so `experts_launching / experts_calls` is the launches per MoE layer per forward). Views are
ops but not launching; a Triton kernel or a CUDA graph's replay is launching; a blocking
upload is a sync only where the counter can see it, on a GPU. With `spec.compile=on` each
compiled draft step is one graph replay: one launching operation standing for the whole step
(on CUDA, one captured graph's replay), not the operations inside it.

    python -m experiments.hotpath OUT [system=lru,specter ...] [any run.py override]

runs the systems through the runner (records under OUT/records) and writes OUT/hotpath.csv
and OUT/hotpath.md. Defaults: model=small_deepseek budget=high, 2 gsm8k items x 64 tokens, 1
repeat, hardware=a100_pcie4_hf (the counts do not depend on the clock), and the INT4 draft on
`quant.backend=gather_int4`: the fixed-shape backend, whose operations are what a GPU issues
eagerly (the CPU's own `cpu_int4` runs a GEMM per routed expert: pass quant.backend=cpu_int4
to count it).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path

from specter.experts import experts_of
from specter.counting import OpCounter
from specter.clock.counted import follow_phases

PHASES = ("prefill", "decode", "draft", "verify", "bookkeeping")
DEFAULT_SYSTEMS = ("resident", "lru", "specmoeoff", "specter")
COLUMNS = ("ops", "launching", "copies", "syncs", "host_reads", "host_side", "graph_replays",
           "graph_kernels", "experts_launching", "experts_calls")


class HotPath:
    """The runner's `decode_context`: counts one system's decode calls, phase by phase."""

    def __init__(self):
        self.counter = OpCounter()
        self.tokens = 0  # committed tokens after each request's first
        self.forwards: Counter = Counter()  # forwards per phase

    @contextlib.contextmanager
    def __call__(self, engine):
        counter = self.counter
        counter.cpu_run = engine.device.type == "cpu"
        runtime = getattr(engine, "runtime", None)
        if runtime is not None:  # the offloaded experts' own share of each phase
            seat = experts_of(engine.model)  # the dispatcher's target seat: the runtime's
            inner = seat.target

            def experts_forward(*a, **k):
                c = counter.counts[counter.phase]
                before = c["launching"] - c["copies"]
                try:
                    return inner(*a, **k)
                finally:
                    c["experts_launching"] += c["launching"] - c["copies"] - before
                    c["experts_calls"] += 1
            seat.target = experts_forward
        gen_batch = engine.generate_batch

        def counted_batch(prompts, max_new_tokens):
            gens = gen_batch(prompts, max_new_tokens)
            self.tokens += sum(max(len(g.tokens) - 1, 0) for g in gens)
            return gens
        engine.generate_batch = counted_batch
        try:
            with follow_phases(counter, engine) as forwards, counter:
                yield
                self.forwards.update(forwards)
        finally:
            del engine.generate_batch
            if runtime is not None:
                seat.target = inner

    def rows(self, system: str) -> list[dict]:
        out = []
        for phase in PHASES:
            c = self.counter.counts.get(phase, Counter())
            row = {"system": system, "phase": phase, "forwards": self.forwards.get(phase, 0),
                   "committed_tokens": self.tokens}
            for col in COLUMNS:
                row[col] = c.get(col, 0)
                row[f"{col}_per_token"] = c.get(col, 0) / self.tokens if self.tokens else float("nan")
            out.append(row)
        total = {"system": system, "phase": "decoding (all but prefill)",
                 "forwards": sum(v for k, v in self.forwards.items() if k != "prefill"),
                 "committed_tokens": self.tokens}
        for col in COLUMNS:
            n = sum(r[col] for r in out if r["phase"] != "prefill")
            total[col] = n
            total[f"{col}_per_token"] = n / self.tokens if self.tokens else float("nan")
        return out + [total]


def measure(systems, overrides: list[str], out: Path, log=print) -> list[dict]:
    """Each system run through the runner with the counter around its decode calls."""
    from experiments import runner
    from specter.settings import run_config

    rows = []
    base = ["model=small_deepseek", "budget=high", "dataset=gsm8k", "hardware=a100_pcie4_hf",
            "workload.items=2", "workload.repeats=1", "workload.max_new_tokens=64",
            "quant.backend=gather_int4", "progress=false"]
    for system in systems:
        hot = HotPath()
        rc = run_config([*base, *overrides, f"system={system}", f"out_dir={out / 'records' / system}"])
        runner.run(rc, log=lambda *_: None, decode_context=hot)
        rows += hot.rows(system)
        total = rows[-1]
        log(f"[hotpath] {system}: {total['launching_per_token']:.0f} launching ops, "
            f"{total['syncs_per_token']:.1f} syncs, {total['host_reads_per_token']:.1f} host "
            f"reads per committed token ({total['committed_tokens']} tokens)")
    return rows


def table(rows: list[dict]):
    import pandas as pd

    df = pd.DataFrame(rows)
    return df[["system", "phase", "forwards", "committed_tokens",
               *[f"{c}_per_token" for c in COLUMNS], *COLUMNS]]


def main(argv: list[str] | None = None) -> int:
    from specter.errors import UserError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        print("usage: python -m experiments.hotpath OUT [system=a,b] [run.py overrides]",
              file=sys.stderr)
        return 2
    out, rest = Path(argv[0]), argv[1:]
    systems = list(DEFAULT_SYSTEMS)
    for a in list(rest):
        if a.startswith("system="):
            systems = [s for s in a.split("=", 1)[1].split(",") if s]
            rest.remove(a)
    try:
        rows = measure(systems, rest, out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return UserError.exit_code
    df = table(rows)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "hotpath.csv", index=False)
    md = markdown(df, index=False, floatfmt=".1f")
    (out / "hotpath.md").write_text(md + "\n")
    print(md)
    return 0


def show(df, out=None, floatfmt: str = ".3g") -> None:
    """Print `df` as a markdown table, and write it to `out` when given (the table tools')."""
    text = markdown(df, index=False, floatfmt=floatfmt)
    print(text)
    if out:
        out.write_text(text + "\n")


def markdown(df, **kwargs) -> str:
    """`df` as a markdown table where tabulate is installed, else as plain text."""
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return df.to_string(index=kwargs.get("index", True))
    return df.to_markdown(**kwargs)


if __name__ == "__main__":
    sys.exit(main())
