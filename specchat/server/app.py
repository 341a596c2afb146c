"""The HTTP app: OpenAI-compatible routes over one engine whose step loop runs on its own thread.

Every request is submitted `listen_only`: its events reach the server through one engine listener
(`EventRouter`), which hands each step's events to the asyncio queue of the request they belong to. A request is
submitted and its queue registered between two steps (`Engine.apply`), so no event can come before its queue.
A streaming client that goes away cancels its request in the engine, which frees its KV pages. Requests past the
engine's batch wait in a bounded queue (admission.py); pages of other origins may call the server where it allows
them (cors.py).

A stream sends text at most once every `stream_interval_s`: text the engine emits sooner is held and goes out
with the first step after the interval (or with the end), so it waits at most one engine step past it, and no
timer is needed. Every chunk is a socket write, the server's largest cost per chunk (~2/3 of the event loop's time
at 32 streams), paid on the interpreter the engine's step loop also needs; the first text goes out at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import suppress
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from specchat.config import SpecParams
from specchat.engine.api import Request as EngineRequest
from specchat.engine.api import ServedEngine, default_drafter_name
from specchat.engine.sequence import LOOP_FAILED, STEP_FAILED, Event, Finished, TextDelta
from specchat.errors import ConfigError, ContextLengthError, SpecchatError
from specchat.server import STREAM_INTERVAL_S, metrics
from specchat.server.admission import Admission
from specchat.server.cors import add_cors, guard_origins
from specchat.server.protocol import ApiError, GenerationRequest, parse_request, with_tools
from specchat.server.responses import StreamChunks, completion, finish_reason, new_id, refused, sse, tool_calls
from specchat.server.stopping import STOPPING_ERROR

MAX_BODY_BYTES = 16 << 20  # a request body larger than this is refused unread (a 128k-token context is ~0.5 MB)
READ_METHODS = ["GET", "HEAD"]  # HEAD too: uptime monitors and load balancers ask it (a 405 read as the server down)
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client still waits
NESTS_TOO_DEEP = (
    "the request nests deeper than this server writes into a prompt (tools' parameters, tool calls' arguments)"
)


ENGINE_FAILED = (STEP_FAILED, LOOP_FAILED)  # how the errors of requests the engine failed begin


def refusal(fin: Finished) -> ApiError:
    """The error of a request that failed before writing anything. Only a request the server could never hold (more
    KV cache than it has) is the client's 400: a step the engine failed is the server's 500, and a request ended by
    the server's stop a 503; as 400s the openai client took them for the request's fault and did not retry."""
    error = fin.error or "the request failed"
    if error == STOPPING_ERROR:
        return ApiError(503, error)
    return ApiError(500 if error.startswith(ENGINE_FAILED) else 400, error)


class ClientGone(Exception):
    """A non-streaming request's client hung up: its answer is cancelled, nobody is sent a response."""


async def read_body(request: Request) -> bytes:
    """The request's body, refused past MAX_BODY_BYTES as it arrives (a chunked upload declares no length: 20 MB
    was read and tokenized whole before its refusal); ClientGone where the client hangs up mid-body."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES:,} bytes, the most this server takes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


class BodyReaders:
    """The handlers still receiving their request's body. A client that stalls mid-upload held a stopping server for
    uvicorn's whole grace (10 s), then got a plain-text 500, and stderr a CancelledError traceback; `stop()` (from
    any thread, when the stopping server ends its answers: stopping.py) ends those reads with a 503 instead."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False

    async def read(self, request: Request) -> bytes:
        if self.stopping:
            raise ApiError(503, STOPPING_ERROR)
        task = asyncio.current_task()
        self.loop = asyncio.get_running_loop()
        self.tasks.add(task)
        try:
            return await read_body(request)
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            task.uncancel()
            raise ApiError(503, STOPPING_ERROR) from None
        finally:
            self.tasks.discard(task)

    def stop(self) -> None:
        self.stopping = True
        loop = self.loop
        if loop is None or loop.is_closed():  # (the stop's timer can fire after the server's loop has ended)
            return
        with suppress(RuntimeError):  # closed since the check: no read is left to end
            loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:  # on the event loop
        for task in list(self.tasks):
            task.cancel()


