"""The library: `specter.load(...)` gives a model larger than the GPU, with `generate` and
`stream`, through the same composition root the benchmark runner uses.

    import specter
    llm = specter.load("deepseek", path="~/models/DeepSeek-V2-Lite", budget_gb=16)
    out = llm.generate("Why is the sky blue?", max_new_tokens=64)
    print(out.text, out.stats["tpot_ms"], out.stats["hit_rate"])
    for piece in llm.stream("Tell me a story"):
        print(piece, end="", flush=True)

With no arguments it loads the embedded default (the project-made `small_deepseek`, Specter,
the high budget: the same settings as `python run.py`). Settings are the run's (conf/):
`model` is a conf/model name, a hub id a conf/model file names, or a folder holding a
checkpoint (config.json and .safetensors, loaded as shipped); `overrides` takes run.py's
`key=value` arguments for any other knob (`["spec.k=8", "offload.policy=lfu"]`), checked the
same way. Bad input is a `UserError` with one sentence, before any weight loads.

Owns: turning the call's arguments into the run's settings, the prompt's tokens (the
tokenizer's ids with its special tokens, as the runner's prompts; or ids as given), the text
of the output, the stream, and the statistics of each call.
Does not own: turning settings into parts (specter/compose.py), decoding (the engines).
"""

from __future__ import annotations

import json
import math
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from specter.errors import UserError

# The statistics each call reports (their record columns: docs/metrics.md), when the system
# measures them (a greedy resident run has no hit rate or acceptance).
STATS = ("tpot_ms", "ttft_ms", "tokens_per_s", "hit_rate", "acceptance_rate", "h2d_bytes")


@dataclass(frozen=True)
class Output:
    """One call's result: the committed tokens (prompt excluded), their text, and the call's
    statistics on the run's clock (`stats["clock"]`: wall on a GPU, virtual where time is
    modelled)."""

    text: str
    tokens: list[int]
    stats: dict[str, Any] = field(default_factory=dict)


def model_overrides(model: str, path: str | None = None) -> list[str]:
    """The settings naming `model`: a conf/model name; a hub id a conf/model file names; a
    folder holding a checkpoint (then the conf/model entry of the published model whose
    config.json it matches, else a generic `hf` entry named after the folder). `path`: where
    a named model's weights are (model.path)."""
    from specter.settings import CONF

    names = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
    folder = Path(path or model).expanduser()
    hub = _hub_names()
    if model in names or model in hub:
        name = model if model in names else hub[model]
        if path:
            _check_path(name, folder)
        return [f"model={name}"] + ([f"model.path={folder}"] if path else [])
    if (folder / "config.json").is_file():
        known = published_match(folder / "config.json")
        if known is not None:
            return [f"model={known}", f"model.path={folder}"]
        return ["model=hf", f"model.path={folder}", f"model.name={folder.name or 'hf'}"]
    if folder.exists():
        raise UserError(f"{folder} is not a model: it holds no config.json (a checkpoint folder "
                        "holds config.json and .safetensors weights).")
    raise UserError(f"unknown model '{model}': not a folder, and not one of {', '.join(names)} "
                    "or their hub ids.")


def _check_path(name: str, folder: Path) -> None:
    """`path` beside a named model: its checkpoint folder, used, or refused in one sentence
    (a project-made model's weights are the project's: a path would be dropped)."""
    from omegaconf import OmegaConf

    from specter.settings import CONF

    if OmegaConf.load(CONF / "model" / f"{name}.yaml").get("source") == "project":
        raise UserError(f"model={name} is made by the project (its weights are built, not "
                        f"read from a folder), so path={folder} would be ignored; load the "
                        f"checkpoint folder itself (specter.load('{folder}')) or a published "
                        "model's name with path=.")
    if not (folder / "config.json").is_file():
        raise UserError(f"path={folder} is not a checkpoint folder (it holds no config.json); "
                        f"point it at the folder holding {name}'s config.json and .safetensors "
                        "weights.")


def _hub_names() -> dict[str, str]:
    """hub id -> conf/model name, for the entries that name one."""
    from omegaconf import OmegaConf

    from specter.settings import CONF

    out = {}
    for p in sorted((CONF / "model").glob("*.yaml")):
        hub_id = OmegaConf.load(p).get("hub_id")
        if hub_id:
            out[str(hub_id)] = p.stem
    return out


# config.json keys that tell one published MoE from another (not the depth: a model cut to
# fewer layers keeps its named entry)
_SHAPE = ("model_type", "hidden_size", "n_routed_experts",
          "num_local_experts", "num_experts")


