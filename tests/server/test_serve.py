"""`specchat serve` on a free port, driven by the real `openai` client: chat, streaming, completions, tools, errors,
a client that disconnects, /metrics. The tiny random model keeps it fast; greedy output is compared with the
engine's own."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.sequence import Finished
from specchat.engine.stats import SpecStats
from specchat.errors import ConfigError
from specchat.server.app import create_app
from specchat.server.protocol import GenerationRequest
from specchat.server.responses import completion

MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app):
    """The app on a free port, in a thread -> its base url."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def stopping_server(model_dir, grace_s: float, before_step=None, log_level: str = "critical", **stopping):
    """(engine, StoppingServer, its thread, port): the tiny model's engine, started (`before_step(engine)` run before
    each of its steps: answers still running at a stop), served in a thread with uvicorn's grace `grace_s`;
    `stopping` goes to StoppingServer (end_early_s, force_after_s)."""
    from specchat.engine.engine import Engine
    from specchat.server.stopping import StoppingServer

    engine = Engine.load(EngineConfig(model=str(model_dir), device="cpu", dtype="float32"))
    if before_step is not None:
        step = engine.step
        engine.step = lambda: before_step(engine) or step()
    engine.start()
    port = free_port()
    app = create_app(engine, "tiny")
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level, timeout_graceful_shutdown=grace_s)
    server = StoppingServer(config, engine, **stopping)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    return engine, server, thread, port


def ask_in_threads(port: int, max_tokens: int) -> tuple[dict, list[threading.Thread]]:
    """A non-streaming and a streaming chat request to the server at `port`, each from a thread of its own, started:
    ({stream: (status, body text)}, the threads); a request that failed is (None, its error): a 500, a cut stream."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True}
    answers: dict = {}

    def ask(stream: bool) -> None:
        data = json.dumps({**body, "stream": stream}).encode()
        request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                answers[stream] = (response.status, response.read().decode())
        except Exception as exc:
            answers[stream] = (None, repr(exc))

    clients = [threading.Thread(target=ask, args=(stream,)) for stream in (False, True)]
    for client in clients:
        client.start()
    return answers, clients


def wind_down(engine, thread: threading.Thread, clients: list[threading.Thread]) -> None:
    """After a stop: the clients' and the server's threads joined (30 s each at most), the engine closed."""
    for client in clients:
        client.join(30)
    thread.join(30)
    engine.close()


@pytest.fixture(scope="module")
def served(engine):
    """(base url, engine): a server of this module's engine on a free port."""
    with serving(create_app(engine, "tiny")) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def post_raw(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def engine_greedy(engine, messages, max_tokens: int) -> str:
    handle = engine.submit(messages, SamplingParams(max_tokens=max_tokens), SpecParams("none", k=0))
    return handle.result().text


def test_chat_greedy_equals_the_engine_and_stream_equals_whole(client, served):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == engine_greedy(served[1], MESSAGES, 24)
    assert reply.usage.completion_tokens == 24 and reply.usage.total_tokens == reply.usage.prompt_tokens + 24
    assert reply.choices[0].finish_reason == "length"

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert usage.completion_tokens == 24 and usage.model_extra["speculation"]["tokens_per_step"] >= 1.0


def test_a_stream_interval_joins_the_text_between_its_first_chunk_and_its_end(served):
    """With an interval longer than the reply, the first text goes out at once and the rest with the end."""
    engine = served[1]
    with serving(create_app(engine, "tiny", stream_interval_s=60.0)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        chunks = list(
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, stream=True)
        )
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) == 2 and "".join(texts) == engine_greedy(engine, MESSAGES, 24)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_negative_stream_interval_is_refused(served):
    with pytest.raises(ConfigError, match="stream interval"):
        create_app(served[1], "tiny", stream_interval_s=-1)


def test_speculation_per_request_and_in_usage(client, served):
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, extra_body={"drafter": "ngram", "k": 3}
    )
    assert reply.choices[0].message.content == engine_greedy(served[1], MESSAGES, 24)  # lossless
    assert set(reply.usage.model_extra["speculation"]) == {"drafted", "accepted", "acceptance_rate", "tokens_per_step"}


