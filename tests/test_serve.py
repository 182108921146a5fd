"""`python -m specter serve` (specter/serve.py), driven by real clients: the official `openai`
package, `curl` and plain HTTP, against a server on a free loopback port (issue 58).

Every answer's text is the library's own `generate` for the same prompt (computed before the
server starts, on the same loaded model): batched rows decode as they would alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

import specter
from specter.serve import (Metrics, Request, RequestError, Scheduler, Server, chat_prompt,
                           make_app, start_in_thread as start, stop_thread as stop)

openai = pytest.importorskip("openai")

PROMPTS = ["Natalia sold clips to 48 of her friends in April.",
           "The capital of France is"]
# the eager A100 profile's virtual clock, the low budget: experts are offloaded and copied
SMALL = dict(budget="low", hardware="a100_pcie4_hf", k=4, max_prompt_tokens=32,
             max_new_tokens=16, overrides=["workload.stop_on_eos=false"])


@pytest.fixture(scope="module")
def served():
    """The model, its answers to PROMPTS alone (texts at 16 and 6 tokens, and the chat's), and
    a server over it that batches two requests arriving together."""
    llm = specter.load("tiny_deepseek", **SMALL)
    ref = {p: llm.generate(p).text for p in PROMPTS}
    ref6 = {p: llm.generate(p, max_new_tokens=6).text for p in PROMPTS}
    chat = [{"role": "user", "content": PROMPTS[1]}]
    ref_chat = llm.generate(chat_prompt(llm.tokenizer, chat)).text
    server = Server("tiny_deepseek", max_batch=2, max_queue=8, batch_wait_s=0.5)
    server.start(llm)
    http, url = start(make_app(server))
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    yield dict(llm=llm, ref=ref, ref6=ref6, chat=chat, ref_chat=ref_chat, url=url,
               client=client, server=server)
    stop(http)
    server.scheduler.close()
    llm.close()


def test_completion_and_chat_answer_the_librarys_text_with_usage_and_statistics(served):
    c, p = served["client"], PROMPTS[0]
    out = c.completions.create(model="tiny_deepseek", prompt=p, max_tokens=16)
    assert out.choices[0].text == served["ref"][p]
    assert out.choices[0].finish_reason == "length" and out.object == "text_completion"
    assert out.usage.completion_tokens == 16
    assert out.usage.prompt_tokens == len(served["llm"].ids(p))
    stats = out.model_extra["specter"]
    assert stats["clock"] == "virtual" and stats["tpot_ms"] > 0 and stats["ttft_ms"] > 0
    assert stats["drafted_tokens"] >= stats["accepted_tokens"] >= 0
    assert stats["batch_expert_cache_hits"] + stats["batch_expert_cache_misses"] > 0
    assert stats["batch_h2d_bytes"] > 0
    chat = c.chat.completions.create(model="tiny_deepseek", messages=served["chat"])
    assert chat.choices[0].message.content == served["ref_chat"]
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    assert [m.id for m in c.models.list().data] == ["tiny_deepseek"]


def test_a_stream_sends_the_same_text_then_usage_then_done(served):
    c, p = served["client"], PROMPTS[1]
    chunks = list(c.completions.create(model="tiny_deepseek", prompt=p, max_tokens=16,
                                       stream=True, stream_options={"include_usage": True}))
    pieces = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(pieces) == served["ref"][p] and len([x for x in pieces if x]) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    chat = list(c.chat.completions.create(model="tiny_deepseek", messages=served["chat"],
                                          stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chat) == served["ref_chat"]


def test_two_concurrent_clients_are_one_batch_and_each_gets_its_own_tokens(served):
    c = served["client"]

    def ask(p):
        return c.completions.create(model="tiny_deepseek", prompt=p, max_tokens=16)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(ask, PROMPTS))
    for p, out in zip(PROMPTS, outs):
        assert out.choices[0].text == served["ref"][p]
    assert [o.model_extra["specter"]["batch_rows"] for o in outs] == [2, 2]
    # and with a limit each: the shorter one stops at its own
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        short, long = pool.map(lambda a: c.completions.create(
            model="tiny_deepseek", prompt=a[0], max_tokens=a[1]), [(PROMPTS[0], 6),
                                                                   (PROMPTS[1], 16)])
    assert short.choices[0].text == served["ref6"][PROMPTS[0]]
    assert long.choices[0].text == served["ref"][PROMPTS[1]]


def test_a_client_that_disconnects_mid_stream_leaves_the_others_whole(served):
    import http.client

    host, port = served["url"].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": "tiny_deepseek", "prompt": PROMPTS[0], "max_tokens": 16, "stream": True}),
        {"Content-Type": "application/json"})
    other = concurrent.futures.ThreadPoolExecutor(1).submit(
        served["client"].completions.create, model="tiny_deepseek", prompt=PROMPTS[1],
        max_tokens=16)
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # the first event, then the client goes away
    conn.close()
    assert other.result(timeout=60).choices[0].text == served["ref"][PROMPTS[1]]
    again = served["client"].completions.create(model="tiny_deepseek", prompt=PROMPTS[0],
                                                max_tokens=16)
    assert again.choices[0].text == served["ref"][PROMPTS[0]]


@pytest.mark.parametrize("body, param, words", [
    ({"model": "gpt-4", "prompt": "hi"}, "model", "unknown model 'gpt-4'"),
    ({"prompt": "word " * 40}, "prompt", "--max-prompt-tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "positive integer"),
    ({"prompt": "hi", "max_tokens": 17}, "max_tokens", "exceeds the 16"),
    ({"prompt": [10**9]}, "prompt", "outside the model's vocabulary"),
    ({"prompt": "hi", "temperature": 0.7}, "temperature", "temperature 0.0"),
    ({"prompt": {"text": "hi"}}, "prompt", "prompt must be"),
    ({"prompt": "hi", "stop": 3}, "stop", "stop must be"),
])
def test_bad_requests_get_one_sentence_in_an_openai_error_body(served, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        served["client"].completions.create(**{"model": "tiny_deepseek", **body})
    err = e.value.body
    assert e.value.status_code == 400 and words in err["message"], err
    assert err["param"] == param and isinstance(err["code"], str) and "\n" not in err["message"]


def test_malformed_json_is_a_400_and_the_server_goes_on(served):
    req = urllib.request.Request(served["url"] + "/v1/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    body = json.loads(e.value.read())
    assert e.value.code == 400 and body["error"]["code"] == "invalid_json"
    ok = served["client"].completions.create(model="tiny_deepseek", prompt=PROMPTS[1],
                                             max_tokens=16)
    assert ok.choices[0].text == served["ref"][PROMPTS[1]]


def test_metrics_count_what_the_responses_report(served):
    served["client"].completions.create(model="tiny_deepseek", prompt=PROMPTS[0], max_tokens=4)
    text = urllib.request.urlopen(served["url"] + "/metrics", timeout=30).read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    for name in ("specter_requests_total", "specter_generation_tokens_total",
                 "specter_expert_cache_hits_total", "specter_h2d_bytes_total",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_drafts_total"):
        assert values[name] > 0, name
    assert values["spec_decode_num_accepted_tokens_total"] <= \
        values["spec_decode_num_draft_tokens_total"]
    assert "# TYPE specter_requests_total counter" in text


def test_curl_streams_a_completion_as_a_shell_user_would(served):
    body = json.dumps({"model": "tiny_deepseek", "prompt": PROMPTS[1], "max_tokens": 16,
                       "stream": True})
    out = subprocess.run(["curl", "-sS", "-N", served["url"] + "/v1/completions", "-H",
                          "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    events = [line[len("data: "):] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == served["ref"][PROMPTS[1]]


def test_health_is_503_while_loading_and_a_full_queue_is_429_with_retry_after():
    """A model that is still loading answers 503 on /health and on requests; a scheduler whose
    queue is full refuses the next request with 429 and a Retry-After."""
    release = threading.Event()

    class Engine:
        batches, stop = True, set()

        def reset(self):
            pass

        def generate(self, ids, n, on_commit=None):
            release.wait(30)
            raise RuntimeError("not decoding in this test")

    class LLM:
        engine = Engine()
        settings = SimpleNamespace(workload=SimpleNamespace(temperature=0.0))
        tokenizer = None

    loaded = threading.Event()

    def load():
        loaded.wait(30)
        raise RuntimeError("no model in this test")

    http, url = start(make_app(Server("m"), load))
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/health", timeout=30)
        assert e.value.code == 503
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(
                url + "/v1/completions", data=b'{"prompt": "hi"}'), timeout=30)
        assert e.value.code == 503 and e.value.headers["Retry-After"]
    finally:
        loaded.set()
        stop(http)

    sched = Scheduler(LLM(), Metrics(), max_batch=1, max_queue=1)
    try:
        loop = asyncio.new_event_loop()

        def request():
            return Request([1], 4, [], 0, loop, asyncio.Queue())
        sched.submit(request())  # decoding (blocked)
        deadline = time.monotonic() + 10
        while sched.waiting:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sched.submit(request())  # waiting
        with pytest.raises(RequestError) as e:
            sched.submit(request())
        assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
        assert "--max-queue 1" in e.value.message
    finally:
        release.set()
        sched.close()
        loop.close()


def test_the_load_benchmark_runs_and_reports_both_phases(tmp_path):
    """experiments/serve_bench.py (not timed here: its figures are the README's)."""
    from experiments import serve_bench

    out = tmp_path / "bench.json"
    assert serve_bench.main(["--model", "tiny_deepseek", "--clients", "2", "--requests", "1",
                             "--max-tokens", "4", "--prompt-tokens", "16",
                             "--batch-wait-ms", "500", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["clock"] == "virtual" and r["sequential"]["tokens"] == r["concurrent"]["tokens"] == 8
    assert r["concurrent"]["mean_rows"] == 2 and r["sequential"]["mean_rows"] == 1
    assert r["speedup"] > 0 and r["concurrent"]["p99_s"] >= r["concurrent"]["p50_s"] > 0


def test_a_stop_string_cuts_the_text_streamed_or_not(served):
    c, p = served["client"], PROMPTS[0]
    ref = served["ref"][p]
    stop = ref[len(ref) // 2:len(ref) // 2 + 3]
    assert stop.strip(), f"premise: a visible stop string in {ref!r}"
    want = ref[:ref.find(stop)]
    out = c.completions.create(model="tiny_deepseek", prompt=p, max_tokens=16, stop=[stop])
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model="tiny_deepseek", prompt=p, max_tokens=16,
                                       stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_sampling_server_draws_per_request_seed():
    """A server started with a temperature (here LRU, a system that samples without
    speculating) honours each request's seed: the same seed the same text, batched or not."""
    llm = specter.load("tiny_deepseek", **{**SMALL, "system": "lru", "temperature": 0.9})
    server = Server("m", max_batch=2, max_queue=4, batch_wait_s=0.5)
    server.start(llm)
    http, url = start(make_app(server))
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def ask(seed):
            return c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=16,
                                        seed=seed).choices[0].text
        alone = [ask(1), ask(2)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            together = list(pool.map(ask, [1, 2]))
        assert together == alone and alone[0] != alone[1]
        unseeded = [c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=16)
                    .choices[0].text for _ in range(2)]
        assert unseeded[0] != unseeded[1]  # each request draws from its own seed
        with pytest.raises(openai.BadRequestError, match="temperature 0.9"):
            c.completions.create(model="m", prompt=PROMPTS[1], temperature=0.0)
    finally:
        stop(http)
        server.scheduler.close()
        llm.close()
