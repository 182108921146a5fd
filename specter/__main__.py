"""`python -m specter generate|chat|serve`: the library's call (specter/api.py) from a shell,
and an OpenAI-compatible server over it (specter/serve.py).

    python -m specter generate "Why is the sky blue?"                       # embedded default
    python -m specter generate --model ~/models/DeepSeek-V2-Lite --budget-gb 16 "prompt"
    python -m specter chat --model deepseek --path ~/models/DeepSeek-V2-Lite --budget-gb 16
    python -m specter serve --model deepseek --path ~/models/DeepSeek-V2-Lite --budget-gb 16

`generate` streams the output to stdout and its statistics to stderr; `chat` reads a prompt
per line (the tokenizer's chat template when it has one) until an empty line or end of
input. Bad input: one sentence on stderr and exit status 2, as `run.py`.
"""

from __future__ import annotations

import argparse
import sys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specter",
                                description="Decode with a MoE model whose experts live in host "
                                            "memory (Specter and the baselines).")
    sub = p.add_subparsers(dest="command", required=True)
    for name, what in (("generate", "decode one prompt, streamed to stdout"),
                       ("chat", "an interactive chat over the same call"),
                       ("serve", "an OpenAI-compatible HTTP server (/v1/completions, "
                                 "/v1/chat/completions, /metrics)")):
        s = sub.add_parser(name, help=what)
        s.add_argument("--model", default="small_deepseek",
                       help="a conf/model name, its hub id, or a checkpoint folder "
                            "(default: the project-made small_deepseek)")
        s.add_argument("--path", default=None, help="where a named model's weights are")
        s.add_argument("--budget-gb", type=float, default=None,
                       help="device memory to use, in GiB (default: the model's high budget)")
        s.add_argument("--budget", default=None, help="high | low | xhigh | full")
        s.add_argument("--system", default="specter", help="specter, lru, specmoeoff, ...")
        s.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
        s.add_argument("--hardware", default=None, help="a conf/hardware profile instead")
        s.add_argument("--k", default=None, help="draft depth (an integer or adaptive)")
        s.add_argument("--temperature", type=float, default=0.0)
        s.add_argument("--max-new-tokens", type=int, default=128)
        s.add_argument("--max-prompt-tokens", type=int, default=512)
        s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="any run.py setting, e.g. --set offload.policy=lfu (repeatable)")
        s.add_argument("--quiet", action="store_true", help="no loading messages")
        if name == "generate":
            s.add_argument("prompt", help="the prompt text")
        if name == "serve":
            s.add_argument("--host", default="127.0.0.1")
            s.add_argument("--port", type=int, default=8000)
            s.add_argument("--max-batch", type=int, default=8,
                           help="requests decoded together at most (default 8)")
            s.add_argument("--max-queue", type=int, default=64,
                           help="requests waiting at most; more get 429 (default 64)")
            s.add_argument("--batch-wait-ms", type=float, default=0.0,
                           help="how long a batch waits for more requests to join (default 0)")
            s.add_argument("--served-name", default=None,
                           help="the model's name in the API (default: --model)")
    return p


def _settings(a):
    from specter.api import load_settings

    k = a.k if a.k is None or not a.k.isdigit() else int(a.k)
    return load_settings(a.model, path=a.path, budget_gb=a.budget_gb, budget=a.budget,
                         system=a.system, device=a.device, hardware=a.hardware, k=k,
                         temperature=a.temperature, max_prompt_tokens=a.max_prompt_tokens,
                         max_new_tokens=a.max_new_tokens, overrides=a.set)


def _load(a, settings=None):
    from specter.api import LLM

    return LLM(settings or _settings(a),
               log=None if a.quiet else (lambda line: print(line, file=sys.stderr)))


def _serve(a) -> int:
    from specter.serve import serve

    settings = _settings(a)  # bad arguments: one sentence before the server starts
    if a.max_batch < 1 or a.max_queue < 1:
        from specter.errors import UserError

        raise UserError(f"--max-batch and --max-queue must be at least 1 (got {a.max_batch}, "
                        f"{a.max_queue}).")
    if not a.quiet:
        print(f"[specter] serving on http://{a.host}:{a.port}/v1 (GET /health answers 200 "
              "once the model is loaded)", file=sys.stderr)

    def load():
        try:
            return _load(a, settings)
        except Exception as e:  # the server stays up and /health says why
            print(f"error: {e}", file=sys.stderr)
            raise
    serve(load, a.served_name or a.model, a.host, a.port, a.max_batch, a.max_queue,
          a.batch_wait_ms / 1e3, log_level="warning" if a.quiet else "info")
    return 0


def _stats_line(stats: dict) -> str:
    parts = [f"{stats['system']}", f"{stats['clock']} clock"]
    for key, fmt in (("tpot_ms", "TPOT {:.2f} ms"), ("hit_rate", "hit rate {:.3f}"),
                     ("acceptance_rate", "acceptance {:.3f}")):
        if key in stats:
            parts.append(fmt.format(stats[key]))
    return "[specter] " + ", ".join(parts)


def _chat_ids(llm, history: list[dict]) -> list[int] | str:
    """The conversation as the tokenizer's chat template gives it, else the last message."""
    tok = llm.tokenizer
    if getattr(tok, "chat_template", None):
        return [int(i) for i in tok.apply_chat_template(history, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)]
    return history[-1]["content"]


def main(argv: list[str] | None = None) -> int:
    from specter.errors import UserError

    a = parser().parse_args(argv)
    try:
        if a.command == "serve":
            return _serve(a)
        if not a.quiet:
            print("[specter] loading ...", file=sys.stderr)
        llm = _load(a)
        if a.command == "generate":
            for piece in llm.stream(a.prompt):
                print(piece, end="", flush=True)
            print()
            print(_stats_line(llm.stats), file=sys.stderr)
            return 0
        history: list[dict] = []
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            try:
                for piece in llm.stream(_chat_ids(llm, history)):
                    print(piece, end="", flush=True)
            except UserError as e:  # a turn too long for the loaded bounds: say so, go on
                print(f"error: {e}", file=sys.stderr)
                history.pop()
                continue
            print()
            history.append({"role": "assistant", "content": llm.last.text})
            print(_stats_line(llm.stats), file=sys.stderr)
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return UserError.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
