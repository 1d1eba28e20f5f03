"""The OpenAI server as a real process: ``python -m titan_mm.serve`` on a free localhost port, serving a tiny random
Qwen3 (an HF folder written by the registry's save_hf) with the real Qwen3 tokenizer, queried by the official
``openai`` client: plain, streaming, 32 concurrent, cancelled mid-stream; bad input answers 400 naming the field;
a full queue answers 429; a client that goes away frees its blocks. /metrics is scraped after each.
Images (Qwen3-VL) go through the same app in-process (FastAPI's TestClient), on a tiny random VL engine.
"""

import asyncio
import base64
import io
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from titan_mm.registry import resolve_model  # noqa: E402
from titan_mm.serve.config import ServeConfig  # noqa: E402
from titan_mm.serve.engine import Engine  # noqa: E402
from titan_mm.serve.sampling_params import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MAX_LEN = 256
LONG = 8192  # the admission server's context: its requests outlast the test's timeouts at any decode speed
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A random 1-layer debug Qwen3 as an HF folder (no tokenizer files: the built-in Qwen3 tokenizer)."""
    out = tmp_path_factory.mktemp("tiny_qwen3")
    spec, cfg = resolve_model("qwen3", "debug", overrides={"num_hidden_layers": 1})
    torch.manual_seed(0)
    model = spec.build(cfg)
    with torch.no_grad():
        model.init_weights()
    spec.save_hf(model, cfg, out)
    return out


class Server:
    def __init__(self, model_dir: Path, *flags: str, max_len: int = MAX_LEN):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("TITAN_TEST_THREADS", "1"))
        self.log = open(model_dir.parent / f"server_{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "titan_mm.serve", "--model", str(model_dir), "--port", str(self.port),
             "--device", "cpu", "--served_model_name", "tiny", "--log_level", "warning",
             "--serve.max_model_len", str(max_len), *flags], cwd=ROOT, env=env, stdout=self.log,
            stderr=subprocess.STDOUT)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def wait_up(self) -> "Server":
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited: {self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise AssertionError(f"the server did not come up in 180 s: {self.output()}")
        return self

    def output(self, tail: int | None = 3000) -> str:
        self.log.seek(0)
        return self.log.read()[-tail if tail else 0:]

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def metric(self, name: str, **labels) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_idle(self, timeout: float = 30) -> dict:
        """/metrics once no request holds a KV block and none runs or waits (the idle value is 0 blocks)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = [m[("titan_mm_serve_" + k, ())] for k in ("kv_blocks_used", "running_requests",
                                                             "waiting_requests")]
            if idle == [0, 0, 0] or time.monotonic() > deadline:
                assert idle == [0, 0, 0], f"not idle after {timeout}s (blocks, running, waiting) = {idle}"
                return m
            time.sleep(0.1)

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def servers(model_dir):
    """The main server, and one that runs one sequence at a time with a queue of one (admission control);
    both start at once."""
    both = [Server(model_dir),
            Server(model_dir, "--serve.max_num_seqs", "1", "--serve.max_queue_len", "1", max_len=LONG)]
    try:
        yield [s.wait_up() for s in both]
    finally:
        for s in both:
            s.close()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def engine(model_dir):
    """The same model offline in this process: the reference answers."""
    return Engine.from_pretrained(model_dir, ServeConfig(max_model_len=MAX_LEN), device="cpu")


def _offline(engine, ids, max_tokens) -> str:
    (out,) = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return out.outputs[0].text


def test_health_and_models(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_startup_line_names_what_runs(server):
    """One line, whatever the log level (the servers run at "warning"), before the port opens."""
    lines = [ln for ln in server.output(None).splitlines() if ln.startswith("engine ready:")]
    assert len(lines) == 1, server.output()
    line = lines[0]
    for part in ("(qwen3)", "dtype float32", f"max_model_len {MAX_LEN}", "KV blocks ", "captured graphs 0",
                 "serving it as 'tiny'", f":{server.port}"):
        assert part in line, line


def test_n_at_temperature_0_gives_identical_choices(server, engine):
    """OpenAI accepts n > 1 greedy: n identical choices (the engine runs one sequence for them), both endpoints,
    plain and streamed; usage counts every choice's tokens."""
    want = _offline(engine, engine.tokenizer.encode("Hello world"), 6)
    r = server.client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, n=3, **GREEDY)
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(i, want, "length") for i in range(3)]
    assert r.usage.completion_tokens == 3 * 6
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, n=2, **GREEDY)
    assert len(r.choices) == 2 and r.choices[0].message.content == r.choices[1].message.content
    texts = {}
    for chunk in server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, n=2, stream=True,
                                                       **GREEDY):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {0: r.choices[0].message.content, 1: r.choices[0].message.content}


