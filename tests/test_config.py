"""Every config composes and converts to a typed RunConfig; metrics arithmetic."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specter.config import RunConfig
from specter.engine import Generation
from specter.metrics import distinct_n, timing

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


def test_tpot_from_commit_times():
    gen = Generation(tokens=[5, 6, 7, 8], commit_times_s=[1.0, 1.1, 1.2, 1.4], start_time_s=0.5,
                     peak_mem_bytes=1, peak_mem_source="device_tensors")
    t = timing(gen)
    assert t["tpot_ms"] == pytest.approx(400 / 3)
    assert t["ttft_ms"] == pytest.approx(500)
    assert t["tokens_per_s"] == pytest.approx(4 / 0.9)
    one = timing(Generation([5], [1.0], 0.5, 1, "x"))
    assert math.isnan(one["tpot_ms"])


def test_distinct_n():
    assert distinct_n([1, 2, 1, 2, 1, 2], 2) == pytest.approx(2 / 5)
    assert distinct_n([1, 2, 3, 4, 5], 4) == 1.0
