"""The server under load: N concurrent clients x M requests against the same requests sent one
at a time, on the embedded default, against 127.0.0.1 only (issue 58 item 7).

    python -m experiments.serve_bench [--clients 8] [--requests 4] [--max-tokens 32]
                                      [--clock virtual|wall] [--system specter] [--json OUT]

It loads the model once, serves it (specter/serve.py) on a free loopback port, and sends the
same N x M completions (the `mix` workload's prompts, cut to `--prompt-tokens`) twice: one at
a time from one client, then from N clients at once, each sending its M one after another.
The server batches what arrives together (`--max-batch` N, a batch waits `--batch-wait-ms`
for the others to join).

Tokens per second and latency on each clock:
- `virtual` (the default on a machine without a GPU): time is the modelled GPU's. A batch's
  time is its longest row's (each response's `specter.e2e_ms`: from the batch's start to its
  last token, on the virtual clock); throughput = tokens / the sum of the batches' times (one
  decode thread: batches run one after another); a request's latency = its batch's time plus
  the times of the batches decoded while it waited (the host's own gaps between batches are
  not modelled).
- `wall`: the client's own wall clock; throughput = tokens / elapsed. Without a GPU the model
  decodes on the CPU's clock with every expert resident (budget=full: offloading on the CPU
  needs a modelled link), so it measures the server and the batching, not the offloading.
Bounded: at most 256 requests and `--timeout` seconds a phase.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def phase(client, prompts: list[list[int]], clients: int, max_tokens: int, timeout: float,
          model: str) -> list[dict]:
    """Each request's answer: tokens, wall latency, its batch and its modelled times."""
    per = [prompts[c::clients] for c in range(clients)]

    def one(ids):
        began = time.perf_counter()
        out = client.completions.create(model=model, prompt=ids, max_tokens=max_tokens)
        s = out.model_extra["specter"]
        return {"tokens": out.usage.completion_tokens, "wall_s": time.perf_counter() - began,
                "batch": s["batch"], "rows": s["batch_rows"], "e2e_ms": s["e2e_ms"],
                "done": time.perf_counter()}

    def run(c, mine):
        return [{**one(ids), "client": c, "seq": i} for i, ids in enumerate(mine)]

    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(run, c, mine) for c, mine in enumerate(per)]
        rows = [r for f in futures for r in f.result(timeout=timeout)]
    for r in rows:
        r["done"] -= began
    return rows


def summary(rows: list[dict], clock: str) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    if clock == "wall":
        elapsed = max(r["done"] for r in rows)
        latency = [r["wall_s"] for r in rows]
    else:  # the batches one after another on the modelled GPU
        batch_s = {}
        for r in rows:
            batch_s[r["batch"]] = max(batch_s.get(r["batch"], 0.0), r["e2e_ms"] / 1e3)
        order = sorted(batch_s)
        ends, t = {}, 0.0
        for b in order:
            t += batch_s[b]
            ends[b] = t
        elapsed = t
        # a closed loop: a client sends its next request when its last one is answered, so
        # a request waits from the end of its client's previous batch to the end of its own
        latency = []
        for c in {r["client"] for r in rows}:
            sent = 0.0
            for r in sorted((r for r in rows if r["client"] == c), key=lambda r: r["seq"]):
                latency.append(ends[r["batch"]] - sent)
                sent = ends[r["batch"]]
    return {"requests": len(rows), "tokens": tokens, "seconds": elapsed,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else float("nan"),
            "p50_s": percentile(latency, 50), "p99_s": percentile(latency, 99),
            "mean_rows": statistics.mean(r["rows"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4, help="per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--clock", choices=("virtual", "wall"), default="virtual")
    ap.add_argument("--system", default="specter")
    ap.add_argument("--model", default="small_deepseek")
    ap.add_argument("--budget", default=None, help="high | low | ... (default: the model's "
                    "high; --clock wall without a GPU: full, every expert resident)")
    ap.add_argument("--batch-wait-ms", type=float, default=200.0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    n = a.clients * a.requests
    if not (1 <= a.clients <= 64 and 1 <= n <= 256):
        print("error: 1 to 64 clients and at most 256 requests in all.", file=sys.stderr)
        return 2

    import openai

    from specter.api import LLM, load_settings
    from specter.serve import Server, make_app, start_in_thread, stop_thread
    from specter.workloads import load_workload, truncate_prompt

    import torch

    hardware, budget = None, a.budget
    if a.clock == "wall" and not torch.cuda.is_available():
        # the CPU's own clock: offloading there needs a modelled link, so every expert resident
        hardware, budget = "cpu", budget or "full"
    settings = load_settings(a.model, system=a.system, hardware=hardware, budget=budget,
                             max_prompt_tokens=a.prompt_tokens, max_new_tokens=a.max_tokens,
                             overrides=["workload.stop_on_eos=false"])
    llm = LLM(settings, log=lambda line: print(line, file=sys.stderr))
    if a.clock == "virtual" and llm.clock != "virtual":
        print(f"error: --clock virtual runs where the model decodes on a modelled GPU (a "
              f"machine without one); this one decodes on the {llm.clock} clock: use --clock "
              "wall.", file=sys.stderr)
        return 2
    texts = load_workload("mix", n).texts
    prompts = [truncate_prompt(llm.tokenizer, t, a.prompt_tokens) for t in texts]
    prompts = (prompts * (n // len(prompts) + 1))[:n]
    result = {"clock": llm.clock, "hardware": llm.settings.hardware.name, "model": a.model,
              "system": a.system,
              "budget": settings.budget.name, "clients": a.clients,
              "requests_per_client": a.requests, "max_tokens": a.max_tokens,
              "prompt_tokens": a.prompt_tokens}
    for name, clients in (("sequential", 1), ("concurrent", a.clients)):
        server = Server(a.model, max_batch=clients, max_queue=max(64, n),
                        batch_wait_s=a.batch_wait_ms / 1e3 if clients > 1 else 0.0)
        server.start(llm)
        http, url = start_in_thread(make_app(server))
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                   timeout=a.timeout)
            rows = phase(client, prompts, clients, a.max_tokens, a.timeout, a.model)
        finally:
            stop_thread(http)
            server.scheduler.close()
        result[name] = summary(rows, "wall" if a.clock == "wall" else "virtual")
        print(f"{name}: {json.dumps(result[name])}", file=sys.stderr)
    seq, con = result["sequential"], result["concurrent"]
    result["speedup"] = con["tokens_per_s"] / seq["tokens_per_s"]
    result["p99_over_p50"] = con["p99_s"] / con["p50_s"]
    llm.close()
    print(f"{a.clients} clients x {a.requests} requests, {a.max_tokens} tokens each, "
          f"{result['clock']} clock: {con['tokens_per_s']:.1f} tokens/s concurrent vs "
          f"{seq['tokens_per_s']:.1f} sequential ({result['speedup']:.2f}x); concurrent "
          f"p50 {con['p50_s']:.2f} s, p99 {con['p99_s']:.2f} s "
          f"(p99/p50 {result['p99_over_p50']:.2f}), {con['mean_rows']:.1f} rows a batch")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
