"""`python -m specter serve`: an OpenAI-compatible HTTP server over one loaded model.

    python -m specter serve                                   # the embedded default, :8000
    python -m specter serve --model deepseek --path ~/models/DeepSeek-V2-Lite --budget-gb 16

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (`stream: true` as server-sent
events ending in `data: [DONE]`; `stream_options.include_usage` adds one usage chunk with
`choices: []` before it), `GET /v1/models`, `GET /health` (503 while the model loads, 200 once
it is warm) and `GET /metrics` (Prometheus text). Built on FastAPI (Starlette) and uvicorn.

Each response carries, beside `usage`, a `specter` object: the request's TTFT and TPOT per
committed token on the run's clock, its drafted and accepted tokens, and its batch's
expert-cache hits and misses, H2D bytes and seconds, prefetches and time waiting on experts
(those are the batch's: every row of a batch shares its experts). `/metrics` sums the same as
counters, the speculative ones named as vLLM names them (`spec_decode_num_draft_tokens_total`,
`spec_decode_num_accepted_tokens_total`, `spec_decode_num_drafts_total`).

Concurrent requests are batched: one decode thread (`Scheduler`) takes the requests waiting
when a batch ends, up to `max_batch`, and decodes them together (the engine's batched
decoding, each row as it would decode alone); more than `max_queue` waiting is a 429 with
`Retry-After`. A client that disconnects ends its row at its next commit. `max_tokens`,
`stop` (text, cut server-side) and `seed` (without one, each request draws from its own) are
per request; `temperature` is the loaded one (the draft step is built for it): another is a
400. Bad requests get an OpenAI-style 400 body, `{"error": {"message", "type", "param",
"code"}}`, one sentence.

Owns: HTTP, the request queue and batches, responses and their statistics.
Does not own: loading (specter/api.py `load`), decoding (the engine's `generate_batch`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HttpRequest  # (FastAPI reads handlers' annotations)

from specter.errors import UserError
from specter.metrics import timing

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class RequestError(Exception):
    """A bad request: its HTTP status and OpenAI-style error fields."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value",
                 status: int = 400, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status
        self.kind, self.headers = kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class Request:
    """One client request, from the queue to its last token."""

    ids: list[int]
    limit: int
    stops: list[str]
    seed: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    tokens: list[int] = field(default_factory=list)
    shown: str = ""  # the text sent so far
    stopped: bool = False  # a stop string ended it
    gone: bool = False  # its client disconnected
    rows: int = 1  # the rows of the batch it was decoded in
    batch: int = 0  # which batch (the server's count, from 1)

    def tell(self, kind: str, value: Any = None) -> None:
        """An event for the request's handler, from the decode thread."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Metrics:
    """The server's counters since it started (Prometheus text: `render`)."""

    COUNTERS = {
        "specter_requests_total": "requests answered",
        "specter_request_errors_total": "requests refused (400, 429)",
        "specter_batches_total": "batches decoded",
        "specter_prompt_tokens_total": "prompt tokens prefilled",
        "specter_generation_tokens_total": "tokens generated",
        "specter_expert_cache_hits_total": "routed experts found resident when needed",
        "specter_expert_cache_misses_total": "routed experts copied when needed",
        "specter_h2d_bytes_total": "bytes copied host to device",
        "specter_h2d_seconds_total": "seconds the copy engine was busy (the run's clock)",
        "specter_prefetches_total": "expert copies issued ahead of their use",
        "specter_expert_wait_seconds_total": "seconds compute waited on expert copies",
        "spec_decode_num_drafts_total": "speculative windows (vLLM's name)",
        "spec_decode_num_draft_tokens_total": "draft tokens proposed (vLLM's name)",
        "spec_decode_num_accepted_tokens_total": "draft tokens accepted (vLLM's name)",
    }

    def __init__(self):
        self.values = {name: 0.0 for name in self.COUNTERS}
        self.waiting = self.running = 0
        self.lock = threading.Lock()

    def add(self, **values: float) -> None:
        with self.lock:
            for name, v in values.items():
                self.values[name] += v

    def render(self) -> str:
        lines = []
        with self.lock:
            for name, what in self.COUNTERS.items():
                lines += [f"# HELP {name} {what}", f"# TYPE {name} counter",
                          f"{name} {_number(self.values[name])}"]
            for name, value, what in (("specter_requests_waiting", self.waiting,
                                       "requests queued for the next batch"),
                                      ("specter_requests_running", self.running,
                                       "requests in the batch decoding now")):
                lines += [f"# HELP {name} {what}", f"# TYPE {name} gauge", f"{name} {value}"]
        return "\n".join(lines) + "\n"


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class Scheduler:
    """The one decode thread: the requests waiting when a batch ends form the next batch (up
    to `max_batch`); more than `max_queue` waiting are refused (`submit`: 429)."""

    def __init__(self, llm, metrics: Metrics, max_batch: int = 8, max_queue: int = 64,
                 batch_wait_s: float = 0.0):
        """`batch_wait_s`: once a request waits, how long the next batch waits for more to
        join it (0: it starts at once with whoever is waiting)."""
        if max_batch < 1 or max_queue < 1:
            raise UserError(f"--max-batch and --max-queue must be at least 1 (got {max_batch}, "
                            f"{max_queue}).")
        self.llm, self.metrics = llm, metrics
        engine = llm.engine
        self.max_batch = max_batch if getattr(engine, "batches", False) else 1
        self.max_queue, self.batch_wait_s = max_queue, batch_wait_s
        self.waiting: list[Request] = []
        self.cond = threading.Condition()
        self.batch_s = 1.0  # a running mean of a batch's wall seconds (Retry-After)
        self.closed = False
        self.batches = 0
        self.thread = threading.Thread(target=self._run, name="specter-serve", daemon=True)
        self.thread.start()

    def submit(self, req: Request) -> None:
        with self.cond:
            if len(self.waiting) >= self.max_queue:
                batches = math.ceil((len(self.waiting) + 1) / self.max_batch)
                retry = max(1, math.ceil(batches * self.batch_s))
                raise RequestError(
                    f"the server has {len(self.waiting)} requests waiting, its limit "
                    f"(--max-queue {self.max_queue}); retry in {retry} s.", code="queue_full",
                    status=429, kind="rate_limit_error", headers={"Retry-After": str(retry)})
            self.waiting.append(req)
            self.metrics.waiting = len(self.waiting)
            self.cond.notify()

    def close(self) -> None:
        """Stop after the batch decoding now; the requests still waiting hear an error."""
        with self.cond:
            self.closed = True
            left, self.waiting = self.waiting, []
            self.cond.notify()
        for r in left:
            r.tell("error", "the server is shutting down")
        self.thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.closed:
                    self.cond.wait()
                deadline = time.monotonic() + self.batch_wait_s
                while (len(self.waiting) < self.max_batch and not self.closed
                       and (left := deadline - time.monotonic()) > 0):
                    self.cond.wait(left)
                if self.closed:
                    return
                batch = self.waiting[:self.max_batch]
                del self.waiting[:len(batch)]
                batch = [r for r in batch if not r.gone]
                self.metrics.waiting, self.metrics.running = len(self.waiting), len(batch)
            if batch:
                began = time.perf_counter()
                self._decode(batch)
                self.batch_s = 0.8 * self.batch_s + 0.2 * (time.perf_counter() - began)
            self.metrics.running = 0

    def _decode(self, batch: list[Request]) -> None:
        llm, engine = self.llm, self.llm.engine
        try:
            engine.reset()
            if llm.settings.workload.temperature > 0:
                engine.seed_requests([r.seed for r in batch])
            listeners = [self._listener(r) for r in batch]
            self.batches += 1
            for r in batch:
                r.rows, r.batch = len(batch), self.batches
            if len(batch) == 1:
                gens = [engine.generate(batch[0].ids, batch[0].limit, on_commit=listeners[0])]
            else:
                gens = engine.generate_batch([r.ids for r in batch], [r.limit for r in batch],
                                             on_commit=listeners)
        except Exception as e:  # noqa: BLE001 - every client of the batch hears it
            for r in batch:
                r.tell("error", f"decoding failed: {type(e).__name__}: {e}")
            return
        self._count(batch, gens)
        for r, gen in zip(batch, gens):
            r.tell("done", gen)

    def _listener(self, req: Request):
        """The decode thread's listener for `req`: its text pieces to its handler, a stop
        string cut, and False (its row ends) once it is stopped or its client is gone."""
        tokenizer, stops = self.llm.tokenizer, req.stops

        def heard(tokens: list[int]) -> bool:
            if req.gone or req.stopped:
                return False
            req.tokens += tokens
            text = tokenizer.decode(req.tokens, skip_special_tokens=True)
            cut = _stop_at(text, stops)
            if cut >= 0:
                text, req.stopped = text[:cut], True
            elif text.endswith("\ufffd"):  # a character whose bytes are not all committed
                return True
            if text.startswith(req.shown) and len(text) > len(req.shown):
                # with stop strings, hold back what could begin one
                hold = 0 if req.stopped else max((len(s) - 1 for s in stops), default=0)
                upto = max(len(req.shown), len(text) - hold)
                if upto > len(req.shown):
                    req.tell("text", text[len(req.shown):upto])
                    req.shown = text[:upto]
            return not req.stopped
        return heard

    def _count(self, batch: list[Request], gens) -> None:
        shared = gens[0].stats  # a batch's demand, link and prefetch columns are shared
        m = self.metrics
        m.add(specter_batches_total=1,
              specter_prompt_tokens_total=sum(len(r.ids) for r in batch),
              specter_generation_tokens_total=sum(len(g.tokens) for g in gens),
              specter_expert_cache_hits_total=shared.get("demand_hits", 0),
              specter_expert_cache_misses_total=shared.get("demand_misses", 0),
              specter_h2d_bytes_total=shared.get("h2d_bytes", 0),
              specter_h2d_seconds_total=shared.get("h2d_ms", 0.0) / 1e3,
              specter_prefetches_total=shared.get("prefetches", 0),
              specter_expert_wait_seconds_total=shared.get("exposed_wait_ms", 0.0) / 1e3,
              spec_decode_num_drafts_total=sum(g.stats.get("windows", 0) for g in gens),
              spec_decode_num_draft_tokens_total=sum(g.stats.get("drafted", 0) for g in gens),
              spec_decode_num_accepted_tokens_total=sum(
                  sum(g.stats.get("accepted_lens", [])) for g in gens))