def test_completions_models_health_and_metrics(client, served):
    text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert text.object == "text_completion" and text.usage.completion_tokens == 8
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert json.loads(get(served[0] + "/health"))["status"] == "ok"
    page = get(served[0] + "/metrics")
    assert 'specchat:spec_decode_num_draft_tokens_total{model="tiny"}' in page
    assert "specchat:kv_cache_usage_perc" in page and "specchat:tokens_per_second" in page


def test_completions_take_token_ids_as_openai_does(client, served):
    """A prompt of token ids (alone or as a batch of one: OpenAI's forms, which lm-eval and vLLM's benchmarks send)
    was a 400 "prompt must be a non-empty string"; ids outside the vocabulary and a batch of several are 400s."""
    url, engine = served
    ids = engine.encode_prompt("Once upon a time", raw=True)
    by_text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    for prompt in (ids, [ids]):
        by_ids = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    for prompt, message in (([10**9], "vocabulary"), ([ids, ids], "one prompt a request"), (["a", "b"], "one prompt")):
        status, answer = post_raw(url + "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt}).encode())
        assert status == 400 and answer["error"]["param"] == "prompt" and message in answer["error"]["message"], answer


def test_head_answers_where_get_does(served):
    """Uptime monitors and load balancers ask HEAD (UptimeRobot's default): /health was a 405 and the server read as
    down."""
    for path, status in (("/health", 200), ("/v1/models", 200), ("/v1/models/tiny", 200), ("/v1/models/gpt-9", 404)):
        request = urllib.request.Request(served[0] + path, method="HEAD")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                assert (response.status, response.read()) == (status, b""), path
        except urllib.error.HTTPError as error:
            assert error.code == status, path


def test_a_trailing_slash_names_the_same_route(served):
    """POST /v1/chat/completions/ was Starlette's 307 with an empty body: a client that follows no redirect (curl
    without -L, urllib, http.client) got no answer; GET /v1/models/ was a 404 for a model named ""."""
    host, port = served[0].removeprefix("http://").split(":")
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "ignore_eos": True}
    for method, path, body, status, wanted in (
        ("POST", "/v1/chat/completions/", chat, 200, {"object": "chat.completion"}),
        ("POST", "/v1/completions/", {"model": "tiny", "prompt": "Once", "max_tokens": 2}, 200, {"model": "tiny"}),
        ("GET", "/v1/models/", None, 200, {"object": "list"}),
        ("GET", "/v1/models/tiny/", None, 200, {"id": "tiny"}),
        ("GET", "/health/", None, 200, {"status": "ok"}),
        ("GET", "/v1/chat/completions/", None, 405, {}),
        ("POST", "/v1/nowhere/", {}, 404, {}),
    ):
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        data = None if body is None else json.dumps(body)
        connection.request(method, path, data, {"content-type": "application/json"})
        response = connection.getresponse()  # (http.client follows no redirect)
        answer = json.loads(response.read() or b"null")
        connection.close()
        assert response.status == status and isinstance(answer, dict), (method, path, response.status, answer)
        assert answer.items() >= wanted.items() and ("error" in answer) == (status != 200), (method, path, answer)
    assert "specchat:kv_cache_usage_perc" in get(served[0] + "/metrics/")


def test_body_readers_stop_after_their_loop_closed():
    """The stopping server's timer thread ends the body reads (BodyReaders.stop) and could fire after the event loop
    had closed: `call_soon_threadsafe` raised in that thread ("Event loop is closed", a traceback on stderr)."""
    import asyncio

    from specchat.server.app import BodyReaders

    readers = BodyReaders()
    readers.loop = asyncio.new_event_loop()
    readers.loop.close()
    readers.stop()
    assert readers.stopping


def test_metrics_quote_a_model_name_that_needs_it(served):
    """The model's name (a path as given) is a label value: its backslashes, quotes and newlines escaped as the
    Prometheus text format wants, so the page still parses."""
    from specchat.server.metrics import render

    page = render(served[1].snapshot(), 'models/a "b" \\c\nd.gguf')
    line = next(line for line in page.splitlines() if line.startswith("specchat:generation_tokens_total{"))
    assert line.startswith('specchat:generation_tokens_total{model="models/a \\"b\\" \\\\c\\nd.gguf"} ')
    assert len(page.splitlines()) == len(render(served[1].snapshot(), "tiny").splitlines())


