"""`specchat bench`: the sessions runner keeps its concurrency and the synthetic runner reports what it ran."""

from __future__ import annotations

import json

from click.testing import CliRunner

from specchat.bench.sessions import run_sessions
from specchat.cli import main
from specchat.config import SamplingParams, SpecParams


def test_sessions_run_every_request_with_bounded_concurrency(tiny_engine):
    in_flight_seen = []

    def watch(_events):
        in_flight_seen.append(len(tiny_engine.handles))

    tiny_engine.listeners.append(watch)
    try:
        sampling = SamplingParams(max_tokens=6, ignore_eos=True)
        result = run_sessions(tiny_engine, ["a b c", "hello there"], 2, sampling, SpecParams(drafter="none"), 5)
    finally:
        tiny_engine.listeners.remove(watch)
    assert result.requests == 5 and result.completion_tokens == 5 * 6
    assert max(in_flight_seen) == 2  # never more than `sessions` at once, and the slots were kept full
    assert result.tok_per_s > 0 and not tiny_engine.handles
    assert result.memory["weights_format"] == "float32"  # named by dtype, as generate --json names it
    # the latency percentiles are the whole run's: every inter-token gap kept, not the newest window's
    assert tiny_engine.metrics.latency_window is None and len(tiny_engine.metrics.itl_ms) == 5 * 5


def test_synthetic_bench_json_rows():
    args = ["bench", "--synthetic", "tiny", "--device", "cpu", "--batch", "1,2", "--k", "0,2"]
    run = CliRunner().invoke(main, [*args, "--steps", "2", "--context", "8", "--json"])
    assert run.exit_code == 0, run.output
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [(r["case"]["batch"], r["case"]["k"]) for r in rows] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    plain = [r for r in rows if r["case"]["k"] == 0]
    assert all(r["tokens_per_step"] == 1.0 for r in plain)  # plain decoding gives one token per step
    assert all(1.0 <= r["tokens_per_step"] <= 3.0 for r in rows)  # k = 2: at most k + 1
    assert all(r["kv_bytes_per_token"] > 0 and r["weights_bytes"] > 0 for r in rows)
    assert all(r["prefill_tok_per_s"] > 0 for r in rows)  # the prompts, timed


def test_bench_flags_fail_with_one_line():
    run = CliRunner().invoke(main, ["bench", "--synthetic", "llama-9000"])
    assert run.exit_code != 0 and "unknown synthetic shape" in run.output


def test_bench_sessions_sample_at_a_temperature(tiny_model_dir, tmp_path):
    """--temperature T runs the sessions sampled (each drafter's row measured), the way API clients send requests."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a b c\nhello there\n")
    args = ["bench", str(tiny_model_dir), "--device", "cpu", "--sessions", "1,2", "--prompts", str(prompts),
            "--max-tokens", "6", "--drafter", "none,ngram", "--temperature", "0.8", "--json"]  # fmt: skip
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0, run.output
    rows = [json.loads(line) for line in run.output.splitlines() if line.startswith("{")]
    assert sorted((r["sessions"], r["drafter"]) for r in rows) == [(1, "ngram"), (1, "none"), (2, "ngram"), (2, "none")]
    # a plain row drafts nothing: its k is null, where the JSON said "4" (the table's "-")
    assert {(r["drafter"], r["k"]) for r in rows} == {("none", None), ("ngram", "4")}


def test_bench_reports_each_configurations_median_warm_run():
    """Of a configuration's runs over the rounds after the first, the one of median throughput (the lower middle
    of an even count); one round: its run."""
    from specchat.bench.sessions import SessionsResult
    from specchat.cli.bench import median_run

    def run(tok_per_s):
        return SessionsResult(
            sessions=1, requests=1, drafter="none", k="0", completion_tokens=1, wall_s=1.0, tok_per_s=tok_per_s,
            itl_p50_ms=None, itl_p99_ms=None, ttft_p50_ms=None, acceptance_rate=0.0, tokens_per_step=1.0,
            kv_used_tokens_peak=0, memory={}, step_ahead=False,
        )  # fmt: skip

    assert median_run([run(3.0), run(1.0), run(2.0)]).tok_per_s == 2.0
    assert median_run([run(3.0), run(1.0)]).tok_per_s == 1.0
    assert median_run([run(5.0)]).tok_per_s == 5.0


def test_bench_sessions_run_the_requests_asked(tiny_model_dir, tmp_path):
    """--requests N: every session count runs N requests (the prompts cycled; the slots refilled as they end),
    not the default of the largest count; with --synthetic it is a usage error."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a b c\nhello there\n")
    args = ["bench", str(tiny_model_dir), "--device", "cpu", "--sessions", "1,2", "--prompts", str(prompts),
            "--max-tokens", "4", "--drafter", "none", "--requests", "5", "--rounds", "3", "--json"]  # fmt: skip
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0, run.output
    rows = [json.loads(line) for line in run.output.splitlines() if line.startswith("{")]
    assert [(r["sessions"], r["requests"], r["completion_tokens"]) for r in rows] == [(1, 5, 20), (2, 5, 20)]
    bad = CliRunner().invoke(main, ["bench", "--synthetic", "tiny", "--requests", "3"])
    assert bad.exit_code != 0 and "--requests" in bad.output


