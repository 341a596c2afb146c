"""`specchat generate`: the timing line after a streamed answer (prompt, time to first token, decode rate,
speculation), the time to first token and decode time in --json, and unquantized weights named by their dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specchat.cli import main
from specchat.cli.generate import time_to_first_token, timing_line
from specchat.engine.sequence import Finished
from specchat.engine.stats import SpecStats, StepRecord


def generate(*args: str):
    result = CliRunner().invoke(main, ["generate", *args])
    assert result.exit_code == 0, result.output
    return result


def finished(steps: list[tuple[int, int]], elapsed_s: float, decode_s: float) -> Finished:
    """A Finished whose steps drafted k and accepted a tokens each: (k, a) per step."""
    stats = SpecStats()
    for k, accepted in steps:
        stats.observe_step(StepRecord(k=k, accepted=accepted, emitted=accepted + 1, draft_ms=0.1, verify_ms=2.0))
    tokens = sum(a + 1 for _, a in steps)
    return Finished(1, "stop", "x", list(range(tokens)), 12, stats, elapsed_s=elapsed_s, decode_s=decode_s)


def test_the_timing_line_splits_first_token_from_decoding():
    fin = finished([(4, 3), (4, 1), (4, 4)], elapsed_s=1.5, decode_s=1.25)
    assert time_to_first_token(fin) == pytest.approx(0.25)
    line = timing_line(fin, "ngram")
    assert line == (
        "[prompt 12 tokens · first token 250 ms · 11 tokens in 1.25 s, 8.0 tok/s · "
        "3.67 tokens/step, 67% of 12 drafts accepted · drafter ngram]"
    )


def test_without_drafts_the_line_leaves_speculation_out():
    line = timing_line(finished([(0, 0)] * 5, elapsed_s=0.5, decode_s=0.4), "none")
    assert "tokens/step" not in line and "accepted" not in line
    assert line.startswith("[prompt 12 tokens · first token 100 ms · 5 tokens in 0.40 s, 10.0 tok/s")


def test_a_streamed_answer_ends_with_the_timing_line(tiny_model_dir: Path):
    result = generate(str(tiny_model_dir), "-p", "hi", "--max-tokens", "6", "--drafter", "ngram", "--stats")
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[prompt ") and lines[0].endswith("drafter ngram]"), lines
    assert " first token " in lines[0] and " tok/s" in lines[0]
    assert "[prompt" not in result.stdout


def test_no_timing_line_with_no_stats_or_json(tiny_model_dir: Path):
    assert generate(str(tiny_model_dir), "-p", "hi", "--max-tokens", "3", "--no-stats").stderr == ""
    assert generate(str(tiny_model_dir), "-p", "hi", "--max-tokens", "3", "--json", "--stats").stderr == ""


@pytest.mark.parametrize(
    ("flags", "label"), [(("--dtype", "float32"), "float32"), (("--dtype", "bfloat16"), "bfloat16")]
)
def test_json_names_unquantized_weights_by_their_dtype(tiny_model_dir: Path, flags, label):
    result = generate(str(tiny_model_dir), "-p", "hi", "--max-tokens", "3", "--json", "--device", "cpu", *flags)
    stats = json.loads(result.stdout.splitlines()[0])["stats"]
    assert stats["memory"]["weights_format"] == label
    assert stats["ttft_s"] > 0 and stats["decode_s"] >= 0


def test_ctrl_c_during_a_json_request_keeps_its_text_so_far():
    from specchat.cli.generate import Interrupted, collect, result_json
    from specchat.engine.sequence import TextDelta

    class Handle:
        cancelled = False

        def events(self):
            yield TextDelta(1, "Hello", [5])
            yield TextDelta(1, " sea", [6])
            raise KeyboardInterrupt

        def cancel(self):
            self.cancelled = True

    handle = Handle()
    with pytest.raises(Interrupted) as stop:
        collect(handle)
    partial = stop.value.partial
    assert handle.cancelled and partial.text == "Hello sea" and partial.token_ids == [5, 6]
    record = result_json({}, "m", partial)
    assert record["finish_reason"] == "cancelled" and record["text"] == "Hello sea" and "interrupted" in record["error"]


@pytest.mark.parametrize("source", ["--prompt", "stdin"])
def test_json_prints_the_record_of_a_single_prompt_refused_at_submit(tiny_model_dir: Path, source: str):
    """--json prints one record per prompt, failed ones included: a single prompt beyond the context printed none,
    only the error line."""
    long = "word " * 400  # the tiny model's context holds 256
    args = ["generate", str(tiny_model_dir), "--raw", "--json", "--max-tokens", "4"]
    if source == "--prompt":
        result = CliRunner().invoke(main, [*args, "-p", long])
    else:
        result = CliRunner().invoke(main, args, input=long)
    assert result.exit_code == 1
    [record] = [json.loads(line) for line in result.stdout.splitlines()]
    assert record["finish_reason"] == "error" and record["error"].startswith(f"{source}: prompt is ")
    assert result.stderr.strip().splitlines() == [f"specchat: error: {record['error']}"]
    streamed = CliRunner().invoke(main, [*args[:3], "--max-tokens", "4", "-p", long])
    assert streamed.exit_code == 1 and streamed.stdout == ""
    assert streamed.stderr.strip().splitlines() == [f"specchat: error: --prompt: {record['error'].split(': ', 1)[1]}"]


def test_one_token_has_no_decode_rate_to_show():
    """The rate is over the gaps after the first token: one token gave "1 tokens in 0.00 s, 0.0 tok/s"."""
    line = timing_line(finished([(0, 0)], elapsed_s=0.3, decode_s=0.0), "none")
    assert line == "[prompt 12 tokens · first token 300 ms · 1 token · drafter none]"


def test_a_streamed_prompt_that_fails_before_any_text_prints_nothing_on_stdout(tiny_model_dir: Path):
    """A prompt the KV pool cannot hold fails in the engine: stdout had an empty line before the error line."""
    args = ["generate", str(tiny_model_dir), "--raw", "-p", "word " * 150, "--kv-memory", "64K", "--kv", "fp32"]
    result = CliRunner().invoke(main, [*args, "--max-tokens", "4", "--no-stats"])  # a pool of 128 tokens
    assert result.exit_code == 1 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("specchat: error: ") and "KV cache" in line


def test_stop_ends_the_answer_where_its_text_appears(tiny_model_dir: Path):
    """--stop (repeatable, as the API's `stop`): the answer ends before the first stop text it reaches, which is left
    out, and its finish reason is "stop"; an empty one is refused in one line."""
    args = [str(tiny_model_dir), "-p", "hi", "--max-tokens", "24", "--no-stats"]
    whole = json.loads(generate(*args, "--json").stdout)["text"]
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    assert len(stop.strip()) > 0, whole
    cut = json.loads(generate(*args, "--json", "--stop", stop, "--stop", "never in it 42").stdout)
    assert cut["text"] == whole[: whole.index(stop)] and cut["finish_reason"] == "stop", (whole, stop, cut)
    assert generate(*args, "--stop", stop).stdout == whole[: whole.index(stop)] + "\n"
    refused = CliRunner().invoke(main, ["generate", *args, "--stop", ""])
    assert refused.exit_code == 1 and "--stop: an empty stop text is refused" in refused.output


def test_a_byte_order_mark_is_no_part_of_the_first_prompt(tiny_model_dir: Path, tmp_path: Path):
    """Windows editors start a UTF-8 file with a BOM: a .jsonl file's line 1 failed as invalid JSON, a plain file's
    first prompt and stdin's got it as a token, and a BOM alone on stdin was answered with exit 0."""
    from specchat.cli.inputs import read_prompt_file

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"prompt": "hi"}\n{"prompt": "yo"}\n')
    assert [item.prompt for item in read_prompt_file(jsonl)] == ["hi", "yo"]
    plain = tmp_path / "p.txt"
    plain.write_bytes(b"\xef\xbb\xbfhi\n")
    assert [item.prompt for item in read_prompt_file(plain)] == ["hi"]
    args = [str(tiny_model_dir), "--raw", "--json", "--max-tokens", "2"]
    records = [json.loads(line) for line in generate(*args, "--prompts-file", str(jsonl)).stdout.splitlines()]
    assert [r["finish_reason"] for r in records] == ["length", "length"]
    with_bom = CliRunner().invoke(main, ["generate", *args], input="\ufeffhi")
    assert (
        with_bom.exit_code == 0
        and json.loads(with_bom.stdout)["stats"]["prompt_tokens"]
        == (json.loads(generate(*args, "-p", "hi").stdout)["stats"]["prompt_tokens"])
    )
    only_bom = CliRunner().invoke(main, ["generate", *args], input="\ufeff")
    assert only_bom.exit_code == 1 and "empty prompt" in only_bom.stderr


