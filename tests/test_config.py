"""Every config composes and converts to a typed RunConfig; each system's settings are its own
(a knob it lacks is one sentence)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

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
    from specter.config import system_config_class as config_class
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
    ("bandwidth_prior_Bps", -1.0, "system.bandwidth_prior_Bps must be >= 0"),
    ("bandwidth_prior_Bps", 0.0, "system.bandwidth_prior_Bps must be a positive number"),
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


# -- every numeric setting, probed past what any consumer accepts ------------------------------
ZERO_MEANS = {  # numeric settings where 0 is a meaning, not an error
    "seed", "model_seed", "budget.staging", "budget.reserve_gb", "workload.temperature",
    "quant.min_tokens", "system.prefetch_noise",
    # a hardware profile's 0: "not modelled" (a wall-clock profile has no device rates; a
    # public-fit profile no fitted framework costs; a profile of constants no counted costs)
    *(f"hardware.{f}" for f in ("matrix_flops", "mem_bandwidth_Bps", "launch_overhead_s",
                                "layer_overhead_s", "expert_overhead_s", "draft_overhead_s",
                                "offload_layer_overhead_s", "h2d_bandwidth_Bps",
                                "h2d_latency_s", "host_matrix_flops",
                                "host_mem_bandwidth_Bps", "host_op_s", "sync_s", "kernel_floor_s",
                                "expert_bits", "attn_bits", "attn_quant_group")),
}


def numeric_settings():
    """(dotted key, system name, is-integer) of every numeric field of the typed config,
    the systems' own knobs included."""
    import dataclasses

    from specter.recipes import SYSTEMS
    from specter.config import RunConfig, section_classes, system_config_class

    out, seen = [], set()
    classes = [(f"{name}.", cls, None) for name, cls in section_classes().items()
               if name != "system"]
    classes += [("", RunConfig, None)]
    classes += [("system.", system_config_class(s), s) for s in SYSTEMS]
    for prefix, cls, system in classes:
        for f in dataclasses.fields(cls):
            t = str(f.type)
            if prefix == "" and f.name in section_classes():
                continue
            if ("int" in t or "float" in t) and (prefix + f.name) not in seen:
                seen.add(prefix + f.name)
                out.append((prefix + f.name, system, "float" not in t))
    return out


def _with(key: str, value, system: str | None) -> dict:
    from test_offload import A100

    model = ({"name": "deepseek", "source": "hf", "weights": "random"}
             if key == "model.layers" else {"name": "tiny_qwen", "source": "project"})
    d = {"model": model, "budget": {"name": "high"},
         "system": {"name": system or "specter"}, "dataset": {"name": "gsm8k"},
         "hardware": dict(A100), "workload": {}, "progress": False}
    section, _, field = key.rpartition(".")
    if not section:
        d[field] = value
    elif key.startswith("model.budget_"):  # a mapping of numbers: one entry
        d["model"][field] = {"high": value}
    else:
        d.setdefault(section, {})[field] = value
    return d


NUMERIC = numeric_settings()


@pytest.mark.parametrize("key,system,integer", NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_every_numeric_setting_refuses_what_no_consumer_accepts(key, system, integer):
    """Negative, not finite, or, where a whole number is meant, past 64 bits or not whole: one
    sentence before anything loads; zero too, unless zero means something for that key."""
    from specter.config import RunConfig

    bad = [-1, float("nan"), float("inf")] + ([2**64, 1.5] if integer else [])
    if key not in ZERO_MEANS:
        bad.append(0)
    if key == "spec.profile_ks":
        bad = [[v] for v in bad]
    for value in bad:
        with pytest.raises(UserError) as err:
            RunConfig.from_dict(_with(key, value, system))
        assert "\n" not in str(err.value) and key.split(".")[-1] in str(err.value), (key, value)
    good = {"spec.profile_ks": [1], "quant.bits": 4, "hardware.expert_bits": 4,
            "hardware.attn_bits": 4, "model.layers": 4}.get(key, 1)
    RunConfig.from_dict(_with(key, good, system))
