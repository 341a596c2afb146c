"""CORS (server/cors.py): a browser's preflight from an allowed origin is answered, and every response to it (streams
and errors too) carries Access-Control-Allow-Origin; other origins, and a server not told any, get none."""

from __future__ import annotations

import http.client
import json

import pytest
from click.testing import CliRunner

from specchat.errors import ConfigError
from specchat.server.app import create_app
from specchat.server.cors import parse_origins
from tests.server.test_serve import MESSAGES, serving

PAGE = "http://localhost:3000"
JSON = "application/json"
PREFLIGHT = {
    "Origin": PAGE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",  # the openai JS client's
}


def ask(
    url: str, method: str, path: str, headers: dict, body: dict | None = None, content_type: str | None = JSON
) -> tuple[int, dict, bytes]:
    """(status, headers with lower-case names, body) of one request; `headers` with lower-case names (a "host"
    replaces the one http.client sends); `content_type` None: none sent."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    data = None if body is None else json.dumps(body)
    connection.request(method, path, data, ({"content-type": content_type} if content_type else {}) | headers)
    response = connection.getresponse()
    answer = (response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    connection.close()
    return answer


def test_origins_are_parsed_and_a_wrong_one_is_refused():
    assert parse_origins(f" {PAGE}, https://chat.example ,") == [PAGE, "https://chat.example"]
    assert parse_origins("*") == ["*"] and parse_origins("") == []
    for wrong in ("http://localhost:3000/", "localhost:3000", "https://chat.example/app"):
        with pytest.raises(ConfigError, match="is not an origin"):
            parse_origins(wrong)
    from specchat.cli import main

    result = CliRunner().invoke(main, ["serve", "no-such-model", "--allowed-origins", "http://localhost:3000/"])
    assert result.exit_code != 0 and "--allowed-origins" in result.stderr and "Traceback" not in result.output


def test_an_origin_is_spelled_as_the_browser_sends_it(engine):
    """A browser's Origin has its scheme and host in lower case and no default port: "http://LocalHost:3000" or
    "https://chat.example:443" were taken as given and matched no request, so their pages were refused, silently."""
    given = "HTTP://LocalHost:3000, https://Chat.Example:443, http://[::1]:8080, http://h:80"
    assert parse_origins(given) == [PAGE, "https://chat.example", "http://[::1]:8080", "http://h"]
    for wrong in ("http://user@localhost:3000", "http://localhost:99999", "http://"):
        with pytest.raises(ConfigError, match="is not an origin"):
            parse_origins(wrong)
    # a pattern was taken as a host of its own and matched no request; an extension's or a webview's origin is kept
    for pattern in ("chrome-extension://*", "http://*.example.com"):
        with pytest.raises(ConfigError, match="wildcard in its host"):
            parse_origins(pattern)
    assert parse_origins("chrome-extension://abcdef, tauri://localhost") == [
        "chrome-extension://abcdef",
        "tauri://localhost",
    ]
    with serving(create_app(engine, "tiny", allowed_origins=parse_origins("http://LocalHost:3000"))) as url:
        status, headers, _ = ask(url, "OPTIONS", "/v1/chat/completions", PREFLIGHT)
    assert status == 200 and headers["access-control-allow-origin"] == PAGE, (status, headers)


def test_an_allowed_origin_gets_its_preflight_answered_and_every_response_marked(engine):
    """A browser page's preflight was a 405: the page could not call the server at all."""
    with serving(create_app(engine, "tiny", allowed_origins=[PAGE, "https://chat.example"])) as url:
        status, headers, _ = ask(url, "OPTIONS", "/v1/chat/completions", PREFLIGHT)
        assert status == 200 and headers["access-control-allow-origin"] == PAGE, (status, headers)
        assert "POST" in headers["access-control-allow-methods"]
        assert "x-stainless-os" in headers["access-control-allow-headers"].lower()
        origin = {"Origin": PAGE}
        chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
        status, headers, body = ask(url, "POST", "/v1/chat/completions", origin, {**chat, "stream": True})
        assert status == 200 and headers["access-control-allow-origin"] == PAGE
        assert body.rstrip().endswith(b"data: [DONE]")
        status, headers, body = ask(url, "POST", "/v1/chat/completions", origin, {**chat, "model": "gpt-9"})
        assert status == 404 and headers["access-control-allow-origin"] == PAGE  # the page reads its error
        assert "retry-after" in headers["access-control-expose-headers"].lower()
        status, headers, _ = ask(url, "GET", "/v1/models", origin)
        assert status == 200 and headers["access-control-allow-origin"] == PAGE
        status, headers, _ = ask(
            url, "OPTIONS", "/v1/chat/completions", {**PREFLIGHT, "Origin": "https://evil.example"}
        )
        assert status == 400 and "access-control-allow-origin" not in headers
        status, headers, _ = ask(url, "GET", "/v1/models", {"Origin": "https://evil.example"})
        assert status == 403 and "access-control-allow-origin" not in headers  # refused (it was served, hidden)
    with serving(create_app(engine, "tiny", allowed_origins=["*"])) as url:
        status, headers, _ = ask(url, "OPTIONS", "/v1/completions", {**PREFLIGHT, "Origin": "https://any.example"})
        assert status == 200 and headers["access-control-allow-origin"] == "*"