def parse_json(raw: bytes) -> object:
    """The body as JSON, or a 400: not JSON, not UTF-8, nested deeper than the parser recurses (a RecursionError),
    or a number past Python's 4,300-digit limit (a ValueError) were 500s with a traceback."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise ApiError(
            400, "the request body is not valid JSON (or nests or counts past what this server parses)"
        ) from None


def json_body_type(content_type: str | None) -> None:
    """A 415 where a body is declared something other than JSON (application/json, or application/...+json, as
    FastAPI reads a JSON body): text/plain and the form types are what a web page may POST without a preflight, so
    any page could make the server generate (cors.OriginCheck refuses those of other origins; this, where a browser
    sent no Origin). No Content-Type at all is taken as JSON, as FastAPI and vLLM take it."""
    if content_type is None:
        return
    kind = content_type.partition(";")[0].strip().lower()
    main, _, sub = kind.partition("/")
    if main != "application" or not (sub == "json" or sub.endswith("+json")):
        raise ApiError(
            415,
            f"the request body must be JSON, sent with Content-Type: application/json (got {content_type!r})",
            code="unsupported_media_type",
        )


class TrailingSlashes:
    """ASGI middleware: a path's trailing slash names the same route (/v1/chat/completions/ is /v1/chat/completions).
    Starlette answered it with a 307 and an empty body, which a client that follows no redirect (curl without -L,
    urllib) took for the answer, and /v1/models/ as the card of a model named ""."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
        await self.app(scope, receive, send)


class StreamedAnswer(StreamingResponse):
    """A stream that lets its request go however the response ends (`let_go`): the generator's own `finally` never
    runs where the client left before the first chunk (Starlette's disconnect listener can cancel the response
    before it starts the generator), and the request would have decoded on, holding its KV pages and its place in the
    server's count."""

    def __init__(self, chunks: AsyncIterator[bytes], let_go: Callable[[], None]) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self.let_go = let_go

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.let_go()


