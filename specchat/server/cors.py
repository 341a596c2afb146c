"""CORS: which web pages may call the server from a browser (`specchat serve --allowed-origins`).

A page on another origin (a chat UI at http://localhost:3000) that POSTs JSON makes the browser ask first with a
preflight (OPTIONS with Origin and Access-Control-Request-Method), then read the answer only where it carries
Access-Control-Allow-Origin. Starlette's CORSMiddleware does both; this module says which origins, and what they
may send. None by default: a local server is not readable from every page the user's browser opens (vLLM allows "*"
unless told otherwise).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

from specchat.errors import ConfigError

ANY_ORIGIN = "*"
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s?#]+")  # scheme://host[:port], as a browser's Origin header spells it
METHODS = ("GET", "HEAD", "POST")  # the server's routes' (a preflight names the method it will send)
DEFAULT_PORTS = {"http": 80, "https": 443}  # a browser's Origin leaves these out
EXPOSED = ("Retry-After",)  # headers a page's script may read beyond the safelisted ones (an overloaded 503's)


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
