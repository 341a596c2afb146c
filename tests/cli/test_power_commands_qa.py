"""QA of the power-user commands (bench, quantize, train-heads, perplexity): each failure a user can cause ends in
one `specchat: error:` line and a nonzero exit, never a traceback, a silent wrong result or a torn output file."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from specchat.cli import main

pytestmark = pytest.mark.timeout(240)

TINY_TRAINING = ["--max-prompts", "2", "--max-tokens", "4", "--samples", "0", "--epochs", "1"]


def invoke(args: list[str]) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def assert_one_error_line(result: Result, *needles: str) -> str:
    assert not (result.exception and not isinstance(result.exception, SystemExit)), (
        f"uncaught {type(result.exception).__name__}: {result.exception}"
    )
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("specchat") or "Traceback" in line]
    assert len(lines) == 1 and lines[0].startswith("specchat: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# --- train-heads ----------------------------------------------------------------------------------------------


def test_eagle_out_naming_a_model_folder_is_refused_and_the_model_left_alone(tiny_model_dir, tmp_path) -> None:
    """`--arch eagle --out MODEL_DIR` wrote the head's config.json and model.safetensors over the model's own."""
    victim = shutil.copytree(tiny_model_dir, tmp_path / "model")
    before = digests(victim)
    result = invoke(["train-heads", tiny_model_dir, "--arch", "eagle", "--out", victim, *TINY_TRAINING])
    assert_one_error_line(result, "--out", "EAGLE-3")
    assert digests(victim) == before


def test_heads_out_naming_a_file_that_is_not_heads_is_refused(tiny_model_dir, tmp_path) -> None:
    """`--out MODEL_DIR/model.safetensors` replaced the model's weights with the heads."""
    victim = shutil.copytree(tiny_model_dir, tmp_path / "model")
    before = digests(victim)
    result = invoke(["train-heads", tiny_model_dir, "--out", victim / "model.safetensors", *TINY_TRAINING])
    assert_one_error_line(result, "--out", "not draft heads")
    assert digests(victim) == before


@pytest.mark.parametrize("arch", ["heads", "eagle"])
def test_a_run_whose_every_answer_is_held_out_is_refused_not_written_untrained(tiny_model_dir, tmp_path, arch):
    """--max-prompts 1 holds out its only prompt for the report: no training step ran, the random heads were
    written and the command said `wrote ...` with exit 0."""
    out = tmp_path / ("h.safetensors" if arch == "heads" else "e")
    args = ["train-heads", tiny_model_dir, "--arch", arch, "--out", out, "--max-prompts", "1", "--max-tokens", "4"]
    result = invoke([*args, "--samples", "0", "--epochs", "1"])
    assert_one_error_line(result, "nothing to train on", "--max-prompts")
    assert not out.exists()


@pytest.mark.parametrize("arch", ["heads", "eagle"])
def test_a_full_disk_at_the_final_save_is_one_line_and_leaves_no_torn_output(
    tiny_model_dir, tmp_path, monkeypatch, arch
) -> None:
    """The result is written beside --out and renamed: a save that fails half-way (a full disk) used to end in a
    traceback with a torn file (heads) or a config.json without its weights (eagle) where --out points."""
    from specchat.engine.drafters.eagle import EagleHead
    from specchat.engine.drafters.heads import DraftHeads

    cls = DraftHeads if arch == "heads" else EagleHead

    def full_disk_save(self, path: Path, target: dict) -> None:
        file = path if arch == "heads" else path / "model.safetensors"
        file.parent.mkdir(parents=True, exist_ok=True)
        if arch == "eagle":
            (path / "config.json").write_text("{}")
        file.write_bytes(b"\0" * 100)  # torn
        raise OSError(errno.ENOSPC, "No space left on device", str(file))

    monkeypatch.setattr(cls, "save", full_disk_save)
    out = tmp_path / ("h.safetensors" if arch == "heads" else "e")
    result = invoke(["train-heads", tiny_model_dir, "--arch", arch, "--out", out, *TINY_TRAINING])
    assert_one_error_line(result, str(out), "No space left on device")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name + ".work"]


