"""What a user hands the CLI as text: files named by flags, prompt files (plain or JSONL) and stdin.

Every way such input can be wrong (unreadable, not UTF-8, empty, a JSONL line that is not a prompt) becomes one
error line that names the flag and the file (docs/style.md #12). A prompt file's lines fail one by one: a bad
line becomes a PromptItem with an error, so `generate` still reports every other prompt.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from specchat.errors import ConfigError, PromptError, SpecchatError

JSONL_SUFFIX = ".jsonl"  # a prompt file with this suffix holds one JSON object per line
MESSAGE_KEYS = ("role", "content")
ROLES = ("system", "user", "assistant")  # what the chat templates take
BOM = "\ufeff"  # a UTF-8 byte order mark: Windows editors (and PowerShell 5's Out-File) start files with one


def utf8_error(exc: UnicodeDecodeError) -> str:
    return f"not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"


def given_path(text: str, flag: str, hint: str = "name a file or folder") -> Path:
    """A path flag's value; an empty one (a shell variable that was not set) is refused, not read as "."."""
    if not text.strip():
        raise ConfigError(f"{flag} is empty: {hint}")
    return Path(text)


def read_text(path: Path, flag: str) -> str:
    """The UTF-8 text of a file a flag names; ConfigError naming both if it cannot be read or decoded."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{flag} {path}: {utf8_error(exc)}") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read ({exc.strerror or exc})") from None


def read_nonempty_text(path: Path, flag: str) -> str:
    """read_text, refusing a file with nothing but whitespace (a byte order mark counts as none: Windows editors
    save an empty UTF-8 file as one, which `perplexity` scored as 2 tokens). A BOM before text is kept."""
    text = read_text(path, flag)
    if not text.replace(BOM, "").strip():
        raise ConfigError(f"{flag} {path}: the file has no text")
    return text


def read_prompt_text(path: Path, flag: str) -> str:
    """read_text less a leading byte order mark, which is no part of the first prompt (in a .jsonl file it made
    line 1 invalid JSON; in a plain file it went to the model as a token of the first prompt)."""
    return read_text(path, flag).removeprefix(BOM)


def read_prompt_lines(path: Path, flag: str) -> list[str]:
    """The non-blank lines of a plain prompt file (one prompt per line)."""
    prompts = [line for line in read_prompt_text(path, flag).splitlines() if line.strip()]
    if not prompts:
        raise PromptError(f"{flag} {path}: no prompts (one per line)")
    return prompts


def is_non_utf8(text: str) -> bool:
    """True for text decoded with errors="surrogateescape" from bytes that are not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_flag_text(flag: str, value: str | None) -> None:
    """A text flag (--system, --stop) holds UTF-8: bytes that are not reach Python as lone surrogates, and the
    engine then refused every prompt as "not valid Unicode text", naming --prompt or each line of a prompts file
    (every message of `run`) instead of the flag."""
    if value is None or not is_non_utf8(value):
        return
    try:
        value.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{flag}: {utf8_error(exc)}") from None
    except UnicodeEncodeError:  # (a lone surrogate that stands for no byte)
        pass
    raise ConfigError(f"{flag}: not valid Unicode text (it holds a lone surrogate)")


@dataclass(slots=True)
class PromptItem:
    """One prompt to run: text or chat messages, or why its line could not be read (`prompt` is then None)."""

    where: str  # "line 3" of a prompt file, "--prompt" or "stdin"
    prompt: str | list[dict] | None
    error: str | None = None
    max_tokens: int | None = None  # a .jsonl line's own cap on its answer (else --max-tokens)


def read_prompts(prompt: str | None, prompts_file: Path | None) -> list[PromptItem]:
    """The prompts of `generate`: --prompt, --prompts-file (plain or JSONL), else stdin when it is not a terminal."""
    if prompt is not None and prompts_file is not None:
        raise click.UsageError("give one of --prompt or --prompts-file, not both")
    if prompt is not None:
        return [PromptItem("--prompt", prompt)]
    if prompts_file is not None:
        return read_prompt_file(prompts_file)
    if sys.stdin is None:  # closed (`<&-`, a service without one): it raised AttributeError's traceback
        raise click.UsageError("stdin is closed: give --prompt or --prompts-file")
    if sys.stdin.isatty():
        raise click.UsageError("give --prompt, --prompts-file, or the prompt on stdin (echo hi | specchat generate)")
    try:
        text = sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"stdin: {utf8_error(exc)}") from None
    # CR LF (Windows pipes: PowerShell's `echo hi |`) as the line end it is: each CR was a token of the prompt
    return [PromptItem("stdin", text.removeprefix(BOM).replace("\r\n", "\n").removesuffix("\n"))]


def check_stdout() -> None:
    """The answers have somewhere to go: with stdout closed (`>&-`) `generate` printed nothing and exited 0, and
    `run --plain` aborted (exit 134) after a traceback."""
    if sys.stdout is None:
        raise SpecchatError("stdout is closed: the answers would go nowhere (redirect it to a file, or to /dev/null)")


def read_prompt_file(path: Path) -> list[PromptItem]:
    """One PromptItem per non-blank line; a .jsonl file's lines are {"prompt": text} or {"messages": [...]}."""
    jsonl = path.suffix.lower() == JSONL_SUFFIX
    items = [
        jsonl_item(line, number) if jsonl else PromptItem(f"line {number}", line)
        for number, line in enumerate(read_prompt_text(path, "--prompts-file").splitlines(), 1)
        if line.strip()
    ]
    if not items:
        raise PromptError(f"--prompts-file {path}: no prompts (one per line)")
    return items


def jsonl_item(line: str, number: int) -> PromptItem:
    """A JSONL line: an object with "prompt" (a string) or "messages" (a list of {role, content}), and optionally
    "max_tokens" (a positive integer: this answer's cap instead of --max-tokens); other keys (the shipped prompt
    sets' "id" and "split") are ignored."""
    where = f"line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return PromptItem(where, None, f"invalid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
        return PromptItem(where, None, 'expected an object with "prompt" or "messages" (not both)')
    cap = record.get("max_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        return PromptItem(where, None, f'"max_tokens" must be a positive integer, got {json.dumps(cap)}')
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            return PromptItem(where, None, f'"prompt" must be a string, got {type(record["prompt"]).__name__}')
        return PromptItem(where, record["prompt"], max_tokens=cap)
    messages = record["messages"]
    good = isinstance(messages, list) and messages
    good = good and all(
        isinstance(m, dict) and all(isinstance(m.get(key), str) for key in MESSAGE_KEYS) for m in messages
    )
    if not good:
        return PromptItem(where, None, '"messages" must be a non-empty list of {"role": str, "content": str}')
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            return PromptItem(where, None, f"messages[{i}] has role {m['role']!r}: one of {', '.join(ROLES)}")
    return PromptItem(where, [{key: m[key] for key in MESSAGE_KEYS} for m in messages], max_tokens=cap)
