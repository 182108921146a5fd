"""A table of cases run through the runner: what experiments.validate and experiments.anchors
share.

Owns: a case (`Case`, its overrides), running a list of cases in this process (`run_cases`:
each composed as run.py composes a command line, specter/settings.py; one sentence per
failed case), the command-line options every table of cases takes (`table_cli`,
`workload_overrides`), and reading an override's value back as Hydra types it
(`override_value`, to match a case against its records' configuration columns).
Does not own: which cases a table runs or how it tabulates their records (experiments/
validate.py, experiments/anchors.py), the records (experiments/records.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    overrides: tuple[str, ...]


def run_cases(out: Path, todo: list[Case], common: list[str], log=print,
              experiment: str = "validate") -> int:
    """Each case through the runner in this process (Hydra's compose API, the configs of
    run.py); returns how many failed (their one-sentence errors printed)."""
    from experiments import runner
    from specter.settings import run_config
    from specter.errors import UserError

    failed = 0
    for i, case in enumerate(todo, 1):
        log(f"[{experiment}] case {i}/{len(todo)}: {' '.join(case.overrides)}")
        try:  # composed and checked as run.py does: a misspelt choice fails this case alone
            runner.run(run_config([*case.overrides, *common, f"out_dir={out}",
                                   f"experiment={experiment}", "progress=false"]),
                       log=lambda *_: None)
        except UserError as e:
            failed += 1
            log(f"[{experiment}]   error: {e}")
    return failed


def override_value(text: str):
    """An override's value as Hydra would type it (bool, number or string)."""
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def table_cli(prog: str, description: str, tokens: int, datasets_help: str) -> argparse.ArgumentParser:
    """The options a table of cases shares (experiments.validate's, experiments.anchors'): the
    results tree, the workload of every case, and --table-only."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("out", help="results tree (records are added under OUT/records)")
    ap.add_argument("--items", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--datasets", default="gsm8k", help=datasets_help)
    ap.add_argument("--table-only", action="store_true", help="tabulate the records already there")
    return ap


def workload_overrides(args) -> list[str]:
    return [f"workload.items={args.items}", f"workload.max_new_tokens={args.tokens}",
            "workload.repeats=1"]
