"""The OpenAI-compatible server, through the real ``openai`` client over a real socket.

smollm2-135m where the text must equal ``LLM.chat``'s; tiny-llama where only the
mechanics matter (64 concurrent streams, disconnects, bad input, a full queue, an engine
failure, metrics, SIGINT). Servers run uvicorn in a thread of this process (one per
module fixture), except the SIGINT test, which starts ``python -m llmlab.serve``.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import uvicorn  # noqa: E402

import llmlab  # noqa: E402
from llmlab.serve.client import scrape_metrics  # noqa: E402
from llmlab.serve.process import free_port, start_server, stop_server  # noqa: E402
from llmlab.engine import LLM, SamplingParams  # noqa: E402
from llmlab.serve import create_app  # noqa: E402
from llmlab.serve.client import parse_sse  # noqa: E402

from .conftest import FRANCE  # noqa: E402


class ThreadServer:
    """uvicorn serving ``app`` on a free localhost port, in a daemon thread."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        self.app = app
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                    timeout=60)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics (parsed by prometheus_client's own parser)."""
        return scrape_metrics(self.url)

    def close(self):
        self.server.should_exit = True
        self.thread.join(15)


def wait_for(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


# -- request bodies -> SamplingParams arguments (no server) ----------------------------------
def test_sampling_kwargs_pass_only_what_the_client_set():
    from llmlab.serve.protocol import ChatCompletionRequest, CompletionRequest, sampling_kwargs

    req = CompletionRequest(prompt="x", temperature=0, logprobs=3)
    assert sampling_kwargs(req, 16) == {"temperature": 0, "logprobs": 3, "max_tokens": 16}
    req = CompletionRequest(prompt="x", max_tokens=5, presence_penalty=0.5, stop="\n")
    assert sampling_kwargs(req, 16) == {"max_tokens": 5, "presence_penalty": 0.5, "stop": "\n"}
    msgs = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest(messages=msgs, logprobs=True, top_logprobs=4,
                                 max_completion_tokens=7)
    assert sampling_kwargs(chat, 100) == {"logprobs": 4, "max_tokens": 7}
    assert sampling_kwargs(ChatCompletionRequest(messages=msgs, top_logprobs=4), 100) == \
        {"max_tokens": 100}                      # top_logprobs without logprobs: none
    assert sampling_kwargs(ChatCompletionRequest(messages=msgs, logprobs=True), 9) == \
        {"logprobs": 0, "max_tokens": 9}         # the chosen token's only


# -- smollm2-135m: the text of LLM.chat ----------------------------------------------------
@pytest.fixture(scope="module")
def smol(smollm2, tokenizer):
    srv = ThreadServer(create_app(LLM(smollm2, tokenizer, max_num_seqs=4), "smollm2-135m"))
    yield srv
    srv.close()


MSGS = [{"role": "user", "content": FRANCE}]


@pytest.fixture(scope="module")
def chat_reference(smollm2, tokenizer):
    out = LLM(smollm2, tokenizer).chat(MSGS, SamplingParams(temperature=0, max_tokens=24),
                                       use_tqdm=False)[0]
    return out.outputs[0]


def test_greedy_chat_equals_llm_chat(smol, chat_reference):
    r = smol.client.chat.completions.create(model="smollm2-135m", messages=MSGS,
                                            temperature=0, max_tokens=24)
    assert "Paris" in chat_reference.text
    assert r.choices[0].message.content == chat_reference.text
    assert r.choices[0].finish_reason == chat_reference.finish_reason
    assert r.usage.completion_tokens == len(chat_reference.token_ids)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"


def test_streamed_chat_equals_llm_chat(smol, chat_reference):
    stream = smol.client.chat.completions.create(
        model="smollm2-135m", messages=MSGS, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_reference.text
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3   # streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        chat_reference.finish_reason
    assert chunks[-1].usage.completion_tokens == len(chat_reference.token_ids)
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_models_health_and_sse_ends_with_done(smol):
    assert [m.id for m in smol.client.models.list().data] == ["smollm2-135m"]
    assert httpx.get(smol.url + "/health").json() == {"status": "ok"}
    body = {"model": "smollm2-135m", "prompt": "One, two,", "max_tokens": 3,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", smol.url + "/v1/completions", json=body, timeout=60) as r:
        lines = list(r.iter_lines())
    assert r.headers["content-type"].startswith("text/event-stream")
    assert [x for x in lines if x][-1] == "data: [DONE]"
    chunks = list(parse_sse(lines))
    assert chunks and all(c["object"] == "text_completion" for c in chunks)


# -- tiny-llama: mechanics ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    return llmlab.load_model("tiny-llama", device="cpu"), llmlab.load_tokenizer("tiny-llama")


@pytest.fixture(scope="module")
def tiny(tiny_model):
    model, tok = tiny_model
    srv = ThreadServer(create_app(LLM(model, tok, max_num_seqs=16, block_size=4),
                                  "tiny-llama", max_waiting=128))
    yield srv
    srv.close()


def _stream_text(client, prompt, max_tokens):
    stream = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens


def test_64_concurrent_streams_lose_and_duplicate_nothing(tiny, tiny_model):
    prompts = [f"request {i}: " + "word " * (i % 7) for i in range(64)]
    model, tok = tiny_model
    ref = LLM(model, tok, max_num_seqs=64, block_size=4).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    before = tiny.metrics()
    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(lambda p: _stream_text(tiny.client, p, 8), prompts))
    assert [g[1] for g in got] == [8] * 64
    assert [g[0] for g in got] == [r.outputs[0].text for r in ref]
    after = tiny.metrics()
    assert after["llmlab_time_to_first_token_seconds_count"] - \
        before["llmlab_time_to_first_token_seconds_count"] == 64
    assert after["llmlab_generation_tokens_total"] - before["llmlab_generation_tokens_total"] == 512


def test_disconnect_mid_stream_frees_the_blocks(tiny):
    body = {"model": "tiny-llama", "prompt": "a long one", "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    key = 'llmlab_requests_finished_total{"finish_reason": "%s"}'
    before = tiny.metrics()
    with httpx.stream("POST", tiny.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")           # the stream has begun
        assert tiny.metrics()["llmlab_kv_blocks_used"] > 0
        assert tiny.metrics()["llmlab_requests_running"] == 1
    # the client is gone after 1 of 2000 tokens: the engine must drop it and free its blocks
    assert wait_for(lambda: tiny.metrics()["llmlab_kv_blocks_used"] == 0, 10)
    after = tiny.metrics()
    assert after[key % "abort"] - before.get(key % "abort", 0) == 1       # aborted, not run out
    assert after.get(key % "length", 0) == before.get(key % "length", 0)
    assert tiny.metrics()["llmlab_requests_running"] == 0
    assert tiny.app.state.server.llm.engine.requests == {}


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 2, "temperature": 0}, 400, "n"),
    ({"prompt": 3.5}, 400, "prompt"),
    ({"max_tokens": 2}, 400, "prompt"),
    ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"prompt": "x", "logprobs": 9}, 400, "logprobs"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
])
def test_bad_completion_requests_get_an_error_naming_the_field(tiny, body, status, param):
    r = httpx.post(tiny.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert param in err["message"] or param == "prompt"


def test_bad_requests_through_the_openai_client(tiny):
    c = tiny.client
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-llama", messages=[{"role": "wizard", "content": "hi"}])
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-llama", messages=[
            {"role": "user", "content": "word " * 5000}], max_tokens=2)
    assert e.value.body["param"] == "messages" and e.value.body["code"] == "context_length_exceeded"
    r = httpx.post(tiny.url + "/v1/chat/completions", content=b'{"messages": [', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def test_metrics_parse_and_count_prompt_tokens(tiny):
    before = tiny.metrics()
    r = tiny.client.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=2,
                                       temperature=0)
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 2
    after = tiny.metrics()
    for name in ("llmlab_requests_running", "llmlab_requests_waiting", "llmlab_kv_blocks_used",
                 "llmlab_time_per_output_token_seconds_count", "llmlab_e2e_request_latency_seconds_sum"):
        assert name in after
    assert after["llmlab_prompt_tokens_total"] - before["llmlab_prompt_tokens_total"] == 3
    assert after['llmlab_requests_finished_total{"finish_reason": "length"}'] - \
        before.get('llmlab_requests_finished_total{"finish_reason": "length"}', 0) == 1
    assert after["llmlab_prefix_cache_queried_tokens"] - \
        before["llmlab_prefix_cache_queried_tokens"] == 3
    stats = tiny.app.state.server.llm.engine.cache.manager.stats
    assert after["llmlab_prefix_cache_hit_rate"] == pytest.approx(stats.hit_rate)