def published_match(config_json: Path) -> str | None:
    """The conf/model name of the published model (specter/models/published.py) whose
    config.json has the same architecture and sizes, or None."""
    from specter.models.published import PUBLISHED

    raw = json.loads(config_json.read_text())
    for name, entry in PUBLISHED.items():
        pub = entry["config"]
        if all(raw.get(k) == pub.get(k) for k in _SHAPE):
            return name
    return None


def load(model: str = "small_deepseek", *, path: str | None = None,
         budget_gb: float | None = None, budget: str | None = None, system: str = "specter",
         device: str = "auto", hardware: str | None = None, k: int | str | None = None,
         temperature: float = 0.0, max_prompt_tokens: int = 512, max_new_tokens: int = 256,
         seed: int = 0, overrides: list[str] | tuple[str, ...] = (), log=None) -> "LLM":
    """A loaded model, ready to generate (`load_settings`' arguments, then `log`: a function
    taking each progress line, None: quiet)."""
    return LLM(load_settings(model, path=path, budget_gb=budget_gb, budget=budget,
                             system=system, device=device, hardware=hardware, k=k,
                             temperature=temperature, max_prompt_tokens=max_prompt_tokens,
                             max_new_tokens=max_new_tokens, seed=seed, overrides=overrides),
               log=log)


def load_settings(model: str = "small_deepseek", *, path: str | None = None,
                  budget_gb: float | None = None, budget: str | None = None,
                  system: str = "specter", device: str = "auto", hardware: str | None = None,
                  k: int | str | None = None, temperature: float = 0.0,
                  max_prompt_tokens: int = 512, max_new_tokens: int = 256, seed: int = 0,
                  overrides: list[str] | tuple[str, ...] = ()):
    """The run settings `load` builds its model from, checked (one sentence, `UserError`)
    before any weight loads.

    `budget_gb`: the device memory it may use, in GiB (the byte accounting turns it into
    resident expert slots); else `budget`: high | low | xhigh | full (the model's table);
    neither: high. `device`: auto | cuda | cpu; `hardware`: a conf/hardware profile instead
    (e.g. a virtual clock's). On a machine without a GPU, `auto` runs on the CPU with time
    from the virtual clock of a modelled GPU (one log line says so), as the runner does.
    `k`: the draft depth (an int, "adaptive"; None: the model's). `temperature` > 0 samples
    (speculative sampling, or plain sampling where the system does not speculate): fixed at
    load, as the draft step is built for it.
    `max_prompt_tokens` + `max_new_tokens`: the longest request, whose KV cache the budget
    holds."""
    from specter.settings import run_config

    args = model_overrides(model, path)
    args.append(f"system={system}")
    if budget_gb is not None and budget is not None:
        raise UserError("give budget_gb or budget, not both.")
    if budget_gb is not None:
        args += ["budget=gb", f"budget.gb={budget_gb}"]
    elif budget is not None:
        args.append(f"budget={budget}")
    if hardware is not None:
        args.append(f"hardware={hardware}")
    elif device != "auto":
        if device not in ("cpu", "cuda"):
            raise UserError(f"device must be auto, cpu or cuda (got '{device}').")
        args.append(f"hardware={device}")
    if k is not None:
        args.append(f"spec.k={k}")
    if temperature:
        args.append(f"workload.temperature={temperature}")
    args += [f"workload.prompt_tokens={max_prompt_tokens}",
             f"workload.max_new_tokens={max_new_tokens}", "workload.batch=1", f"seed={seed}",
             "progress=false", *overrides]
    settings = run_config(args)
    from specter.recipes import depth_of

    depth = depth_of(settings)
    if depth is not None and depth.mode == "auto":
        raise UserError("spec.k=auto profiles K over the benchmark's datasets (python run.py "
                        "spec.k=auto prints the K it chose); give k=N or k='adaptive' here.")
    return settings


