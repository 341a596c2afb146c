"""OpenAI's response JSON from the engine's results: a whole completion, the chunks of a stream (server-sent
events), usage with the speculation behind it, and tool calls read out of a reply.

A streamed text chunk is the server's most frequent write: `StreamChunks` builds it from a template made once per
stream; `sse(chunk(...))` is the reference it is held to (tests/server/test_responses.py).
"""

from __future__ import annotations

import json
import secrets
import string
import time
import uuid
from typing import Any

from specchat.agent.toolcalls import CALL_ID_LENGTH, parse_tool_calls
from specchat.engine.sequence import Finished
from specchat.server.protocol import GenerationRequest


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def new_call_id() -> str:
    """A tool call's id, random: unique across responses, as a client that keys tool results by id needs (the parser's
    ids count calls within one reply, the same in every response)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(CALL_ID_LENGTH))


def usage(fin: Finished) -> dict:
    """OpenAI's usage, with the speculation that produced the tokens (engine.stats definitions)."""
    stats = fin.stats
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": len(fin.token_ids),
        "total_tokens": fin.prompt_tokens + len(fin.token_ids),
        "speculation": {
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "tokens_per_step": round(stats.tokens_per_step, 4),
        },
    }


def finish_reason(fin: Finished, has_calls: bool) -> str:
    """OpenAI's finish reason; an answer the engine cut short with an error after writing some of it (the KV cache
    filled mid-answer) is "length": its text is kept and sent, and the choice carries the error."""
    if has_calls:
        return "tool_calls"
    return "length" if fin.reason in ("length", "error") else "stop"


def refused(fin: Finished) -> bool:
    """A request that failed before writing anything: an error response, not a completion."""
    return fin.reason == "error" and not fin.token_ids


def tool_calls(text: str, tools: list[dict]) -> tuple[str, list[dict]]:
    """(content without the call markup, OpenAI tool_calls) from a reply to a request offering `tools`. A reply that
    calls a function the request did not declare is all content, as OpenAI's: the client is never asked to run a
    name the model made up (say, delete_all_files), and no text of the reply is lost."""
    parsed = parse_tool_calls(text)
    declared = {tool["function"]["name"] for tool in tools}
    if any(call.name not in declared for call in parsed.calls):
        return text, []
    calls = [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in parsed.calls
    ]
    return (parsed.content if calls else text), calls


def completion(req: GenerationRequest, rid: str, model: str, fin: Finished) -> dict:
    """The whole response of a request that did not stream."""
    if req.chat:
        content, calls = tool_calls(fin.text, req.tools) if req.tools else (fin.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = calls
        kind, choice = "chat.completion", {"index": 0, "message": message}
    else:
        kind, choice, calls = "text_completion", {"index": 0, "text": fin.text}, []
    choice |= {"logprobs": None, "finish_reason": finish_reason(fin, bool(calls))}
    if fin.error:  # cut short: the answer so far, and why it stopped (a field OpenAI does not define)
        choice["error"] = fin.error
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(fin),
    }


SEPARATORS = (",", ":")  # compact JSON: the bytes of every streamed chunk, for every token


def sse(data: dict) -> bytes:
    """One server-sent event carrying `data` as JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=SEPARATORS).encode() + b"\n\n"


def chunk(
    req: GenerationRequest,
    rid: str,
    model: str,
    delta: dict | str | None,
    reason: str | None = None,
    created: int | None = None,
    error: str | None = None,
) -> dict:
    """One streamed chunk: a chat delta ({"content": ...}) or completion text, and the finish reason at the end
    (with `error` beside it where the engine cut the answer short)."""
    created = int(time.time()) if created is None else created
    if not req.chat:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    else:
        choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": reason}
        kind = "chat.completion.chunk"
    if error:
        choice["error"] = error
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}


def usage_chunk(req: GenerationRequest, rid: str, model: str, fin: Finished, created: int | None = None) -> dict:
    """The last chunk of a stream whose client asked for stream_options.include_usage."""
    kind = "chat.completion.chunk" if req.chat else "text_completion"
    created = int(time.time()) if created is None else created
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [], "usage": usage(fin)}


class StreamChunks:
    """The server-sent events of one streamed response, as bytes, all with the stream's one `created` (as OpenAI's).

    A text chunk goes out for every stream at every engine step, so it comes from a template built once per
    stream and only the text is JSON-encoded each time; `sse(chunk(...))` is the reference a test holds it to,
    and builds the few other chunks (the role, the end, the usage).
    """

    def __init__(self, req: GenerationRequest, rid: str, model: str, created: int | None = None) -> None:
        self.req, self.rid, self.model = req, rid, model
        self.created = int(time.time()) if created is None else created
        kind = "chat.completion.chunk" if req.chat else "text_completion"
        head = {"id": rid, "object": kind, "created": self.created, "model": model}
        head = json.dumps(head, ensure_ascii=False, separators=SEPARATORS)[:-1]  # left open: the choices follow
        text_field, close = ('"delta":{"content":', "}") if req.chat else ('"text":', "")
        self._before = f'data: {head},"choices":[{{"index":0,{text_field}'.encode()
        self._after = f'{close},"logprobs":null,"finish_reason":null}}]}}\n\n'.encode()

    def text(self, text: str) -> bytes:
        """The chunk carrying `text` (non-empty)."""
        return self._before + json.dumps(text, ensure_ascii=False).encode() + self._after

    def other(self, delta: dict | None, reason: str | None = None, error: str | None = None) -> bytes:
        """A chunk other than text: the role at the start, tool calls or the finish reason at the end."""
        return sse(chunk(self.req, self.rid, self.model, delta, reason, self.created, error))

    def usage(self, fin: Finished) -> bytes:
        return sse(usage_chunk(self.req, self.rid, self.model, fin, self.created))
