"""registry.derived_dir: what is derived from a model file lives in a folder keyed by the file's path, size and
modification time; a new version of the file replaces the folders of its earlier versions that no live process
holds, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specchat.registry import derived_dir

HOLD = """
import sys
from pathlib import Path
from specchat.registry import derived_dir
folder = derived_dir(Path(sys.argv[1]))
folder.mkdir(parents=True, exist_ok=True)  # (as the caches' writers do)
(folder / "weights.safetensors").write_bytes(b"derived")
print(folder, flush=True)
if sys.argv[2:] == ["hold"]:
    sys.stdin.read()  # till the test closes stdin
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def derive(model: Path, hold: bool = False) -> tuple[Path, subprocess.Popen]:
    """The derived folder of `model` as another process takes it (and a file in it); `hold`: that process lives
    on, holding it, till its stdin is closed."""
    args = [sys.executable, "-c", HOLD, str(model), *(["hold"] if hold else [])]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    folder = Path(proc.stdout.readline().strip())
    if not hold:
        assert proc.wait(timeout=60) == 0
    return folder, proc


def new_version(model: Path) -> None:
    """The file downloaded again: the same path, another modification time."""
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_a_new_version_of_a_model_file_replaces_its_old_derived_folder(home: Path, tmp_path: Path):
    """Every re-download left its ~650 MB folder behind under derived/ for good."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF version 1")
    old, _ = derive(model)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "model.gguf").write_bytes(b"GGUF version 1")
    same_name, _ = derive(tmp_path / "elsewhere" / "model.gguf")
    new_version(model)
    new = derived_dir(model)
    assert new != old and new.is_dir() and not old.exists()
    assert same_name.is_dir()  # another path's (same stem or not): kept
    assert sorted(p.name for p in new.parent.iterdir()) == sorted([new.name, same_name.name])  # nothing left over


def test_only_folders_marked_as_the_same_paths_are_removed(home: Path, tmp_path: Path):
    """A folder named like a derived one that specchat did not mark (an older version's, a user's), and a link
    there to a folder outside the cache that claims the same model, stay untouched; so does what the link
    points to."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF version 1")
    old, _ = derive(model)
    root = old.parent
    unmarked = root / "model-0123456789ab"
    unmarked.mkdir()
    (unmarked / "weights.safetensors").write_bytes(b"not ours to judge")
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in os.listdir(old):  # a copy of the old folder's marks, out of the cache
        (outside / name).write_bytes((old / name).read_bytes())
    (root / "model-ba9876543210").symlink_to(outside, target_is_directory=True)
    new_version(model)
    derived_dir(model)
    assert not old.exists()
    assert (unmarked / "weights.safetensors").read_bytes() == b"not ours to judge"
    assert (root / "model-ba9876543210").is_symlink() and (outside / "weights.safetensors").read_bytes() == b"derived"


def test_a_folder_a_live_process_holds_is_kept_till_it_ends(home: Path, tmp_path: Path):
    """Two processes on two versions of one file: the one that started on the old version keeps its folder (its
    weights mapped from it, its tokenizer read from it, its later caches written there); once it has ended, the
    next new folder of that path removes it. The folder this process holds is kept too."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF version 1")
    held, proc = derive(model, hold=True)
    try:
        new_version(model)
        mine = derived_dir(model)
        assert mine != held and held.is_dir() and (held / "weights.safetensors").read_bytes() == b"derived"
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    new_version(model)
    newest = derived_dir(model)
    assert not held.exists() and mine.is_dir() and newest.is_dir()


RACE = """
import os, random, sys, time
from pathlib import Path
from specchat.registry import derived_dir
model, end, taken = Path(sys.argv[1]), time.monotonic() + 3, 0
while time.monotonic() < end:
    children = []
    for _ in range(4):  # short-lived processes, each taking the folder of the version it sees, then ending
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                folder = derived_dir(model)
                folder.mkdir(parents=True, exist_ok=True)
                mine = folder / f"mine-{os.getpid()}"
                mine.write_text("x")
                time.sleep(random.random() / 100)
                status = 0 if mine.is_file() else 3
            finally:
                os._exit(status)
        children.append(pid)
    for pid in children:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "a held folder went"
        taken += 1
print(taken)
"""


def test_processes_deriving_while_the_file_changes_never_lose_a_folder_they_hold(home: Path, tmp_path: Path):
    """Races: short-lived processes take the folders of versions that come and go under them while the others
    sweep (a folder swept while being taken, two taking one version, two sweeping one folder); a folder a process
    has taken is there, with what it wrote, until that process ends, and nothing is left over after."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF version 1")
    args = [sys.executable, "-c", RACE, str(model)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        new_version(model)
        time.sleep(0.005)
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and int(out) > 20, err.decode()
    folder = derived_dir(model)  # every other process has ended: only this one's folder is left
    assert [p.name for p in (home / "derived").iterdir()] == [folder.name]


def test_a_derived_folder_that_cannot_be_made_is_returned_for_its_writers_to_skip(home: Path, tmp_path: Path):
    """A file where the derived root should be: the folder's path comes back as before (each cache's writer then
    skips it with a note), nothing raises; once the root can be made, the folder is."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF version 1")
    home.mkdir()
    (home / "derived").write_text("a file where the folder should be")
    folder = derived_dir(model)
    assert folder.parent == home / "derived" and (home / "derived").is_file()
    (home / "derived").unlink()
    assert derived_dir(model) == folder and folder.is_dir()


@pytest.mark.parametrize("size", [0, -5])
def test_a_size_that_is_no_file_size_is_refused(size):
    """`size = -5` in a user's models.toml loaded, and `specchat models` listed the model as "-5 B"."""
    from specchat.errors import ConfigError
    from specchat.registry import ModelSpec

    with pytest.raises(ConfigError, match="size is the file's bytes"):
        ModelSpec("mine", "gguf", path="m.gguf", size=size)
