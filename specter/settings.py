"""Settings: the run configuration as a command line or the library gives it, Hydra's conf/
composed into a typed `RunConfig`.

Owns: the config folder (`CONF`) and its groups (`GROUPS`), the checks of a command line's
arguments before Hydra sees them (an unknown group choice, a knob the chosen system does not
have, an unknown or unreadable `key=value`: each one sentence naming the nearest valid key),
the rewriting of a valid key the selected yaml does not list into `++key=value`, and the one
conversion of Hydra's composed config into a `RunConfig` (`to_run_config`; `run_config` for a
whole argument list in this process, as run.py's entry, the library (specter/api.py),
experiments.validate, experiments.hotpath and the tests compose it).
Does not own: the command-line entries and their exit statuses (run.py, specter/__main__.py),
the typed settings and their validation (specter.config), each system's knobs
(specter/recipes.py), turning settings into parts (specter/compose.py).
"""

from __future__ import annotations

from pathlib import Path

CONF = Path(__file__).resolve().parent.parent / "conf"
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
    knobs are its own typed config, specter/config.py `system_config_class`), before Hydra's
    struct check answers in several lines."""
    from specter.config import check_setting

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
    for i, arg in enumerate(argv):
        flag_value = i > 0 and argv[i - 1].startswith("-") and "=" not in argv[i - 1]
        if arg.startswith("-") or arg.startswith("~") or flag_value:  # Hydra's (--cfg job)
            out.append(arg)
            continue
        if "=" not in arg:
            raise UserError(f"cannot read the setting '{arg}': a setting is key=value (e.g. "
                            "spec.k=8 or system=lru).")
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


def checked_overrides(argv: list[str]) -> list[str]:
    """A command line's arguments checked as run.py checks them (group choices, the chosen
    system's knobs, every `key=value`), rewritten for Hydra (`typed_overrides`)."""
    check_group_choices(argv)
    check_system_settings(argv)
    return typed_overrides(argv)


def to_run_config(cfg):
    """Hydra's composed config (a DictConfig) as the typed `RunConfig`, interpolations resolved."""
    from omegaconf import OmegaConf

    from specter.config import RunConfig

    return RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))


def compose_run_config(overrides: list[str]):
    """conf/config.yaml composed with Hydra overrides (already checked), as a `RunConfig`."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return to_run_config(cfg)


def run_config(argv: list[str]):
    """The `RunConfig` of one job's `key=value` arguments, composed in this process as
    `python run.py ARGS` composes it: checked (one sentence, `UserError`), then composed."""
    return compose_run_config(checked_overrides(argv))
