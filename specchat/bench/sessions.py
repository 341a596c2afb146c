"""N concurrent chat sessions through the engine: aggregate throughput, inter-token latency, acceptance, memory."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from specchat.config import SamplingParams, SpecParams
from specchat.engine.api import named_weights
from specchat.engine.engine import Engine
from specchat.engine.sequence import Finished


@dataclass(slots=True)
class SessionsResult:
    sessions: int
    requests: int
    drafter: str
    k: str | None  # "auto" or the fixed k; None for plain decoding (drafter none), which drafts nothing
    completion_tokens: int
    wall_s: float
    tok_per_s: float  # aggregate: completion tokens of all sessions / wall time
    itl_p50_ms: float | None  # inter-token latency (engine.telemetry)
    itl_p99_ms: float | None
    ttft_p50_ms: float | None
    acceptance_rate: float
    tokens_per_step: float
    kv_used_tokens_peak: int
    memory: dict
    step_ahead: bool = True  # plain steps launched ahead of the host (where the runner overlaps: CUDA graphs)
    gate_caps: dict[int, int] = field(default_factory=dict)  # steps the draft gates allowed at each cap (--k auto)


def run_sessions(
    engine: Engine,
    prompts: list[str],
    sessions: int,
    sampling: SamplingParams,
    spec: SpecParams,
    requests: int | None = None,
) -> SessionsResult:
    """Run `requests` prompts (default: `sessions`; prompts cycled) with at most `sessions` in flight.

    A finished request's slot is refilled at once (continuous batching), so runs that share `requests` do the
    same work at different concurrency and their throughputs compare directly.
    """
    assert not engine.running_in_background, "the benchmark drives the engine's steps itself"
    engine.reset_metrics(whole_run=True)  # (the newest latencies alone would be the run's tail, as the batch drains)
    caps_before = gate_caps(engine)
    peak = 0
    total, submitted = requests or sessions, 0  # (a count, not a list of request numbers: any number runs)
    in_flight, finished = [], []
    start = time.perf_counter()
    while submitted < total or in_flight:
        while submitted < total and len(in_flight) < sessions:
            in_flight.append(engine.submit(prompts[submitted % len(prompts)], sampling, spec))
            submitted += 1
        engine.step()
        peak = max(peak, engine.pool.used_pages * engine.pool.page_size)
        for handle in list(in_flight):
            while not handle.queue.empty():
                event = handle.queue.get()
                if isinstance(event, Finished):
                    finished.append(event)
                    in_flight.remove(handle)
    wall = time.perf_counter() - start
    snap = engine.snapshot()
    tokens = sum(len(f.token_ids) for f in finished)
    return SessionsResult(
        sessions=sessions,
        requests=len(finished),
        drafter=spec.drafter,
        k=None if spec.drafter == "none" else "auto" if spec.k is None else str(spec.k),
        completion_tokens=tokens,
        wall_s=wall,
        tok_per_s=tokens / wall,
        itl_p50_ms=snap.itl_p50_ms,
        itl_p99_ms=snap.itl_p99_ms,
        ttft_p50_ms=snap.ttft_p50_ms,
        acceptance_rate=snap.spec.acceptance_rate,
        tokens_per_step=snap.spec.tokens_per_step,
        kv_used_tokens_peak=peak,
        memory=named_weights(snap.memory),
        step_ahead=engine.spec_step.runs_ahead,
        gate_caps=dict(sorted((gate_caps(engine) - caps_before).items())),
    )


def gate_caps(engine: Engine) -> Counter:
    """Steps the engine's draft gates (one per batch size and drafters) allowed at each cap, so far."""
    total = Counter()
    for gate in engine.scheduler.gates.values():
        total.update(gate.allowed)
    return total
