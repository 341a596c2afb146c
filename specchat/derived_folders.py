"""The derived folders of model files (registry.derived_dir): held by every process that uses one, and the stale
ones (other versions of the same file) removed where no live process holds them."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

try:
    import fcntl
except ImportError:  # (Windows: derived folders are kept, none removed)
    fcntl = None


class DerivedFolders:
    """The derived folders this process holds, and the removal of stale ones.

    Each folder holds `.source` (the resolved path of the model file it was derived from) and `.lock`, on which each
    process that uses the folder holds a shared flock(2) till it ends (the kernel drops it however the process
    ends). A stale folder (another version of the same path) is removed only by a process that gets the exclusive
    lock without waiting: it moves the folder to a `.removing-*` name in the derived root while holding the lock,
    then deletes it. A process taking a folder checks, once its lock is granted, that the lock file is still the
    folder's (a sweep may have moved it meanwhile), and makes the folder again if not. Folders without a `.source`
    naming the same path (another file's, an older specchat's, one being made), links and anything outside the
    derived root are never touched.
    """

    SOURCE, LOCK, REMOVING = ".source", ".lock", ".removing-"
    ATTEMPTS = 100  # to take a folder that sweeps keep moving away (each time a version of it goes stale)

    def __init__(self) -> None:
        self.held: dict[Path, int] = {}  # folder -> its lock's descriptor, open till the process ends
        self.guard = threading.Lock()

    def hold(self, folder: Path, source: Path) -> bool:
        """Make `folder` and hold it (once per process); False where it cannot be made, or locks do not exist."""
        if fcntl is None:  # (no flock: nothing is held, so nothing is removed)
            return False
        with self.guard:
            if folder in self.held:
                return False
            try:
                self.held[folder] = self._take(folder, source)
            except OSError:
                return False
        return True

    def _take(self, folder: Path, source: Path) -> int:
        lock = folder / self.LOCK
        for _ in range(self.ATTEMPTS):
            try:
                folder.mkdir(parents=True, exist_ok=True)
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except (FileExistsError, FileNotFoundError):  # a sweep moved the folder away during the mkdir, or after
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # (waits only while a sweep moves the folder)
                if _same_file(fd, lock):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # the lock file of a folder a sweep moved away: make the folder again
        else:
            raise OSError(f"{folder}: swept away {self.ATTEMPTS} times while taken")
        try:
            if not (folder / self.SOURCE).is_file():
                partial = folder / f"{self.SOURCE}.{os.getpid()}"
                partial.write_text(str(source), encoding="utf-8")
                partial.replace(folder / self.SOURCE)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def remove_stale(self, keep: Path, source: Path) -> None:
        """Remove the folders beside `keep` derived from `source` (its other versions) that no process holds, and
        what killed removals left (`.removing-*`)."""
        root = keep.parent
        try:
            entries = [e for e in os.scandir(root) if e.name != keep.name and e.is_dir(follow_symlinks=False)]
        except OSError:
            return
        stem = keep.name.rpartition("-")[0]
        for entry in entries:
            if entry.name.startswith(self.REMOVING):
                shutil.rmtree(entry.path, ignore_errors=True)
            elif entry.name.rpartition("-")[0] == stem and self._derived_from(root / entry.name, source):
                self._remove_unheld(root / entry.name)

    def _derived_from(self, folder: Path, source: Path) -> bool:
        marker = folder / self.SOURCE
        try:
            return not marker.is_symlink() and marker.read_text(encoding="utf-8") == str(source)
        except (OSError, UnicodeDecodeError):
            return False

    def _remove_unheld(self, folder: Path) -> None:
        try:
            fd = os.open(folder / self.LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, or not ours
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: a live process uses it (this one, too)
                return
            if not _same_file(fd, folder / self.LOCK):  # another sweep moved it meanwhile
                return
            removing = folder.with_name(f"{self.REMOVING}{folder.name}-{os.getpid()}")
            try:
                folder.rename(removing)  # under the lock: no process takes it meanwhile
            except OSError:
                return
        finally:
            os.close(fd)
        shutil.rmtree(removing, ignore_errors=True)


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is the file at `path` now."""
    try:
        here = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    there = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


DERIVED = DerivedFolders()  # this process's: its locks live as long as it does