def test_an_eagle_head_made_earlier_is_replaced_whole(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "e"
    assert invoke(["train-heads", tiny_model_dir, "--arch", "eagle", "--out", out, *TINY_TRAINING]).exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    again = invoke(["train-heads", tiny_model_dir, "--arch", "eagle", "--out", out, *TINY_TRAINING])
    assert again.exit_code == 0, again.output
    assert "eagle_config" in json.loads((out / "config.json").read_text())


def test_a_checkpoint_torch_cannot_write_is_one_line(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """torch.save reports a short write (a full disk) as a RuntimeError from its zip writer: it was a traceback."""
    import torch

    def short_write(obj, f, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6592 vs 6486")

    monkeypatch.setattr(torch, "save", short_write)
    out = tmp_path / "h.safetensors"
    result = invoke(["train-heads", tiny_model_dir, "--out", out, *TINY_TRAINING])
    assert_one_error_line(result, "checkpoint", "cannot write")
    assert not out.exists()


def test_an_out_where_nothing_can_be_made_is_refused_before_loading(tiny_model_dir, tmp_path) -> None:
    """/proc passes os.access for root, but nothing can be made there: the save failed after all the training."""
    result = invoke(["train-heads", tiny_model_dir, "--out", "/proc/h.safetensors", "--work", tmp_path / "w"])
    assert_one_error_line(result, "--out", "cannot write in /proc")


@pytest.mark.parametrize(("arch", "out", "work"), [("eagle", "e", "e"), ("eagle", "e", "e/w"), ("heads", "h", "h")])
def test_a_work_folder_that_the_result_would_replace_is_refused(tiny_model_dir, tmp_path, arch, out, work) -> None:
    """--work inside an eagle --out was deleted with it when the head replaced the folder; --work equal to a heads
    --out made a folder where the heads file was to go, and the save failed after all the training."""
    args = ["train-heads", tiny_model_dir, "--arch", arch, "--out", tmp_path / out, "--work", tmp_path / work]
    assert_one_error_line(invoke([*args, *TINY_TRAINING]), "--work", "inside --out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("arch", ["heads", "eagle"])
@pytest.mark.parametrize(("kv_memory", "max_tokens", "needle"), [("8K", "200", "answering"), ("16K", "10", "features")])
def test_a_kv_cache_too_small_for_training_says_so_and_how(
    tiny_model_dir, tmp_path, arch, kv_memory, max_tokens, needle
):
    """An answer the KV pool cut short was kept as training data, then the features failed with "KV cache full: not
    enough free pages for this step", which named neither the stage nor --kv-memory."""
    out = tmp_path / "o"
    args = ["train-heads", tiny_model_dir, "--arch", arch, "--out", out, "--kv-memory", kv_memory]
    result = invoke([*args, "--max-prompts", "2", "--max-tokens", max_tokens, "--samples", "0", "--epochs", "1"])
    assert_one_error_line(result, needle, "raise --kv-memory")
    assert not out.exists()


# --- quantize ---------------------------------------------------------------------------------------------------


def test_quantize_to_a_full_disk_is_one_line_and_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """safetensors reports a failed write as its own SafetensorError, not an OSError: it was a traceback."""
    from safetensors import SafetensorError

    from specchat.quant import checkpoint

    def full_disk(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")

    monkeypatch.setattr(checkpoint, "save_tensors", full_disk)
    out = tmp_path / "q"
    result = invoke(["quantize", tiny_model_dir, "--method", "rtn", "--out", out])
    assert_one_error_line(result, str(out), "File too large")
    assert list(tmp_path.iterdir()) == []


def test_quantize_some_linears_of_a_gguf_model_writes_the_others_dense(tmp_path) -> None:
    """On the CPU a GGUF model's block linears drop their float weights (int8 rows read only the blocks), so the
    checkpoint of `--layers all,-layers.0.*` lacked layer 0's weights: written with exit 0, it did not load
    ("checkpoint lacks layers.0.attn.wo.weight and 3 more"). The default model with `--layers lm_head` too."""
    import torch

    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine
    from specchat.safetensors_io import read_safetensors
    from tests.engine.tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny-q8.gguf", blocks=True)
    out = tmp_path / "q"
    result = invoke(["quantize", gguf, "--method", "rtn", "--layers", "all,-layers.0.*", "--out", out])
    assert result.exit_code == 0, result.output
    generated = invoke(["generate", out, "-p", "hi", "--max-tokens", "2"])
    assert generated.exit_code == 0, generated.output
    saved = read_safetensors(out / "model.safetensors")
    source = Engine.load(EngineConfig(model=str(gguf), device="cpu", cpu_act="fp32"))
    assert torch.equal(saved["layers.0.attn.wo.weight"], source.model.layers[0].attn.wo.weight.float())


def test_quantize_out_where_nothing_can_be_made_is_refused_before_quantizing() -> None:
    result = invoke(["quantize", "/nonexistent-model-dir-never-read", "--out", "/proc/q"])
    assert_one_error_line(result, "--out /proc/q", "cannot write in /proc")


def test_perplexity_of_a_text_as_long_as_the_context_says_why_it_is_one_window(tiny_model_dir, tmp_path) -> None:
    """`the text (2 tokens) is shorter than one window (2)` contradicted itself: a window is 3 tokens there."""
    text = tmp_path / "t.txt"
    text.write_text("hello world")  # 2 tokens of the tiny tokenizer
    result = invoke(["perplexity", tiny_model_dir, "--file", text, "--context", "2", "--stride", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert "the text (2 tokens) is shorter than one window (3 tokens: 2 of context and the next)" in result.stderr
    assert json.loads(result.stdout)["tokens"] == 1


# --- bench ------------------------------------------------------------------------------------------------------


def table_rows(output: str) -> list[list[str]]:
    lines = [line for line in output.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def test_bench_sessions_listed_twice_compare_with_the_first(tiny_model_dir, tmp_path) -> None:
    """`--sessions 1,1`: the first row read "0.61x" against itself (the base was the last run of the count)."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello there\nWrite a poem\n")
    result = invoke(["bench", tiny_model_dir, "--sessions", "1,1", "--prompts", prompts, "--max-tokens", "4"])
    assert result.exit_code == 0, result.output
    rows = table_rows(result.stdout)
    assert len(rows) == 2 and rows[0][5] == "1.00x"
    assert abs(float(rows[1][5].removesuffix("x")) - float(rows[1][4]) / float(rows[0][4])) < 0.02  # (rounded)


def test_bench_synthetic_batch_listed_twice_compares_with_the_first_plain_run() -> None:
    result = invoke(["bench", "--synthetic", "tiny", "--batch", "1,1", "--k", "0", "--steps", "2", "--context", "8"])
    assert result.exit_code == 0, result.output
    rows = table_rows(result.stdout)
    assert len(rows) == 2 and rows[0][10] == "1.00x"
    assert "| step P50 ms |" in result.stdout  # a median (tok/s is the whole run's mean): not "step ms"


def test_bench_more_sessions_than_the_kv_cache_holds_is_refused(tiny_model_dir, tmp_path) -> None:
    """`--sessions 99999999999` ended in a MemoryError traceback (a list of every request number)."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello there\n")
    result = invoke(["bench", tiny_model_dir, "--sessions", "99999999999", "--prompts", prompts, "--max-tokens", "4"])
    assert_one_error_line(result, "--sessions 99999999999", "KV cache")


def test_bench_runs_more_sessions_than_the_engines_default_batch_at_once(tiny_model_dir, tmp_path, monkeypatch):
    """`--sessions 70` ran at most 64 requests at once (EngineConfig.max_running's default) under a row saying 70."""
    from specchat.cli import bench as bench_cli
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine

    asked = []

    def load(config, progress=None):
        asked.append(config.max_running)
        raise SystemExit(3)  # what the engine would be asked for is all this test needs

    monkeypatch.setattr(Engine, "load", load)
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello\n")
    with pytest.raises(SystemExit):
        bench_cli.bench_sessions(EngineConfig(model=str(tiny_model_dir)), prompts, "1,70", 4, "none", "4", False)
    assert asked == [70]


def test_bench_names_the_prompt_past_the_context_and_notes_answers_cut_by_it(tiny_model_dir, tmp_path) -> None:
    """A prompt past the context failed with a message naming neither --prompts nor the prompt; --max-tokens past
    the context ran shorter answers than asked without a word."""
    long = tmp_path / "long.txt"
    long.write_text("hi\n" + "word " * 2000 + "\n")
    result = invoke(["bench", tiny_model_dir, "--sessions", "1", "--prompts", long, "--requests", "2"])
    assert_one_error_line(result, "--prompts, prompt 2:", "context")
    short = tmp_path / "short.txt"
    short.write_text("hi\n")
    result = invoke(["bench", tiny_model_dir, "--sessions", "1", "--prompts", short, "--max-tokens", "1000"])
    assert result.exit_code == 0, result.output
    assert "--max-tokens 1000 after a prompt of" in result.stderr and "past the model's context (256)" in result.stderr


def test_bench_synthetic_refuses_a_context_past_the_shapes() -> None:
    """`--synthetic tiny --context 2000` timed requests past the shape's 1,024 positions without a word."""
    result = invoke(["bench", "--synthetic", "tiny", "--context", "2000"])
    assert_one_error_line(result, "--context 2000", "1024")
    # ... and one whose steps would decode past it: 1000 + (4 warm-up + 64) x 5 positions at k = 4
    result = invoke(["bench", "--synthetic", "tiny", "--context", "1000", "--k", "0,4"])
    assert_one_error_line(result, "--context 1000", "position 1340", "1024")


def test_bench_synthetic_step_p50_is_the_per_token_p50_of_plain_decoding() -> None:
    """Plain decoding gives one token a step, so the two medians are one: with an even step count the step's was
    the upper middle (179.95 against 145.97 ms over 2 steps)."""
    result = invoke(["bench", "--synthetic", "tiny", "--k", "0", "--steps", "2", "--context", "8", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.splitlines()[0])
    assert row["step_ms"] == pytest.approx(row["latency_p50_ms"], rel=1e-6)


def test_ctrl_c_in_train_heads_says_what_was_kept_and_how_to_resume(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """Ctrl-C after hours of answers ended with a blank line: nothing said the work folder lets it resume."""
    from specchat.engine import train_heads as engine_train_heads

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_train_heads, "train_heads", interrupted)
    out = tmp_path / "h.safetensors"
    result = invoke(["train-heads", tiny_model_dir, "--out", out, *TINY_TRAINING])
    assert result.exit_code == 130 and "Traceback" not in result.output
    assert f"specchat: interrupted; {out} not written. The same command resumes from {out}.work" in result.stderr
    assert result.stderr.count("specchat: interrupted") == 1  # (said once: not the plain line after it)
    assert not out.exists()


def test_ctrl_c_in_a_long_command_says_it_was_interrupted(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """bench, perplexity and quantize stopped by Ctrl-C ended with a blank line on stderr and exit 130: a run cut
    short read like one that had nothing to say."""
    from specchat.engine.engine import Engine

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "load", interrupted)
    text = tmp_path / "t.txt"
    text.write_text("some text to score " * 20)
    bench = ["bench", tiny_model_dir, "--sessions", "1", "--prompts", text]
    for args in (bench, ["perplexity", tiny_model_dir, "--file", text]):
        result = invoke(args)
        assert result.exit_code == 130 and "Traceback" not in result.output, (args, result.output)
        assert [line for line in result.stderr.splitlines() if line] == ["specchat: interrupted"], result.stderr


def test_bench_synthetic_refuses_an_acceptance_no_row_uses() -> None:
    """`--k 0 --acceptance 0.5` printed a plain-decoding table as if the rate had been measured with."""
    result = invoke(["bench", "--synthetic", "tiny", "--k", "0", "--acceptance", "0.5"])
    assert_one_error_line(result, "--acceptance", "--k 0")
    assert invoke(["bench", "--synthetic", "tiny", "--k", "0", "--steps", "1", "--context", "4"]).exit_code == 0
