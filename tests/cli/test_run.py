"""`specchat run --plain`: input is read from the first moment (a message typed before the model is ready waits
for it), /commands never reach the model, and speculation follows the model's models.toml drafter."""

from __future__ import annotations

import io
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
from click.testing import CliRunner

from specchat.cli import main
from specchat.cli.run import REPL_HELP, LoadProgress, PlainChat, plain_repl
from specchat.config import SamplingParams, SpecParams
from specchat.registry import resolve


def repl(lines: list[str], loading: Future, monkeypatch) -> PlainChat:
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    chat = PlainChat(loading, LoadProgress(), SamplingParams(max_tokens=3, ignore_eos=True), SpecParams("none", 4))
    plain_repl(chat)
    return chat


def test_a_message_typed_before_the_model_is_ready_waits_for_it(tiny_engine, monkeypatch, capsys):
    loading: Future = Future()
    threading.Timer(0.5, loading.set_result, [tiny_engine]).start()  # the model is ready half a second later
    chat = repl(
        ["/help", "/k 2", "hello", "//etc/hosts is a path", "/drafter ngram", "/k", "/quit", "ignored"],
        loading,
        monkeypatch,
    )
    err = capsys.readouterr().err
    assert REPL_HELP in err and "(k 2)" in err and "(drafter ngram)" in err
    assert err.index("(waiting for the model…)") < err.index("[3 tokens")
    users = [m["content"] for m in chat.messages if m["role"] == "user"]
    assert users == ["hello", "/etc/hosts is a path"]  # commands never reach the model, // sends a /
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2
    assert chat.spec == SpecParams("ngram", 2)


def test_mistakes_are_one_line_and_the_repl_goes_on(tiny_engine, monkeypatch, capsys):
    loading: Future = Future()
    loading.set_result(tiny_engine)
    chat = repl(["/k many", "/k 99", "/drafter nope", "/what", "/clear", "hi"], loading, monkeypatch)
    err = capsys.readouterr().err
    assert "error: /k must be an integer or 'auto', got 'many'\n" in err
    assert (
        "error: /k must be in [0, 8] or 'auto', got 99\n" in err
        and "error: /drafter: unknown drafter 'nope' (available: " in err
    )
    assert "unknown command /what: /help lists them" in err and "(conversation cleared)" in err
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["hi"]


def test_a_drafter_that_does_not_load_is_one_line_and_the_repl_goes_on(tiny_engine, monkeypatch, capsys, tmp_path):
    """A heads file that is not one, or a draft model that does not exist: one error line, the chat goes on (it
    ended the REPL with the conversation lost)."""
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    loading: Future = Future()
    loading.set_result(tiny_engine)
    lines = [f"/drafter heads:{junk}", f"/drafter draft-model:{tmp_path / 'nope'}", f"/drafter heads:{tmp_path}", "hi"]
    chat = repl(lines, loading, monkeypatch)
    err = capsys.readouterr().err
    assert err.count("error: ") == 3 and "Traceback" not in err
    assert f"draft heads file: {tmp_path} is a directory, not a file" in err
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["hi"] and chat.spec.drafter == "none"


def test_an_answer_the_kv_cache_cut_is_shown_and_left_out_of_the_conversation(tiny_model_dir, tiny_engine, capsys):
    """The KV cache fills mid-answer: the error is named, and the turn is left out of the conversation, so the next
    message is answered (it failed too, with no reason given, as the cut turn stayed in the history)."""
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine

    per_token = tiny_engine.pool.bytes_per_token
    small = Engine.load(
        EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", kv_memory=per_token * 48)
    )
    loading: Future = Future()
    loading.set_result(small)
    chat = PlainChat(loading, LoadProgress(), SamplingParams(max_tokens=200, ignore_eos=True), SpecParams("none", 0))
    chat.send("a long answer please")
    assert chat.messages == []
    chat.sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    chat.send("hi")
    captured = capsys.readouterr()
    assert "error: " in captured.err and "KV" in captured.err and "left out of the conversation" in captured.err
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] and chat.messages[0]["content"] == "hi"
    assert captured.err.count("error: ") == 1 and captured.out.endswith("\n")
    assert (chat.failed, chat.sent) == (1, 2)  # (what `run` counts for its exit status with piped input)


