"""What a user new to quantize / perplexity / pull / train-heads runs into first: a typo'd model name, an empty or
odd --out, GPTQ flags given to round to nearest, a text shorter than the window. Each failure is one line,
`specchat: error: ...`, with a nonzero exit; each success says what it did, not what an earlier run did."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from specchat.cli import main

pytestmark = pytest.mark.timeout(240)


def invoke(args: list[str], env: dict | None = None) -> Result:
    return CliRunner().invoke(main, args, env=env, catch_exceptions=True)


def error_line(result: Result) -> str:
    """The one line a failure printed (asserting it is one, with a nonzero exit and no traceback)."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specchat: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("typo", ["smolm2-135m", "smollm2-13m", "SmolLM2-135M"])
def test_a_typo_of_an_alias_suggests_it(typo: str) -> None:
    assert "did you mean 'smollm2-135m'?" in error_line(invoke(["pull", typo]))


def test_a_name_like_no_alias_suggests_nothing() -> None:
    assert "did you mean" not in error_line(invoke(["pull", "gpt4"]))


def test_hub_failure_names_the_cause_once(monkeypatch) -> None:
    import huggingface_hub

    from specchat.errors import OfflineError
    from specchat.registry import ModelSpec, _fetch_hf

    def offline(*args, **kwargs):
        raise OSError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened ...")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(OfflineError) as caught:
        _fetch_hf(ModelSpec(alias="org/name", source="hf", repo="org/name"))
    assert str(caught.value) == (
        "model 'org/name' is not in the Hugging Face cache and could not be fetched: "
        "ConnectError: [Errno -2] Name or service not known"
    )


# --- perplexity -------------------------------------------------------------------------------------------------
def test_a_context_alone_takes_half_of_it_as_stride(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--context 16 alone was refused for the default stride (512) that nobody gave."""
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 10)
    result = invoke(["perplexity", str(tiny_model_dir), "--device", "cpu", "--file", str(text), "--context", "16"])
    assert result.exit_code == 0, result.output
    assert "(context 16, stride 8)" in result.stdout


def test_a_text_shorter_than_the_window_says_so(tiny_model_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("def f(x): return x")
    result = invoke(["perplexity", str(tiny_model_dir), "--device", "cpu", "--file", str(text), "--json"])
    assert result.exit_code == 0, result.output
    assert "is shorter than one window" in result.stderr and '"tokens"' in result.stdout


def test_a_long_text_says_it_is_being_tokenized(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """A 16 MB --file was tokenized for ~14 s with nothing on the screen before the progress bar."""
    from specchat.cli import perplexity

    monkeypatch.setattr(perplexity, "LONG_TEXT_CHARS", 100)
    text = tmp_path / "t.txt"
    text.write_text("def f(x): return x\n" * 10)
    result = invoke(["perplexity", str(tiny_model_dir), "--device", "cpu", "--file", str(text), "--context", "16"])
    assert result.exit_code == 0, result.output
    assert "specchat: tokenizing 0.0 MB of text..." in result.stderr


@pytest.mark.parametrize("content", [b"\xef\xbb\xbf", b"\xef\xbb\xbf \r\n"])
def test_a_file_of_only_a_byte_order_mark_has_no_text(tiny_model_dir: Path, tmp_path: Path, content: bytes) -> None:
    """An empty UTF-8 file saved with a BOM (Windows editors) was scored: "perplexity 2565.2215 over 2 tokens"."""
    text = tmp_path / "t.txt"
    text.write_bytes(content)
    result = invoke(["perplexity", str(tiny_model_dir), "--device", "cpu", "--file", str(text)])
    assert "the file has no text" in error_line(result)


# --- quantize ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--method", "rtn", "--damp", "0.1"], ["--damp", "for --method gptq"]),
        (["--method", "rtn", "--no-act-order", "--calibration-tokens", "9"], ["--act-order, --calibration-tokens"]),
        (["--damp", "1e100"], ["--damp must be in (0, 1000]"]),
        (["--damp", "inf"], ["--damp must be in (0, 1000]"]),
    ],
)
def test_quantize_flags_refused_before_loading(tiny_model_dir: Path, tmp_path: Path, flags, needles) -> None:
    line = error_line(invoke(["quantize", str(tiny_model_dir), "--out", str(tmp_path / "q"), *flags]))
    assert all(needle in line for needle in needles), line
    assert not (tmp_path / "q").exists()


def test_an_empty_out_is_refused_not_read_as_here(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert "--out is empty" in error_line(invoke(["quantize", str(tiny_model_dir), "--method", "rtn", "--out", ""]))


def test_out_the_current_folder_is_refused(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """The checkpoint replaces its folder whole; `--out .` failed with a traceback after quantizing."""
    monkeypatch.chdir(tmp_path)
    line = error_line(invoke(["quantize", str(tiny_model_dir), "--method", "rtn", "--out", "."]))
    assert "the current folder" in line and list(tmp_path.iterdir()) == []


def test_an_out_with_dots_writes_where_it_names(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    result = invoke(["quantize", str(tiny_model_dir), "--method", "rtn", "--out", "../q"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "q" / "specchat_mxfp4.json").is_file()


def test_a_singular_hessian_is_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Ten calibration tokens and no dampening: Cholesky's LinAlgError was a traceback."""
    text = tmp_path / "short.txt"
    text.write_text("Hello there, this is short.")
    args = ["--out", str(tmp_path / "q"), "--calibration", str(text), "--damp", "1e-300", "--device", "cpu"]
    line = error_line(invoke(["quantize", str(tiny_model_dir), *args]))
    assert "Hessian is singular" in line and "raise --damp" in line
    assert not (tmp_path / "q").exists()


def test_a_cached_checkpoint_is_reported_as_reused(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The second run quantized nothing but printed the first run's time as its own."""
    env = {"SPECCHAT_HOME": str(tmp_path)}
    first = invoke(["quantize", str(tiny_model_dir), "--method", "rtn", "--device", "cpu"], env=env)
    again = invoke(["quantize", str(tiny_model_dir), "--method", "rtn", "--device", "cpu"], env=env)
    assert first.exit_code == 0 and again.exit_code == 0, first.output + again.output
    assert "already in the cache" not in first.stdout and "already in the cache" in again.stdout


def test_gptq_says_how_many_tokens_it_calibrated_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ["--out", str(tmp_path / "q"), "--calibration-tokens", "100", "--device", "cpu"]
    result = invoke(["quantize", str(tiny_model_dir), *args])
    assert result.exit_code == 0, result.output
    assert "100 calibration tokens" in result.stdout


# --- train-heads ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--out", ""], "--out is empty"),
        (["--arch", "eagle", "--out", ""], "--out is empty"),
        (["--out", "h.safetensors", "--work", ""], "--work is empty"),
    ],
)
def test_train_heads_refuses_an_empty_place(tiny_model_dir: Path, tmp_path: Path, monkeypatch, flags, needle) -> None:
    """An empty --out was a traceback; an empty --work trained into the current folder."""
    monkeypatch.chdir(tmp_path)
    assert needle in error_line(invoke(["train-heads", str(tiny_model_dir), *flags]))
    assert list(tmp_path.iterdir()) == []