def test_bodies_past_what_the_parser_takes_are_400s_not_500s(served, monkeypatch):
    """Nesting past the parser's recursion and a number past Python's 4,300 digits were 500s with a traceback; a
    chunked upload (no Content-Length) past the body limit was read whole; a client gone mid-body a traceback."""
    url = served[0] + "/v1/chat/completions"
    status, answer = post_raw(url, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert status == 400 and "not valid JSON" in answer["error"]["message"], (status, answer)
    status, answer = post_raw(url, b'{"model": "tiny", "max_tokens": ' + b"9" * 5000 + b"}")
    assert status == 400 and "not valid JSON" in answer["error"]["message"], (status, answer)
    monkeypatch.setattr("specchat.server.app.MAX_BODY_BYTES", 1000)
    host, port = served[0].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    chunks = iter([b'{"model": "tiny", "prompt": "', b"x" * 800, b"x" * 800, b'"}'])
    conn.request("POST", "/v1/completions", body=chunks, encode_chunked=True,
                 headers={"content-type": "application/json", "transfer-encoding": "chunked"})  # fmt: skip
    response = conn.getresponse()
    assert response.status == 413 and "1,000" in json.loads(response.read())["error"]["message"]
    conn.close()
    monkeypatch.undo()
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # hangs up mid-body
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b'Content-Length: 500\r\n\r\n{"messages"')  # fmt: skip
    status, answer = post_raw(url, json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 2}).encode())
    assert status == 200 and answer["choices"][0]["message"]["content"] is not None


def test_tools_nested_deeper_than_the_prompt_writes_are_400s_not_500s(served):
    """Parameters the body's parser took but json.dumps could not write into the system prompt (it recurses deeper
    from the handler than the parse did) were a 500 with a traceback: every depth is a 200 or an OpenAI 400."""
    url = served[0] + "/v1/chat/completions"
    statuses = set()
    for depth in range(880, 1000):  # the window between the two limits is a few levels, set by the server's stack
        parameters = '{"a": ' * depth + "1" + "}" * depth
        body = '{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "w"}], "tools": [{"type": '
        body += f'"function", "function": {{"name": "f", "parameters": {parameters}}}}}]}}'
        status, answer = post_raw(url, body.encode())
        assert status in (200, 400) and (status == 200 or answer["error"]["type"] == "invalid_request_error"), depth
        statuses.add(status)
    assert 400 in statuses
    status, answer = post_raw(url, json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 2}).encode())
    assert status == 200


def test_a_stopping_server_returns_the_answers_in_flight(tiny_model_dir):
    """Ctrl-C / SIGTERM: uvicorn cancels the requests still running at its deadline (a plain-text 500, a stream
    without its end, a traceback). StoppingServer ends the engine's answers just before it, so a non-streaming
    client gets what its answer wrote, finish_reason "length" and the error; a streaming one its stream's end."""
    import signal

    from specchat.server.stopping import STOPPING_ERROR

    # ~50 tokens a second: answers still running at the stop
    engine, server, thread, port = stopping_server(
        tiny_model_dir, 3, lambda _: time.sleep(0.02), log_level="error", end_early_s=2.5
    )
    answers, clients = ask_in_threads(port, max_tokens=200)
    time.sleep(1.0)
    server.handle_exit(signal.SIGINT, None)
    wind_down(engine, thread, clients)
    status, text = answers[False]
    choice = json.loads(text)["choices"][0]
    assert status == 200 and choice["finish_reason"] == "length" and choice["message"]["content"]
    assert STOPPING_ERROR in json.dumps(choice)
    status, text = answers[True]
    assert status == 200 and text.rstrip().endswith("data: [DONE]")


