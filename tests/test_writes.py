"""specchat/writes.py: results written whole, write failures as one line, our own errors kept as they are."""

from __future__ import annotations

import errno

import pytest

from specchat.errors import ConfigError
from specchat.writes import check_writable_folder, write_folder_whole, write_whole


def test_a_file_is_written_whole_or_left_as_it_was(tmp_path):
    path = tmp_path / "heads.safetensors"
    write_whole(path, lambda p: p.write_text("first"))
    assert path.read_text() == "first"

    def torn(p):
        p.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ConfigError, match=r"heads.safetensors: cannot write it \(No space left on device\)"):
        write_whole(path, torn)
    assert path.read_text() == "first" and list(tmp_path.iterdir()) == [path]


def test_torch_saves_short_write_is_a_write_failure_and_other_runtime_errors_are_ours(tmp_path):
    """torch.save's zip writer reports a full disk as a RuntimeError ("unexpected pos"); safetensors raises
    RuntimeError for our own mistakes too (tensors sharing memory), which must keep their traceback."""

    def raising(message):
        def write(p):
            raise RuntimeError(message)

        return write

    with pytest.raises(ConfigError, match="is the disk full"):
        write_whole(tmp_path / "c.pt", raising("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0"))
    with pytest.raises(RuntimeError, match="share memory"):
        write_whole(tmp_path / "c.pt", raising("Some tensors share memory, this will lead to duplicate memory"))
    with pytest.raises(RuntimeError, match="share memory"):
        write_folder_whole(tmp_path / "head", raising("Some tensors share memory"))


def test_a_folder_is_replaced_whole_or_left_as_it_was(tmp_path):
    out = tmp_path / "head"

    def save(files):
        def write(folder):
            folder.mkdir()
            for name, text in files.items():
                (folder / name).write_text(text)

        return write

    write_folder_whole(out, save({"config.json": "1", "model.safetensors": "1"}))
    write_folder_whole(out, save({"config.json": "2"}))  # an earlier one is replaced whole
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]

    def failing(folder):
        save({"config.json": "3"})(folder)
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    with pytest.raises(ConfigError, match="cannot write it"):
        write_folder_whole(out, failing)
    assert (out / "config.json").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def test_a_folder_that_cannot_hold_files_is_refused_before_the_work(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="--out: cannot make"):
        check_writable_folder(tmp_path / "file" / "sub", "--out")
    check_writable_folder(tmp_path / "new" / "deeper", "--out")
    assert (tmp_path / "new" / "deeper").is_dir() and not any((tmp_path / "new" / "deeper").iterdir())
