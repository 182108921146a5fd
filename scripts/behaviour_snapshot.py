"""Every system's output tokens and virtual-clock numbers on one fixed sweep, to prove a
refactor changed no behaviour.

    .venv/bin/python scripts/behaviour_snapshot.py OUT.json            # record
    .venv/bin/python scripts/behaviour_snapshot.py NEW.json --compare OLD.json

The sweep: every decoding system x tiny_deepseek, tiny_qwen x the eager A100 profile's virtual
clock (exact and repeatable), 2 gsm8k items x 16 tokens, K = 4, at the low budget (so that
experts are offloaded and copied); greedy, plus temperature 0.8 for the systems that sample.
Per (system, model, temperature, request) it keeps the output tokens, TPOT, bytes copied, hit
rate and acceptance. `--compare` prints every difference and exits 1 when there is one.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = "tiny_deepseek,tiny_qwen"
FIELDS = ("tpot_ms", "h2d_bytes", "hit_rate", "acceptance_rate")


def _systems() -> tuple[list[str], list[str]]:
    sys.path.insert(0, str(ROOT))
    from specter.recipes import SYSTEMS, sampling_systems

    decoders = [s for s in SYSTEMS if s != "fidelity"]  # fidelity measures routing, no decode
    return decoders, [s for s in decoders if s in sampling_systems()]


def record(out: Path) -> dict:
    decoders, sampling = _systems()
    with tempfile.TemporaryDirectory() as tmp:
        common = [sys.executable, str(ROOT / "run.py"), "-m", f"model={MODELS}", "dataset=gsm8k",
                  "hardware=a100_pcie4_hf", "budget=low", "spec.k=4", "workload.items=2",
                  "workload.max_new_tokens=16", "workload.repeats=1", f"out_dir={tmp}",
                  "progress=false"]
        for systems, temp in ((decoders, 0.0), (sampling, 0.8)):
            subprocess.run(common + [f"system={','.join(systems)}"]
                           + ([f"+workload.temperature={temp}"] if temp else []),
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        sys.path.insert(0, str(ROOT))
        from experiments import records

        df = records.load(Path(tmp))
    snap = {}
    for _, r in df.iterrows():
        key = f"{r['system']}|{r['model']}|t={r['cfg.workload.temperature']}|{r['request_id']}"
        snap[key] = {"tokens": [int(t) for t in r["output_tokens"]],
                     **{f: (None if f not in r or r[f] is None or
                            (isinstance(r[f], float) and math.isnan(r[f])) else float(r[f]))
                        for f in FIELDS}}
    out.write_text(json.dumps(dict(sorted(snap.items())), indent=1))
    return snap


def compare(new: dict, old: dict) -> list[str]:
    diffs = [f"only in old: {k}" for k in old if k not in new]
    diffs += [f"only in new: {k}" for k in new if k not in old]
    for k in sorted(set(new) & set(old)):
        for f, v in old[k].items():
            w = new[k].get(f)
            same = v == w or (isinstance(v, float) and isinstance(w, float)
                              and math.isclose(v, w, rel_tol=1e-9, abs_tol=1e-12))
            if not same:
                diffs.append(f"{k} {f}: {v if f != 'tokens' else len(v)} -> "
                             f"{w if f != 'tokens' else w}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="where to write this snapshot (JSON)")
    ap.add_argument("--compare", metavar="OLD", help="a snapshot to compare against")
    args = ap.parse_args(argv)
    new = record(Path(args.out))
    print(f"recorded {len(new)} rows -> {args.out}")
    if not args.compare:
        return 0
    diffs = compare(new, json.loads(Path(args.compare).read_text()))
    for d in diffs:
        print(d)
    print(f"{len(diffs)} difference(s) against {args.compare}")
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