def test_bench_table_lists_each_counted_rounds_throughput(tiny_model_dir, tmp_path):
    """Over three rounds or more the table is followed by every counted round's tok/s, each drafter's against
    the first of its session count in the same round (paired: a round's noise hits both)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a b c\n")
    args = ["bench", str(tiny_model_dir), "--device", "cpu", "--sessions", "2", "--prompts", str(prompts),
            "--max-tokens", "4", "--drafter", "none,ngram", "--rounds", "3"]  # fmt: skip
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0, run.output
    lines = run.output.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("tok/s by round")))
    none, ngram = lines[at + 1], lines[at + 2]
    assert none.startswith("  2 none: ") and none.count(" / ") == 1 and "x)" not in none
    assert ngram.startswith("  2 ngram: ") and ngram.count("x)") == 2


def test_bench_runs_each_configuration_untimed_before_its_timed_run(tiny_model_dir, tmp_path, monkeypatch):
    """One round (the CPU's default) counts its runs: each configuration ran short and untimed first, and every
    prompt was prefilled once, so the first configuration is not timed cold (12 tok/s where the same one ran at 100
    next, on the default model) nor without the prefix cache the later ones found."""
    from specchat.bench import sessions

    calls = []

    def recording(engine, prompts, n, sampling, spec, requests=None):
        calls.append((spec.drafter, engine.spec_step.runs_ahead, requests, sampling.max_tokens))
        return run_sessions(engine, prompts, n, sampling, spec, requests)

    monkeypatch.setattr(sessions, "run_sessions", recording)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a b c\nhello there\nthree\n")
    args = ["bench", str(tiny_model_dir), "--device", "cpu", "--sessions", "2", "--prompts", str(prompts),
            "--max-tokens", "6", "--drafter", "none,ngram", "--json"]  # fmt: skip
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0, run.output
    rows = [json.loads(line) for line in run.output.splitlines() if line.startswith("{")]
    assert [(r["drafter"], r["completion_tokens"]) for r in rows] == [("none", 12), ("ngram", 12)]  # the timed ones
    mode = calls[-1][1]
    assert calls == [
        ("none", mode, 2, 1),  # the prompts the runs send (2 requests: the first two), prefilled
        ("none", mode, 2, 4),  # each configuration, short
        ("ngram", mode, 2, 4),
        ("none", mode, 2, 6),  # then the timed round
        ("ngram", mode, 2, 6),
    ]


def test_synthetic_drafter_accepts_at_per_position_rates():
    """--acceptance r1,r2,..: draft j is accepted at rate r_j once those before it were (the last rate after)."""
    import random

    from specchat.bench.synthetic import sample_accepted

    rng = random.Random(0)
    draws = [sample_accepted(rng, 4, (1.0, 0.5, 0.0)) for _ in range(4000)]
    assert set(draws) == {1, 2}  # the first always, the second half the time, never a third
    assert abs(draws.count(2) / len(draws) - 0.5) < 0.05
    assert {sample_accepted(rng, 3, (1.0,)) for _ in range(50)} == {3}  # one rate: every position
    run = CliRunner().invoke(main, ["bench", "--synthetic", "tiny", "--device", "cpu", "--k", "2", "--steps", "2",
                                    "--context", "8", "--acceptance", "1,0", "--json"])  # fmt: skip
    assert run.exit_code == 0, run.output
    (row,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert row["case"]["acceptance"] == [1.0, 0.0] and row["tokens_per_step"] == 2.0
    bad = CliRunner().invoke(main, ["bench", "--synthetic", "tiny", "--acceptance", "0.5,x"])
    assert bad.exit_code != 0 and "--acceptance" in bad.output
