"""ARTIFACT.md's expected results are what the artifact prints today (issue 56 item 6).

The virtual clock is deterministic, so the `make run` table in ARTIFACT.md ("A.6") can be held
cell for cell: the same job (`run.py -m experiment=quickstart`, small_deepseek, 3 gsm8k items
x 64 tokens, a100_pcie4_hf) run here, summarized as `make run` summarizes it
(experiments.summarize, three significant digits), equals the committed table. A change that
moves a number fails here until ARTIFACT.md is remeasured (and names its commit). So is one
row of the validation table: Specter's TPOT on small_deepseek under the eager engine, as
`experiments.validate` runs it in the quick profile.
"""

from __future__ import annotations

import math
import re

from conftest import REPO, run_cli
from experiments import records, summarize

COLUMNS = ("tpot_ms", "x_resident", "speedup_vs_specmoeoff", "hit_rate", "hit_rate_cap",
           "h2d_hidden_frac", "acceptance_rate")


def committed_make_run_table() -> dict[str, list[str]]:
    """system -> its cells, from the table after ARTIFACT.md's "**`make run`**" paragraph."""
    text = (REPO / "ARTIFACT.md").read_text()
    block = text[text.index("**`make run`**"):]
    rows = {}
    for line in block.splitlines():
        if line.startswith("| ---"):
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[0] != "system":
                rows[cells[0]] = cells[1:]
        elif rows:
            break
    return rows


def cell(v) -> str:
    """A value as `summarize --short` prints it (three significant digits, '-' for none)."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


def test_make_run_prints_artifacts_table(tmp_path):
    committed = committed_make_run_table()
    assert set(committed) == {"specter", "resident", "specmoeoff", "lru"}, committed
    res = run_cli("-m", "experiment=quickstart", f"out_dir={tmp_path}", "progress=false")
    assert res.returncode == 0, res.stderr[-3000:]
    t = summarize.table(records.load(tmp_path))
    assert set(t["hardware"]) == {"a100_pcie4_hf"} and set(t["clock"]) == {"virtual"}
    got = {r["system"]: [cell(r[c]) for c in COLUMNS] for _, r in t.iterrows()}
    assert got == committed, f"ARTIFACT.md's make run table is not today's:\n{got}"
    assert re.search(r"measured at\s+commit `[0-9a-f]{7}`", (REPO / "ARTIFACT.md").read_text())


def committed_validation_cell(quantity: str, profile: str) -> str:
    """The cell of `quantity`'s row under `profile` in ARTIFACT.md's validation table (the one
    after its "**The validation table**" paragraph)."""
    text = (REPO / "ARTIFACT.md").read_text()
    block = text[text.index("**The validation table**"):]
    header = None
    for line in block.splitlines():
        if not line.startswith("|"):
            if header:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
        elif cells[0] == quantity:
            return cells[header.index(profile)]
    raise AssertionError(f"no row {quantity!r} in ARTIFACT.md's validation table")


def test_one_validation_row_is_todays(tmp_path):
    """The validation table's Specter TPOT on the DeepSeek-shaped model under the eager engine
    (`experiments.validate`'s main case: small_deepseek, high budget, the paper's K, the quick
    profile's 1 gsm8k item x 32 tokens, a100_pcie4_hf) equals what the case prints today, to
    the table's one decimal."""
    committed = committed_validation_cell("TPOT Specter, DeepSeek / Qwen / Phi high (ms)", "hf")
    res = run_cli("experiment=validate", "system=specter", "model=small_deepseek", "budget=high",
                  "dataset=gsm8k",
                  "hardware=a100_pcie4_hf", "workload.items=1", "workload.max_new_tokens=32",
                  "workload.repeats=1", f"out_dir={tmp_path}", "progress=false")
    assert res.returncode == 0, res.stderr[-3000:]
    tpot = records.load(tmp_path)["tpot_ms"].mean()
    assert f"{tpot:.1f}" == committed.split(" / ")[0], (tpot, committed)
    text = (REPO / "ARTIFACT.md").read_text()
    block = text[text.index("**The validation table**"):][:600]
    assert re.search(r"commit `[0-9a-f]{7}`", block), "the validation table names its commit"
