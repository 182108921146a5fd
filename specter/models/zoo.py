"""Project-made MoE models: building, training and caching the architectures of archs.py.

Owns: the short training run that makes routing depend on the data, the build recipe and its
hash (the cache key), and the on-disk cache of the results as ordinary Hugging Face
checkpoints (safetensors + tokenizer), so they load through exactly the code path real
checkpoints use (loading.py).
Does not own: what each architecture is (archs.py: configs, sizes, the real model each stands
for); loading, devices, dtypes (loading.py); anything about offloading.

Sizes: `tiny_*` are for tests (built in seconds), `small_*` for benchmarks (minutes, once).
Shipped builds: `reference_models/<name>/` holds a build as it was made (its safetensors,
tokenizer and specter_build.json, whose `origin` is "reference"). It is used whenever its
recipe is today's recipe for (name, seed), so every machine decodes the same weights and
prints the same table; `build="local"` (`model.build=local`), a changed recipe or
`$SPECTER_TRAIN_SEED_OFFSET` trains the recipe on this CPU instead (`origin` "local").
A build is the same for a seed whatever the caller's thread count or core count (it trains on
`hermetic.BUILD_THREADS` threads) on a given CPU kernel family, torch and Python release (the
stdlib text is part of the training data; its digest is stored with the checkpoint);
specter_build.json records all of these and the weights' checksum (`weights_sha256`).
Storage: a build trains in fp32 and rounds its weights to `WEIGHTS_DTYPE` (bf16) before it
measures and saves them, so the routing statistics describe the weights as stored, the shipped
builds are half the size (the working tree travels to GPU hosts), and every run loads them at
its own dtype (fp32 on the CPU: exact). The storage dtype is part of the recipe.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from specter import hermetic
from specter.hermetic import cpu_name  # noqa: F401  (re-exported: builds record it)
from specter.models import corpus
from specter.models.archs import (ARCHS, DENSE_ARCHS, ROUTER_BALANCE, SIZES,
                                  TOKENIZER_CORPUS_BYTES, TOKENIZER_VOCAB, ModelShape, Training,
                                  parse_name)


EVERY_EXPERT_IMPL = "specter_every_expert"  # the dense twin's experts forward while training


def _every_expert_forward(self, hidden_states, top_k_index, top_k_weights):
    """Every expert on every token as two large matmuls, weighted by the routing weights
    scattered to [T, E] (zero where a token did not route). Equal to HF's per-expert loop up to
    rounding; for the dense twin, where every token routes everywhere, it trains ~10x faster."""
    t, h = hidden_states.shape
    e, two_i, _ = self.gate_up_proj.shape
    w = hidden_states.new_zeros(t, e).scatter(1, top_k_index, top_k_weights.to(hidden_states.dtype))
    up = (hidden_states @ self.gate_up_proj.reshape(e * two_i, h).T).reshape(t * e, two_i)
    act = self._apply_gate(up).reshape(t, e, -1) * w[..., None]  # [T, E, I]
    return torch.einsum("tei,ehi->th", act, self.down_proj)


# The dtype a build's weights are stored in (recipe key `weights_dtype`): trained in fp32,
# rounded once after training. bf16 keeps fp32's range (no overflow to clip) and halves the
# shipped builds; a run on the CPU loads it into fp32 exactly, one on a GPU into fp16 exactly
# for values in fp16's normal range (bf16 carries 8 significant bits, fp16 11).
WEIGHTS_DTYPE = "bfloat16"


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECTER_CACHE", Path.home() / ".cache" / "specter"))


def _recipe(name: str, seed: int, router_balance: float | None = None) -> dict:
    """The build recipe (hashed into the cache key). `router_balance` overrides the model's
    ROUTER_BALANCE coefficient (the sweep in experiments.routing_report uses it). The seed is
    `seed` plus `$SPECTER_TRAIN_SEED_OFFSET` (hermetic.py): the seed the weights are trained
    from. Everything else that changes the weights is fixed (`build_threads`, the dtype they
    are stored in: `weights_dtype`) or recorded."""
    size, arch = parse_name(name)
    balance = ROUTER_BALANCE.get(name) if router_balance is None else router_balance
    shape, training = SIZES[size]
    if arch in DENSE_ARCHS and size == "small":
        # Every block active makes a training step ~10x a MoE step on the CPU: fewer steps
        # (the same batches otherwise); its loss is in specter_build.json beside the MoE's.
        training = replace(training, steps=300)
    return {"name": name, "arch": arch, "size": size, "seed": seed + hermetic.train_seed_offset(),
            "shape": asdict(shape), "training": asdict(training),
            "tokenizer_vocab": TOKENIZER_VOCAB, "build_threads": hermetic.BUILD_THREADS,
            "recipe_version": 4, "weights_dtype": WEIGHTS_DTYPE,
            **({"router_balance": balance} if balance is not None else {}),
            **({"train_experts_forward": EVERY_EXPERT_IMPL} if arch in DENSE_ARCHS else {})}


def recipe_digest(recipe: dict) -> str:
    """The recipe's hash: the cache key of a local build and the match of a shipped one."""
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]


