"""The four clocks a run can keep, and what each one is, asked by name of trait.

Code outside this package asks a clock what it does (`charged`, `modelled`, `measured`,
`real`, `sleeps`, `times_copies`), never which one it is: adding a fifth clock is one entry
here, not a search for string tests. `hardware.clock` (config) names one of wall | virtual | emulated; a wall run on a
GPU keeps the `cuda` clock (its link times copies with CUDA events).

| clock    | charged | modelled | measured | real | sleeps | times_copies |
|----------|---------|----------|----------|------|--------|--------------|
| virtual  | yes     | yes      |          |      |        | yes          |
| emulated |         | yes      | yes      |      | yes    | yes          |
| wall     |         |          | yes      | yes  |        |              |
| cuda     |         |          | yes      | yes  |        | yes          |
"""

from __future__ import annotations

from dataclasses import dataclass

from specter.errors import UserError


@dataclass(frozen=True)
class ClockKind:
    name: str
    # Time is the cost model's: every compute step and copy is charged, nothing is measured
    # (the virtual clock). A step that ran compiled is charged as the modelled GPU runs it.
    charged: bool
    # Copies and the charged sizes come from a hardware profile (virtual; emulated, whose
    # threads sleep the profile's transfer time): the real model's sizes can be charged.
    modelled: bool
    # Real time passes in hooks and threads that sleep (emulated): a compiled or captured step,
    # whose hooks do not run, would skip its sleeps.
    sleeps: bool
    # Copies take time on this clock: modelled (virtual), slept (emulated) or timed by CUDA
    # events (cuda). On the CPU's own clock (wall) a copy is a memcpy with nothing to time.
    times_copies: bool

    @property
    def measured(self) -> bool:
        """Time is read off this machine (wall, cuda, emulated)."""
        return not self.charged

    @property
    def real(self) -> bool:
        """Measured and not emulated: the machine's own time for its own work (wall, cuda)."""
        return not self.modelled


VIRTUAL = ClockKind("virtual", charged=True, modelled=True, sleeps=False, times_copies=True)
EMULATED = ClockKind("emulated", charged=False, modelled=True, sleeps=True, times_copies=True)
WALL = ClockKind("wall", charged=False, modelled=False, sleeps=False, times_copies=False)
CUDA = ClockKind("cuda", charged=False, modelled=False, sleeps=False, times_copies=True)
CLOCKS = {k.name: k for k in (VIRTUAL, EMULATED, WALL, CUDA)}
HARDWARE_CLOCKS = ("wall", "virtual", "emulated")  # what `hardware.clock` may name


def clock_kind(name: str) -> ClockKind:
    """The clock called `name`; an unknown name is one sentence."""
    kind = CLOCKS.get(name)
    if kind is None:
        raise UserError(f"unknown clock '{name}'; hardware.clock must be one of "
                        f"{', '.join(HARDWARE_CLOCKS)}.")
    return kind
