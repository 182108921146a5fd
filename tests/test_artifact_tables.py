"""ARTIFACT.md's expected results are what the artifact prints today (issue 56 item 6).

The virtual clock is deterministic, so the `make run` table in ARTIFACT.md ("A.6") can be held
cell for cell: the same job (`run.py -m experiment=quickstart`, small_deepseek, 3 gsm8k items
x 64 tokens, a100_pcie4_hf) run here, summarized as `make run` summarizes it
(experiments.summarize, three significant digits), equals the committed table. A change that
moves a number fails here until ARTIFACT.md is remeasured (and names its commit).
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
