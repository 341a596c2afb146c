"""CORS: which web pages may call the server from a browser (`specchat serve --allowed-origins`).

A page on another origin (a chat UI at http://localhost:3000) that POSTs JSON makes the browser ask first with a
preflight (OPTIONS with Origin and Access-Control-Request-Method), then read the answer only where it carries
Access-Control-Allow-Origin. Starlette's CORSMiddleware does both; this module says which origins, and what they
may send. None by default: a local server is not readable from every page the user's browser opens (vLLM allows "*"
unless told otherwise).

CORS only hides answers: a "simple request" (a POST of text/plain or a form, no preflight) is sent and served all
the same, so any page could make the server generate on the user's CPU or GPU. `OriginCheck` refuses, with a 403
(as Ollama does), every request whose Origin header is neither allowed nor the server's own; a request without one
(curl, the openai client, every client that is not a browser) is left alone.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from specchat.errors import ConfigError
from specchat.server.protocol import ApiError

ANY_ORIGIN = "*"
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s?#]+")  # scheme://host[:port], as a browser's Origin header spells it
METHODS = ("GET", "HEAD", "POST")  # the server's routes' (a preflight names the method it will send)
DEFAULT_PORTS = {"http": 80, "https": 443}  # a browser's Origin leaves these out
EXPOSED = ("Retry-After",)  # headers a page's script may read beyond the safelisted ones (an overloaded 503's)
LOOPBACK_NAME = "localhost"  # a name browsers resolve to the loopback address themselves, never through DNS


def parse_origins(text: str) -> list[str]:
    """`--allowed-origins` ("http://localhost:3000,https://app.example", or "*") -> the origins, spelled as a
    browser's Origin header spells them (scheme and host in lower case, no default port: "http://LocalHost:3000" or
    "https://app.example:443" matched no request, silently); ConfigError for one that a browser never sends (a path
    or a trailing slash would match no request either)."""
    return [_origin(origin.strip()) for origin in text.split(",") if origin.strip()]


def _origin(origin: str) -> str:
    if origin == ANY_ORIGIN:
        return origin
    scheme, sep, rest = origin.partition("://")
    candidate = scheme.lower() + sep + rest
    try:
        parts = urlsplit(candidate) if ORIGIN.fullmatch(candidate) else None
        port = parts.port if parts is not None else None  # (a ValueError where it is not a port)
        host = parts.hostname if parts is not None and parts.username is None else None
    except ValueError:
        host = None
    if not host:
        raise ConfigError(
            f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port], no path or trailing slash,"
            " e.g. http://localhost:3000), nor '*'"
        )
    if "*" in host:  # a pattern would be taken as a host of its own and match no request
        raise ConfigError(
            f"--allowed-origins: {origin!r} has a wildcard in its host; list each origin as the browser sends it"
            " (a browser extension's: chrome-extension://<its id>), or give '*' alone"
        )
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}" + ("" if port in (None, DEFAULT_PORTS.get(parts.scheme)) else f":{port}")


def add_cors(app: Starlette, origins: Sequence[str]) -> None:
    """Answer preflights, and mark responses (streams and errors too) readable by pages of `origins`.

    Any request header is allowed (the openai JavaScript client sends Authorization and its own x-stainless-*
    headers); no credentials (cookies): the server has no sessions. A page on a public site calling this server on the
    user's machine or network makes Chrome's preflight ask for the private network too
    (Access-Control-Request-Private-Network): an allowed origin gets it (it was a 400, "Disallowed CORS
    private-network", and the page could not call the server it was allowed to)."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=origins,
        allow_methods=METHODS,
        allow_headers=["*"],
        expose_headers=EXPOSED,
        allow_private_network=True,
    )


def _spelled(origin: str) -> str | None:
    """An Origin header's value as parse_origins spells an origin, or None where it is none (a sandboxed frame's or a
    file's "null")."""
    try:
        return _origin(origin)
    except ConfigError:
        return None


def own_origin(scope: Scope) -> str | None:
    """The origin the request was addressed to (its scheme and Host header), where a page of it can only be on this
    server: a host that is an address or "localhost". Not another name: DNS rebinding makes an attacker's name
    (evil.example) resolve to 127.0.0.1, and its page is then same-origin with the server in the browser's eyes, Origin
    and Host both http://evil.example:8000."""
    host = Headers(scope=scope).get("host")
    spelled = _spelled(f"{scope.get('scheme', 'http')}://{host}") if host else None
    hostname = urlsplit(spelled).hostname if spelled else None
    if hostname is None:
        return None
    if hostname != LOOPBACK_NAME:
        try:
            ipaddress.ip_address(hostname)
        except ValueError:
            return None
    return spelled


def refusal(origin: str) -> ApiError:
    spelled = _spelled(origin)
    how = (
        f"start the server with --allowed-origins {spelled} to let its pages call it"
        if spelled
        else "a page with no origin of its own (a sandboxed frame, a file) is let in only by --allowed-origins '*'"
    )
    return ApiError(
        403,
        f"the origin {origin!r} may not call this server (a web page's request, refused so that no page the browser"
        f" opens can make it generate); {how}",
        code="origin_not_allowed",
    )


class OriginCheck:
    """ASGI middleware: a request whose Origin header is neither one of `origins` nor the server's own (own_origin) is
    a 403, before its body is read or any route runs; requests without an Origin, and preflights (OPTIONS: answered by
    CORSMiddleware, or a 405 where no origin is allowed), pass. Inside CORSMiddleware, which marks an allowed origin's
    responses; the 403 of another origin carries no CORS header, so its page cannot read it either. Not installed
    with "*"."""

    def __init__(self, app: ASGIApp, origins: Iterable[str]) -> None:
        self.app = app
        self.origins = frozenset(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            origin = Headers(scope=scope).get("origin")
            if origin is not None and not self.allows(origin, scope):
                refused = refusal(origin)
                await JSONResponse(refused.body(), status_code=refused.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def allows(self, origin: str, scope: Scope) -> bool:
        spelled = _spelled(origin)
        return spelled is not None and (spelled in self.origins or spelled == own_origin(scope))


def guard_origins(app: Starlette, origins: Sequence[str]) -> None:
    """Refuse the requests of pages on other origins than `origins` (all of them where there is none) or the
    server's own: see OriginCheck. Add it before add_cors, so that CORSMiddleware runs outside it."""
    if ANY_ORIGIN not in origins:
        app.add_middleware(OriginCheck, origins=origins)
