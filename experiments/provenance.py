"""Where a record came from: code version, packages, machine. Collected once per run."""

from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "transformers", "accelerate", "hydra-core", "pandas", "pyarrow", "safetensors")


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def gpu_name() -> str:
    """The CUDA device name, or "" without one (NVML errors on CPU machines are expected)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml.NVMLError or no driver: not a GPU machine
        return ""


@lru_cache(maxsize=1)
def provenance() -> dict[str, str]:
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = ""
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    prov = {
        "prov.git_commit": commit + ("+dirty" if commit and dirty else ""),
        "prov.python": platform.python_version(),
        "prov.machine": platform.node(),
        "prov.platform": platform.platform(),
        "prov.cpu_count": str(os.cpu_count()),
        "prov.gpu": gpu_name(),
    }
    prov.update({f"prov.pkg.{k}": v for k, v in versions.items()})
    return prov
