"""N concurrent chat sessions through the engine: aggregate throughput, per-token latency, acceptance, memory."""

from __future__ import annotations

import time
from dataclasses import dataclass

from specchat.config import SamplingParams, SpecParams
from specchat.engine.engine import Engine


@dataclass(slots=True)
class SessionsResult:
    sessions: int
    drafter: str
    k: str
    completion_tokens: int
    wall_s: float
    tok_per_s: float  # aggregate: completion tokens of all sessions / wall time
    latency_p50_ms: float
    latency_p99_ms: float
    acceptance_rate: float
    tokens_per_step: float
    kv_used_tokens_peak: int
    memory: dict


def run_sessions(
    engine: Engine, prompts: list[str], sessions: int, sampling: SamplingParams, spec: SpecParams
) -> SessionsResult:
    """Submit `sessions` requests at once (prompts cycled) and run them all to the end."""
    engine.reset_metrics()
    peak = 0

    def track_peak(_events) -> None:
        nonlocal peak
        peak = max(peak, engine.pool.used_pages * engine.pool.page_size)

    engine.listeners.append(track_peak)
    start = time.perf_counter()
    try:
        handles = [engine.submit(prompts[i % len(prompts)], sampling, spec) for i in range(sessions)]
        finished = [h.result() for h in handles]
    finally:
        engine.listeners.remove(track_peak)
    wall = time.perf_counter() - start
    snap = engine.snapshot()
    tokens = sum(len(f.token_ids) for f in finished)
    return SessionsResult(
        sessions=sessions,
        drafter=spec.drafter,
        k="auto" if spec.k is None else str(spec.k),
        completion_tokens=tokens,
        wall_s=wall,
        tok_per_s=tokens / wall,
        latency_p50_ms=snap.latency_p50_ms,
        latency_p99_ms=snap.latency_p99_ms,
        acceptance_rate=snap.spec.acceptance_rate,
        tokens_per_step=snap.spec.tokens_per_step,
        kv_used_tokens_peak=peak,
        memory=snap.memory,
    )
