"""The bound on waiting requests (server/admission.py): a request past `max_queue` waiting gets an OpenAI error and a
503 with Retry-After at once, /metrics counts it, and every way a request ends gives its place back."""

from __future__ import annotations

import http.client
import json
import time

import pytest
from click.testing import CliRunner

from specchat.errors import ConfigError
from specchat.server.admission import RETRY_AFTER_S, Admission
from specchat.server.app import create_app
from specchat.server.protocol import ApiError
from tests.server.test_serve import MESSAGES, get, serving

SLOW_STEP_S = 0.02  # a step of the engine while a test fills its queue: answers of 200 tokens take ~4 s


def post(url: str, body: dict) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a POST to `url`."""
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/" + url.split("/", 3)[3], json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    answer = (response.status, dict(response.getheaders()), json.loads(response.read()))
    connection.close()
    return answer


def open_stream(url: str) -> http.client.HTTPConnection:
    """A chat stream of 200 tokens, read up to its first chunk (the request is admitted and in the engine)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "ignore_eos": True, "stream": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    return connection


def wait_until(condition, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_the_queue_admits_up_to_its_bound_and_counts_the_refused():
    admission = Admission(max_running=2, max_queue=1)
    for _ in range(3):
        admission.admit()
    assert (admission.in_flight, admission.waiting) == (3, 1)
    with pytest.raises(ApiError) as refused:
        admission.admit()
    error = refused.value
    assert error.status == 503 and error.headers == {"Retry-After": str(RETRY_AFTER_S)}
    assert error.body()["error"]["type"] == "server_error" and error.body()["error"]["code"] == "server_overloaded"
    assert (admission.in_flight, admission.rejected) == (3, 1)
    admission.release()
    admission.admit()  # a place given back is taken again
    unbounded = Admission(max_running=1, max_queue=0)
    for _ in range(1000):
        unbounded.admit()
    assert unbounded.waiting == 999 and unbounded.rejected == 0
    for bad in ({"max_running": 0}, {"max_running": 1, "max_queue": -1}):
        with pytest.raises(ConfigError):
            Admission(**bad)


def test_a_request_past_a_full_queue_is_refused_at_once_and_places_come_back(engine, monkeypatch):
    """The queue had no bound: under overload every request waited, however many came. Now one request runs, one
    waits, the third gets the 503 at once; when the first two end (their clients gone) new requests come in."""
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(SLOW_STEP_S) or step())
    admission = Admission(max_running=1, max_queue=1)
    app = create_app(engine, "tiny", admission=admission)
    with serving(app) as url:
        streams = [open_stream(url), open_stream(url)]
        assert admission.in_flight == 2
        start = time.monotonic()
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
        status, headers, answer = post(url + "/v1/chat/completions", body)
        assert time.monotonic() - start < 2, "the refused request waited"
        assert status == 503 and headers["retry-after"] == str(RETRY_AFTER_S), (status, headers)
        assert answer["error"]["code"] == "server_overloaded" and "overloaded" in answer["error"]["message"]
        assert 'specchat:requests_rejected_total{model="tiny"} 1' in get(url + "/metrics")
        for stream in streams:
            stream.close()  # the clients go away mid-answer
        wait_until(lambda: admission.in_flight == 0, "a stream whose client left kept its place")
        wait_until(lambda: not engine.scheduler.has_work(), "a stream whose client left kept running")
        status, _, answer = post(url + "/v1/chat/completions", body)
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        too_long = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 400}]}
        for _ in range(3):  # refused after their admission (the prompt past the context): places given back
            status, _, answer = post(url + "/v1/chat/completions", too_long)
            assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        status, _, answer = post(url + "/v1/completions", {"model": "tiny", "prompt": "Once", "max_tokens": 2})
        assert status == 200 and admission.in_flight == 0


def test_max_queue_is_checked_before_the_model_loads():
    from specchat.cli import main

    result = CliRunner().invoke(main, ["serve", "no-such-model", "--max-queue", "-1"])
    assert result.exit_code != 0 and "max-queue must be >= 0" in result.stderr, result.output
    assert "Traceback" not in result.output