def test_a_closed_stdin_or_stdout_is_one_line(tiny_model_dir: Path):
    """`generate <&-` without --prompt raised AttributeError's traceback; `generate -p hi >&-` answered into nothing
    and exited 0."""
    from tests.cli.test_run import run_closed

    args = ["generate", str(tiny_model_dir), "--device", "cpu", "--max-tokens", "2"]
    no_stdin = run_closed(args, 0)
    assert no_stdin.returncode == 2 and no_stdin.stderr.decode().startswith(
        "specchat: error: stdin is closed: give --prompt or --prompts-file"
    )
    no_stdout = run_closed([*args, "-p", "hi"], 1)
    assert no_stdout.returncode == 1 and no_stdout.stderr.decode().splitlines() == [
        "specchat: error: stdout is closed: the answers would go nowhere (redirect it to a file, or to /dev/null)"
    ]


def test_a_prompt_piped_with_windows_line_ends_is_the_same_prompt(tiny_model_dir: Path):
    """`echo hi | specchat generate` from PowerShell sends "hi\\r\\n": the CR stayed in the prompt, a token more, and
    the answer was another (a prompt file's lines, and run --plain's messages, never had it)."""
    args = ["generate", str(tiny_model_dir), "--raw", "--json", "--max-tokens", "4"]
    unix = CliRunner().invoke(main, args, input="first line\nsecond\n")
    windows = CliRunner().invoke(main, args, input="first line\r\nsecond\r\n")
    assert unix.exit_code == windows.exit_code == 0, windows.output
    assert json.loads(windows.stdout)["stats"]["prompt_tokens"] == json.loads(unix.stdout)["stats"]["prompt_tokens"]
    assert json.loads(windows.stdout)["token_ids"] == json.loads(unix.stdout)["token_ids"]


def test_a_text_flag_that_is_not_utf8_is_named(tiny_model_dir: Path, tmp_path: Path):
    """`--system $'\\xff'` (bytes that are not UTF-8 reach Python as lone surrogates): the engine refused the prompt as
    "not valid Unicode text", blaming --prompt, or every line of a prompts file; a --stop of them never matched."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\n")
    args = ["generate", str(tiny_model_dir), "--max-tokens", "2"]
    for flags, error in [
        (["-p", "hi", "--system", "bad\udcff"], "--system: not valid UTF-8 (byte 0xff at offset 3)"),
        (["--prompts-file", str(prompts), "--system", "\udcff"], "--system: not valid UTF-8 (byte 0xff at offset 0)"),
        (["-p", "hi", "--stop", "ok", "--stop", "\udce9t\udce9"], "--stop: not valid UTF-8 (byte 0xe9 at offset 0)"),
    ]:
        result = CliRunner().invoke(main, [*args, *flags])
        assert result.exit_code == 1 and result.stderr.splitlines() == [f"specchat: error: {error}"], result.output