def test_run_follows_the_models_drafter(tiny_model_dir: Path, tmp_path: Path):
    """An alias whose models.toml entry names a drafter: `run` uses it unless --drafter says otherwise."""
    (tmp_path / "models.toml").write_text(
        f'[models.tiny]\nsource = "dir"\npath = "{tiny_model_dir}"\ndrafter = "ngram"\n'
    )
    env = {"SPECCHAT_HOME": str(tmp_path)}
    runner = CliRunner()
    result = runner.invoke(main, ["run", "tiny", "--plain"], input="/drafter\n/quit\n", env=env)
    assert result.exit_code == 0, result.output
    assert "loading tiny (drafter ngram, k auto)" in result.stderr and "(drafter ngram)" in result.stderr
    result = runner.invoke(main, ["run", "tiny", "--plain", "--drafter", "none"], input="/quit\n", env=env)
    assert "loading tiny (drafter none, k auto)" in result.stderr
    assert "[default: default]" in " ".join(runner.invoke(main, ["run", "--help"]).output.split())


def test_the_default_model_drafts_where_drafting_measured_faster():
    """docs/benchmarks.md: ngram+heads on the CPU (1.66x plain decoding under int8 rows, fifth lease) and on the
    H200, where its steps run ahead of the host since the twenty-fifth session (1.38-1.55x plain decoding at one session
    with --k auto over four runs, 1.62x at k = 4; the heads alone 1.46x there); under --tp, which splits the output head the heads
    read, plain decoding."""
    spec = resolve(None)
    assert spec.default_drafter("cpu") == spec.default_drafter("cuda") == "ngram+heads"
    assert spec.default_drafter("cuda", tp=2) == "none"


def test_a_bad_model_name_fails_before_anything_loads():
    result = CliRunner().invoke(main, ["run", "no-such-model", "--plain"], input="hi\n")
    assert result.exit_code == 1 and result.stderr.startswith("specchat: error: unknown model 'no-such-model'")


