"""The responses: the streamed chunks' fast path (StreamChunks' template) against the reference (`sse(chunk(...))`),
byte for byte; tool calls read out of a reply (declared functions only, ids unique across responses)."""

from __future__ import annotations

import json

import pytest

from specchat.config import SamplingParams, SpecParams
from specchat.engine.sequence import Finished
from specchat.engine.stats import SpecStats
from specchat.server.protocol import GenerationRequest
from specchat.server.responses import StreamChunks, chunk, completion, sse, usage_chunk

TEXTS = [
    " the",
    "x",
    ' "quoted"',
    "line\nbreak\ttab\r",
    "back\\slash",
    " café 東京 🙂",
    "\x00\x1f control",
    "\u2028\u2029 separators",
    "</script>",
    "{}[],:",
]


def request(chat: bool) -> GenerationRequest:
    prompt = [{"role": "user", "content": "hi"}] if chat else "hi"
    return GenerationRequest(chat=chat, prompt=prompt, sampling=SamplingParams(), spec=SpecParams())


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("model", ["smollm2-135m", 'odd "name" \\ é'])
@pytest.mark.parametrize("text", TEXTS)
def test_text_chunk_template_equals_the_reference(chat: bool, model: str, text: str) -> None:
    req = request(chat)
    chunks = StreamChunks(req, "chatcmpl-0123456789abcdef01234567", model, created=1764612000)
    reference = chunk(req, chunks.rid, model, {"content": text} if chat else text, created=1764612000)
    assert chunks.text(text) == sse(reference)
    assert json.loads(chunks.text(text).removeprefix(b"data: ")) == reference


def test_every_chunk_of_a_stream_has_its_created() -> None:
    req = request(chat=True)
    chunks = StreamChunks(req, "chatcmpl-1", "m", created=42)
    fin = Finished(1, "length", "ab", [1, 2], 3, SpecStats(), 0.1, 0.1)
    lines = [chunks.other({"role": "assistant", "content": ""}), chunks.text("ab"), chunks.other(None, "length")]
    lines.append(chunks.usage(fin))
    assert [json.loads(line.removeprefix(b"data: "))["created"] for line in lines] == [42, 42, 42, 42]
    assert chunks.usage(fin) == sse(usage_chunk(req, "chatcmpl-1", "m", fin, created=42))
    assert all(line.startswith(b"data: ") and line.endswith(b"\n\n") for line in lines)


ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}


def tool_reply(text: str, tools: list[dict]) -> dict:
    """The choice of a non-streamed answer whose model wrote `text` to a request offering `tools`."""
    fin = Finished(1, "stop", text, [5, 6], 10, SpecStats(), 0.1, 0.1)
    req = GenerationRequest(chat=True, prompt=[{"role": "user", "content": "w"}], sampling=SamplingParams(),
                            spec=SpecParams(), tools=tools)  # fmt: skip
    return completion(req, "chatcmpl-1", "m", fin)["choices"][0]


def test_tool_call_ids_are_unique_across_responses_and_nine_alphanumerics() -> None:
    """Every response's first call was "c00000000": a client that keys tool results by id mixed up two turns."""
    text = '<tool_call>[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]</tool_call>'
    ids = [call["id"] for _ in range(20) for call in tool_reply(text, [ADD_TOOL])["message"]["tool_calls"]]
    assert len(ids) == 40 and len(set(ids)) == 40
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)  # as Mistral's templates insist


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "delete_all_files", "arguments": {}}',
        'Sure.<tool_call>[{"name": "add", "arguments": {}}, {"name": "rm", "arguments": {"path": "/"}}]</tool_call>',
    ],
)
def test_a_call_to_a_function_the_request_did_not_declare_stays_content(text: str) -> None:
    """The model's made-up function came back as a tool call, finish_reason "tool_calls", for the client to run."""
    choice = tool_reply(text, [ADD_TOOL])
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == text


def test_a_call_to_a_declared_function_is_a_tool_call() -> None:
    choice = tool_reply('Sure.<tool_call>[{"name": "add", "arguments": {"a": 1}}]</tool_call>', [ADD_TOOL])
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["add"]