class LLM:
    """A model with its system's engine, built once by the composition root
    (specter/compose.py); each call decodes one request from the same initial state."""

    def __init__(self, settings, log=None):
        from specter import compose

        quiet = log is None
        say = (lambda line: None) if quiet else log
        self.settings, self.device = compose.settle(settings, say)
        planned = compose.plan(self.settings, self.device, say)
        self.parts = compose.build(planned, say)
        self.tokenizer = planned.tokenizer
        self.engine = self.parts.engine
        self.clock = self.settings.hardware.clock
        compose.warm_up(self.engine, self.settings, self.ids("Hello"), say)
        self.stats: dict[str, Any] = {}  # the last call's
        self._requests = 0

    # -- prompts and text -------------------------------------------------------------------
    def ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids: the tokenizer's (special tokens included, as the runner's
        prompts), or `prompt` itself when it is a list of ids."""
        w = self.settings.workload
        if isinstance(prompt, str):
            if not prompt.strip():
                raise UserError("empty prompt: the text is empty or only whitespace; give a "
                                "prompt with content.")
            ids = [int(i) for i in self.tokenizer(prompt, add_special_tokens=True)["input_ids"]]
        else:
            ids = [int(i) for i in prompt]
            vocab = self.parts.loaded.model.config.vocab_size
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise UserError(f"token id {bad[0]} is outside the model's vocabulary "
                                f"(0..{vocab - 1}).")
        if not ids:
            raise UserError("empty prompt: no token ids; give a prompt with content.")
        if len(ids) > w.prompt_tokens:
            raise UserError(f"the prompt is {len(ids)} tokens and this model was loaded for at "
                            f"most {w.prompt_tokens}; load with max_prompt_tokens={len(ids)} "
                            "or more.")
        return ids

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _check(self, max_new_tokens: int | None, temperature: float | None) -> int:
        if self.engine is None:
            raise UserError("this model is closed (llm.close() freed it); load it again with "
                            "specter.load(...).")
        w = self.settings.workload
        n = w.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if n < 1:
            raise UserError(f"max_new_tokens must be at least 1 (got {n}).")
        if n > w.max_new_tokens:
            raise UserError(f"max_new_tokens={n} exceeds the {w.max_new_tokens} this model was "
                            f"loaded for; load with max_new_tokens={n} or more.")
        if temperature is not None and temperature != w.temperature:
            raise UserError(f"this model was loaded with temperature={w.temperature}; load it "
                            f"with temperature={temperature} (the draft step is built for one).")
        return n

    # -- decoding ---------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], max_new_tokens: int | None = None,
                 temperature: float | None = None) -> Output:
        """Decode one request to its end (a stop token or `max_new_tokens`)."""
        n = self._check(max_new_tokens, temperature)
        ids = self.ids(prompt)
        return self._finish(self._decode(ids, n, None))

    def stream(self, prompt: str | list[int], max_new_tokens: int | None = None,
               temperature: float | None = None) -> Iterator[str]:
        """The output's text piece by piece, as the system commits tokens (a speculating
        system commits a window's accepted tokens at once). The call's `Output` is
        `self.last` once the stream ends."""
        n = self._check(max_new_tokens, temperature)
        ids = self.ids(prompt)
        chunks: queue.Queue = queue.Queue()
        box: dict[str, Any] = {}

        def work():
            try:
                box["gen"] = self._decode(ids, n, chunks.put)
            except BaseException as e:  # raised again on the caller's thread
                box["error"] = e
            finally:
                chunks.put(None)

        worker = threading.Thread(target=work, name="specter-decode", daemon=True)
        worker.start()
        tokens: list[int] = []
        shown = ""
        while (chunk := chunks.get()) is not None:
            tokens += chunk
            now = self.text(tokens)
            if now.endswith("\ufffd"):  # a character whose bytes are not all committed yet
                continue
            if now.startswith(shown) and len(now) > len(shown):
                yield now[len(shown):]
            shown = now
        worker.join()
        if "error" in box:
            raise box["error"]
        out = self._finish(box["gen"])
        if out.text.startswith(shown) and len(out.text) > len(shown):
            yield out.text[len(shown):]

    def _decode(self, ids: list[int], n: int, on_commit):
        engine = self.engine
        engine.reset()
        if self.settings.workload.temperature > 0:  # as the runner seeds request i, repeat r
            engine.seed_requests([self.settings.seed * 1_000_003 + self._requests * 1_009])
        self._requests += 1
        return engine.generate(ids, n, on_commit=on_commit)

    def _finish(self, gen) -> Output:
        from specter.metrics import timing

        stats = {key: value for key, value in {**timing(gen), **gen.stats}.items()
                 if key in STATS and not (isinstance(value, float) and math.isnan(value))}
        stats["clock"] = self.clock
        stats["system"] = self.settings.system.name
        self.stats = stats
        self.last = Output(text=self.text(gen.tokens), tokens=list(gen.tokens), stats=stats)
        return self.last

    def close(self) -> None:
        """Free the model and the engine (and, on CUDA, the allocator's cached blocks)."""
        from specter.compose import free

        self.parts = self.engine = None
        free()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