def test_leaving_before_the_model_has_loaded_ends_the_chat_cleanly(default_model_path: Path):
    """`/quit` or the end of input while the model still loads: the process ends at once with the command's status,
    where Python's own exit tore the interpreter down under the loader (torch aborted it: exit 134). A real process
    (the hook ends it with os._exit); the default model's load takes seconds, the tiny one's may beat the /quit."""
    import subprocess
    import sys

    for stdin, status in ((b"/quit\n", 0), (b"", 0), (b"hi \xff\n", 1)):
        proc = subprocess.run(
            [sys.executable, "-m", "specchat", "run", "--plain", "--max-tokens", "2"], input=stdin,
            capture_output=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == status, proc.stderr
        assert b"terminate" not in proc.stderr and b"FATAL" not in proc.stderr and b"Traceback" not in proc.stderr


def test_an_answer_of_one_token_shows_no_decode_rate(tiny_engine, monkeypatch, capsys):
    """The rate is over the gaps after the first token: one token has none to time (it read 0.0 tok/s)."""
    loading: Future = Future()
    loading.set_result(tiny_engine)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    chat = PlainChat(loading, LoadProgress(), SamplingParams(max_tokens=1, ignore_eos=True), SpecParams("none", 0))
    plain_repl(chat)
    err = capsys.readouterr().err
    assert "[1 token, " in err and "tok/s" not in err


def test_piped_answers_on_stdout_carry_no_prompts(tiny_model_dir: Path):
    """`specchat run --plain < questions > answers`: stdout holds the answers alone, one line each; the "> "
    prompts (input()'s, written to stdout) began every line of the file and ended it with a stray "> "."""
    args = ["run", str(tiny_model_dir), "--plain", "--drafter", "none", "--max-tokens", "3"]
    result = CliRunner().invoke(main, args, input="hello\nsecond line \\\ncontinued\n")
    assert result.exit_code == 0, result.output
    lines = result.stdout.split("\n")
    assert len(lines) == 3 and lines[2] == "", result.stdout  # two answers, each ending its line
    assert not any(line.startswith(("> ", ". ")) for line in lines), result.stdout


@pytest.mark.parametrize("messages", [["word " * 300, "hi"], ["word " * 300, "word " * 301]], ids=["one", "all"])
def test_piped_messages_whose_answers_failed_end_in_status_1(tiny_model_dir: Path, messages: list[str]):
    """A script piping messages in could not tell that answers had failed: every message past the context was an
    `error:` line, and the exit status 0. With stdin not a terminal the chat still goes on to the end, then one more
    line counts the failures, exit status 1."""
    args = ["run", str(tiny_model_dir), "--plain", "--drafter", "none", "--max-tokens", "3"]
    result = CliRunner().invoke(main, args, input="".join(f"{m}\n" for m in messages))
    failed = sum(m.startswith("word") for m in messages)
    assert result.exit_code == 1, result.output
    assert result.stderr.count("error: prompt is ") == failed and "Traceback" not in result.stderr
    last = result.stderr.rstrip("\n").splitlines()[-1]
    assert last == f"specchat: error: {failed} of {len(messages)} messages ended in an error (each named above)"
    assert result.stdout.count("\n") == len(messages) - failed  # the answer that came, on stdout


class InterruptedOnce(Future):
    """A load that the user's Ctrl-C interrupts the first time someone waits for it, then ends with `engine`."""

    def __init__(self, engine) -> None:
        super().__init__()
        self.engine, self.waits = engine, 0

    def done(self) -> bool:
        return self.waits > 0

    def result(self, timeout=None):
        self.waits += 1
        if self.waits == 1:
            raise KeyboardInterrupt
        return self.engine


def test_ctrl_c_while_an_answer_waits_for_the_model_stops_that_answer(tiny_engine, monkeypatch, capsys):
    """Ctrl-C after "(waiting for the model…)" stops that answer and the chat goes on, as Ctrl-C during an answer
    does; it ended the REPL (exit 130) with whatever was typed lost."""
    try:
        chat = repl(["hi", "again"], InterruptedOnce(tiny_engine), monkeypatch)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while waiting for the model ended the chat")
    err = capsys.readouterr().err
    assert "[stopped]" in err and "[3 tokens" in err
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["again"]


def test_a_conversation_grown_past_the_context_says_so_and_clear_goes_on(tiny_engine, monkeypatch, capsys):
    """The history is part of every prompt: past the context each later message failed with "prompt is N tokens",
    N far above what was typed, and nothing said how to go on. The error says the conversation is in it and that
    /clear starts afresh; the conversation is kept until then, and answered after it."""
    loading: Future = Future()
    loading.set_result(tiny_engine)
    long = "word " * 230  # 243 of the tiny model's 256 positions with the template: no other message fits beside
    chat = repl([long, "hi", "again", "/clear", "hi"], loading, monkeypatch)
    err = capsys.readouterr().err
    assert err.count("error: prompt is ") == 2 and err.count("/clear starts a new one") == 2, err
    assert "Traceback" not in err and err.count("[3 tokens") == 2
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["hi"]


def test_a_first_message_past_the_context_says_nothing_of_the_conversation(tiny_engine, monkeypatch, capsys):
    loading: Future = Future()
    loading.set_result(tiny_engine)
    chat = repl(["word " * 300], loading, monkeypatch)
    err = capsys.readouterr().err
    assert "error: prompt is " in err and "/clear" not in err and chat.messages == []


def test_ctrl_c_while_a_message_is_encoded_stops_that_answer(tiny_engine, monkeypatch, capsys):
    """Ctrl-C just after Enter lands in submit() while a long conversation is encoded: it ended the chat (exit 130,
    the conversation lost) instead of stopping that answer."""
    submit, calls = tiny_engine.submit, []

    def interrupted_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return submit(*args, **kwargs)

    monkeypatch.setattr(tiny_engine, "submit", interrupted_once)
    loading: Future = Future()
    loading.set_result(tiny_engine)
    try:
        chat = repl(["hi", "stopped", "again"], loading, monkeypatch)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while the message was encoded ended the chat")
    err = capsys.readouterr().err
    assert "[stopped]" in err and err.count("[3 tokens") == 2
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["hi", "again"]


def run_closed(args: list[str], fd: int):
    """`specchat ARGS` in a process started with file descriptor `fd` closed (`<&-` or `>&-` in a shell)."""
    import os
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "specchat", *args], stdin=subprocess.DEVNULL, capture_output=True,
        preexec_fn=lambda: os.close(fd), timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("plain", [["--plain"], []], ids=["plain", "tui"])