def test_engine_failure_gives_500_and_the_server_goes_on(tiny):
    runner = tiny.app.state.server.llm.engine.runner
    real = runner.execute

    def broken(work):
        runner.execute = real
        raise RuntimeError("injected fault")

    runner.execute = broken
    r = httpx.post(tiny.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    assert tiny.client.completions.create(model="tiny-llama", prompt="x", max_tokens=3,
                                          temperature=0).usage.completion_tokens == 3
    assert tiny.metrics()["llmlab_kv_blocks_used"] == 0


def test_full_waiting_queue_gets_503(tiny_model):
    model, tok = tiny_model
    srv = ThreadServer(create_app(LLM(model, tok, max_num_seqs=1, block_size=4), "tiny-llama",
                                  max_waiting=2))
    body = {"prompt": "hold", "max_tokens": 300, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as h:
            streams = [h.stream("POST", "/v1/completions", json=body) for _ in range(3)]
            opened = [streams[0].__enter__()]         # takes the one seat
            assert wait_for(lambda: srv.metrics()["llmlab_requests_running"] == 1, 10)
            opened += [s.__enter__() for s in streams[1:]]     # two wait: the queue is full
            assert [o.status_code for o in opened] == [200] * 3
            m = srv.metrics()
            assert (m["llmlab_requests_running"], m["llmlab_requests_waiting"]) == (1, 2)
            r = h.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
            assert r.status_code == 503 and "waiting queue is full" in r.json()["error"]["message"]
            for s in streams:
                s.__exit__(None, None, None)
        assert wait_for(lambda: srv.metrics()["llmlab_kv_blocks_used"] == 0, 10)
        r = srv.client.completions.create(model="tiny-llama", prompt="after", max_tokens=2)
        assert r.usage.completion_tokens == 2      # room again: nothing stuck
    finally:
        srv.close()


@pytest.mark.slow
def test_sigint_stops_the_server_cleanly_and_answers_open_requests():
    port = free_port()
    proc = start_server("tiny-llama", "continuous", port, ["--graceful-timeout", "3"])
    url = f"http://127.0.0.1:{port}/v1/completions"
    lines, started = [], threading.Event()

    def long_stream():
        body = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                started.set()

    try:
        assert httpx.post(url, json={"prompt": "x", "max_tokens": 2}, timeout=30).status_code == 200
        reader = threading.Thread(target=long_stream)
        reader.start()
        assert started.wait(30)
    finally:
        t = time.monotonic()
        code = stop_server(proc, timeout_s=15)
    reader.join(15)
    assert code == 0 and time.monotonic() - t < 15
    # the open stream was answered, not dropped: an error event saying why, then [DONE]
    events = [x for x in lines if x]
    assert events[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(events[-2][len("data: "):])["error"]["message"]


def test_penalties_and_logprobs_pass_through_to_the_engine(tiny, tiny_model):
    model, tok = tiny_model
    kw = dict(temperature=0, max_tokens=12, presence_penalty=1.5, frequency_penalty=0.5,
              repetition_penalty=1.3, ignore_eos=True)
    llm = LLM(model, tok, block_size=4)
    ref = llm.generate("the the the", SamplingParams(**kw, logprobs=2), use_tqdm=False)[0].outputs[0]
    plain = llm.generate("the the the", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert ref.token_ids != plain.token_ids          # the penalties matter for this prompt
    extra = {k: kw[k] for k in ("repetition_penalty", "ignore_eos")}
    args = dict(model="tiny-llama", prompt="the the the", temperature=0, max_tokens=12,
                presence_penalty=1.5, frequency_penalty=0.5, logprobs=2, extra_body=extra)
    r = tiny.client.completions.create(**args)
    assert r.choices[0].text == ref.text
    want = [lp[t] for t, lp in zip(ref.token_ids, ref.logprobs)]
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-5)
    assert [len(d) for d in r.choices[0].logprobs.top_logprobs] == [2] * 12
    chunks = list(tiny.client.completions.create(**args, stream=True))
    streamed = [x for c in chunks for x in (c.choices[0].logprobs.token_logprobs
                                             if c.choices and c.choices[0].logprobs else [])]
    assert streamed == pytest.approx(want, abs=1e-5)
    chat = tiny.client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], temperature=0,
        max_tokens=3, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)


def test_a_served_llm_refuses_offline_calls_until_the_server_stops(tiny_model):
    from llmlab.serve.loop import EngineLoop
    model, tok = tiny_model
    llm = LLM(model, tok, block_size=4)
    loop = EngineLoop(llm)
    loop.start()
    try:
        with pytest.raises(RuntimeError, match="being served"):
            llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(RuntimeError, match="being served"):
            next(llm.stream("hello", SamplingParams(max_tokens=2)))
        with pytest.raises(RuntimeError, match="being served"):
            llm.beam_search("hello", 2, 2)
        with pytest.raises(RuntimeError, match="already served"):
            EngineLoop(llm).start()
    finally:
        loop.stop()
    assert llm.served_by is None
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
