"""An engine stand-in that answers each request with the next canned reply, for testing the agent loop's logic."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from specchat.config import SamplingParams, SpecParams
from specchat.engine.sequence import Finished, StepEvent, TextDelta
from specchat.engine.stats import SpecStats, StepRecord
from specchat.errors import ConfigError

HANG = object()  # a reply that never comes: the request runs until it is cancelled


class ScriptedHandle:
    """A request whose reply is known up front (or never comes, for HANG)."""

    def __init__(self, request_id: int, reply: str | object, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.reply = reply
        self.prompt_tokens = prompt_tokens
        self.cancelled = threading.Event()
        self.finished: Finished | None = None

    def events(self) -> Iterator:
        if self.reply is HANG:
            self.cancelled.wait()
            self.finished = self._finish("", "cancelled")
            yield self.finished
            return
        tokens = list(range(len(self.reply.split())))
        yield StepEvent(self.request_id, StepRecord(k=2, accepted=1, emitted=2), 2)
        yield TextDelta(self.request_id, self.reply, tokens)
        self.finished = self._finish(self.reply, "stop")
        yield self.finished

    def _finish(self, text: str, reason: str) -> Finished:
        stats = SpecStats()
        stats.observe_step(StepRecord(k=2, accepted=1, emitted=2))
        tokens = list(range(len(text.split())))
        return Finished(self.request_id, reason, text, tokens, self.prompt_tokens, stats, 0.1, 0.1)

    def result(self) -> Finished:
        for _ in self.events():
            pass
        return self.finished

    def cancel(self) -> None:
        self.cancelled.set()


class ScriptedTokenizer:
    def __init__(self, chat_template_source: str) -> None:
        self.chat_template_source = chat_template_source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(char) for char in text]


class ScriptedEngine:
    """Replies in order. `requests` holds each prompt it encoded (one per turn: messages, tools) with the requests
    submitted for it (prompt ids past the conversation, sampling, speculation)."""

    def __init__(self, replies: list[str | object], chat_template: str = "ChatML", drafters: tuple = ("none",)):
        self.replies = list(replies)
        self.tokenizer = ScriptedTokenizer(chat_template)
        self.drafters = drafters
        self.requests: list[dict] = []
        self.prefix_hit_tokens = 0
        self.lock = threading.Lock()

    def drafter(self, name: str) -> None:
        if name not in self.drafters:
            raise ConfigError(f"unknown drafter {name!r}")

    def encode_prompt(self, messages: list[dict], tools=None) -> list[int]:
        with self.lock:
            self.requests.append({"messages": [dict(m) for m in messages], "tools": tools, "submits": []})
            return [-len(self.requests)]  # a marker for the prompt, so submit can tell whose request it is

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, spec: SpecParams) -> ScriptedHandle:
        with self.lock:
            request = self.requests[-prompt_ids[0] - 1]
            request["submits"].append({"text": "".join(map(chr, prompt_ids[1:])), "sampling": sampling, "spec": spec})
            reply = self.replies.pop(0) if self.replies else "I do not know."
            for stop in sampling.stop:  # the engine ends a reply at a stop string and leaves the string out
                if isinstance(reply, str) and stop in reply:
                    reply = reply[: reply.index(stop)]
            self.prefix_hit_tokens += 10
            return ScriptedHandle(len(self.requests), reply, prompt_tokens=20)

    def memory(self) -> dict:
        return {"kv_prefix_hit_tokens": self.prefix_hit_tokens}