def test_plain_answers_match_the_engine(server, engine):
    tok = engine.tokenizer
    r = server.client.completions.create(model="tiny", prompt="Hello world", max_tokens=8, **GREEDY)
    assert r.choices[0].text == _offline(engine, tok.encode("Hello world"), 8)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode("Hello world")), 8)

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    r = server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, **GREEDY)
    ids, _ = engine.chat_prompt([{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                                 for m in msgs])
    assert ids[-3:] == tok.encode("<|im_start|>assistant\n")  # the chat template's generation prompt
    assert r.choices[0].message.content == _offline(engine, ids, 6)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(ids)

    # logprobs: the chosen token's and the top ones, by the token's text
    r = server.client.completions.create(model="tiny", prompt="Hello", max_tokens=3, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(max(top.values()) == chosen for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))  # greedy
    r = server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, logprobs=True,
                                              top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob == t.logprob >= t.top_logprobs[1].logprob for t in content)


def test_streaming_equals_plain(server):
    c = server.client
    msgs = [{"role": "user", "content": "Count to three."}]
    plain = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, **GREEDY)
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        plain.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8

    plain = c.completions.create(model="tiny", prompt="One, two,", max_tokens=8, echo=True, **GREEDY)
    parts = list(c.completions.create(model="tiny", prompt="One, two,", max_tokens=8, echo=True, stream=True,
                                      **GREEDY))
    assert "".join(p.choices[0].text for p in parts) == plain.choices[0].text
    assert plain.choices[0].text.startswith("One, two,")


def test_32_concurrent_requests(server):
    prompts = ["The sky is", "Once upon a time", "def main():", "1, 2, 3,"]
    want = {p: server.client.completions.create(model="tiny", prompt=p, max_tokens=8, **GREEDY).choices[0].text
            for p in prompts}
    before = server.metric("titan_mm_serve_requests_total", finish_reason="length")
    ttft_before = server.metric("titan_mm_serve_ttft_seconds_count")
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    async def one(i):
        p = prompts[i % 4]
        if i % 2:  # half of them stream
            s = await aclient.completions.create(model="tiny", prompt=p, max_tokens=8, stream=True, **GREEDY)
            return p, "".join([ch.choices[0].text async for ch in s])
        r = await aclient.completions.create(model="tiny", prompt=p, max_tokens=8, **GREEDY)
        return p, r.choices[0].text

    async def run():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    t0 = time.perf_counter()
    got = asyncio.run(run())
    wall = time.perf_counter() - t0
    assert [g for _, g in got] == [want[p] for p, _ in got], "a batched answer differs from the same prompt alone"
    m = server.wait_idle()
    assert m[("titan_mm_serve_requests_total", (("finish_reason", "length"),))] == before + 32
    assert m[("titan_mm_serve_ttft_seconds_count", ())] == ttft_before + 32
    assert m[("titan_mm_serve_tpot_seconds_count", ())] >= 32
    print(f"32 concurrent requests x 8 tokens: {wall:.2f}s wall")


def test_cancel_mid_stream_frees_blocks(server):
    aborted = server.metric("titan_mm_serve_requests_total", finish_reason="abort")
    stream = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=200, stream=True,
        **GREEDY)
    got = []
    for ch in stream:
        got.append(ch)
        if len(got) == 3:
            break
    assert server.metric("titan_mm_serve_kv_blocks_used") > 0  # still running on the server
    stream.close()
    m = server.wait_idle()
    assert m[("titan_mm_serve_requests_total", (("finish_reason", "abort"),))] == aborted + 1
    # and the server goes on serving
    r = server.client.completions.create(model="tiny", prompt="Hi", max_tokens=2, **GREEDY)
    assert r.usage.completion_tokens == 2


def _post(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=30)
    return r.status_code, r.json()


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/completions", {"prompt": list(range(1000, 1000 + MAX_LEN + 4)), "max_tokens": 4}, "prompt",
     ["260 tokens", f"at most {MAX_LEN - 1}"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_LEN}, "max_tokens", [f"max_model_len ({MAX_LEN})"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2000}], "max_tokens": 1}, "messages",
     [f"at most {MAX_LEN - 1}"]),
    ("/v1/completions", {"prompt": "hi", "max_tokenz": 4}, "max_tokenz", ["unknown field", "'max_tokens'"]),
    ("/v1/completions", {"prompt": "hi", "top_k": "4"}, "top_k", ["integer", "got a string"]),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature", [">= 0.0"]),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 1}, "messages", ["at least one message"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": True},
     "top_logprobs", ["<= 20"]),
    ("/v1/completions", {"prompt": [[5, 151936 + 7]], "max_tokens": 1}, "prompt", ["vocabulary"]),
])
def test_bad_input_is_400_naming_the_field(server, path, body, param, words):
    status, err = _post(server, path, {"model": "tiny"} | body)
    assert status == 400, err
    e = err["error"]
    assert e["param"] == param and e["type"] == "invalid_request_error"
    for w in words:
        assert w in e["message"], e["message"]


