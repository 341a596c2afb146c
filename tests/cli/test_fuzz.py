"""Bad input of every kind fed to the CLI (issue 19; docs/reliability.md counts and lists the cases).

Each case must end in exactly one line on stderr, `specchat: error: ...`, that names the flag or the file and
what is wrong, with a nonzero exit status: never a traceback, never a hang (every test has a timeout). The cases
run in-process through click's CliRunner on the tiny model (no download); a few run as real processes, where
stdin and the locale's decoding are the operating system's.

Groups: text files and stdin; model files (config.json, safetensors, side files, the chat template, GGUF);
flags (sampling, engine, drafters, bench, quantize, perplexity, train-heads, agent); models.toml; and the prompt
file contract of `generate` (one record per prompt, the bad ones failing alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from specchat.cli import main
from tests.cli.fuzz_inputs import BAD_UTF8, BROKEN_CONFIG_ENTRIES, Fixtures, build_fixtures

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def fx(tmp_path_factory, tiny_model_dir: Path) -> Fixtures:
    return build_fixtures(tmp_path_factory.mktemp("fuzz"), tiny_model_dir)


# --- the cases ------------------------------------------------------------------------------------------------
# (id, argv, words the one error line must hold, extra: env / stdin). In argv and env, {tiny} is the tiny
# model, {root} the fixtures' folder, {text} its text files, {models} the broken models, {gguf}, {heads}.
TEXT_CASES = [
    ("prompts-file not UTF-8", ["generate", "{tiny}", "--prompts-file", "{text}/bad.txt"], ["--prompts-file", "UTF-8"]),
    (
        "prompts-file empty",
        ["generate", "{tiny}", "--prompts-file", "{text}/empty.txt"],
        ["--prompts-file", "no prompts"],
    ),
    ("prompts-file blank lines", ["generate", "{tiny}", "--prompts-file", "{text}/blank.txt"], ["--prompts-file"]),
    ("prompts-file missing", ["generate", "{tiny}", "--prompts-file", "{text}/nope.txt"], ["--prompts-file", "exist"]),
    ("prompts-file a folder", ["generate", "{tiny}", "--prompts-file", "{text}"], ["--prompts-file", "directory"]),
    ("prompts-file jsonl not UTF-8", ["generate", "{tiny}", "--prompts-file", "{text}/bad.jsonl"], ["UTF-8"]),
    ("perplexity --file not UTF-8", ["perplexity", "{tiny}", "--file", "{text}/bad.txt"], ["--file", "UTF-8"]),
    ("perplexity --file empty", ["perplexity", "{tiny}", "--file", "{text}/empty.txt"], ["--file", "no text"]),
    (
        "quantize --calibration not UTF-8",
        ["quantize", "{tiny}", "--out", "{root}/q", "--calibration", "{text}/bad.txt"],
        ["--calibration", "UTF-8"],
    ),
    (
        "quantize --calibration empty",
        ["quantize", "{tiny}", "--out", "{root}/q", "--calibration", "{text}/empty.txt"],
        ["--calibration", "no text"],
    ),
    (
        "quantize --calibration blank",
        ["quantize", "{tiny}", "--out", "{root}/q", "--calibration", "{text}/blank.txt"],
        ["--calibration", "no text"],
    ),
    (
        "bench --prompts not UTF-8",
        ["bench", "{tiny}", "--sessions", "1", "--prompts", "{text}/bad.txt"],
        ["--prompts", "UTF-8"],
    ),
    ("bench --prompts empty", ["bench", "{tiny}", "--sessions", "1", "--prompts", "{text}/empty.txt"], ["--prompts"]),
    ("generate stdin not UTF-8", ["generate", "{tiny}"], ["stdin", "UTF-8"], {"stdin": BAD_UTF8}),
    ("generate stdin empty", ["generate", "{tiny}"], ["stdin", "empty prompt"], {"stdin": b""}),
    ("run --plain stdin not UTF-8", ["run", "{tiny}", "--plain"], ["stdin", "UTF-8"], {"stdin": BAD_UTF8, "repl": 1}),
    ("agent tasks_file not UTF-8", ["agent", "{agent:tasks_not_utf8}", "--headless"], ["tasks_file", "UTF-8"]),
    ("agent tasks_file empty", ["agent", "{agent:tasks_empty}", "--headless"], ["agent.toml", "no tasks"]),
    ("agent tasks_file missing", ["agent", "{agent:tasks_missing}", "--headless"], ["tasks_file", "no such file"]),
    ("agent script missing", ["agent", "{root}/nope.toml", "--headless"], ["nope.toml", "no such file"]),
    ("agent script not UTF-8", ["agent", "{agent:script_not_utf8}", "--headless"], ["agent.toml", "cannot read"]),
    ("models.toml not UTF-8", ["generate", "{tiny}", "-p", "hi"], ["models.toml", "UTF-8"], {"home": b'x = "\xff"\n'}),
]

MODEL_CASES = [
    ("config.json a list", "config_list", ["config.json", "list"]),
    ("config.json not UTF-8", "config_not_utf8", ["config.json", "UTF-8"]),
    ("config.json not JSON", "config_not_json", ["config.json", "invalid JSON"]),
    *(
        (f"config.json {name}", f"config_{name}", ["config.json", word])
        for name, (_, word) in BROKEN_CONFIG_ENTRIES.items()
    ),
    ("safetensors header a list", "st_header_list", ["model.safetensors", "header"]),
    ("safetensors without data_offsets", "st_no_offsets", ["model.safetensors", "data_offsets"]),
    ("safetensors offsets reversed", "st_reversed_offsets", ["model.safetensors", "data_offsets"]),
    ("safetensors empty file", "st_empty", ["model.safetensors", "truncated"]),
    ("safetensors header beyond the file", "st_header_beyond_file", ["model.safetensors", "truncated"]),
    ("safetensors header not JSON", "st_header_not_json", ["model.safetensors", "header"]),
    ("safetensors unknown dtype", "st_bad_dtype", ["model.safetensors"]),
    ("index.json junk", "index_junk", ["model.safetensors.index.json", "invalid JSON"]),
    ("index.json a list", "index_list", ["model.safetensors.index.json", "list"]),
    ("index.json without weight_map", "index_no_map", ["model.safetensors.index.json", "weight_map"]),
    ("index.json names a file outside", "index_escapes", ["model.safetensors.index.json", "weight_map"]),
    ("index.json names a missing shard", "index_missing_shard", ["shard-2.safetensors"]),
    ("generation_config.json junk", "generation_config_junk", ["generation_config.json", "invalid JSON"]),
    ("generation_config.json a list", "generation_config_list", ["generation_config.json", "list"]),
    ("generation_config.json eos a string", "generation_config_eos", ["generation_config.json", "eos_token_id"]),
    ("tokenizer_config.json junk", "tokenizer_config_junk", ["tokenizer_config.json", "invalid JSON"]),
    (
        "tokenizer_config.json template a number",
        "tokenizer_config_template_number",
        ["tokenizer_config.json", "chat_template"],
    ),
    ("tokenizer.json junk", "tokenizer_json_junk", ["tokenizer.json"]),
    ("tokenizer.json missing", "tokenizer_missing", ["tokenizer.json"]),
    ("chat_template.jinja syntax", "template_syntax", ["chat_template.jinja", "invalid chat template"]),
    ("chat_template.jinja not UTF-8", "template_not_utf8", ["chat_template.jinja", "UTF-8"]),
    ("chat template fails when rendered", "template_fails", ["chat template", "ZeroDivisionError"]),
    ("chat template raises", "template_raises", ["chat template", "no system role"]),
]

GGUF_CASES = [
    ("GGUF garbage", "garbage.gguf", ["garbage.gguf", "GGUF"]),
    ("GGUF without tokenizer.ggml.tokens", "no_tokens.gguf", ["no_tokens.gguf", "tokenizer.ggml.tokens"]),
    ("GGUF head_count = 0", "heads_zero.gguf", ["heads_zero.gguf", "head_count"]),
    ("GGUF head_count an array", "heads_array.gguf", ["heads_array.gguf", "head_count"]),
    ("GGUF unsupported architecture", "unsupported.gguf", ["unsupported.gguf", "gpt2"]),
    ("GGUF missing tensors", "missing_tensors.gguf", ["missing_tensors.gguf", "missing tensor"]),
]

GEN = ["generate", "{tiny}", "-p", "hi"]
TINY_TRAINING = ["--max-prompts", "1", "--max-tokens", "4", "--samples", "0", "--epochs", "1"]  # quick if it runs
FLAG_CASES = [
    ("--seed 2^70", [*GEN, "--seed", str(2**70)], ["seed"]),
    ("--seed 2^64", [*GEN, "--seed", str(2**64)], ["seed"]),
    ("--seed -1", [*GEN, "--seed", "-1"], ["seed"]),
    ("--seed abc", [*GEN, "--seed", "abc"], ["--seed"]),
    ("--temperature inf", [*GEN, "--temperature", "inf"], ["temperature"]),
    ("--temperature nan", [*GEN, "--temperature", "nan"], ["temperature"]),
    ("--temperature -1", [*GEN, "--temperature", "-1"], ["temperature"]),
    ("--top-p 0", [*GEN, "--top-p", "0"], ["top-p"]),
    ("--top-p nan", [*GEN, "--top-p", "nan"], ["top-p"]),
    ("--top-p 2", [*GEN, "--top-p", "2"], ["top-p"]),
    ("--top-k -1", [*GEN, "--top-k", "-1"], ["top-k"]),
    ("--max-tokens 0", [*GEN, "--max-tokens", "0"], ["max-tokens"]),
    ("--max-tokens abc", [*GEN, "--max-tokens", "abc"], ["--max-tokens"]),
    ("--k 99", [*GEN, "--k", "99"], ["--k must be in [0, 8]"]),
    ("--k lots", [*GEN, "--k", "lots"], ["--k"]),
    ("--kv-memory inf", [*GEN, "--kv-memory", "inf"], ["--kv-memory"]),
    ("--kv-memory nan", [*GEN, "--kv-memory", "nan"], ["--kv-memory"]),
    ("--kv-memory 1000T", [*GEN, "--kv-memory", "1000T"], ["--kv-memory", "free"]),
    ("--kv-memory 0", [*GEN, "--kv-memory", "0"], ["--kv-memory"]),
    ("--kv-memory -5M", [*GEN, "--kv-memory", "-5M"], ["--kv-memory"]),
    ("--kv-memory lots", [*GEN, "--kv-memory", "lots"], ["--kv-memory"]),
    ("--kv-memory 1K (no page fits)", [*GEN, "--kv-memory", "1K"], ["--kv-memory", "holds no page"]),
    ("--kv int3", [*GEN, "--kv", "int3"], ["--kv"]),
    ("--dtype fp8", [*GEN, "--dtype", "fp8"], ["--dtype"]),
    ("--weights int4", [*GEN, "--weights", "int4"], ["--weights"]),
    ("--device tpu", [*GEN, "--device", "tpu"], ["--device"]),
    ("unknown flag", [*GEN, "--bogus"], ["--bogus"]),
    ("unknown command", ["frobnicate"], ["frobnicate"]),
    ("--prompt and --prompts-file", [*GEN, "--prompts-file", "{text}/ok.txt"], ["--prompt", "--prompts-file"]),
    ("empty --prompt", ["generate", "{tiny}", "-p", "  "], ["--prompt", "empty prompt"]),
    ("--prompt beyond the context", ["generate", "{tiny}", "--raw", "-p", "word " * 400], ["--prompt", "context"]),
    (
        "--raw with --system",
        ["generate", "{tiny}", "--raw", "--system", "Be brief.", "-p", "hi"],
        ["--raw", "--system"],
    ),
    ("--prompt not UTF-8", ["generate", "{tiny}", "-p", "hi \udcff"], ["--prompt", "lone surrogate"]),
    ("--drafter bogus", [*GEN, "--drafter", "bogus"], ["drafter", "bogus"]),
    ("--drafter heads:", [*GEN, "--drafter", "heads:"], ["drafter"]),
    ("--drafter heads:missing", [*GEN, "--drafter", "heads:{root}/nope.safetensors"], ["--drafter", "no such file"]),
    ("--drafter eagle:missing", [*GEN, "--drafter", "eagle:{root}/nope"], ["--drafter", "no such directory"]),
    ("--drafter heads:DIR", [*GEN, "--drafter", "heads:{root}"], ["--drafter", "is a directory, not a file"]),
    ("--drafter heads:device", [*GEN, "--drafter", "heads:/dev/null"], ["--drafter", "is a character device, not a"]),
    ("--drafter draft-model:unknown", [*GEN, "--drafter", "draft-model:no-such-model"], ["--drafter", "no-such-model"]),
    (
        "--drafter heads:FILE without metadata",
        [*GEN, "--drafter", "heads:{heads}/no_metadata.safetensors"],
        ["no_metadata.safetensors", "draft heads"],
    ),
    (
        "--drafter heads:FILE of a model",
        [*GEN, "--drafter", "heads:{heads}/model_format.safetensors"],
        ["model_format.safetensors", "draft heads"],
    ),
    ("--drafter heads:FILE junk", [*GEN, "--drafter", "heads:{heads}/junk.safetensors"], ["junk.safetensors"]),
    ("--drafter heads without shipped heads", [*GEN, "--drafter", "heads"], ["draft heads"]),
    ("model alias unknown", ["generate", "no-such-model", "-p", "hi"], ["no-such-model"]),
    ("model path missing", ["generate", "{root}/nope.gguf", "-p", "hi"], ["nope.gguf"]),
    ("model a text file", ["generate", "{text}/ok.txt", "-p", "hi"], ["ok.txt"]),
    ("model folder without config.json", ["generate", "{text}", "-p", "hi"], ["config.json"]),
    ("bench --synthetic tiny --steps 0", ["bench", "--synthetic", "tiny", "--steps", "0"], ["--steps"]),
    ("bench --synthetic tiny --context -5", ["bench", "--synthetic", "tiny", "--context", "-5"], ["--context"]),
    ("bench --acceptance 2", ["bench", "--synthetic", "tiny", "--acceptance", "2"], ["--acceptance"]),
    ("bench --acceptance -0.1", ["bench", "--synthetic", "tiny", "--acceptance", "-0.1"], ["--acceptance"]),
    ("bench --batch abc", ["bench", "--synthetic", "tiny", "--batch", "abc"], ["--batch"]),
    ("bench --batch 0", ["bench", "--synthetic", "tiny", "--batch", "0"], ["--batch"]),
    ("bench --k -1", ["bench", "--synthetic", "tiny", "--k", "-1"], ["--k"]),
    ("bench --kv int3", ["bench", "--synthetic", "tiny", "--kv", "int3"], ["--kv"]),
    ("bench --weights int8", ["bench", "--synthetic", "tiny", "--weights", "int8"], ["--weights"]),
    ("bench unknown shape", ["bench", "--synthetic", "gpt-9"], ["gpt-9"]),
    ("bench --synthetic with MODEL", ["bench", "{tiny}", "--synthetic", "tiny"], ["--synthetic", "MODEL"]),
    ("bench --synthetic and --sessions", ["bench", "--synthetic", "tiny", "--sessions", "1"], ["--synthetic"]),
    (
        "bench --synthetic --dtype",
        ["bench", "--synthetic", "tiny", "--dtype", "float16"],
        ["--dtype", "for --sessions"],
    ),
    (
        "bench --synthetic --drafter --max-tokens",
        ["bench", "--synthetic", "tiny", "--drafter", "ngram", "--max-tokens", "8"],
        ["--max-tokens, --drafter", "not --synthetic"],
    ),
    (
        "bench --sessions --batch --steps",
        ["bench", "{tiny}", "--sessions", "1", "--prompts", "{text}/ok.txt", "--batch", "4", "--steps", "9"],
        ["--batch, --steps", "for --synthetic"],
    ),
    ("bench --sessions without --prompts", ["bench", "{tiny}", "--sessions", "1"], ["--prompts"]),
    (
        "bench --sessions --weights int4",
        ["bench", "{tiny}", "--sessions", "1", "--prompts", "{text}/ok.txt", "--weights", "int4"],
        ["--weights takes auto, bf16, mxfp4 with --sessions, got 'int4'"],
    ),
    (
        "bench --sessions --kv int3",
        ["bench", "{tiny}", "--sessions", "1", "--prompts", "{text}/ok.txt", "--kv", "int3"],
        ["--kv takes auto, bf16, fp16, fp32, mxfp4, k8v4 with --sessions, got 'int3'"],
    ),
    ("bench --sessions 0", ["bench", "{tiny}", "--sessions", "0", "--prompts", "{text}/ok.txt"], ["--sessions"]),
    ("bench --sessions -1", ["bench", "{tiny}", "--sessions", "-1", "--prompts", "{text}/ok.txt"], [">= 1"]),
    ("bench --sessions abc", ["bench", "{tiny}", "--sessions", "abc", "--prompts", "{text}/ok.txt"], ["--sessions"]),
    ("bench --sessions 1,,2", ["bench", "{tiny}", "--sessions", "1,,2", "--prompts", "{text}/ok.txt"], ["--sessions"]),
    (
        "bench --temperature -1",
        ["bench", "{tiny}", "--sessions", "1", "--prompts", "{text}/ok.txt", "--temperature", "-1"],
        ["temperature must be a finite number >= 0"],
    ),
    (
        "bench --sessions --drafter bogus",
        ["bench", "{tiny}", "--sessions", "1", "--prompts", "{text}/ok.txt", "--drafter", "none,bogus"],
        ["bogus"],
    ),
    ("quantize --damp -1", ["quantize", "{tiny}", "--out", "{root}/q", "--damp", "-1"], ["--damp"]),
    ("quantize --damp nan", ["quantize", "{tiny}", "--out", "{root}/q", "--damp", "nan"], ["--damp"]),
    (
        "quantize --calibration-tokens 0",
        ["quantize", "{tiny}", "--out", "{root}/q", "--calibration-tokens", "0"],
        ["--calibration-tokens"],
    ),
    (
        "quantize --layers bogus",
        ["quantize", "{tiny}", "--out", "{root}/q", "--method", "rtn", "--layers", "bogus"],
        ["--layers", "bogus"],
    ),
    (
        "quantize --layers empty",
        ["quantize", "{tiny}", "--out", "{root}/q", "--method", "rtn", "--layers", ""],
        ["--layers", "names no linears"],
    ),
    (
        "quantize --layers removing all it adds",
        ["quantize", "{tiny}", "--out", "{root}/q", "--method", "rtn", "--layers", "blocks,lm_head,-layers.*,-lm_head"],
        ["--layers", "selects no linear"],
    ),
    ("quantize --out the model's folder", ["quantize", "{tiny}", "--out", "{tiny}"], ["--out", "not an MXFP4"]),
    ("quantize --out a folder of files", ["quantize", "{tiny}", "--out", "{text}"], ["--out", "holds"]),
    ("quantize --out under a file", ["quantize", "{tiny}", "--out", "{text}/ok.txt/q"], ["--out", "cannot make"]),
    (
        "perplexity --file of one token",
        ["perplexity", "{tiny}", "--file", "{text}/one_token.txt"],
        ["--file", "1 token"],
    ),
    ("perplexity window past --kv-memory", ["perplexity", "{tiny}", "--kv-memory", "20K"], ["--kv-memory", "window"]),
    ("perplexity --context 1", ["perplexity", "{tiny}", "--context", "1"], ["--context"]),
    ("perplexity --stride 0", ["perplexity", "{tiny}", "--stride", "0"], ["--stride"]),
    ("perplexity --stride > --context", ["perplexity", "{tiny}", "--context", "8", "--stride", "9"], ["--stride"]),
    ("train-heads --tap 999", ["train-heads", "{tiny}", "--out", "{root}/h.safetensors", "--tap", "999"], ["--tap"]),
    ("train-heads --tap -1", ["train-heads", "{tiny}", "--out", "{root}/h.safetensors", "--tap", "-1"], ["--tap"]),
    (
        "train-heads --tap with --arch eagle",
        ["train-heads", "{tiny}", "--out", "{root}/e", "--arch", "eagle", "--tap", "1"],
        ["--tap"],
    ),
    *(
        (
            f"train-heads --arch {arch} {' '.join(flags)}",
            ["train-heads", "{tiny}", "--out", "{root}/" + out, "--arch", arch, *flags],
            [f"for --arch {other}", flags[0]],
        )
        for arch, other, out, flags in (
            ("eagle", "heads", "e", ["--heads", "8"]),
            ("eagle", "heads", "e", ["--parallel"]),
            ("eagle", "heads", "e", ["--labels", "soft"]),
            ("eagle", "heads", "e", ["--batch-size", "64"]),
            ("heads", "eagle", "h.safetensors", ["--ttt-steps", "3"]),
            ("heads", "eagle", "h.safetensors", ["--batch-tokens", "4096"]),
        )
    ),
    (
        "train-heads --max-prompts 0",
        ["train-heads", "{tiny}", "--out", "{root}/h.safetensors", "--max-prompts", "0"],
        ["--max-prompts"],
    ),
    ("train-heads --heads 0", ["train-heads", "{tiny}", "--out", "{root}/h.safetensors", "--heads", "0"], ["--heads"]),
    ("train-heads --seed -1", ["train-heads", "{tiny}", "--out", "{root}/h.safetensors", "--seed", "-1"], ["--seed"]),
    (
        "train-heads --epochs 0",
        ["train-heads", "{tiny}", "--out", "{root}/h.safetensors", "--epochs", "0"],
        ["--epochs"],
    ),
    *(
        (f"train-heads {flag} {value}", ["train-heads", "{tiny}", "--out", "{root}/h.safetensors", flag, value], [flag])
        for flag, value in (("--samples", "-1"), ("--batch-size", "0"), ("--draft-vocab", "-5"))
    ),
    (
        "train-heads --arch eagle --batch-tokens 0",
        ["train-heads", "{tiny}", "--arch", "eagle", "--out", "{root}/e", "--batch-tokens", "0"],
        ["--batch-tokens", "got 0"],
    ),
    ("train-heads --lr 0", ["train-heads", "{tiny}", "--out", "{root}/h.safetensors", "--lr", "0"], ["--lr"]),
    (
        "train-heads --max-tokens 0",
        ["train-heads", "{tiny}", "--out", "{root}/h.safetensors", "--max-tokens", "0"],
        ["--max-tokens"],
    ),
    (
        "train-heads --max-running 0",
        ["train-heads", "{tiny}", "--out", "{root}/h.safetensors", "--max-running", "0"],
        ["max-running"],
    ),
    ("train-heads --out a folder", ["train-heads", "{tiny}", "--out", "{root}", *TINY_TRAINING], ["--out", "a folder"]),
    (
        "train-heads --out under a file",
        ["train-heads", "{tiny}", "--out", "{text}/ok.txt/h.safetensors", *TINY_TRAINING],
        ["--out", "cannot make"],
    ),
    (
        "train-heads --arch eagle --out a file",
        ["train-heads", "{tiny}", "--arch", "eagle", "--out", "{text}/ok.txt", *TINY_TRAINING],
        ["--out", "a file"],
    ),
    (
        "train-heads work folder under a file",
        ["train-heads", "{tiny}", "--out", "{root}/h.safetensors", "--work", "{text}/ok.txt/w", *TINY_TRAINING],
        ["work folder", "cannot make"],
    ),
    ("agent --concurrency 0", ["agent", "{agent:tasks_missing}", "--concurrency", "0"], ["--concurrency"]),
    ("agent --k lots", ["agent", "{agent:ok}", "--headless", "--k", "lots"], ["--k"]),
    ("agent --drafter bogus", ["agent", "{agent:ok}", "--headless", "--drafter", "bogus"], ["bogus"]),
    ("pull unknown alias", ["pull", "no-such-model"], ["no-such-model"]),
]

REGISTRY_CASES = [
    ("models.toml: models = 3", b"models = 3\n", ["models.toml", "models must be a table"]),
    ("models.toml: models a list", b"models = [1]\n", ["models.toml", "models must be a table"]),
    ("models.toml: an entry not a table", b"[models]\nx = 3\n", ["models.toml", "models.x"]),
    ("models.toml: default a number", b"default = 5\n", ["models.toml", "default"]),
    ("models.toml: unknown source", b'[models.x]\nsource = "ftp"\n', ["models.toml", "source"]),
    ("models.toml: dir without path", b'[models.x]\nsource = "dir"\n', ["models.toml", "path"]),
    ("models.toml: path a number", b'[models.x]\nsource = "dir"\npath = 3\n', ["models.toml", "path"]),
    ("models.toml: unknown drafter", b'[models.x]\nsource = "dir"\npath = "/x"\ndrafter = "bogus"\n', ["bogus"]),
    ("models.toml: unknown key", b'[models.x]\nsource = "dir"\npath = "/x"\ncolour = 1\n', ["colour"]),
    ("models.toml: unknown top-level key", b"modles = 1\n", ["models.toml", "modles"]),
    ("models.toml: invalid TOML", b"[models\n", ["models.toml", "invalid TOML"]),
]


def expand(value: str, fx: Fixtures) -> str:
    if value.startswith("{agent:"):
        return str(fx.root / "agents" / value.removeprefix("{agent:").rstrip("}") / "agent.toml")
    places = {"tiny": fx.tiny, "root": fx.root, "text": fx.text, "models": fx.models, "gguf": fx.root / "gguf"}
    return value.format(**places, heads=fx.root / "heads")


def invoke(args: list[str], env: dict | None = None, stdin: bytes | None = None) -> Result:
    return CliRunner().invoke(main, args, env=env, input=stdin, catch_exceptions=True)


def assert_one_error_line(result: Result, needles: list[str], repl: bool = False) -> None:
    """Nonzero exit, no traceback, and exactly one line on stderr: `specchat: error: ...` holding every needle.
    A REPL also says on stderr what it loads and how to use it: there, only lines from specchat count."""
    assert not (result.exception and not isinstance(result.exception, SystemExit)), (
        f"uncaught {type(result.exception).__name__}: {result.exception}"
    )
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    if repl:
        lines = [line for line in lines if line.startswith("specchat") or "rror" in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("specchat: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


def case_params(cases: list[tuple]) -> list:
    return [pytest.param(*case, id=case[0]) for case in cases]


@pytest.mark.parametrize(("name", "argv", "needles", "extra"), case_params([(*c, {})[:4] for c in TEXT_CASES]))
def test_text_files_and_stdin(fx: Fixtures, tmp_path, name, argv, needles, extra):
    env = None
    if "home" in extra:
        home = fx.home(name.replace(" ", "_"), extra["home"])
        env = {"SPECCHAT_HOME": str(home)}
    result = invoke([expand(a, fx) for a in argv], env=env, stdin=extra.get("stdin"))
    assert_one_error_line(result, needles, repl="repl" in extra)


@pytest.mark.parametrize(("name", "model", "needles"), case_params(MODEL_CASES))
def test_model_files(fx: Fixtures, name, model, needles):
    assert_one_error_line(invoke(["generate", str(fx.models / model), "-p", "hi"]), needles)


@pytest.mark.parametrize(("name", "file", "needles"), case_params(GGUF_CASES))
def test_gguf_files(fx: Fixtures, tmp_path, name, file, needles):
    env = {"SPECCHAT_HOME": str(tmp_path)}  # a GGUF's converted tokenizer and weights are cached there
    assert_one_error_line(invoke(["generate", str(fx.root / "gguf" / file), "-p", "hi"], env=env), needles)


@pytest.mark.parametrize(("name", "argv", "needles"), case_params(FLAG_CASES))
def test_flags(fx: Fixtures, name, argv, needles):
    assert_one_error_line(invoke([expand(a, fx) for a in argv]), needles)


@pytest.mark.parametrize(("name", "models_toml", "needles"), case_params(REGISTRY_CASES))
def test_user_models_toml(fx: Fixtures, name, models_toml, needles):
    home = fx.home(name.replace(" ", "_").replace(":", ""), models_toml)
    for argv in (["generate", str(fx.tiny), "-p", "hi"], ["models"]):
        assert_one_error_line(invoke(argv, env={"SPECCHAT_HOME": str(home)}), needles)


@pytest.mark.parametrize(
    "file",
    [
        pytest.param("no_config.safetensors", id="heads file without its config"),
        pytest.param("partial_config.safetensors", id="heads file with an incomplete config"),
    ],
)
def test_heads_file_with_partial_metadata(fx: Fixtures, file):
    assert_one_error_line(invoke([*(expand(a, fx) for a in GEN), "--drafter", f"heads:{fx.root / 'heads' / file}"]), [])


def test_synthetic_shape_too_big_for_the_machine_is_refused_before_building():
    """bench --synthetic llama-3.1-8b on a CPU machine with less memory than the run needs (with a bad --batch
    too: flags are checked first, then the memory, before any weight exists)."""
    from specchat.bench.synthetic import SHAPES, SyntheticCase, estimate_bytes
    from specchat.cli.options import available_memory

    need = estimate_bytes(SHAPES["llama-3.1-8b"], torch.float32, [SyntheticCase(1, "float32", "bf16")], 512, 64)
    free = available_memory(torch.device("cpu"))
    if free is None or free >= need:
        pytest.skip("this machine could hold the 8B run (or does not say): nothing to refuse")
    assert_one_error_line(invoke(["bench", "--synthetic", "llama-3.1-8b", "--device", "cpu"]), ["--synthetic", "free"])
    assert_one_error_line(invoke(["bench", "--synthetic", "llama-3.1-8b", "--batch", "abc"]), ["--batch"])


# --- real processes: the operating system's stdin and locale -------------------------------------------------
def run_process(args: list[str], stdin: bytes, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specchat", *args],
        input=stdin,
        capture_output=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("locale", ["C.UTF-8", "C"])
def test_plain_repl_refuses_bytes_that_are_not_utf8(tiny_model_dir, locale):
    """Under a C locale Python decodes stdin with surrogateescape; the tokenizer then raised a TypeError."""
    env = {"LC_ALL": locale, "LANG": locale, "PYTHONUTF8": "0"}
    proc = run_process(["run", str(tiny_model_dir), "--plain", "--max-tokens", "2"], BAD_UTF8, env)
    errors = [line for line in proc.stderr.decode(errors="replace").splitlines() if line.startswith("specchat:")]
    assert proc.returncode != 0 and b"Traceback" not in proc.stderr, proc.stderr
    assert errors == ["specchat: error: stdin: the message is not valid UTF-8"], proc.stderr


def test_generate_reads_the_prompt_from_stdin(tiny_model_dir):
    proc = run_process(["generate", str(tiny_model_dir), "--max-tokens", "3", "--json"], b"hi\nthere\n")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["finish_reason"] == "length" and len(record["token_ids"]) == 3


# --- the prompt file contract: one record per prompt, the bad ones failing alone ------------------------------
def records(result: Result) -> list[dict]:
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_a_prompt_beyond_the_context_fails_alone(tiny_model_dir, tmp_path):
    """A 20k-token line among short ones: its record says why and names the line; the others complete."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n" + "word " * 20000 + "\nbye\n")
    result = invoke(["generate", str(tiny_model_dir), "--prompts-file", str(prompts), "--json", "--max-tokens", "4"])
    assert_one_error_line(result, [str(prompts), "1 of 3", "line 2"])
    out = records(result)
    assert [r["finish_reason"] for r in out] == ["length", "error", "length"]
    assert out[1]["error"].startswith("line 2: prompt is") and "context" in out[1]["error"]
    assert out[1]["token_ids"] == [] and set(out[1]) == set(out[0]) | {"error"}