def test_a_public_page_may_call_the_server_on_a_private_network(engine):
    """Chrome's preflight from a public site to a server on the user's machine asks for the private network too: an
    allowed origin's was a 400 ("Disallowed CORS private-network"), so its page could not call the server."""
    private = {**PREFLIGHT, "Origin": "https://chat.example", "Access-Control-Request-Private-Network": "true"}
    with serving(create_app(engine, "tiny", allowed_origins=["https://chat.example"])) as url:
        status, headers, body = ask(url, "OPTIONS", "/v1/chat/completions", private)
        assert status == 200 and headers["access-control-allow-origin"] == "https://chat.example", (status, body)
        assert headers["access-control-allow-private-network"] == "true"
        status, headers, _ = ask(url, "OPTIONS", "/v1/chat/completions", {**private, "Origin": "https://evil.example"})
        assert status == 400 and "access-control-allow-origin" not in headers


def test_without_allowed_origins_no_page_may_call_the_server(engine):
    with serving(create_app(engine, "tiny")) as url:
        status, headers, _ = ask(url, "OPTIONS", "/v1/chat/completions", PREFLIGHT)
        assert status == 405 and "access-control-allow-origin" not in headers
        status, headers, body = ask(url, "GET", "/v1/models", {"origin": PAGE})
        assert status == 403 and "access-control-allow-origin" not in headers, (status, body)


@pytest.fixture
def submitted(engine, monkeypatch) -> list:
    """The requests the engine is given from here on (each one generation run)."""
    calls = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda *args, **kwargs: calls.append(args) or submit(*args, **kwargs))
    return calls


def refused_origin(status: int, body: bytes, origin: str) -> bool:
    message = json.loads(body).get("error", {}).get("message", "")
    how = "--allowed-origins '*'" if origin == "null" else f"--allowed-origins {origin}"
    code = json.loads(body).get("error", {}).get("code")
    return status == 403 and code == "origin_not_allowed" and repr(origin) in message and how in message