def request_stats(gen, clock: str, req: Request) -> dict:
    """The response's `specter` object (times on the run's `clock`, from the batch's start)."""
    s = gen.stats
    t = timing(gen)
    out = {"clock": clock, "batch": req.batch, "batch_rows": req.rows,
           "ttft_ms": t["ttft_ms"], "e2e_ms": t["e2e_ms"], "tpot_ms": None if math.isnan(t["tpot_ms"]) else t["tpot_ms"],
           "drafted_tokens": s.get("drafted", 0),
           "accepted_tokens": sum(s.get("accepted_lens", [])),
           "batch_expert_cache_hits": s.get("demand_hits", 0),
           "batch_expert_cache_misses": s.get("demand_misses", 0),
           "batch_h2d_bytes": s.get("h2d_bytes", 0), "batch_h2d_ms": s.get("h2d_ms", 0.0),
           "batch_prefetches": s.get("prefetches", 0),
           "batch_prefetch_precision": s.get("prefetch_precision"),
           "batch_expert_wait_ms": s.get("exposed_wait_ms", 0.0)}
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


# -- the HTTP side ---------------------------------------------------------------------------
class Server:
    """What the app serves: the model once loaded (`ready`), its scheduler and counters."""

    def __init__(self, name: str, max_batch: int = 8, max_queue: int = 64,
                 batch_wait_s: float = 0.0):
        self.name, self.max_batch, self.max_queue = name, max_batch, max_queue
        self.batch_wait_s = batch_wait_s
        self.llm = self.scheduler = None
        self.metrics = Metrics()
        self.count = itertools.count()  # requests parsed: an unseeded request's own seed
        self.failed: str | None = None

    def start(self, llm) -> None:
        self.scheduler = Scheduler(llm, self.metrics, self.max_batch, self.max_queue,
                                   self.batch_wait_s)
        self.llm = llm

    @property
    def ready(self) -> bool:
        return self.llm is not None

    def parse(self, body: dict, chat: bool) -> tuple[list[int], int, list[str], int, bool, bool]:
        """(ids, max_tokens, stops, seed, stream, include_usage) of a request body, or a
        `RequestError`."""
        llm = self.llm
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object.", code="invalid_json")
        model = body.get("model")
        if model is not None and model != self.name:
            raise RequestError(f"unknown model '{model}'; this server serves '{self.name}' "
                               "(GET /v1/models).", "model", "model_not_found")
        if body.get("n", 1) != 1:
            raise RequestError("n must be 1 (one choice per request).", "n")
        w = llm.settings.workload
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is None:
            limit = w.max_new_tokens if chat else min(DEFAULT_MAX_TOKENS, w.max_new_tokens)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise RequestError(f"max_tokens must be a positive integer (got {limit!r}).",
                               "max_tokens")
        if limit > w.max_new_tokens:
            raise RequestError(f"max_tokens={limit} exceeds the {w.max_new_tokens} this server "
                               f"was loaded for (--max-new-tokens).", "max_tokens")
        temperature = body.get("temperature")
        if temperature is not None:
            if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
                raise RequestError(f"temperature must be a number (got {temperature!r}).",
                                   "temperature")
            if float(temperature) != w.temperature:
                raise RequestError(f"this server decodes at temperature {w.temperature} (its "
                                   f"draft step is built for one); got {temperature}: restart "
                                   f"it with --temperature {temperature}, or leave it out.",
                                   "temperature")
        stops = body.get("stop") or []
        if isinstance(stops, str):
            stops = [stops]
        if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
                and len(stops) <= 4):
            raise RequestError("stop must be a string or a list of up to 4 strings.", "stop")
        n = next(self.count)
        # without a seed, each request its own (the server's seed and its count, as the
        # library seeds its calls)
        seed = body.get("seed", llm.settings.seed * 1_000_003 + n * 1_009)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise RequestError(f"seed must be an integer (got {seed!r}).", "seed")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be true or false.", "stream")
        options = body.get("stream_options") or {}
        usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
        try:
            ids = self._prompt_ids(body, chat)
        except UserError as e:
            code = "context_length_exceeded" if "max_prompt_tokens" in str(e) else "invalid_value"
            raise RequestError(str(e).replace("max_prompt_tokens", "--max-prompt-tokens"),
                               "messages" if chat else "prompt", code) from None
        return ids, limit, stops, seed, stream, usage

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        llm = self.llm
        if chat:
            messages = body.get("messages")
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in messages)):
                raise RequestError("messages must be a non-empty list of {role, content} "
                                   "objects with text content.", "messages")
            return llm.ids(chat_prompt(llm.tokenizer, messages))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in prompt):
            return llm.ids(prompt)
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string or a list of token ids (one prompt "
                               "per request).", "prompt")
        return llm.ids(prompt)


