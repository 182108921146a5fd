"""Every config composes and converts to a typed RunConfig; each system's settings are its own
(a knob it lacks is one sentence)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import experiments.registry  # noqa: F401  (registers each system's typed config with specter.config)
from specter.config import RunConfig
from specter.errors import UserError

CONF = Path(__file__).resolve().parent.parent / "conf"
CHOICES = [(g, p.stem) for g in ("model", "budget", "system", "dataset", "hardware", "experiment")
           for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.mark.parametrize("group,choice", CHOICES, ids=[f"{g}={c}" for g, c in CHOICES])
def test_every_config_composes(group, choice):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"{group}={choice}"])
    run_cfg = RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    if group == "model":
        assert run_cfg.model.name == choice
    elif group != "experiment":
        assert getattr(run_cfg, group).name == choice


def test_knobs_are_refused_by_systems_that_do_not_have_them():
    import yaml

    from conftest import REPO
    from experiments.registry import config_class
    from specter.config import RunConfig
    from test_offload import A100

    def cfg(system: dict):
        return RunConfig.from_dict({
            "model": yaml.safe_load((REPO / "conf/model/tiny_qwen.yaml").read_text()),
            "budget": {"name": "low"}, "system": system, "dataset": {"name": "gsm8k"},
            "hardware": A100, "workload": {}})

    assert cfg({"name": "specter", "shared": False, "top_m": 3}).system.top_m == 3
    assert isinstance(cfg({"name": "sp_l", "top_m": 3}).system, config_class("sp_l"))
    for name, knob, text in (("sp_e", "overlap", "system.overlap applies to specter, specter_hybrid only"),
                             ("specmoeoff", "kv_copy", "system.kv_copy applies to specter, specter_hybrid only"),
                             ("lru_s", "shared", "system.shared applies to specter, specter_hybrid only"),
                             ("lru", "prefetch_noise", "prefetch_noise applies to specter, specter_hybrid, sp_e"),
                             ("lru", "sharing", "unknown setting 'system.sharing'")):
        with pytest.raises(UserError, match=text):
            cfg({"name": name, knob: True})


@pytest.mark.parametrize("knob,value,text", [
    ("cold_start_round", "round", "system.cold_start_round must be floor or ceil"),
    ("bandwidth_prior_Bps", -1.0, "system.bandwidth_prior_Bps must be a positive number"),
    ("step_prior_s", 0.0, "system.step_prior_s must be a positive number"),
    ("final_plan", "yes", "system.final_plan must be bool"),
])
def test_bad_planner_switches_are_one_sentence(knob, value, text):
    import yaml

    from conftest import REPO
    from specter.config import RunConfig
    from test_offload import A100

    with pytest.raises(UserError, match=text) as err:
        RunConfig.from_dict({
            "model": yaml.safe_load((REPO / "conf/model/tiny_qwen.yaml").read_text()),
            "budget": {"name": "low"}, "system": {"name": "specter", knob: value},
            "dataset": {"name": "gsm8k"}, "hardware": A100, "workload": {}})
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


def test_system_settings_on_the_command_line_are_one_sentence_when_wrong(tmp_path):
    from conftest import run_cli

    wrong_system = run_cli("system=lru", "system.shared=false", f"out_dir={tmp_path}")
    unknown = run_cli("system=specter", "system.sharing=false", f"out_dir={tmp_path}")
    for res, text in ((wrong_system, "system.shared applies to specter, specter_hybrid only"),
                      (unknown, "unknown setting 'system.sharing'")):
        assert res.returncode == 2 and text in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    assert not tmp_path.joinpath("records").exists()
