"""Command-line entry: `python run.py model=... budget=... system=... dataset=...` (Hydra).

A thin edge: checks config-group names and every `key=value` against the typed config (one
clear sentence for a typo or an unknown key), converts Hydra's config once into a typed
`RunConfig`, calls `experiments.runner.run`, and turns a `UserError`
into one line on stderr and exit status 2. Multirun (`-m`) sweeps call the same function.
The checks and the conversion are specter/settings.py's; nothing imports this file.
"""

from __future__ import annotations

import sys

from specter.settings import CONF, checked_overrides, to_run_config


def main() -> None:
    import hydra

    from specter.errors import UserError

    @hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
    def _run(cfg) -> float:
        from experiments import runner

        try:
            summary = runner.run(to_run_config(cfg))
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(UserError.exit_code)
        return summary.tpot_ms_mean

    try:
        sys.argv[1:] = checked_overrides(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(UserError.exit_code)
    try:
        _run()
    except KeyboardInterrupt:  # rows are published whole (experiments/records.py): none partial
        from experiments.runner import ROWS_WRITTEN

        print(f"\ninterrupted: {ROWS_WRITTEN[0]} row(s) written by this command are kept; "
              "rerun the same command to resume.", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
