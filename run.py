"""Command-line entry: `python run.py model=... budget=... system=... dataset=...` (Hydra).

A thin edge: checks config-group names and every `key=value` against the typed config (one
clear sentence for a typo or an unknown key), converts Hydra's config once into a typed
`RunConfig`, calls `experiments.runner.run`, and turns a `UserError`
into one line on stderr and exit status 2. Multirun (`-m`) sweeps call the same function.
"""

from __future__ import annotations

import sys
from pathlib import Path

CONF = Path(__file__).resolve().parent / "conf"
GROUPS = ("model", "budget", "system", "dataset", "hardware", "host", "quant", "experiment",
          "ablation")


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


def chosen_systems(argv: list[str]) -> list[str]:
    """The systems a command line runs: `system=a,b`, else its experiment overlay's, else the
    default (conf/config.yaml)."""
    import re

    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        if eq and key == "system":
            return value.split(",")
    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        if eq and key == "experiment" and (CONF / "experiment" / f"{value}.yaml").exists():
            m = re.search(r"override /system: *(\w+)", (CONF / "experiment" / f"{value}.yaml").read_text())
            if m:
                return [m.group(1)]
    m = re.search(r"- system: *(\w+)", (CONF / "config.yaml").read_text())
    return [m.group(1)] if m else []


def check_system_settings(argv: list[str]) -> None:
    """`system.<knob>=v` that the chosen system does not have: one sentence (each system's
    knobs are its own typed config, experiments/registry.py `config_class`), before Hydra's
    struct check answers in several lines."""
    from experiments.registry import check_setting

    for arg in argv:
        key, eq, _ = arg.lstrip("+~").partition("=")
        if eq and key.startswith("system.") and not arg.startswith("~"):
            for name in chosen_systems(argv):
                check_setting(name, key[len("system."):])


def listed_keys(argv: list[str]) -> set[str] | None:
    """The dotted keys the yaml files compose to for the command line's group choices (a swept
    group: its first option), or None when they do not compose."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    choices = []
    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        if eq and (key in GROUPS or key == "workload"):
            choices.append(f"{key}={value.split(',')[0]}")
    try:
        OverridesParser.create().parse_overrides(choices)
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="config", overrides=choices)
    except Exception:  # noqa: BLE001 - Hydra says what is wrong when it runs
        return None
    keys: set[str] = set()

    def walk(d, prefix):
        for k, v in d.items():
            keys.add(prefix + str(k))
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return keys


def typed_overrides(argv: list[str]) -> list[str]:
    """Every `key=value` checked against the typed run configuration (specter.config) before
    Hydra sees it: unreadable syntax or an unknown key is one sentence naming the key and the
    nearest valid one; a valid key that the selected yaml does not list (e.g.
    `workload.temperature` under workload=artifact) is passed as `++key=value`, so every key
    of the typed config works in the plain `key=value` form. A key the yaml lists stays plain,
    so that a sweep of it replaces an experiment overlay's sweep of the same key (Hydra's
    sweeper tells `++k` and `k` apart and would run both)."""
    import difflib
    from dataclasses import fields

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from specter.config import RunConfig, section_classes
    from specter.errors import UserError

    parser = OverridesParser.create()
    listed = listed_keys(argv)
    sections = section_classes()
    scalars = [f.name for f in fields(RunConfig) if f.name not in sections]
    out = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg.lstrip("~"):
            out.append(arg)
            continue
        try:
            o = parser.parse_overrides([arg])[0]
        except HydraException:
            key, _, value = arg.partition("=")
            raise UserError(f"cannot read the setting '{arg}': quote a value with special "
                            f"characters, e.g. {key.lstrip('+~')}='{value}'.") from None
        key = o.key_or_group
        if key.startswith("hydra") or key in GROUPS or o.is_delete():
            out.append(arg)
            continue
        group, _, name = key.partition(".")
        if not name:
            if key not in scalars:
                near = difflib.get_close_matches(key, scalars + list(GROUPS), n=1, cutoff=0.5)
                raise UserError(f"unknown setting '{key}'" + (f"; did you mean '{near[0]}'?"
                                if near else f"; top-level settings are: {', '.join(scalars)}."))
            out.append(arg)
            continue
        cls = sections.get(group)
        if cls is None:
            raise UserError(f"unknown setting '{key}': '{group}' is not a config section "
                            f"(sections: {', '.join(sections)}).")
        if group == "system":  # its own typed config: check_system_settings said it
            out.append(arg)
            continue
        names = [f.name for f in fields(cls)]
        if name.split(".")[0] not in names:
            near = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
            raise UserError(f"unknown setting '{key}'" + (f"; did you mean '{group}.{near[0]}'?"
                            if near else f"; {group} settings are: "
                            f"{', '.join(group + '.' + n for n in names)}."))
        plain = arg.startswith("+") or (listed is not None and key in listed)
        out.append(arg if plain else "++" + arg)
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
        check_system_settings(sys.argv[1:])
        sys.argv[1:] = typed_overrides(sys.argv[1:])
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