class EventRouter:
    """Engine listener: each step's events, per request, onto that request's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queues: dict[int, asyncio.Queue[list[Event]]] = {}

    def __call__(self, events: list[Event]) -> None:  # on the engine's thread
        by_request: dict[int, list[Event]] = {}
        for event in events:
            if event.request_id in self.queues:
                by_request.setdefault(event.request_id, []).append(event)
        if by_request:  # one wake-up of the event loop per step, not one per request (the step loop pays for it)
            self.loop.call_soon_threadsafe(self._deliver, by_request)

    def _deliver(self, by_request: dict[int, list[Event]]) -> None:  # on the event loop
        for request_id, batch in by_request.items():
            if (queue := self.queues.get(request_id)) is not None:
                queue.put_nowait(batch)


def create_app(
    engine: ServedEngine,
    model: str,
    default_spec: SpecParams | None = None,
    stream_interval_s: float = STREAM_INTERVAL_S,
    admission: Admission | None = None,
    allowed_origins: Sequence[str] = (),
) -> FastAPI:
    """The app for `engine`, answering as model `model`; the engine's step loop must be running. `admission` bounds
    the requests waiting (None: no bound); `allowed_origins` may call it from a browser (none: no CORS headers)."""
    if not 0 <= stream_interval_s < float("inf"):
        raise ConfigError(f"the stream interval must be a number >= 0, got {stream_interval_s}")
    app = FastAPI(title="specchat", docs_url=None, redoc_url=None, redirect_slashes=False)
    app.add_middleware(TrailingSlashes)
    guard_origins(app, allowed_origins)  # another origin's page is a 403: it could not read, but it made us generate
    if allowed_origins:
        add_cors(app, allowed_origins)  # outermost: preflights of any path, and every response's headers
    admission = admission or Admission(max_running=1, max_queue=0)  # (max_queue 0: no bound)
    spec = default_spec or SpecParams(drafter="none", k=0)
    # what a request's drafter "default" names (a models.toml entry may name a file or another model)
    model_drafter = default_drafter_name(engine)
    state: dict[str, EventRouter] = {}
    app.state.body_readers = readers = BodyReaders()  # the stopping server ends their reads (stopping.py)

    def router() -> EventRouter:
        if "router" not in state:  # made on the server's loop, at the first request
            state["router"] = EventRouter(asyncio.get_running_loop())
            engine.listeners.append(state["router"])
        return state["router"]

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": no one reads it

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """An unknown route or a wrong method: OpenAI's error body too, not FastAPI's {"detail": ...}."""
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(ApiError(exc.status_code, message).body(), status_code=exc.status_code, headers=exc.headers)

    @app.api_route("/health", methods=READ_METHODS)
    async def health() -> dict:
        return {"status": "ok", "model": model}

    card = {"id": model, "object": "model", "created": 0, "owned_by": "specchat"}

    def unknown_model(name) -> ApiError:
        return ApiError(
            404, f"the model {name!r} does not exist; this server runs {model!r}", "model", "model_not_found"
        )

    @app.api_route("/v1/models", methods=READ_METHODS)
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.api_route("/v1/models/{name:path}", methods=READ_METHODS)
    async def model_card(name: str) -> dict:  # the openai client's models.retrieve
        if name != model:
            raise unknown_model(name)
        return card

    @app.api_route("/metrics", methods=READ_METHODS)
    async def prometheus() -> PlainTextResponse:
        snap = await asyncio.to_thread(engine.snapshot)
        page = metrics.render(snap, model, rejected=admission.rejected)
        return PlainTextResponse(page, media_type="text/plain; version=0.0.4")

    async def generate(request: Request, chat: bool):
        json_body_type(request.headers.get("content-type"))
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:  # else read and tokenized whole before it is refused
            raise ApiError(
                413, f"the request body is {int(length):,} bytes; this server takes up to {MAX_BODY_BYTES:,}"
            )
        body = parse_json(await readers.read(request))
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if body.get("model") not in (None, model):
            raise unknown_model(body.get("model"))
        req = parse_request(body, chat, spec, model_drafter)
        admission.admit()  # a 503 at once where the queue is full
        try:
            queue, handle = await submit(req)
        except BaseException as exc:  # refused (a 400), or cancelled
            admission.release()
            if not isinstance(exc, asyncio.CancelledError) or not readers.stopping:
                raise
            asyncio.current_task().uncancel()  # uvicorn's deadline, the engine still in a step (below)
            raise ApiError(503, STOPPING_ERROR) from None
        rid = new_id(chat)
        if req.stream:
            return StreamedAnswer(stream(req, rid, queue), partial(let_go, handle))
        try:
            fin = await finished_while_connected(request, queue)
        except (asyncio.CancelledError, ClientGone) as exc:
            handle.cancel()
            if isinstance(exc, asyncio.CancelledError) and readers.stopping:
                # uvicorn's deadline came while the engine was still in one step (a long prompt's prefill on the
                # CPU): the end of the answers could not come in time; a 503, not a plain-text 500 and a traceback
                asyncio.current_task().uncancel()
                raise ApiError(503, STOPPING_ERROR) from None
            raise
        finally:
            router().queues.pop(handle.request_id, None)
            admission.release()
        if refused(fin):
            raise refusal(fin)
        return completion(req, rid, model, fin)

    async def submit(req: GenerationRequest):
        """Encode, then submit and register the request's queue between two engine steps."""
        try:
            messages, tools = (
                with_tools(req.prompt, req.tools, engine.tokenizer.chat_template_source or "")
                if req.chat
                else (req.prompt, None)
            )
            ids = await asyncio.to_thread(engine.encode_prompt, messages, raw=not req.chat, tools=tools)
        except SpecchatError as exc:
            code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
            raise ApiError(400, str(exc), "messages" if req.chat else "prompt", code) from None
        except RecursionError:  # tools' parameters or a call's arguments parsed, but too deep to write into the prompt
            raise ApiError(400, NESTS_TOO_DEEP) from None
        room = engine.max_position - len(ids)
        req.sampling.max_tokens = min(req.max_tokens or room, room)
        queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        events = router()
        placed = {}

        def place() -> None:
            handle = engine.submit(ids, req.sampling, req.spec, listen_only=True)
            events.queues[handle.request_id] = queue
            placed["handle"] = handle

        try:
            # shielded: a cancelled wait cancelled the engine's Future, whose set_result then raised on the engine's
            # thread, and its loop's catch-all failed every live request ("the engine failed: InvalidStateError")
            await asyncio.shield(asyncio.wrap_future(engine.apply(place)))
        except SpecchatError as exc:  # an unknown drafter, a bad k
            raise ApiError(400, str(exc), "drafter") from None
        return queue, placed["handle"]

    async def finished(queue: asyncio.Queue[list[Event]]) -> Finished:
        while True:
            for event in await queue.get():
                if isinstance(event, Finished):
                    return event

    async def finished_while_connected(request: Request, queue: asyncio.Queue[list[Event]]) -> Finished:
        """The answer of a non-streaming request, or ClientGone once its client has hung up (nothing else would
        notice: a long answer nobody waits for would decode to its end, and hold up the server's shutdown)."""
        answer = asyncio.ensure_future(finished(queue))
        try:
            while True:
                done, _ = await asyncio.wait({answer}, timeout=DISCONNECT_POLL_S)
                if done:
                    return answer.result()
                if await request.is_disconnected():
                    raise ClientGone
        finally:
            answer.cancel()

    def let_go(handle: EngineRequest) -> None:
        """A stream's response has ended: its request leaves the count, and is cancelled where it has not finished
        (its queue still registered: the client went away), which frees its KV pages."""
        if router().queues.pop(handle.request_id, None) is not None:
            handle.cancel()
        admission.release()

    async def stream(req: GenerationRequest, rid: str, queue) -> AsyncIterator[bytes]:
        chunks = StreamChunks(req, rid, model)
        loop = asyncio.get_running_loop()
        held, next_text = "", 0.0  # text not sent yet; the loop time before which only the end may send it
        if req.chat:
            yield chunks.other({"role": "assistant", "content": ""})
        while True:
            events = await queue.get()
            while not queue.empty():  # behind the engine: send what piled up as one chunk, not one per token
                events += queue.get_nowait()
            if not req.tools:
                held += "".join(e.text for e in events if isinstance(e, TextDelta))
            last = any(isinstance(e, Finished) for e in events)
            if held and (last or loop.time() >= next_text):
                yield chunks.text(held)
                held, next_text = "", loop.time() + stream_interval_s
            for event in events:
                if isinstance(event, Finished):
                    router().queues.pop(event.request_id, None)  # finished: nothing for let_go to cancel
                    async for line in stream_end(req, chunks, event):
                        yield line
                    return

    async def stream_end(req: GenerationRequest, chunks: StreamChunks, fin: Finished) -> AsyncIterator[bytes]:
        if refused(fin):  # nothing written: the error ends the stream
            yield sse(refusal(fin).body())
            yield b"data: [DONE]\n\n"
            return
        calls: list[dict] = []
        if req.tools:  # with tools the reply is held back: calls are known only at its end
            content, calls = tool_calls(fin.text, req.tools)
            delta: dict = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            yield chunks.other(delta)
        yield chunks.other(None, finish_reason(fin, bool(calls)), fin.error)  # cut short: "length" + the error
        if req.include_usage:
            yield chunks.usage(fin)
        yield b"data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    return app
