"""/metrics: the engine's figures in the Prometheus text format (0.0.4).

The speculation counters are the ones vLLM exposes (drafts, draft tokens, accepted tokens, accepted tokens per
draft position), with the definitions of engine/stats.py; beside them tokens per step, KV use, tok/s and the
request queue, from the same engine.telemetry Snapshot the TUI reads; and the requests the server refused because its
queue was full (server/admission.py), which the engine never sees.
"""

from __future__ import annotations

from specchat.engine.telemetry import Snapshot

PREFIX = "specchat"


def label_value(text: str) -> str:
    """A label's value as the text format quotes it: backslash, double quote and newline escaped (a model named by a
    path with a quote in it broke every line of the page for a scraper)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(snap: Snapshot, model: str, rejected: int = 0) -> str:
    label = f'model="{label_value(model)}"'
    spec, memory = snap.spec, snap.memory
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float, extra: str = "") -> None:
        full = f"{PREFIX}:{name}"
        if not any(line.startswith(f"# TYPE {full} ") for line in lines):
            lines.extend([f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"])
        labels = label + (f",{extra}" if extra else "")
        lines.append(f"{full}{{{labels}}} {value}")

    metric("spec_decode_num_drafts_total", "counter", "Steps in which tokens were drafted.", spec.drafts)
    metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", spec.drafted)
    metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens the target kept.", spec.accepted)
    for i, accepted in enumerate(spec.accepted_per_position):
        metric(
            "spec_decode_num_accepted_tokens_per_pos_total",
            "counter",
            "Accepted draft tokens by position in the draft.",
            accepted,
            f'position="{i}"',
        )
    metric("spec_decode_acceptance_rate", "gauge", "Accepted over drafted tokens since start.", spec.acceptance_rate)
    metric("spec_decode_tokens_per_step", "gauge", "Tokens emitted per target step since start.", spec.tokens_per_step)
    metric("generation_tokens_total", "counter", "Completion tokens emitted.", snap.tokens_total)
    metric("requests_finished_total", "counter", "Requests finished.", snap.finished_total)
    metric("num_requests_running", "gauge", "Requests in the running batch.", snap.running)
    metric("num_requests_waiting", "gauge", "Requests waiting for KV pages or a slot.", snap.waiting)
    metric("requests_rejected_total", "counter", "Requests refused at once: the waiting queue was full.", rejected)
    metric("tokens_per_second", "gauge", "Completion tokens per second, recent.", snap.tok_per_s or 0.0)
    metric("kv_cache_used_tokens", "gauge", "KV cache tokens held by requests.", memory.get("kv_used_tokens", 0))
    metric("kv_cache_capacity_tokens", "gauge", "KV cache capacity in tokens.", memory.get("kv_capacity_tokens", 0))
    capacity = memory.get("kv_capacity_tokens") or 0
    usage = memory.get("kv_used_tokens", 0) / capacity if capacity else 0.0
    metric("kv_cache_usage_perc", "gauge", "Share of the KV cache in use.", usage)
    metric(
        "prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens taken from the prefix cache.",
        memory.get("kv_prefix_hit_tokens", 0),
    )
    return "\n".join(lines) + "\n"
