"""The streamed chunks' fast path (StreamChunks' template) against the reference (`sse(chunk(...))`), byte for byte."""

from __future__ import annotations

import json

import pytest

from specchat.config import SamplingParams, SpecParams
from specchat.engine.sequence import Finished
from specchat.engine.stats import SpecStats
from specchat.server.protocol import GenerationRequest, StreamChunks, chunk, sse, usage_chunk

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
