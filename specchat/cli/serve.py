"""`specchat serve`: one engine behind an OpenAI-compatible endpoint (docs/serve.md)."""

from __future__ import annotations

import contextlib
import socket

import click

from specchat.cli.options import (
    StderrProgress,
    engine_config,
    model_options,
    spec_options,
    spec_params,
    tp_option,
)
from specchat.errors import ConfigError
from specchat.server import DEFAULT_MAX_QUEUE, STREAM_INTERVAL_S

PORT_RANGE = (1, 65535)


GRACEFUL_S = 10  # seconds in-flight answers get to finish when the server is stopped


@click.command("serve")
@model_options
@tp_option
@spec_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-running", type=int, default=64, show_default=True, help="requests decoded together")
@click.option(
    "--stream-interval-ms",
    type=float,
    default=STREAM_INTERVAL_S * 1000,
    show_default=True,
    help="a stream sends text at most this often (0: at every engine step); fewer chunks cost the server less",
)
@click.option(
    "--max-queue",
    type=int,
    default=DEFAULT_MAX_QUEUE,
    show_default=True,
    help="requests that may wait past --max-running; more are refused at once with a 503 (0: no bound)",
)
@click.option(
    "--allowed-origins",
    default="",
    help="comma-separated origins whose web pages may call the server (CORS), e.g. http://localhost:3000, or '*';"
    " other pages' requests are refused with a 403 [default: none]",
)
def serve(
    model,
    device,
    dtype,
    drafter,
    k,
    host,
    port,
    max_running,
    stream_interval_ms,
    max_queue,
    allowed_origins,
    **model_extra,
) -> None:
    """Serve MODEL (default: smollm2-135m) at http://HOST:PORT/v1 (chat/completions, completions, models)."""
    import uvicorn

    from specchat.engine.engine import Engine
    from specchat.server.admission import Admission
    from specchat.server.app import create_app
    from specchat.server.cors import parse_origins
    from specchat.server.stopping import StoppingServer

    if not PORT_RANGE[0] <= port <= PORT_RANGE[1]:
        raise ConfigError(f"--port must be in [{PORT_RANGE[0]}, {PORT_RANGE[1]}], got {port}")
    if not 0 <= stream_interval_ms < float("inf"):  # NaN too: it compared false and held every stream's text
        raise ConfigError(f"--stream-interval-ms must be a number >= 0, got {stream_interval_ms}")
    admission = Admission(max_running, max_queue)
    origins = parse_origins(allowed_origins)
    check_address(host, port)  # before the load: a port in use or a bad host is one line, at once
    spec = spec_params(drafter, k)
    config = engine_config(model, device, dtype, max_running=max_running, **model_extra)
    engine = Engine.load(config, progress=StderrProgress())
    engine.drafter(spec.drafter)  # a drafter that cannot load fails now, not at the first request
    # graphs up to the batch the server admits, with the default drafter's taps
    engine.warm_up(StderrProgress(), sessions=config.max_running, drafters=[spec.drafter])
    name = engine.model_spec.alias if engine.model_spec else config.model
    engine.start()
    app = create_app(
        engine, name, spec, stream_interval_s=stream_interval_ms / 1000, admission=admission, allowed_origins=origins
    )
    click.echo(f"specchat: serving {name} at {base_url(host, port)} (Ctrl-C stops)", err=True)
    try:
        # on SIGTERM / Ctrl-C, answers in flight get GRACEFUL_S to finish, then are cancelled (a client waiting for
        # 100,000 tokens would hold up a `docker stop` or systemd's stop for good)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACEFUL_S)
        StoppingServer(config, engine).run()
    finally:
        engine.close()


def base_url(host: str, port: int) -> str:
    """The URL clients are told to use: an IPv6 address in brackets ("http://::1:8000/v1" is no URL: the openai
    client and curl refuse it)."""
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def check_address(host: str, port: int) -> None:
    """ConfigError unless a server could listen on host:port now: on every address the host names, bound at once as
    the event loop's create_server binds them (SO_REUSEADDR, so a port in TIME_WAIT passes; IPv6 sockets v6-only).
    uvicorn's own failure there came after the "serving" line, as a log record; probing only the first address missed
    a name with several ("localhost": ::1 and 127.0.0.1, another server holding the port on the second)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r}: {exc.strerror}") from None
    with contextlib.ExitStack() as probes:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # (each address once, in order)
            try:
                probe = probes.enter_context(socket.socket(family, kind, proto))
            except OSError:  # a family this machine lacks (IPv6 off): create_server skips it too
                continue
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                where = f"{host}:{port}" if len(infos) == 1 else f"{host}:{port} ({address[0]})"
                raise ConfigError(f"cannot listen on {where}: {exc.strerror or exc}") from None


def register(group: click.Group) -> None:
    group.add_command(serve)