def chat_prompt(tokenizer, messages: list[dict]) -> list[int] | str:
    """The conversation as the tokenizer's chat template gives it; a tokenizer without one
    (the project-made models): each message as `role: content` on its own line, then
    `assistant:`."""
    if getattr(tokenizer, "chat_template", None):
        return [int(i) for i in tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False)]
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


def make_app(server: Server, load=None):
    """The FastAPI app over `server`; `load()`, when given, loads the model in a thread at
    startup (`/health` answers 503 until it is done)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    @asynccontextmanager
    async def lifespan(app):
        if load is not None:
            def loading():
                try:
                    server.start(load())
                except Exception as e:  # noqa: BLE001 - /health says why, the server stays up
                    server.failed = str(e) if isinstance(e, UserError) else \
                        f"{type(e).__name__}: {e}"
            threading.Thread(target=loading, name="specter-load", daemon=True).start()
        yield
        if server.scheduler is not None:
            server.scheduler.close()

    app = FastAPI(title="specter", lifespan=lifespan)

    def refuse(e: RequestError) -> JSONResponse:
        server.metrics.add(specter_request_errors_total=1)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.get("/health")
    async def health():
        if server.failed:
            return JSONResponse({"status": "failed", "error": server.failed}, status_code=500)
        if not server.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model",
                                            "created": 0, "owned_by": "specter"}]}

    async def answer(http: HttpRequest, chat: bool):
        if not server.ready:
            return refuse(RequestError("the model is still loading; retry when GET /health "
                                       "answers 200.", code="loading", status=503,
                                       kind="server_error", headers={"Retry-After": "5"}))
        try:
            body = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return refuse(RequestError("the request body is not valid JSON.", code="invalid_json"))
        try:
            ids, limit, stops, seed, stream, usage = server.parse(body, chat)
            req = Request(ids, limit, stops, seed, asyncio.get_running_loop(), asyncio.Queue())
            server.scheduler.submit(req)
        except RequestError as e:
            return refuse(e)
        kind = "chat.completion" if chat else "text_completion"
        prefix = "chatcmpl-" if chat else "cmpl-"
        base = {"id": prefix + req.id, "created": req.created, "model": server.name}
        if stream:
            return StreamingResponse(_stream(server, http, req, chat, usage, base),
                                     media_type="text/event-stream")
        try:
            while True:
                what, value = await req.events.get()
                if what == "error":
                    return JSONResponse({"error": {"message": value, "type": "server_error",
                                                   "param": None, "code": "decode_failed"}},
                                        status_code=500)
                if what == "done":
                    break
        except asyncio.CancelledError:
            req.gone = True
            raise
        gen, text = value, _final_text(server, req, value)
        choice = {"index": 0, "finish_reason": _finish(server, req, gen)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        server.metrics.add(specter_requests_total=1)
        return {**base, "object": kind, "choices": [choice], "usage": _usage(req, gen),
                "specter": request_stats(gen, server.llm.clock, req)}

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await answer(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await answer(http, chat=True)

    return app


def _stop_at(text: str, stops: list[str]) -> int:
    """Where the first stop string begins in `text`, or -1."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def _final_text(server: Server, req: Request, gen) -> str:
    text = server.llm.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    cut = _stop_at(text, req.stops)
    return text[:cut] if cut >= 0 else text


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _finish(server: Server, req: Request, gen) -> str:
    if req.stopped or (gen.tokens and gen.tokens[-1] in server.llm.engine.stop):
        return "stop"
    return "length"