def test_a_closed_stdin_is_the_end_of_input(tiny_model_dir: Path, plain: list[str]):
    """`specchat run <&-` (a service, cron): stdin is None in Python, and the REPL (or the choice of it) ended in an
    AttributeError's traceback; it is an input with no messages, as /dev/null's."""
    proc = run_closed(["run", str(tiny_model_dir), *plain, "--device", "cpu", "--max-tokens", "2"], 0)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr


def test_a_closed_stdout_is_one_line():
    """`specchat run --plain >&-`: input() raised 'lost sys.stdout', then the exit hook's flush, and torch aborted the
    process (exit 134); nothing loads now, one line says why."""
    proc = run_closed(["run", "--plain", "--max-tokens", "2"], 1)
    assert proc.returncode == 1 and proc.stderr.decode().splitlines() == [
        "specchat: error: stdout is closed: the answers would go nowhere (redirect it to a file, or to /dev/null)"
    ]


def scripted_input(monkeypatch, answers: list, terminal: bool) -> None:
    """stdin as a person at a terminal (or a pipe) gives it: each item a line, or an exception input() raises."""
    feed = iter(answers)

    def ask(prompt: str) -> str:
        item = next(feed, EOFError())
        if isinstance(item, BaseException):
            raise item
        return item

    monkeypatch.setattr("specchat.cli.run.ask", ask)
    monkeypatch.setattr("specchat.cli.run.stdin_is_terminal", lambda: terminal)


def test_ctrl_c_at_the_prompt_drops_the_line_and_the_chat_goes_on(tiny_engine, monkeypatch, capsys):
    """A second Ctrl-C meant for an answer that had just ended landed at the prompt and left the REPL, the
    conversation with it (exit 130); at a terminal it drops the line being typed, as a shell does."""
    loading: Future = Future()
    loading.set_result(tiny_engine)
    chat = PlainChat(loading, LoadProgress(), SamplingParams(max_tokens=3, ignore_eos=True), SpecParams("none", 4))
    scripted_input(monkeypatch, ["hello", "half a line \\", KeyboardInterrupt(), "again"], terminal=True)
    plain_repl(chat)
    assert [m["content"] for m in chat.messages if m["role"] == "user"] == ["hello", "again"]
    assert "(Ctrl-D or /quit leaves)" in capsys.readouterr().err
    scripted_input(monkeypatch, ["hello", KeyboardInterrupt(), "never read"], terminal=False)
    with pytest.raises(KeyboardInterrupt):  # piped messages: Ctrl-C stops the command
        plain_repl(chat)


def test_a_system_prompt_that_is_not_utf8_is_named_before_anything_loads(tiny_model_dir: Path):
    """`run --system $'\\xff'` refused every message, each as "the prompt is not valid Unicode text"."""
    result = CliRunner().invoke(main, ["run", str(tiny_model_dir), "--plain", "--system", "be\udcff"], input="hi\n")
    assert result.exit_code == 1
    assert result.stderr.splitlines() == ["specchat: error: --system: not valid UTF-8 (byte 0xff at offset 2)"]
