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
PREFLIGHT = {
    "Origin": PAGE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",  # the openai JS client's
}


def ask(url: str, method: str, path: str, headers: dict, body: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers with lower-case names, body) of one request."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    data = None if body is None else json.dumps(body)
    connection.request(method, path, data, {"content-type": "application/json", **headers})
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
        assert status == 200 and "access-control-allow-origin" not in headers  # served; the browser hides it
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
        status, headers, _ = ask(url, "GET", "/v1/models", {"Origin": PAGE})
        assert status == 200 and "access-control-allow-origin" not in headers
