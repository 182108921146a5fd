"""The house's measures that a test can hold (issue 57): code outside specter/clock/ asks a
clock by trait, never by name (scripts/clock_strings.py); no import circle, at most 2 arrows
back up (scripts/import_circles.py, layers.py); a window read three calls deep from the loop
within 8 files and 40 functions (scripts/window_path.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import clock_strings  # noqa: E402

from specter.clock.kinds import CLOCKS, clock_kind  # noqa: E402
from specter.config import HardwareConfig  # noqa: E402
from specter.errors import UserError  # noqa: E402


def test_the_counter_sees_a_string_test_and_lets_a_device_test_be():
    found = clock_strings.string_tests(
        "if timing.clock == 'virtual': pass\n"
        "ok = hw.clock not in ('virtual', 'emulated')\n"
        "gpu = device.type == 'cuda'\n"
        "cuda = torch.device(d).type != 'cuda'\n"
        "x = name == 'fast'\n")
    assert [line for line, _ in found] == [1, 2]


def test_no_string_test_of_the_clock_kind_outside_the_clock():
    found = clock_strings.clock_string_tests()
    assert len(found) <= 2, "ask the clock by trait (specter/clock/kinds.py): " + "; ".join(
        f"{rel}:{line} {code}" for rel, line, code in found)


def test_each_clock_answers_its_traits():
    table = {name: (k.charged, k.modelled, k.measured, k.real, k.sleeps, k.times_copies)
             for name, k in CLOCKS.items()}
    assert table == {"virtual": (True, True, False, False, False, True),
                     "emulated": (False, True, True, False, True, True),
                     "wall": (False, False, True, True, False, False),
                     "cuda": (False, False, True, True, False, True)}
    assert HardwareConfig("h", clock="emulated").kind is clock_kind("emulated")
    with pytest.raises(UserError, match="hardware.clock must be wall, virtual or emulated"):
        HardwareConfig("h", clock="cuda").kind  # a run's clock is named wall on a GPU


def test_compute_is_charged_only_through_the_clock():
    """`link.compute(seconds)` moves the virtual clock: only specter/clock/ calls it (the
    observer's methods), so every charge is found in one place."""
    import re

    root = Path(__file__).resolve().parent.parent
    calls = [f"{p.relative_to(root)}:{n}" for top in ("specter", "baselines", "experiments")
             for p in sorted((root / top).rglob("*.py"))
             if not p.relative_to(root).as_posix().startswith("specter/clock/")
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"link\.compute\(", line)]
    assert calls == []


def test_import_circles_find_a_loop_and_specter_has_none():
    """scripts/import_circles.py sees a planted loop; inside specter/ there is none (the
    registry's table, specter/registry.py, imports nothing of the project, so the settings and
    the recipes' reader both read it)."""
    import import_circles

    planted = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert import_circles.circles(planted) == [["p.a", "p.b", "p.c"]]
    found = import_circles.circles(import_circles.import_graph(
        Path(__file__).resolve().parent.parent / "specter"))
    assert found == []


def test_arrows_back_up_are_seen_and_do_not_grow():
    """scripts/layers.py sees a planted import from a leaf up to the library's entry; inside
    specter/ the arrows back up against its written layering (LAYERS, docs/layout.md) are no
    more than issue 57's goal, 2 (clock -> offload, config -> clock: docs/layout.md)."""
    import import_circles
    import layers

    planted = {"specter.errors": {"specter.api"}, "specter.api": {"specter.errors"}}
    assert list(layers.arrows_back_up(planted)) == [("errors", "api")]
    up = layers.arrows_back_up(import_circles.import_graph(
        Path(__file__).resolve().parent.parent / "specter"))
    assert len(up) <= 2, up


def test_a_window_three_calls_deep_reads_at_most_8_files_and_40_functions(tmp_path):
    """scripts/window_path.py traces default Specter's window (virtual clock, experts copied)
    in a fresh process (other tests patch transformers' classes: verification's pieces): it
    sees the loop's own calls, the runtime under Hugging Face's frames (depth 3: the
    dispatcher at 2) and the orchestrator behind the loop's events; three calls deep the
    reading stays within issue 57's goal, or the script exits 1."""
    import json
    import subprocess

    out = tmp_path / "path.json"
    script = Path(__file__).resolve().parent.parent / "scripts" / "window_path.py"
    run = subprocess.run([sys.executable, str(script), "--tokens", "12", "--json", str(out),
                          "--max", "8", "40"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    seen = {(r["file"], r["function"]): r["depth"] for r in json.loads(out.read_text())["functions"]}
    assert seen[("specter/decoding/loop.py", "Rows.commit_window")] == 1
    assert seen[("specter/experts.py", "dispatch")] == 2
    assert seen[("specter/offload/runtime.py", "OffloadRuntime.experts_forward")] == 3
    assert seen[("specter/pio/orchestrator.py", "Orchestrator.draft_step")] == 3
    assert len(seen) > 100  # deeper, the whole machine runs