def test_bad_requests_get_openai_errors_and_the_server_stays_up(client, served, monkeypatch):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="max_tokens must be > 0"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="context holds") as too_long:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 400}])
    assert too_long.value.body["code"] == "context_length_exceeded"  # what LiteLLM reads to shorten a chat
    with pytest.raises(openai.BadRequestError, match="unknown drafter"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"drafter": "nope"})
    with pytest.raises(openai.BadRequestError, match="only n = 1"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, n=2)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    with pytest.raises(openai.BadRequestError, match="echo is not supported"):
        client.completions.create(model="tiny", prompt="a b", echo=True, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tool_choice="required", tools=[])
    monkeypatch.setattr("specchat.server.app.MAX_BODY_BYTES", 1000)
    status, answer = post_raw(
        served[0] + "/v1/completions", json.dumps({"model": "tiny", "prompt": "x" * 2000}).encode()
    )
    assert status == 413 and "up to 1,000" in answer["error"]["message"]
    monkeypatch.undo()
    for drafter in ("heads:/etc/hostname", "draft-model"):  # not the server's disk, nor a default draft model
        with pytest.raises(openai.BadRequestError, match="chosen when the server starts"):
            client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"drafter": drafter})
    for path, body in (
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800 hi"}]}'),
        ("/v1/completions", b'{"model": "tiny", "prompt": "\\udc80x"}'),
    ):
        status, answer = post_raw(served[0] + path, body)
        assert status == 400 and "lone surrogate" in answer["error"]["message"], (status, answer)
    status, body = post_raw(served[0] + "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = post_raw(served[0] + "/v1/nowhere", b"{}")
    assert status == 404 and "/v1/nowhere" in body["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as wrong_method:
        get(served[0] + "/v1/chat/completions")
    assert wrong_method.value.code == 405 and json.loads(wrong_method.value.read())["error"]["message"]
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices  # still up


def test_a_prompt_far_past_the_context_is_refused_before_it_is_encoded(served, monkeypatch):
    """A 15.6 MB prompt was 5.8M tokens encoded (~15 s holding the GIL: /health and every stream stalled) before its
    400; a text longer than the context times the longest token is refused unencoded, chat and completions alike."""
    url, engine = served
    encoded, encode = [], engine.tokenizer.encode
    monkeypatch.setattr(
        engine.tokenizer, "encode", lambda text, **kw: (encoded.append(len(text)), encode(text, **kw))[1]
    )
    text = "lorem ipsum dolor sit amet " * 2000
    for path, body in (
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}]}),
        ("/v1/completions", {"model": "tiny", "prompt": text}),
    ):
        status, answer = post_raw(url + path, json.dumps(body).encode())
        message = answer["error"]["message"]
        assert status == 400 and message.startswith("prompt is at least ") and "context holds 256" in message, answer
        assert answer["error"]["code"] == "context_length_exceeded", answer
    assert encoded == []
    status, answer = post_raw(url + "/v1/completions", json.dumps({"model": "tiny", "prompt": "word " * 400}).encode())
    assert status == 400 and re.match(r"prompt is \d+ tokens", answer["error"]["message"]) and encoded  # counted


def test_a_client_that_disconnects_cancels_its_request(served):
    url, engine = served
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "stream": True}
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.readline().startswith(b"data: ")  # the role chunk: the request is running
    connection.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 20
    while engine.scheduler.has_work() or engine.pool.used_pages:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)


def test_tools_are_offered_and_calls_come_back_as_tool_calls(client):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    reply = client.chat.completions.create(model="tiny", messages=history, tools=tools, max_tokens=8)
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # A reply that calls a tool (the tiny model will not write one): the call comes back as tool_calls.
    fin = Finished(
        1,
        "stop",
        'On it.<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>',
        [5, 6],
        10,
        SpecStats(),
        0.1,
        0.1,
    )
    req = GenerationRequest(chat=True, prompt=MESSAGES, sampling=SamplingParams(), spec=SpecParams(), tools=tools)
    choice = completion(req, "id", "tiny", fin)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "On it."
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}


def test_a_port_in_use_or_a_bad_host_is_one_line_before_the_model_loads():
    from click.testing import CliRunner

    from specchat.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", "no-such-model", "--port", str(port)])
    assert result.exit_code != 0 and "cannot listen on 127.0.0.1:" in result.stderr, result.output
    assert "serving" not in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["serve", "no-such-model", "--host", "256.1.1.1", "--port", "8000"])
    assert result.exit_code != 0 and "--host '256.1.1.1'" in result.stderr, result.output


