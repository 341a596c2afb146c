"""One request's state as it moves through the engine, and the events it produces."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specchat.config import SamplingParams, SpecParams
from specchat.engine.adaptive import AdaptiveK
from specchat.engine.stats import SpecStats, StepRecord
from specchat.engine.tokenizer import ByteStreamDecoder, StreamDecoder

if TYPE_CHECKING:
    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TextDelta:
    """New text of a request (may be empty when tokens are held back for a stop string)."""

    request_id: int
    text: str
    token_ids: list[int]


@dataclass(slots=True)
class StepEvent:
    """What one engine step did for a request."""

    request_id: int
    record: StepRecord
    k_next: int


# How a Finished error begins where the engine failed the request: its step raised (a bug, a device error), or the
# engine's own loop did (the server tells these from a request's own faults by them)
STEP_FAILED = "the engine step failed"
LOOP_FAILED = "the engine failed"


@dataclass(slots=True)
class Finished:
    """The request ended: reason is stop | length | cancelled | error."""

    request_id: int
    reason: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    stats: SpecStats
    elapsed_s: float
    decode_s: float
    error: str | None = None

    @property
    def tok_per_s(self) -> float:
        """Completion tokens per second of decoding (time from the first token to the last)."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


Event = TextDelta | StepEvent | Finished


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    spec: SpecParams
    detok: StreamDecoder | ByteStreamDecoder
    eos_ids: frozenset[int]
    max_position: int
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_cached: int = 0  # tokens whose keys/values are in the KV pool
    k: int = 0  # drafts to propose at the next step
    adaptive: AdaptiveK | None = None  # set when the request's k is "auto"
    text: str = ""  # output text so far (stop strings cut off)
    emitted_chars: int = 0  # how much of `text` has gone out in TextDelta events
    # tapped hidden states {layer: [m, d]} of the cached positions num_cached - m .. num_cached - 1 that the
    # request's drafter has not read yet (m = 1 for drafters that read only the newest: engine.drafters.base)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    stats: SpecStats = field(default_factory=SpecStats)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None
    token_times: list[float] = field(default_factory=list)  # perf_counter at each step that emitted tokens

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens_from(self, start: int, stop: int | None = None) -> list[int]:
        """all_ids[start:stop] without building all_ids (the scheduler and the n-gram drafter ask every step)."""
        n = len(self.prompt_ids)
        if start < 0 or (stop is not None and stop < 0):
            return self.all_ids[start:stop]
        if start >= n and (stop is None or stop >= n):
            return self.output_ids[start - n : None if stop is None else stop - n]
        if stop is not None and stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: None if stop is None else stop - n]

    @property
    def newest(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def draft_room(self) -> int:
        """Drafts a step may verify without overrunning max tokens or the context (its emitted tokens are the
        accepted drafts plus one)."""
        return min(self.sampling.max_tokens - len(self.output_ids) - 1, self.max_position - self.num_tokens - 1)

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_tokens(self, tokens: list[int]) -> list[int]:
        """Add emitted tokens, stopping at EOS / max tokens / context end; returns the tokens kept."""
        kept = []
        for tok in tokens:
            if tok in self.eos_ids and not self.sampling.ignore_eos:
                self.finish_reason = "stop"
                break
            kept.append(tok)
            self.output_ids.append(tok)
            if len(self.output_ids) >= self.sampling.max_tokens or self.num_tokens >= self.max_position:
                self.finish_reason = "length"
                break
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        self.token_times.append(now)
        if kept:
            self.text += self.detok.push(kept)
        if self.finish_reason is not None:
            self.text += self.detok.flush()
        self._apply_stop_strings()
        return kept

    def _apply_stop_strings(self) -> None:
        """Cut the text at the earliest stop string found, whatever their order in the list ("cab" of stops ["ab",
        "cab"] cuts before its "c")."""
        cut = None
        for stop in self.sampling.stop:
            idx = self.text.find(stop, max(0, self.emitted_chars - len(stop) + 1))
            if idx >= 0 and (cut is None or idx < cut):
                cut = idx
        if cut is not None:
            self.text = self.text[:cut]
            self.finish_reason = "stop"

    def take_delta(self) -> str:
        """Text not sent yet, holding back a tail that could still become a stop string."""
        end = len(self.text)
        if self.finish_reason is None:
            for stop in self.sampling.stop:
                # (up to the whole unsent text, not to `end`: another stop's held tail may be this one's middle)
                for n in range(min(len(stop) - 1, len(self.text) - self.emitted_chars), 0, -1):
                    if self.text.endswith(stop[:n]):
                        end = min(end, len(self.text) - n)
                        break
        delta = self.text[self.emitted_chars : end]
        self.emitted_chars = max(self.emitted_chars, end)
        return delta

    def finish_event(self) -> Finished:
        now = time.perf_counter()
        decode_s = (self.t_last - self.t_first) if self.t_first and self.t_last else 0.0
        return Finished(
            request_id=self.seq_id,
            reason=self.finish_reason or "stop",
            text=self.text,
            token_ids=list(self.output_ids),
            prompt_tokens=len(self.prompt_ids),
            stats=self.stats,
            elapsed_s=now - self.t_submit,
            decode_s=decode_s,
            error=self.error,
        )
