"""One attribute set for the length of a block: the project's mode switches (the draft mode,
the compiled draft step's formulations, verification in pieces)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def switched(owner, name: str, value, result=None):
    """`owner.name` is `value` inside the block and what it was after; yields `result`."""
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield result
    finally:
        setattr(owner, name, previous)