def test_an_answer_cut_short_by_a_full_kv_cache_keeps_its_text(tiny_model_dir):
    from specchat.engine.engine import Engine

    engine = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", kv_memory=16384))
    engine.start()  # 4 pages of 16 tokens: an answer of 200 tokens outgrows them
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200}
    try:
        with serving(create_app(engine, "tiny")) as url:
            status, reply = post_raw(url + "/v1/chat/completions", json.dumps(body).encode())
            choice = reply["choices"][0]
            assert status == 200 and choice["finish_reason"] == "length" and choice["message"]["content"]
            assert "KV cache" in choice["error"] and reply["usage"]["completion_tokens"] > 0
            request = urllib.request.Request(
                url + "/v1/chat/completions",
                data=json.dumps({**body, "stream": True}).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                lines = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
    finally:
        engine.close()
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert not any("error" in event for event in events)  # the text came; the stream ends as "length"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    last = events[-1]["choices"][0]
    assert text and last["finish_reason"] == "length" and "KV cache" in last["error"]


def test_a_non_streaming_answer_whose_client_hung_up_is_cancelled(served, monkeypatch):
    """Nothing else would notice: the answer would decode to its end (and hold up the server's shutdown)."""
    url, engine = served
    cancelled, cancel = [], engine.cancel
    monkeypatch.setattr(engine, "cancel", lambda request_id: (cancelled.append(request_id), cancel(request_id)))
    monkeypatch.setattr("specchat.server.app.DISCONNECT_POLL_S", 0.01)  # notices before the tiny model could finish
    body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 100000, "temperature": 0}).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
    )
    with contextlib.suppress(TimeoutError, urllib.error.URLError):
        urllib.request.urlopen(request, timeout=0.05)  # gives up before the answer can be ready
    deadline = time.monotonic() + 30
    while not cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled, "the server did not cancel the answer nobody waits for"


def test_a_failed_engine_step_is_a_500_and_a_stop_a_503_not_the_clients_400(served, monkeypatch):
    """A request that wrote nothing before the engine's step failed, or before the server stopped, got a 400
    (invalid_request_error): the openai client took it for the request's fault and did not retry."""
    url, engine = served

    def broken(plan):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.spec_step, "run", broken)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5}
    status, answer = post_raw(url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 500 and answer["error"]["type"] == "server_error", (status, answer)
    assert "the engine step failed: RuntimeError: boom" in answer["error"]["message"]
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 5, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        lines = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert json.loads(lines[0][6:])["error"]["type"] == "server_error" and lines[-1] == "data: [DONE]"
    monkeypatch.undo()
    from specchat.server.app import refusal
    from specchat.server.stopping import STOPPING_ERROR

    stats = SpecStats()
    stopped = Finished(1, "error", "", [], 3, stats, 0.0, 0.0, error=STOPPING_ERROR)
    assert refusal(stopped).status == 503 and refusal(stopped).body()["error"]["type"] == "server_error"
    too_big = Finished(1, "error", "", [], 3, stats, 0.0, 0.0, error="request needs 401 tokens of KV cache")
    assert refusal(too_big).status == 400
    loop_error = Finished(1, "error", "", [], 3, stats, 0.0, 0.0, error="the engine failed: KeyError: 3")
    assert refusal(loop_error).status == 500  # the engine loop's catch-all (engine.py's _loop)
    status, _ = post_raw(url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200  # the engine goes on


def test_a_second_ctrl_c_ends_the_answers_now_rather_than_cancelling_them(tiny_model_dir):
    """A second Ctrl-C was uvicorn's forced exit: the handlers in flight were cancelled (a CancelledError traceback
    each on stderr), a non-streaming client got a plain-text 500 and a stream was cut. Now the answers end at once
    and come back as what they wrote; the server exits as soon as they are sent."""
    import signal

    from specchat.server.stopping import STOPPING_ERROR

    # answers still running at the stop
    engine, server, thread, port = stopping_server(
        tiny_model_dir, 60, lambda _: time.sleep(0.02), end_early_s=1.0, force_after_s=30
    )
    answers, clients = ask_in_threads(port, max_tokens=5000)
    time.sleep(1.0)
    start = time.monotonic()
    server.handle_exit(signal.SIGINT, None)
    time.sleep(0.3)
    server.handle_exit(signal.SIGINT, None)
    wind_down(engine, thread, clients)
    assert not thread.is_alive() and time.monotonic() - start < 15  # not the 60 s grace
    status, text = answers[False]
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] and STOPPING_ERROR in choice["error"]
    status, text = answers[True]
    assert status == 200 and STOPPING_ERROR in text and text.rstrip().endswith("data: [DONE]"), text


def test_a_stopping_server_ends_a_stalled_upload_with_a_503(tiny_model_dir):
    """A client that sent its headers and part of its body held the stopping server for uvicorn's whole grace, then
    got a plain-text 500 (its handler cancelled, a CancelledError traceback on stderr)."""
    import signal

    from specchat.server.stopping import STOPPING_ERROR

    engine, server, thread, port = stopping_server(tiny_model_dir, 8, end_early_s=7.5)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as stalled:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.5)
        start = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        reply = b""
        while chunk := stalled.recv(65536):
            reply += chunk
            if b"}}" in reply:
                break
    thread.join(30)
    engine.close()
    head, _, body = reply.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 503"), reply
    assert json.loads(body)["error"]["message"] == STOPPING_ERROR
    assert time.monotonic() - start < 5  # not the whole grace


