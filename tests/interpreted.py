"""Triton kernels run under Triton's interpreter in a fresh process (TRITON_INTERPRET must be
set before triton is first imported), their launches counted and the aten operations around
them recorded: the checks of tests/test_draft_step.py, test_grouped.py and
test_verify_pieces.py.

A check is Python source in `str.format` style (`{root!r}` is the repository; a literal brace
is doubled) that prints "ok" at its end; `PRELUDE` goes before it and defines `launches` (one
grid per Triton launch), `seen` (the aten operations dispatched under `Ops()`, the
interpreter's own work apart) and `kernels` (specter/quant/kernels.py, whose `_kernel` is
wrapped to count)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]

PRELUDE = """
import sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, {root!r})
from specter.counting import DEVICE_LAUNCHES
from specter.quant import kernels

launches, seen, paused = [], [], []
real = kernels._kernel

class Counted:  # the jitted kernel: its launch counted, its interpreter's work not recorded
    def __init__(self, k): self.k = k
    def __getitem__(self, grid):
        def launch(*a, **kw):
            launches.append(grid)
            paused.append(1)
            try:
                return self.k[grid](*a, **kw)
            finally:
                paused.pop()
        return launch
kernels._kernel = lambda *a, **kw: Counted(real(*a, **kw))

class Ops(TorchDispatchMode):  # aten calls of the op's body: allocations only
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not paused and not func.is_view:
            seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {{}}))
"""


def run(check: str) -> None:
    """`PRELUDE + check` under the interpreter; it must exit 0 and print "ok"."""
    code = (PRELUDE + check).format(root=str(ROOT))
    res = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr[-3000:]
