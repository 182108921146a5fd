"""What makes a project-made build (a trained tiny/small model, its INT4 draft) the same on
every run, and what is left that is not.

Owns: the thread count every CPU build runs under (`BUILD_THREADS`, set for the build and the
caller's restored afterwards), the training-seed offset a user may set to train other weights
from the same recipes (`SPECTER_TRAIN_SEED_OFFSET`), the checksum of a checkpoint's weights, and
the description of the build environment written beside each build, and the digest of the
sources a cached result was made by (`source_digest`: a depth profile, an INT4 draft).
Does not own: the recipes (models/archs.py, models/zoo.py) or the quantizer (quant/).

Why the thread count: CPU kernels split their reductions by thread, so the same recipe trained
on 1 thread and on 2 gives other weights (measured: all 585 tensors of tiny_qwen differed, by
up to 0.43). Fixing it makes a build depend only on the recipe, the torch release and the CPU's
kernel family (`cpu_capability`, e.g. AVX2 vs AVX512, and the vendor's float kernels), which a
build records; no count of cores or caller's setting enters. Two is what a 2-core machine
trains with by default, so the benchmark-size models stay those the docs measured.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from contextlib import contextmanager
from pathlib import Path

import torch

from specter.errors import UserError

ROOT = Path(__file__).resolve().parents[1]  # the checkout: specter/, baselines/
BUILD_THREADS = 2  # intra-op threads of every CPU build (training, routing stats, GPTQ)
SEED_OFFSET_ENV = "SPECTER_TRAIN_SEED_OFFSET"


@contextmanager
def build_threads(n: int = BUILD_THREADS):
    """Run the block on `n` intra-op threads; the caller's count is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_seed_offset() -> int:
    """`$SPECTER_TRAIN_SEED_OFFSET` (default 0): added to the training seed of every project-made
    model, so the suite and the benchmarks can be run on other weights of the same recipes."""
    raw = os.environ.get(SEED_OFFSET_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value < 2**31:
        raise UserError(f"{SEED_OFFSET_ENV}={raw!r} is not a whole number from 0 to {2**31 - 1}.")
    return value


def cpu_name() -> str:
    """This machine's CPU model (a build records it: float rounding differs between CPU kernel
    families, so the same recipe trains slightly different weights on another CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def environment() -> dict:
    """What a build ran under, for specter_build.json: what still changes the weights (the CPU,
    its vector kernels, torch) and what was fixed (the thread count)."""
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    return {"torch": torch.__version__, "cpu": cpu_name(), "cpu_capability": capability,
            "threads": torch.get_num_threads()}


def state_checksum(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's tensors in name order (name, dtype, shape, bytes): equal
    checksums mean bit-identical weights."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def checkpoint_checksum(folder: Path) -> str:
    """`state_checksum` of every tensor in a checkpoint folder's safetensors files."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state_checksum(state)


@functools.lru_cache(maxsize=None)
def source_digest(*folders: str, root: Path = ROOT) -> str:
    """A digest of the Python sources under `folders` (relative to `root`): what a cached result
    depends on beyond its configuration, so a result made by other code is made again."""
    h = hashlib.sha256()
    for folder in folders:
        for f in sorted((root / folder).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]