def _usage(req: Request, gen) -> dict:
    return {"prompt_tokens": len(req.ids), "completion_tokens": len(gen.tokens),
            "total_tokens": len(req.ids) + len(gen.tokens)}


async def _stream(server: Server, http, req: Request, chat: bool, usage: bool, base: dict):
    """Server-sent events: a chunk per committed piece of text, the finish, the usage chunk
    when asked, `[DONE]`. A client gone ends its row at its next commit."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: str | None, finish: str | None = None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": piece or ""} if first else \
                ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
        return _sse({**base, "object": kind, "choices": [choice]})

    try:
        first = True
        while True:
            what, value = await req.events.get()
            if what == "text":
                yield chunk(value, first=first)
                first = False
            elif what == "error":
                yield _sse({"error": {"message": value, "type": "server_error", "param": None,
                                      "code": "decode_failed"}})
                return
            elif what == "done":
                gen = value
                text = _final_text(server, req, gen)
                if len(text) > len(req.shown) and text.startswith(req.shown):
                    yield chunk(text[len(req.shown):], first=first)
                    first = False
                yield chunk(None, _finish(server, req, gen), first=first)
                server.metrics.add(specter_requests_total=1)
                if usage:
                    yield _sse({**base, "object": kind, "choices": [], "usage": _usage(req, gen),
                                "specter": request_stats(gen, server.llm.clock, req)})
                yield "data: [DONE]\n\n"
                return
    finally:
        req.gone = True  # a client that left mid-stream: its row ends at its next commit


def serve(load, name: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
          max_queue: int = 64, batch_wait_s: float = 0.0, log_level: str = "info") -> None:
    """Run the server until interrupted; `load()` gives the model (in a thread, so /health
    answers while it loads)."""
    import uvicorn

    server = Server(name, max_batch, max_queue, batch_wait_s)
    uvicorn.run(make_app(server, load), host=host, port=port, log_level=log_level)


def start_in_thread(app, host: str = "127.0.0.1"):
    """`app` served by uvicorn on a free port of `host`, in a thread (tests, benchmarks):
    (the uvicorn server, its base url). `stop_thread` ends it."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    server.thread = threading.Thread(target=server.run, name="specter-http", daemon=True)
    server.thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not server.thread.is_alive():
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)
    return server, f"http://{host}:{port}"


def stop_thread(server) -> None:
    server.should_exit = True
    server.thread.join(timeout=30)