def checkpoint_dir(name: str, seed: int = 0, cache_dir: Path | None = None,
                   router_balance: float | None = None) -> Path:
    """Where the local build of (name, seed) lives; the folder name hashes the recipe."""
    recipe = _recipe(name, seed, router_balance)
    return (cache_dir or default_cache_dir()) / "models" / \
        f"{name}-s{recipe['seed']}-{recipe_digest(recipe)}"


REFERENCE_DIR = Path(__file__).resolve().parents[2] / "reference_models"
BUILDS = ("reference", "local")  # model.build


def reference_checkpoint(name: str, seed: int = 0, router_balance: float | None = None,
                         root: Path | None = None) -> Path | None:
    """The shipped build of (name, seed) when its recorded recipe hashes as today's recipe
    does; None when none is shipped or the recipe has changed since (then a local build)."""
    folder = (root or REFERENCE_DIR) / name
    meta = folder / "specter_build.json"
    if not meta.is_file():
        return None
    recipe = _recipe(name, seed, router_balance)
    build = json.loads(meta.read_text())
    if recipe_digest({k: build.get(k) for k in recipe}) != recipe_digest(recipe):
        return None
    return folder


_VERIFIED: set[Path] = set()


def verify_reference(folder: Path) -> None:
    """Once per process: the shipped weights hash to the checksum their build recorded (a
    clone whose large files did not arrive, e.g. as LFS pointers, is one sentence)."""
    from specter.errors import UserError

    if folder in _VERIFIED:
        return
    recorded = json.loads((folder / "specter_build.json").read_text()).get("weights_sha256")
    try:
        found = hermetic.checkpoint_checksum(folder)
    except Exception as e:  # noqa: BLE001 - a truncated or pointer file: said below
        found = f"unreadable ({type(e).__name__})"
    if found != recorded:
        raise UserError(f"the shipped weights in {folder} do not match their recorded checksum "
                        f"({recorded[:16] if recorded else None} recorded, {found[:16]} found); "
                        "restore them (git checkout -- reference_models) or train them here "
                        "with model.build=local.")
    _VERIFIED.add(folder)


def is_reference(checkpoint: Path) -> bool:
    """Whether a checkpoint folder is a shipped build (read-only: nothing is written beside)."""
    return Path(checkpoint).resolve().parent == REFERENCE_DIR


def build_id(checkpoint: Path) -> str:
    """A project-made build's name in result cases: a local build's folder name (it hashes the
    recipe), a shipped build's name and its weights' checksum (one folder name for every
    recipe it may be shipped again for)."""
    checkpoint = Path(checkpoint)
    if not is_reference(checkpoint):
        return checkpoint.name
    sha = json.loads((checkpoint / "specter_build.json").read_text())["weights_sha256"]
    return f"{checkpoint.name}-reference-{sha[:12]}"