def test_bad_input_leaks_nothing(server):
    errors = server.metric("titan_mm_serve_http_errors_total", status="400")
    for body in ({"prompt": "x", "n": 0}, {"prompt": "x" * 3000}, {"prompt": "hi", "stop": [""]}):
        assert _post(server, "/v1/completions", {"model": "tiny"} | body)[0] == 400
    status, err = _post(server, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert status == 404 and "'tiny'" in err["error"]["message"]
    m = server.wait_idle()
    assert m[("titan_mm_serve_http_errors_total", (("status", "400"),))] == errors + 3
    assert _post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1})[0] == 200


def test_full_queue_is_429_and_disconnect_frees_blocks(servers):
    """One sequence at a time and a queue of one: A runs, B waits, C is refused; closing A and dropping B's
    connection (a non-streaming request) abort both and free their blocks."""
    s = servers[1]
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": LONG - 16, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body | {"stream": True}, timeout=60) as a:
        lines = a.iter_lines()
        assert next(lines).startswith("data: ")  # A has its first token: it runs
        b_done = {}

        def b():  # non-streaming; it gives up after 5 s, while it runs: the connection closes under it
            try:
                httpx.post(s.url + "/v1/completions", json=body, timeout=5)
            except httpx.TimeoutException:
                b_done["timed_out"] = True

        tb = threading.Thread(target=b)
        tb.start()
        deadline = time.monotonic() + 10
        while s.metric("titan_mm_serve_waiting_requests") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.metric("titan_mm_serve_waiting_requests") == 1
        status, err = _post(s, "/v1/completions", body)
        assert status == 429, err
        assert err["error"]["type"] == "rate_limit_error" and "max_queue_len=1" in err["error"]["message"]
    # A's stream closed here: B runs (it holds blocks) until its client gives up
    deadline = time.monotonic() + 5
    while s.metric("titan_mm_serve_running_requests") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.metric("titan_mm_serve_running_requests") == 1 and s.metric("titan_mm_serve_kv_blocks_used") > 0
    assert tb.is_alive()
    tb.join(30)
    assert b_done.get("timed_out")
    m = s.wait_idle()
    assert m[("titan_mm_serve_requests_total", (("finish_reason", "abort"),))] == 2
    assert m[("titan_mm_serve_http_errors_total", (("status", "429"),))] == 1
    assert _post(s, "/v1/completions", body | {"max_tokens": 2})[0] == 200


def test_server_logs_hold_no_traceback(servers):
    for s in servers:
        assert s.proc.poll() is None and "Traceback" not in s.output(tail=None), s.output()


# ---------------------------------------------------------------------------------------------- images (in-process)
def _png(w=64, h=48) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vl_app():
    from fastapi.testclient import TestClient

    from titan_mm.serve.entrypoints.server import build_app

    spec, cfg = resolve_model("qwen3_vl", "debug", overrides={"text": {"num_hidden_layers": 2}})
    torch.manual_seed(0)
    model = spec.build(cfg)
    with torch.no_grad():
        model.init_weights()
    engine = Engine(model, spec, cfg, ServeConfig(max_model_len=512), device="cpu")
    with TestClient(build_app(engine, "tiny-vl")) as client:
        yield client, engine


def test_images_and_bad_images(vl_app):
    client, engine = vl_app
    url = _png()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    r = client.post("/v1/chat/completions", json={"model": "tiny-vl", "messages": msgs, "max_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    ids, images = engine.chat_prompt(msgs[:0] + [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": url}]}])
    (ref,) = engine.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), images=[images])
    assert r.json()["choices"][0]["message"]["content"] == ref.outputs[0].text
    assert r.json()["usage"]["prompt_tokens"] == len(ref.prompt_token_ids) > len(ids)  # expanded image pads

    broken = "data:image/png;base64," + base64.b64encode(b"\x89PNG not an image").decode()
    bad = [{"role": "system", "content": "x"},
           {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": url}},
                                        {"type": "image_url", "image_url": {"url": broken}}]}]
    r = client.post("/v1/chat/completions", json={"model": "tiny-vl", "messages": bad, "max_tokens": 2})
    assert r.status_code == 400
    e = r.json()["error"]
    assert e["param"] == "messages[1].content[2].image_url" and "decode" in e["message"], e
    r = client.post("/v1/chat/completions", json={"model": "tiny-vl", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url"
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished()


def test_a_failing_step_is_500_and_the_server_goes_on(vl_app, monkeypatch):
    """An exception in engine.step ends the requests in flight with 500 (an error event when streaming);
    the step thread keeps serving and nothing stays allocated."""
    client, engine = vl_app
    step, calls = engine.step, []

    def fail_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return step()

    monkeypatch.setattr(engine, "step", fail_once)
    body = {"model": "tiny-vl", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    calls.clear()  # streaming: the 200 went out first, so an error event ends the stream
    r = client.post("/v1/completions", json=body | {"stream": True})
    assert r.status_code == 200 and "injected step failure" in r.text and "[DONE]" not in r.text
    assert client.get("/health").json() == {"status": "ok"}
    # the step thread reports the aborted request on its next step, which may come after the error event
    deadline = time.monotonic() + 10
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished()