@pytest.mark.parametrize("placed", [False, True])
def test_a_stop_whose_deadline_comes_mid_step_answers_a_503(tiny_model_dir, placed: bool):
    """Ctrl-C while the engine ran one step longer than the grace (a long prompt's prefill on the CPU): the end of the
    answers could not come before uvicorn's deadline, which cancelled the handler (a plain-text 500, a traceback;
    cancelled while its request waited to be placed, it also failed every live request: "the engine failed")."""
    import signal

    from specchat.server.stopping import STOPPING_ERROR

    def before_step(engine) -> None:
        # steps longer than the grace: every one (the request waits to be placed), or those with a request to run
        if not placed or engine.scheduler.has_work():
            time.sleep(2.5)

    engine, server, thread, port = stopping_server(tiny_model_dir, 1, before_step, end_early_s=0.5)
    answers: dict = {}

    def ask() -> None:
        data = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 50}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=data, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                answers["reply"] = (response.status, response.read().decode())
        except urllib.error.HTTPError as error:
            answers["reply"] = (error.code, error.read().decode())

    client = threading.Thread(target=ask)
    client.start()
    time.sleep(0.5)
    server.handle_exit(signal.SIGTERM, None)
    client.join(30)
    thread.join(30)
    engine.close()
    status, text = answers["reply"]
    assert status == 503 and json.loads(text)["error"]["message"] == STOPPING_ERROR, (status, text)


def test_a_host_of_several_addresses_is_checked_on_each(monkeypatch):
    """The name localhost is ::1 and 127.0.0.1 on most Linux machines, and the server listens on both; the check probed
    the first only, so a port another server held on the second passed, the model loaded, and uvicorn's bind failed
    after the "serving" line."""
    from click.testing import CliRunner

    from specchat.cli import main

    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        both = [
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
        ]
        monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: both)
        result = CliRunner().invoke(main, ["serve", "no-such-model", "--host", "localhost", "--port", str(port)])
    assert result.exit_code != 0 and f"cannot listen on localhost:{port} (127.0.0.1)" in result.stderr, result.output
    assert "serving" not in result.output and "Traceback" not in result.output


def test_the_url_the_server_names_is_one_a_client_can_use():
    """`--host ::1` was announced as http://::1:8000/v1, which no client parses as that host and port."""
    from urllib.parse import urlsplit

    from specchat.cli.serve import base_url

    for host in ("::1", "::", "127.0.0.1", "localhost"):
        url = urlsplit(base_url(host, 8000))
        assert (url.hostname, url.port, url.path) == (host.lower(), 8000, "/v1"), (host, url)


def test_a_request_for_the_default_drafter_loads_no_model_the_server_did_not(engine, tmp_path, monkeypatch):
    """A request's drafter "default" is the model's models.toml drafter, which a user's entry may name as another
    model or a file: a client of a server run with another --drafter made it load (or download) that model."""
    from specchat.registry import ModelSpec
    from tests.conftest import save_tiny_hf

    draft = f"draft-model:{save_tiny_hf(tmp_path, seed=1)}"
    monkeypatch.setattr(engine, "model_spec", ModelSpec(alias="tiny", source="dir", path="x", drafter=draft))
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "drafter": "default"}
    with serving(create_app(engine, "tiny", SpecParams(drafter="ngram", k=2))) as url:
        status, reply = post_raw(url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and reply["error"]["param"] == "drafter" and draft in reply["error"]["message"], reply
    assert draft not in engine.drafters.by_name
