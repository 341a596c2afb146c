"""Derived caches heal themselves (issue 19): a GGUF's dequantized weights (engine/weights_cache.py) and its
converted tokenizer (engine/tokenizer.py gguf_tokenizer) that fail to load are rebuilt from the GGUF file with a
one-line note, and a cache that cannot be written costs only speed."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specchat.engine import loader, weights_cache
from specchat.engine.loader import load_gguf
from specchat.engine.loading import load_tokenizer
from specchat.engine.tokenizer import CONVERTED_FILES, gguf_tokenizer
from specchat.engine.weights_cache import STALE_PARTIAL_S, read_converted
from specchat.registry import resolve
from tests.engine.tiny_gguf import write_tiny_gguf

MESSAGES = [{"role": "user", "content": "hello there, how are you?"}]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def fresh(gguf: Path):
    """The GGUF converted without any cache: what every healed load must return."""
    return load_gguf(gguf)


@pytest.fixture(scope="module")
def fresh_ids(gguf: Path, tmp_path_factory) -> list[int]:
    """A chat encoded by a tokenizer converted afresh."""
    return gguf_tokenizer(gguf, tmp_path_factory.mktemp("tok") / "tokenizer").encode_chat(MESSAGES)


def notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("specchat: note:")]


def assert_same(loaded, fresh) -> None:
    (cfg, sd), (cfg0, sd0) = loaded, fresh
    assert cfg == cfg0 and sd.keys() == sd0.keys()
    assert all(torch.equal(sd[k], sd0[k]) for k in sd0)


# --- the weights cache --------------------------------------------------------------------------------------------
def test_the_first_load_writes_the_cache_and_later_loads_read_it(gguf, fresh, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "derived" / "weights.safetensors"
    assert_same(load_gguf(gguf, cache=cache), fresh)
    assert cache.is_file() and sorted(p.name for p in cache.parent.iterdir()) == ["weights.safetensors"]
    monkeypatch.setattr(loader, "_load_gguf", lambda *a: pytest.fail("read the GGUF although the cache is good"))
    assert_same(load_gguf(gguf, cache=cache), fresh)
    assert notes(caplog) == []


def damage_truncated(cache: Path) -> None:
    data = cache.read_bytes()
    cache.write_bytes(data[: len(data) // 2])


def damage_tensor_bytes_cut(cache: Path) -> None:
    with cache.open("r+b") as f:
        f.truncate(cache.stat().st_size - 1)


def damage_without_config(cache: Path) -> None:
    save_file({"embed.weight": torch.zeros(4, 4)}, str(cache))


def rewrite(cache: Path, config_changes: dict | None = None, tensor_changes: dict | None = None) -> None:
    """Save the cache again with some config fields or tensors changed."""
    cfg, sd = read_converted(cache)
    sd = {name: t.clone() for name, t in sd.items()}  # read_converted's tensors map the file being rewritten
    fields = {**dataclasses.asdict(cfg), **(config_changes or {})}
    save_file({**sd, **(tensor_changes or {})}, str(cache), metadata={"config": json.dumps(fields)})


DAMAGE = {
    "truncated to half": damage_truncated,
    "the last tensor byte cut": damage_tensor_bytes_cut,
    "empty": lambda cache: cache.write_bytes(b""),
    "junk bytes": lambda cache: cache.write_bytes(os.urandom(4096)),
    "a header length only": lambda cache: cache.write_bytes((1 << 20).to_bytes(8, "little")),
    "safetensors without our config": damage_without_config,
    "a config that is not JSON": lambda cache: save_file({"x": torch.zeros(1)}, str(cache), {"config": "{nope"}),
    "a config with an unknown field": lambda cache: rewrite(cache, {"colour": "blue"}),
    "a config naming more layers": lambda cache: rewrite(cache, {"num_layers": 3}),
    "a tensor of the wrong shape": lambda cache: rewrite(cache, tensor_changes={"norm.weight": torch.zeros(3)}),
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_weights_cache_is_rebuilt_with_a_note(gguf, fresh, tmp_path, caplog, damage):
    cache = tmp_path / "weights.safetensors"
    load_gguf(gguf, cache=cache)
    damage(cache)
    labels: list[str] = []
    with caplog.at_level(logging.WARNING):
        assert_same(load_gguf(gguf, lambda what, done, total: labels.append(what), cache=cache), fresh)
    [note] = notes(caplog)
    assert str(cache) in note and "rebuilding it from tiny.gguf" in note
    assert labels and all("rebuilding the unreadable cache" in label for label in labels)
    assert_same(read_converted(cache), fresh)  # whole again: the next start reads it without a note
    caplog.clear()
    assert_same(load_gguf(gguf, cache=cache), fresh)
    assert notes(caplog) == []


def test_a_cache_that_cannot_be_written_is_skipped_with_a_note(gguf, fresh, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "weights.safetensors"

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    with caplog.at_level(logging.WARNING):
        assert_same(load_gguf(gguf, cache=cache), fresh)
    [note] = notes(caplog)
    assert "cannot save" in note and "No space left on device" in note
    assert list(tmp_path.iterdir()) == []  # neither the cache nor its partial file


def test_an_unwritable_cache_folder_is_skipped_with_a_note(gguf, fresh, tmp_path, caplog):
    (tmp_path / "derived").write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING):
        assert_same(load_gguf(gguf, cache=tmp_path / "derived" / "weights.safetensors"), fresh)
    assert len(notes(caplog)) == 1 and "cannot save" in notes(caplog)[0]


def test_partial_files_of_killed_writes_are_removed(gguf, tmp_path):
    cache = tmp_path / "weights.safetensors"
    old = [tmp_path / ".weights.safetensors.abc123.part", tmp_path / "weights.part"]  # ours, and the old naming
    young = tmp_path / ".weights.safetensors.def456.part"  # another process may be writing it now
    for path in [*old, young]:
        path.write_bytes(b"partial")
    past = time.time() - STALE_PARTIAL_S - 60
    for path in old:
        os.utime(path, (past, past))
    load_gguf(gguf, cache=cache)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([cache.name, young.name])


def test_the_written_cache_is_synced_before_it_takes_the_name(gguf, tmp_path, monkeypatch):
    cache = tmp_path / "weights.safetensors"
    synced: list[bool] = []
    real_fsync = os.fsync
    monkeypatch.setattr(weights_cache.os, "fsync", lambda fd: (synced.append(not cache.exists()), real_fsync(fd)))
    load_gguf(gguf, cache=cache)
    assert synced == [True]


# --- the converted tokenizer ------------------------------------------------------------------------------------
def test_the_tokenizer_is_converted_once_into_a_whole_folder(gguf, fresh_ids, tmp_path, monkeypatch, caplog):
    folder = tmp_path / "derived" / "tokenizer"
    assert gguf_tokenizer(gguf, folder).encode_chat(MESSAGES) == fresh_ids
    assert set(CONVERTED_FILES) <= {p.name for p in folder.iterdir()}
    assert [p.name for p in folder.parent.iterdir()] == ["tokenizer"]  # no staging folder left
    monkeypatch.setattr("specchat.engine.tokenizer.export_gguf_tokenizer", lambda *a: pytest.fail("converted again"))
    assert gguf_tokenizer(gguf, folder).encode_chat(MESSAGES) == fresh_ids
    assert notes(caplog) == []


def cut_in_half(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


TOKENIZER_DAMAGE = {
    "tokenizer.json junk": lambda d: (d / "tokenizer.json").write_bytes(os.urandom(512)),
    "tokenizer.json cut in half": lambda d: cut_in_half(d / "tokenizer.json"),
    "tokenizer.json valid JSON, not a tokenizer": lambda d: (d / "tokenizer.json").write_text('{"model": 3}'),
    "tokenizer.json missing": lambda d: (d / "tokenizer.json").unlink(),
    "tokenizer_config.json missing (an export cut short)": lambda d: (d / "tokenizer_config.json").unlink(),
    "tokenizer_config.json junk": lambda d: (d / "tokenizer_config.json").write_bytes(b"\xff\xfe{"),
    "chat_template.jinja not UTF-8": lambda d: (d / "chat_template.jinja").write_bytes(b"{{ \xff }}"),
    "chat_template.jinja does not compile": lambda d: (d / "chat_template.jinja").write_text("{% for %}"),
    "an empty folder": lambda d: [f.unlink() for f in d.iterdir()],
    "a plain file where the folder was": lambda d: (shutil.rmtree(d), d.write_text("not a folder")),
}


@pytest.mark.parametrize("damage", TOKENIZER_DAMAGE.values(), ids=TOKENIZER_DAMAGE.keys())
def test_a_damaged_tokenizer_conversion_is_redone_with_a_note(gguf, fresh_ids, tmp_path, caplog, damage):
    folder = tmp_path / "tokenizer"
    gguf_tokenizer(gguf, folder)
    damage(folder)
    with caplog.at_level(logging.WARNING):
        tokenizer = gguf_tokenizer(gguf, folder)
    assert tokenizer.encode_chat(MESSAGES) == fresh_ids  # the chat template came back too
    [note] = notes(caplog)
    assert str(folder) in note and "converting the tokenizer again from tiny.gguf" in note
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer"]  # no staging or old folder left


def test_a_link_where_the_tokenizer_folder_was_is_replaced_and_its_target_kept(gguf, fresh_ids, tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "keep").mkdir(parents=True)
    (elsewhere / "keep" / "file").write_text("kept")
    derived = tmp_path / "derived"
    derived.mkdir()
    (derived / "tokenizer").symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING):
        assert gguf_tokenizer(gguf, derived / "tokenizer").encode_chat(MESSAGES) == fresh_ids
    assert len(notes(caplog)) == 1
    assert [p.name for p in derived.iterdir()] == ["tokenizer"] and not (derived / "tokenizer").is_symlink()
    assert (elsewhere / "keep" / "file").read_text() == "kept"


def test_a_tokenizer_folder_that_cannot_be_made_is_skipped_with_a_note(gguf, fresh_ids, tmp_path, caplog):
    (tmp_path / "derived").write_text("a file where the folder should be")
    folder = tmp_path / "derived" / "tokenizer"
    with caplog.at_level(logging.WARNING):
        assert gguf_tokenizer(gguf, folder).encode_chat(MESSAGES) == fresh_ids
    [note] = notes(caplog)
    assert f"cannot save {folder}" in note and "loading without it" in note


def test_a_tokenizer_conversion_that_cannot_be_saved_is_skipped_with_a_note(
    gguf, fresh_ids, tmp_path, monkeypatch, caplog
):
    from specchat.engine.tokenizer import ByteLevelConversion

    real_save = ByteLevelConversion.save
    saves: list[str] = []

    def disk_full_once(self, folder):
        saves.append(folder)
        if len(saves) == 1:  # the cache's staging folder: half a file, then the disk is full
            (Path(folder) / "tokenizer.json").write_bytes(b"{")
            raise OSError(28, "No space left on device")
        return real_save(self, folder)

    monkeypatch.setattr(ByteLevelConversion, "save", disk_full_once)
    with caplog.at_level(logging.WARNING):
        assert gguf_tokenizer(gguf, tmp_path / "tokenizer").encode_chat(MESSAGES) == fresh_ids
    [note] = notes(caplog)
    assert "cannot save" in note and "No space left on device" in note
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its staging folder


def test_load_tokenizer_heals_the_derived_folder(gguf, fresh_ids, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    spec = resolve(str(gguf))
    load_tokenizer(spec, gguf)
    [folder] = (tmp_path / "derived").glob("*/tokenizer")
    (folder / "tokenizer.json").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        assert load_tokenizer(spec, gguf).encode_chat(MESSAGES) == fresh_ids
    assert len(notes(caplog)) == 1


# --- what a user sees ---------------------------------------------------------------------------------------------
HEAL_BOTH = """
import sys
from pathlib import Path
from specchat.engine.loader import load_gguf
from specchat.engine.loading import load_tokenizer
from specchat.registry import derived_dir, resolve
gguf = Path(sys.argv[1])
load_gguf(gguf, cache=derived_dir(gguf) / "weights.safetensors")
load_tokenizer(resolve(str(gguf)), gguf)
"""


def test_each_rebuild_is_one_line_on_stderr(gguf, tmp_path):
    env = {**os.environ, "SPECCHAT_HOME": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", HEAL_BOTH, str(gguf)], env=env, capture_output=True, text=True)
    assert first.returncode == 0 and first.stderr == "", first.stderr
    [derived] = (tmp_path / "derived").iterdir()
    (derived / "weights.safetensors").write_bytes(b"junk")
    (derived / "tokenizer" / "tokenizer.json").write_bytes(b"junk")
    healed = subprocess.run([sys.executable, "-c", HEAL_BOTH, str(gguf)], env=env, capture_output=True, text=True)
    assert healed.returncode == 0, healed.stderr
    lines = healed.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith("specchat: note: ") for line in lines), lines
    assert "weights.safetensors" in lines[0] and "rebuilding it from tiny.gguf" in lines[0]
    assert "tokenizer.json" in lines[1] and "converting the tokenizer again from tiny.gguf" in lines[1]


@pytest.mark.parametrize("command", [["generate", "-p", "hi"], ["run", "--plain"]], ids=["generate", "run --plain"])
def test_a_cache_that_cannot_be_written_costs_a_note_per_file(tmp_path, command):
    """A file where $SPECCHAT_HOME/derived should be (or a read-only home): the weights, the tokenizer and the CPU
    blocks each have their note and the model answers. The tokenizer's conversion ended every command in a
    NotADirectoryError, the CPU blocks' save in a SafetensorError."""
    from specchat.kernels import cpu_build

    path = write_tiny_gguf(tmp_path / "tiny.gguf", blocks=True)
    home = tmp_path / "home"
    home.mkdir()
    (home / "derived").write_text("a file where the folder should be")
    if cpu_build.kernel_dir().is_dir():
        (home / "kernels").symlink_to(cpu_build.kernel_dir())  # built already: not built again here
    env = {**os.environ, "SPECCHAT_HOME": str(home)}
    args = [sys.executable, "-m", "specchat", *command, str(path), "--max-tokens", "4", "--drafter", "none"]
    done = subprocess.run(args, env=env, input="hi\n", capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    ours = [line for line in done.stderr.splitlines() if line.startswith("specchat:")]
    assert ours and all(line.startswith("specchat: note: cannot save ") for line in ours), done.stderr
    assert any("/tokenizer (" in line for line in ours) and "Traceback" not in done.stderr


def test_a_first_load_parses_the_gguf_once_for_its_weights_and_blocks(tmp_path, monkeypatch):
    """A first load reads the file's tensors twice (the float weights, then the CPU kernels' blocks); within the
    load both take one parse of the file."""
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine
    from specchat.kernels import cpu_gemv

    if not cpu_gemv.available():
        pytest.skip("no CPU block kernels: nothing reads the blocks")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", blocks=True)
    parsed: list[str] = []
    reader = loader.GGUFFile

    class Counting(reader):
        def __init__(self, path):
            parsed.append(str(path))
            super().__init__(path)

    monkeypatch.setattr(loader, "GGUFFile", Counting)
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path / "home"))
    config = EngineConfig(model=str(path), device="cpu", dtype="float32")
    Engine.load(config)  # converts the tokenizer too, kept
    weights = [*(tmp_path / "home").rglob("weights.safetensors"), *(tmp_path / "home").rglob("cpu_blocks.safetensors")]
    assert len(weights) == 2
    for cached in weights:
        cached.unlink()
    parsed.clear()
    engine = Engine.load(config)
    assert parsed == [str(path)]
    assert engine.memory()["weights_gguf"]  # the blocks were read
    with loader.one_parse_per_file():
        assert loader.gguf_reader(path) is loader.gguf_reader(path)
    assert loader.gguf_reader(path) is not loader.gguf_reader(path)


def test_the_shared_parse_is_the_loading_threads_own(gguf):
    """A load on another thread (the TUI loads on an executor) shares nothing with this one's: a scope open there
    leaves this thread parsing afresh, and ends without leaving one open here."""
    import threading

    opened, release = threading.Event(), threading.Event()

    def load_elsewhere() -> None:
        with loader.one_parse_per_file():
            loader.gguf_reader(gguf)
            opened.set()
            release.wait(10)

    thread = threading.Thread(target=load_elsewhere)
    thread.start()
    try:
        assert opened.wait(10)
        assert loader.gguf_reader(gguf) is not loader.gguf_reader(gguf)
        with loader.one_parse_per_file():
            assert loader.gguf_reader(gguf) is loader.gguf_reader(gguf)
    finally:
        release.set()
        thread.join()
    assert loader.gguf_reader(gguf) is not loader.gguf_reader(gguf)
