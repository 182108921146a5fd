"""A model's checkpoint folder and what its config.json says, before any weight loads.

Owns: turning a model config (project-made name, local folder, or hub id) into a checkpoint
folder, checking it holds safetensors weights, transformers' own classes for it (never
`trust_remote_code`), the dtype and attention implementation a run loads it with, its
tokenizer, and what config.json alone tells (context length, routed experts and top-k).
Project-made models are shipped or built on first use (zoo.py) and then read exactly like a
real checkpoint.
Does not own: loading the weights and where each tensor goes (specter/placement/).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specter.config import ModelConfig
from specter.errors import UserError
from specter.models import zoo

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_checkpoint(cfg: ModelConfig, cache_dir: Path | None, seed: int,
                       progress: bool = True) -> Path:
    """The folder to load from; builds project-made models on first use."""
    if cfg.source == "project":
        return zoo.ensure_project_model(cfg.name, seed=seed, cache_dir=cache_dir, progress=progress,
                                        build=cfg.build)
    if cfg.weights == "random":
        return random_folder(cfg, cache_dir)
    if cfg.weights == "inflated":
        return inflated_folder(cfg, cache_dir, seed, progress)
    if not cfg.path and not cfg.hub_id:
        raise UserError(f"model={cfg.name} names no weights: pass model.path=DIR, a folder "
                        "holding its config.json and .safetensors files.")
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise UserError(f"no checkpoint for model={cfg.name} at {path} (no config.json); "
                            f"download it with `hf download {cfg.hub_id} --local-dir {path}` "
                            f"and pass model.path={path}.")
    else:
        path = _hub_snapshot(cfg)
    if not any(path.glob("*.safetensors")):
        raise UserError(f"{path} holds no .safetensors weights; this project loads safetensors "
                        f"only (re-download {cfg.hub_id} in safetensors form).")
    check_checkpoint(path)
    return path


def random_folder(cfg: ModelConfig, cache_dir: Path | None) -> Path:
    """`model.weights=random`: a folder holding the named model's published config.json,
    generation config and a tokenizer with its special tokens, and no weights (written once
    into the cache; the weights are made at load)."""
    import hashlib

    from specter.models.published import PUBLISHED, write_config_folder

    if cfg.name not in PUBLISHED:
        raise UserError(f"model.weights=random needs model={cfg.name}'s published config.json, "
                        f"which this project does not hold; it holds {', '.join(PUBLISHED)}.")
    digest = hashlib.sha256(json.dumps(PUBLISHED[cfg.name]["config"], sort_keys=True)
                            .encode()).hexdigest()[:10]
    if cfg.layers is not None or cfg.narrow:
        digest += "-" + hashlib.sha256(json.dumps([cfg.layers, cfg.narrow], sort_keys=True)
                                       .encode()).hexdigest()[:8]
    folder = (cache_dir or zoo.default_cache_dir()) / "random" / f"{cfg.name}-{digest}"
    _write_once(folder, lambda tmp: _sized(cfg, lambda: write_config_folder(
        cfg.name, tmp, layers=cfg.layers, narrow=cfg.narrow)))
    return folder


def _sized(cfg: ModelConfig, make):
    """make(), with model.layers / model.narrow refused in one sentence where they do not fit
    the published config."""
    try:
        return make()
    except (KeyError, ValueError) as e:
        raise UserError(f"model.narrow / model.layers for model={cfg.name}: {e}") from None


def _write_once(folder: Path, write) -> None:
    """`folder` written by write(tmp) into a temporary sibling and renamed into place, unless
    it holds a config.json already (another process may win the rename: its folder stays);
    then checked."""
    import shutil

    if not (folder / "config.json").is_file():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        write(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process wrote it first
            shutil.rmtree(tmp, ignore_errors=True)
    check_checkpoint(folder)


def inflated_folder(cfg: ModelConfig, cache_dir: Path | None, seed: int = 0,
                    progress: bool = True) -> Path:
    """`model.weights=inflated`: a folder holding the named real model's config.json as its
    inflation from a project-made model carries it (models/inflate.py), the small model's
    tokenizer and generation config, and `specter_inflated.json` naming the source (its folder
    and weights' checksum) and the recipe; no weights (they are made at load from the
    source's). Written once into the cache, keyed by the config, the source's checksum and the
    recipe."""
    import hashlib
    import shutil

    from specter.models.inflate import RECIPE, check_source, inflated_config
    from specter.models.published import fixture_config

    source = check_source(cfg.name, cfg.inflate_from)
    src = zoo.ensure_project_model(source, seed=seed, cache_dir=cache_dir, progress=progress,
                                   build=cfg.build)
    small = json.loads((src / "config.json").read_text())
    big = _sized(cfg, lambda: fixture_config(cfg.name, layers=cfg.layers, narrow=cfg.narrow))
    config = inflated_config(big, small)
    build = json.loads((src / "specter_build.json").read_text()) \
        if (src / "specter_build.json").is_file() else {}
    meta = {"from": source, "source_folder": str(src.resolve()),
            "source_weights_sha256": build.get("weights_sha256", ""),
            "source_origin": build.get("origin", "local"), "recipe": RECIPE}
    digest = hashlib.sha256(json.dumps([config, meta["source_weights_sha256"], RECIPE],
                                       sort_keys=True,
                                       default=str).encode()).hexdigest()[:10]
    folder = (cache_dir or zoo.default_cache_dir()) / "inflated" / f"{cfg.name}-{digest}"

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():  # the tokenizer and generation config, not the weights
            if f.suffix == ".json" and f.name not in ("config.json", "specter_build.json") \
                    or f.name.startswith("tokenizer"):
                shutil.copy(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "specter_inflated.json").write_text(json.dumps(meta, indent=2))

    _write_once(folder, write)
    return folder


# Architectures transformers knows that this project's offloading cannot run, and why.
UNSUPPORTED = {
    "gpt_oss": "its experts are fused across experts ([E, H, 2I], gate and up interleaved, with "
               "biases) and shipped MXFP4-packed, while the expert store, the cache slots and the "
               "INT4 draft take one expert's [2I, H] gate/up and [H, I] down matrices at a time.",
}


def check_checkpoint(path: Path) -> None:
    """The checkpoint folder can be loaded without running anything it ships: config.json is
    JSON naming a model_type transformers implements itself (a folder that also ships code,
    `auto_map`, loads that native class: `native_classes`), and every safetensors file is whole
    (its header's tensors fit the file). One sentence otherwise."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config = path / "config.json"
    try:
        raw = json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{config} is not valid JSON ({e.msg} at line {e.lineno}).") from None
    if not isinstance(raw, dict) or not raw.get("model_type"):
        raise UserError(f"{config} names no model_type; is this a Hugging Face checkpoint?")
    if raw["model_type"] not in CONFIG_MAPPING_NAMES:
        import transformers

        ships = (" It ships its own code (auto_map), which this project never runs; use a "
                 "checkpoint of an architecture transformers supports natively."
                 if raw.get("auto_map") else "")
        raise UserError(f"{config}: model_type '{raw['model_type']}' is not an architecture "
                        f"transformers {transformers.__version__} knows.{ships}")
    if raw["model_type"] in UNSUPPORTED:
        raise UserError(f"{config}: model_type '{raw['model_type']}' is not supported: "
                        f"{UNSUPPORTED[raw['model_type']]}")
    for weights in sorted(path.glob("*.safetensors")):
        problem = _safetensors_problem(weights)
        if problem:
            raise UserError(f"{weights} {problem}; download it again.")


def _safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (None when it is): read from its header."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                return "is truncated or not a safetensors file (its header does not fit)"
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError):
        return "is not a safetensors file (unreadable header)"
    ends = [t["data_offsets"][1] for k, t in header.items()
            if k != "__metadata__" and isinstance(t, dict) and "data_offsets" in t]
    need = 8 + n + (max(ends) if ends else 0)
    if need > size:
        return f"is truncated ({size} of {need} bytes)"
    return None


def _hub_snapshot(cfg: ModelConfig) -> Path:
    """A complete local snapshot of `cfg.hub_id`: from the HF cache, or downloaded when online."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py"]
    try:
        return Path(snapshot_download(cfg.hub_id, allow_patterns=patterns, local_files_only=True))
    except Exception:  # not cached: fall through to a download attempt
        pass
    if os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0"):
        reason = "HF_HUB_OFFLINE is set"
    else:
        try:
            return Path(snapshot_download(cfg.hub_id, allow_patterns=patterns, etag_timeout=10))
        except Exception as e:  # no network, gated repo, ...: one sentence for the user
            reason = f"download failed ({type(e).__name__})"
    raise UserError(f"weights for model={cfg.name} ({cfg.hub_id}) not found: model.path is unset, "
                    f"they are not in the Hugging Face cache and {reason}; download them with "
                    f"`hf download {cfg.hub_id} --local-dir DIR` and pass model.path=DIR.")


def pick_dtype(cfg: ModelConfig, device: torch.device, checkpoint: Path | None = None,
               bf16_ok: bool | None = None) -> torch.dtype:
    """`model.dtype`, or for `auto`: float32 on the CPU; on a GPU the checkpoint's own dtype
    where it ships bfloat16 and the device computes it (`bf16_ok`; asked of the device when
    None), else float16 (the paper's FP16). Every seed model ships bfloat16: on an H100/H200
    its grouped experts kernel is torch's (offload/grouped.py `pick_kernel`)."""
    if cfg.dtype != "auto":
        return DTYPES[cfg.dtype]
    if device.type == "cpu":
        return torch.float32
    if checkpoint is not None and shipped_dtype(checkpoint) == torch.bfloat16:
        if bf16_ok is None:
            bf16_ok = (device.type == "cuda"
                       and torch.cuda.is_bf16_supported(including_emulation=False))
        if bf16_ok:
            return torch.bfloat16
    return torch.float16


def shipped_dtype(checkpoint: Path) -> torch.dtype | None:
    """The dtype config.json says the checkpoint's weights are in (`torch_dtype`, or
    transformers 5's `dtype`), None when it says none."""
    try:
        raw = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = raw.get("torch_dtype") or raw.get("dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16,
            "float32": torch.float32}.get(name)


def native_classes(path: Path):
    """(config, causal-LM class) of transformers' own implementation of the checkpoint's
    model_type, chosen by model_type alone: config.json's `auto_map` (code shipped in the
    folder) and its `architectures` spelling (Phi-3.5-MoE's `PhiMoEForCausalLM` for the native
    `PhimoeForCausalLM`) are never consulted, so nothing in the folder is imported."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = json.loads((path / "config.json").read_text())
    config_class = CONFIG_MAPPING[raw["model_type"]]
    config = config_class.from_pretrained(str(path))
    if hasattr(config, "auto_map"):
        del config.auto_map
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    except KeyError:
        raise UserError(f"{path}: transformers has no causal-LM class for model_type "
                        f"'{raw['model_type']}'.") from None
    return config, model_class


def remote_code_note(path: Path) -> str | None:
    """One line for a checkpoint that ships its own code (auto_map): which native class runs
    instead. None when it ships none."""
    raw = json.loads((path / "config.json").read_text())
    shipped = raw.get("auto_map") or {}
    if not shipped:
        return None
    _, model_class = native_classes(path)
    their = shipped.get("AutoModelForCausalLM") or next(iter(shipped.values()))
    return (f"{path.name}/config.json ships its own code ({their}); loading transformers' native "
            f"{model_class.__name__} for model_type '{raw['model_type']}' instead (nothing in "
            "the folder is imported).")


def flash_attn_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def pick_attention(cfg: ModelConfig, model_class, device: torch.device) -> tuple[str, str]:
    """(attention implementation, why) for `model.attn`: auto takes flash_attention_2 on CUDA
    where the `gpu` extra's flash-attn is installed and the architecture supports it, else
    sdpa where supported, else eager; an explicit choice that cannot run is one sentence."""
    supports = {"eager": True, "sdpa": getattr(model_class, "_supports_sdpa", False),
                "flash_attention_2": getattr(model_class, "_supports_flash_attn", False)}
    name = model_class.__name__
    if cfg.attn == "auto":
        if device.type == "cuda" and supports["flash_attention_2"] and flash_attn_installed():
            return "flash_attention_2", "auto: CUDA, flash-attn installed"
        if supports["sdpa"]:
            why = ("auto: CUDA without the flash-attn extra (pip install -e .[gpu])"
                   if device.type == "cuda" and supports["flash_attention_2"] else "auto")
            return "sdpa", why
        return "eager", f"auto: {name} supports neither flash-attn nor sdpa"
    if not supports[cfg.attn]:
        raise UserError(f"model.attn={cfg.attn}: {name} does not support it; use auto, eager"
                        + (" or sdpa." if supports["sdpa"] else "."))
    if cfg.attn == "flash_attention_2":
        if device.type != "cuda":
            raise UserError(f"model.attn=flash_attention_2 needs a CUDA device (this run's is "
                            f"{device.type}); use model.attn=auto or sdpa.")
        if not flash_attn_installed():
            raise UserError("model.attn=flash_attention_2 needs the flash-attn package, an "
                            "optional extra: pip install -e .[gpu], or use model.attn=sdpa.")
    return cfg.attn, "model.attn"


def load_tokenizer(checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint), trust_remote_code=False)


def read_max_positions(checkpoint: Path) -> int | None:
    """The positions the model supports, from config.json alone (None when it names none)."""
    positions = json.loads((checkpoint / "config.json").read_text()).get("max_position_embeddings")
    return positions if isinstance(positions, int) else None


def read_moe_shape(cfg: ModelConfig, checkpoint: Path) -> tuple[int, int]:
    """(routed experts, top-k) from config.json alone, to validate budgets before loading."""
    raw = json.loads((checkpoint / "config.json").read_text())
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        if raw.get(key):
            return int(raw[key]), int(raw["num_experts_per_tok"])
    raise UserError(f"model={cfg.name}: {checkpoint}/config.json names no routed-expert count; "
                    "is this a Mixture-of-Experts checkpoint?")