def test_jsonl_prompts_and_bad_lines(tiny_model_dir, tmp_path):
    """A .jsonl file: multi-line prompts and chat messages run; each malformed line fails alone, naming its line."""
    lines = [
        json.dumps({"prompt": "first line\nsecond line"}),
        json.dumps({"id": "chat-1", "messages": [{"role": "user", "content": "hi\nthere"}]}),
        "{not json",
        json.dumps({"prompt": 3}),
        json.dumps([1, 2]),
        json.dumps({"prompt": "a", "messages": []}),
        json.dumps({"messages": [{"role": "user"}]}),
        json.dumps({"messages": [{"role": "bogus", "content": "hi"}]}),  # the server's 400: a role the template lacks
        "",
        json.dumps({"prompt": "last"}),
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    result = invoke(["generate", str(tiny_model_dir), "--prompts-file", str(prompts), "--json", "--max-tokens", "2"])
    assert_one_error_line(result, ["6 of 9", "lines 3, 4, 5, 6, 7, 8"])
    out = records(result)
    assert [r["finish_reason"] for r in out] == ["length", "length", *["error"] * 6, "length"]
    assert [r["error"].split(":")[0] for r in out if "error" in r] == [f"line {n}" for n in (3, 4, 5, 6, 7, 8)]
    assert "messages[0] has role 'bogus'" in out[7]["error"]


def test_a_jsonl_line_caps_its_own_answer(tiny_model_dir, tmp_path):
    """ "max_tokens" on a .jsonl line is that answer's cap instead of --max-tokens (it was ignored); one that is not a
    positive integer fails its line alone."""
    lines = [
        json.dumps({"prompt": "one", "max_tokens": 1}),
        json.dumps({"messages": [{"role": "user", "content": "two"}], "max_tokens": 2}),
        json.dumps({"prompt": "three"}),
        json.dumps({"prompt": "four", "max_tokens": True}),
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    result = invoke(["generate", str(tiny_model_dir), "--prompts-file", str(prompts), "--json", "--max-tokens", "3"])
    assert_one_error_line(result, ["1 of 4", "line 4"])
    out = records(result)
    assert [len(r["token_ids"]) for r in out[:3]] == [1, 2, 3] and out[0]["finish_reason"] == "length"
    assert '"max_tokens" must be a positive integer, got true' in out[3]["error"]


def test_raw_refuses_chat_messages_line_by_line(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + '\n{"prompt": "hi"}\n')
    argv = ["generate", str(tiny_model_dir), "--prompts-file", str(prompts), "--json", "--raw", "--max-tokens", "2"]
    result = invoke(argv)
    assert_one_error_line(result, ["1 of 2", "line 1"])
    assert [r["finish_reason"] for r in records(result)] == ["error", "length"]


def test_every_prompt_failing_exits_nonzero(tiny_model_dir, tmp_path):
    """Streamed text: each prompt's header on stdout, each failure on its own stderr line, then the summary."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(("word " * 400 + "\n") * 3)
    result = invoke(["generate", str(tiny_model_dir), "--prompts-file", str(prompts), "--raw", "--max-tokens", "2"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert [line for line in result.stdout.splitlines() if line.startswith("---")] == [
        f"--- prompt {n} ---" for n in (1, 2, 3)
    ]
    lines = result.stderr.splitlines()
    assert [line.split(": prompt is")[0] for line in lines[:3]] == [f"specchat: line {n}" for n in (1, 2, 3)]
    assert lines[3:] == [f"specchat: error: 3 of 3 prompts in {prompts} failed (lines 1, 2, 3)"]


def test_a_small_kv_pool_completes_every_prompt_that_fits(tiny_model_dir, tmp_path):
    """16 mixed prompts on a pool of 128 tokens: all 16 records come back; every request that fits the pool alone
    completes (the engine preempts the others meanwhile), the ones that never fit fail alone with their line."""
    short = ["hi", "tell me a joke", "what is two plus two", "name a color"]
    lines = ["long " * 150 if i % 5 == 3 else f"{short[i % 4]} number {i}" for i in range(16)]
    prompts = tmp_path / "mixed.txt"
    prompts.write_text("\n".join(lines) + "\n")
    max_tokens = 32
    argv = ["generate", str(tiny_model_dir), "--prompts-file", str(prompts), "--json", "--dtype", "float32"]
    result = invoke([*argv, "--max-tokens", str(max_tokens), "--kv-memory", "64K", "--kv", "fp32"])  # 128 tokens
    out = records(result)
    assert len(out) == 16
    per_token = out[0]["stats"]["memory"]["kv_bytes_per_token"]
    capacity = (64 * 1024 // (per_token * 16)) * 16  # whole pages of 16 tokens
    for line, record in enumerate(out, 1):
        fits = record["stats"]["prompt_tokens"] + max_tokens <= capacity
        if record["finish_reason"] == "error":
            assert not fits and record["error"].startswith(f"line {line}: ") and "KV" in record["error"], record
        else:
            assert len(record["token_ids"]) == max_tokens
    assert [n for n, r in enumerate(out, 1) if r["finish_reason"] == "error"] == [4, 9, 14]
    assert_one_error_line(result, ["3 of 16", "lines 4, 9, 14"])