@pytest.mark.parametrize("allowed", [(), (PAGE,)])
def test_a_page_of_another_origin_makes_the_server_generate_nothing(engine, submitted, allowed):
    """Any page the user's browser opened could make the server generate (their CPU or GPU): a POST with
    Content-Type text/plain is a "simple request", sent without a preflight, and the server took any body type; the
    page could not read the answer, but the work ran. Now an Origin the server does not allow is a 403 (as Ollama's),
    before the body is read; its preflight is refused as before."""
    evil = "https://evil.example"
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    with serving(create_app(engine, "tiny", allowed_origins=list(allowed))) as url:
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/chat/completions/"):
            for content_type in ("text/plain", JSON, "application/x-www-form-urlencoded"):
                body = chat if "chat" in path else {"model": "tiny", "prompt": "sea", "max_tokens": 4}
                status, headers, answer = ask(url, "POST", path, {"origin": evil}, body, content_type)
                assert refused_origin(status, answer, evil), (path, content_type, status, answer)
                assert "access-control-allow-origin" not in headers
        for origin in ("null", "http://localhost:3001", "http://127.0.0.1:3000"):  # a sandboxed page, other ports
            status, _, answer = ask(url, "POST", "/v1/chat/completions", {"origin": origin}, chat, "text/plain")
            assert refused_origin(status, answer, origin), (origin, status, answer)
        status, _, answer = ask(url, "GET", "/metrics", {"origin": evil})
        assert refused_origin(status, answer, evil)
        status, headers, _ = ask(url, "OPTIONS", "/v1/chat/completions", {**PREFLIGHT, "Origin": evil})
        assert status == (400 if allowed else 405) and "access-control-allow-origin" not in headers
    assert submitted == []


def test_an_allowed_origin_the_servers_own_and_no_origin_still_generate(engine, submitted):
    """The check leaves alone every client that sends no Origin (curl, the openai client, httpx), the pages of the
    --allowed-origins (spelled otherwise too) and a page on the server's own origin, where its host cannot be another
    name for it (DNS rebinding: a page of evil.example whose name was made to resolve to 127.0.0.1 is same-origin
    with it in the browser's eyes)."""
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    with serving(create_app(engine, "tiny", allowed_origins=parse_origins("HTTP://LocalHost:3000"))) as url:
        port = url.rsplit(":", 1)[1]
        status, headers, _ = ask(url, "POST", "/v1/chat/completions", {"origin": PAGE}, chat)
        assert status == 200 and headers["access-control-allow-origin"] == PAGE
        status, headers, _ = ask(url, "POST", "/v1/chat/completions", {}, chat)
        assert status == 200 and "access-control-allow-origin" not in headers
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LocalHost:{port}"):
            own = {"origin": f"http://{host.lower()}", "host": host}
            status, _, answer = ask(url, "POST", "/v1/chat/completions", own, chat)
            assert status == 200, (host, status, answer)
        status, _, _ = ask(url, "GET", "/v1/models", {"origin": f"http://127.0.0.1:{port}"})
        assert status == 200
        rebound = {"origin": f"http://evil.example:{port}", "host": f"evil.example:{port}"}
        status, _, answer = ask(url, "POST", "/v1/chat/completions", rebound, chat)
        assert refused_origin(status, answer, f"http://evil.example:{port}"), (status, answer)
        other_port = {"origin": "http://127.0.0.1:1", "host": f"127.0.0.1:{port}"}
        status, _, answer = ask(url, "POST", "/v1/chat/completions", other_port, chat)
        assert status == 403, (status, answer)
    assert len(submitted) == 5
    with serving(create_app(engine, "tiny", allowed_origins=["*"])) as url:
        status, headers, _ = ask(url, "POST", "/v1/completions", {"origin": "https://any.example"}, {"prompt": "a"})
        assert status == 200 and headers["access-control-allow-origin"] == "*"


def test_a_body_that_is_not_json_is_a_415_and_generates_nothing(engine, submitted):
    """text/plain and the form types are the bodies a page may POST without a preflight; the server took any type, so
    a browser that sent no Origin could still make it generate. Every client the tests and docs use sends
    application/json; none, as a raw client may send, is still taken as JSON (as FastAPI and vLLM take it)."""
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    with serving(create_app(engine, "tiny")) as url:
        for kind in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "text/json"):
            status, _, answer = ask(url, "POST", "/v1/chat/completions", {}, chat, kind)
            error = json.loads(answer)["error"]
            assert status == 415 and error["code"] == "unsupported_media_type", (kind, status, answer)
            assert "application/json" in error["message"] and repr(kind) in error["message"]
        assert submitted == []
        for kind in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json", None):
            status, _, answer = ask(url, "POST", "/v1/chat/completions", {}, chat, kind)
            assert status == 200, (kind, status, answer)
    assert len(submitted) == 4
