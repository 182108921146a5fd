"""Command-line entry: `python run.py model=... budget=... system=... dataset=...` (Hydra).

A thin edge: checks config-group names (one clear sentence for a typo), converts Hydra's
config once into a typed `RunConfig`, calls `experiments.runner.run`, and turns a `UserError`
into one line on stderr and exit status 2. Multirun (`-m`) sweeps call the same function.
"""

from __future__ import annotations

import sys
from pathlib import Path

CONF = Path(__file__).resolve().parent / "conf"
GROUPS = ("model", "budget", "system", "dataset", "hardware", "quant", "experiment", "ablation")


def check_group_choices(argv: list[str]) -> None:
    """Reject `group=unknown` before Hydra turns it into a multi-line composition error."""
    from specter.errors import UserError

    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        if not eq or key not in GROUPS:
            continue
        options = sorted(p.stem for p in (CONF / key).glob("*.yaml"))
        for choice in value.split(","):  # multirun sweeps: a,b,c
            if choice not in options:
                raise UserError(f"unknown {key} '{choice}'; choose one of: {', '.join(options)}.")


def system_knob_overrides(argv: list[str]) -> list[str]:
    """`system.<knob>=v` for any system: the knobs (specter.config.SystemConfig) live only in
    the yaml of the systems that have them, so the override is forced (`++`) past Hydra's
    struct check and the runner's own check refuses a knob the system lacks, in one sentence;
    an unknown setting is one sentence here."""
    from dataclasses import fields

    from specter.config import SystemConfig
    from specter.errors import UserError

    knobs = [f.name for f in fields(SystemConfig) if f.name != "name"]
    out = []
    for arg in argv:
        key, eq, _ = arg.lstrip("+~").partition("=")
        if eq and key.startswith("system.") and not arg.startswith("~"):
            if key[len("system."):] not in knobs:
                raise UserError(f"unknown setting '{key}'; system settings are: "
                                f"{', '.join('system.' + k for k in knobs)}.")
            arg = "++" + arg.lstrip("+")
        out.append(arg)
    return out


def main() -> None:
    import hydra
    from omegaconf import OmegaConf

    from specter.errors import UserError

    @hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
    def _run(cfg) -> float:
        from experiments.runner import run
        from specter.config import RunConfig

        try:
            summary = run(RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True)))
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(UserError.exit_code)
        return summary.tpot_ms_mean

    try:
        check_group_choices(sys.argv[1:])
        sys.argv[1:] = system_knob_overrides(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(UserError.exit_code)
    _run()


if __name__ == "__main__":
    main()