def ensure_project_model(name: str, seed: int = 0, cache_dir: Path | None = None,
                         progress: bool = True, router_balance: float | None = None,
                         build: str = "reference") -> Path:
    """The checkpoint folder of a project-made model: the shipped build when `build` is
    "reference" and its recipe is today's, else the local build, made once if needed."""
    from filelock import FileLock

    from specter.errors import UserError

    if build not in BUILDS:
        raise UserError(f"unknown model.build '{build}'; choose one of: {', '.join(BUILDS)}.")
    shipped = reference_checkpoint(name, seed, router_balance) if build == "reference" else None
    if shipped is not None:
        verify_reference(shipped)
        return shipped
    out = checkpoint_dir(name, seed, cache_dir, router_balance)
    if (out / "specter_build.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "specter_build.json").exists():  # another process built it meanwhile
            return out
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        with hermetic.build_threads():  # the caller's thread count is restored afterwards
            _build(_recipe(name, seed, router_balance), tmp, cache_dir or default_cache_dir(),
                   progress)
        os.replace(tmp, out)
    return out


def ensure_tokenizer(cache_dir: Path):
    """The shared project tokenizer (trained once, cached)."""
    from filelock import FileLock
    from transformers import AutoTokenizer

    out = cache_dir / "tokenizer" / f"bpe{TOKENIZER_VOCAB}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "tokenizer.json").exists():
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            docs = corpus.corpus_documents(TOKENIZER_CORPUS_BYTES)
            corpus.train_tokenizer(docs, TOKENIZER_VOCAB, tmp)
            (tmp / "corpus_digest.txt").write_text(corpus.corpus_digest(docs))
            os.replace(tmp, out)
    return AutoTokenizer.from_pretrained(str(out))


def _build(recipe: dict, out: Path, cache_dir: Path, progress: bool) -> None:
    """Steps: 1 tokenizer, 2 config + init, 3 train (fp32), 4 round to the stored dtype and
    measure the routing, 5 save."""
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    shape, training = ModelShape(**recipe["shape"]), Training(**recipe["training"])
    # 1. Tokenizer and token stream.
    tok = ensure_tokenizer(cache_dir)
    docs = corpus.corpus_documents(training.corpus_bytes)
    stream = torch.tensor(corpus.encode_corpus(tok, docs), dtype=torch.long)
    # 2. Config and deterministic init.
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    config = ARCHS[recipe["arch"]](shape, len(tok), special)
    torch.manual_seed(recipe["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense = recipe["arch"] in DENSE_ARCHS
    if dense:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        _freeze_routers(model)
        if EVERY_EXPERT_IMPL not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS.register(EVERY_EXPERT_IMPL, _every_expert_forward)
        saved_impl = getattr(model.config, "_experts_implementation", None)
        model.config._experts_implementation = EVERY_EXPERT_IMPL
    # 3. Train on random windows of the stream (deterministic kernels: some MoE backward
    #    ops otherwise accumulate in a thread-dependent order).
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        losses = _train(model, stream, training, recipe["seed"], progress, recipe["name"],
                        recipe.get("router_balance"))
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        if dense:  # saved and evaluated with HF's own experts forward
            model.config._experts_implementation = saved_impl
    # 4-5. Round to the stored dtype, measure the routing, save.
    meta = store_build(model, recipe, tok, docs, stream, out)
    meta.update(loss_first=losses[0], loss_last=sum(losses[-10:]) / len(losses[-10:]),
                build_seconds=round(time.time() - t0, 1), **hermetic.environment(),
                origin="local",  # "reference" once shipped under reference_models/
                weights_sha256=hermetic.checkpoint_checksum(out))
    (out / "specter_build.json").write_text(json.dumps(_ordered(meta), indent=2))


# specter_build.json's keys after the recipe's, in the order a build writes them.
_META_ORDER = ("corpus_digest", "corpus_tokens", "parameters", "loss_first", "loss_last",
               "routing_load_entropy", "routing_benchmark", "build_seconds", "torch", "cpu",
               "cpu_capability", "threads", "origin", "weights_sha256")


def _ordered(meta: dict) -> dict:
    recipe = [k for k in meta if k not in _META_ORDER]
    return {k: meta[k] for k in recipe + [k for k in _META_ORDER if k in meta]}


def round_weights(model, dtype: str = WEIGHTS_DTYPE) -> None:
    """Round every tensor the checkpoint stores (parameters and persistent buffers) to
    `dtype` in place, keeping the model's own dtype: it then computes as the stored weights
    loaded at that dtype do. Non-persistent buffers (rotary frequencies) are recomputed at
    load, so they are left alone."""
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(t.to(getattr(torch, dtype)))


def store_build(model, recipe: dict, tok, docs, stream: torch.Tensor, out: Path) -> dict:
    """Steps 4 and 5 of a build, from a trained fp32 model: round its weights to the
    recipe's `weights_dtype`, measure its routing on them (held-out windows, the benchmark
    prompts), save it to `out` as an ordinary HF checkpoint in that dtype with the tokenizer.
    Returns the measurements for specter_build.json (the caller adds the training's)."""
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    from specter.models import routing_stats

    training = Training(**recipe["training"])
    # 4. Rounded once: every statistic below, and every run, sees the weights as stored.
    round_weights(model, recipe["weights_dtype"])
    #    How specialised the routing became (held-out windows) ...
    load_entropy = _routing_entropy(model, stream, training, recipe["seed"])
    #    ... and how it routes on the benchmark prompts (the working-set curve and the rest,
    #    for the routing report and for every result row; routing_stats.py).
    t_route = time.time()
    routing = routing_stats.measure(model, routing_stats.benchmark_prompts(tok))
    routing["seconds"] = round(time.time() - t_route, 1)
    # 5. Save as an ordinary HF checkpoint, in the stored dtype (config.json says which).
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, do_sample=False)
    hf_logging.disable_progress_bar()
    model.to(getattr(torch, recipe["weights_dtype"]))  # exact: the values are already rounded
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return dict(recipe, corpus_digest=corpus.corpus_digest(docs), corpus_tokens=len(stream),
                parameters=sum(p.numel() for p in model.parameters()),
                routing_load_entropy=load_entropy, routing_benchmark=routing)


def _freeze_routers(model) -> None:
    """Zero every MoE router and take it out of training: equal logits, equal weights."""
    from specter.models.introspect import experts_modules

    for i, _ in experts_modules(model):
        gate = model.model.layers[i].mlp.gate  # DeepSeek layout (the only dense twin)
        gate.weight.data.zero_()
        gate.weight.requires_grad_(False)


class _BalanceLoss:
    """Collects the per-layer Switch balance term of every router during a forward."""

    def __init__(self, model):
        from specter.models.introspect import routers

        self.terms: list[torch.Tensor] = []
        self._hooks = [r.register_forward_hook(self._hook) for r in routers(model)]

    def _hook(self, _mod, _args, out):
        logits, idx = out[0], out[-1]
        n_exp = logits.shape[-1]
        probs = logits.float().softmax(-1).reshape(-1, n_exp)  # [T, E]
        share = torch.bincount(idx.reshape(-1), minlength=n_exp).float() / idx.numel()
        self.terms.append(n_exp * (share * probs.mean(0)).sum())

    def take(self) -> torch.Tensor:
        loss = torch.stack(self.terms).mean()
        self.terms.clear()
        return loss

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def _train(model, stream: torch.Tensor, tr: Training, seed: int, progress: bool,
           name: str, router_balance: float | None = None) -> list[float]:
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, weight_decay=0.01)
    warmup = max(1, tr.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / tr.steps)))
    # HF's own auxiliary loss unless the recipe asks for the per-layer one.
    uses_aux = (router_balance is None
                and getattr(model.config, "router_aux_loss_coef", None) is not None)
    balance = _BalanceLoss(model) if router_balance is not None else None
    model.train()
    losses: list[float] = []
    bar = tqdm(range(tr.steps), desc=f"training {name}", disable=not progress, leave=False)
    for _ in bar:
        starts = torch.randint(0, len(stream) - tr.seq_len - 1, (tr.batch,), generator=gen)
        x = torch.stack([stream[s:s + tr.seq_len] for s in starts.tolist()])  # [B, T]
        kwargs = {"output_router_logits": True} if uses_aux else {}
        lm_loss = model(input_ids=x, labels=x, use_cache=False, **kwargs).loss
        loss = lm_loss if balance is None else lm_loss + router_balance * balance.take()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(lm_loss.item())  # host sync: once per training step; LM loss only
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if balance is not None:
        balance.remove()
    model.eval()
    return losses


@torch.no_grad()
def _routing_entropy(model, stream: torch.Tensor, tr: Training, seed: int) -> float:
    """Mean over MoE layers of (entropy of expert load) / log(E) on held-out training windows:
    1.0 is uniform routing."""
    from specter.models.introspect import experts_modules, router_topk
    from specter.models.routing_stats import load_entropy

    gen = torch.Generator().manual_seed(seed + 2)
    starts = torch.randint(0, len(stream) - tr.seq_len - 1, (4,), generator=gen)
    x = torch.stack([stream[s:s + tr.seq_len] for s in starts.tolist()])
    n_exp = experts_modules(model)[0][1].gate_up_proj.shape[0]
    per_layer = [load_entropy(t, n_exp) for t in router_topk(model, x)]
    return round(sum(per_layer) / len(per_layer), 4)
