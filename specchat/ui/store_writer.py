"""Writing the chat database off the UI thread, in order, without losing a write to a lock.

The UI queues each write (ui/store.py ChatStore) and goes on at once. One thread applies the queue in order, as
many writes per transaction as have piled up. While another process holds the database's write lock ("database
is locked"), or the disk is full, the writes wait in memory and are tried again every RETRY_S; after NOTE_AFTER_S
the UI gets a note, and another once they are saved. A write the database refuses for good (a constraint: a
message of a conversation deleted meanwhile) is dropped with a note. At close the thread has CLOSE_WAIT_S to
finish; what it could not write goes to a journal beside the database (JSON lines naming a kind of write and its
values, never SQL), which the next start queues before anything else. A journal that cannot be read stays, with a
note; one with lines that are not writes, or writes the database refuses, is kept as `<name>.not-saved-<time>`
once the rest is in, with a note, rather than deleted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

RETRY_S = 0.25  # between two tries of writes the database refused for now
BUSY_TIMEOUT_S = 0.25  # SQLite's own wait for the write lock within one try
NOTE_AFTER_S = 2.0  # writes that have waited this long are worth a note to the UI
CLOSE_WAIT_S = 5.0  # at close, how long the last writes may wait for the database
JOURNAL_GLOB = "{name}.unsaved-*.jsonl"

WRITES = {  # a kind of write -> its statement; ids are made by ChatStore, so a replayed write lands on the same row
    "conversation": "INSERT OR IGNORE INTO conversations (id, title, model, created, updated) VALUES (?, ?, ?, ?, ?)",
    "message": (
        "INSERT OR IGNORE INTO messages (id, conversation_id, role, content, meta, created) VALUES (?, ?, ?, ?, ?, ?)"
    ),
    "touch": "UPDATE conversations SET updated = ? WHERE id = ?",
    "rename": "UPDATE conversations SET title = ? WHERE id = ?",
    "update": "UPDATE messages SET content = ?, meta = ? WHERE id = ?",  # id last: coalesce() reads it there
    "delete": "DELETE FROM conversations WHERE id = ?",
}

# a write the database refuses for good, so that trying again cannot help: a constraint, or values SQLite cannot
# take (a string that is not UTF-8, an integer past 64 bits; anything else raised here would end the thread, and
# nothing more would be saved)
REFUSED = (sqlite3.IntegrityError, ValueError, OverflowError)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Write:
    """One change to the database: a kind of WRITES and the values of its statement."""

    kind: str
    args: tuple
    source: Path | None = field(default=None, compare=False)  # the journal it was replayed from

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "args": list(self.args)})

    @staticmethod
    def from_json(line: str, source: Path | None = None) -> Write | None:
        """The write a journal line holds; None for a line that is not one (a journal cut short, a kind that is not
        a string, which raised TypeError at the start, values SQLite cannot take, which held up every write)."""
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):  # not JSON; nested too deep
            return None
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str) or data["kind"] not in WRITES:
            return None
        args = data.get("args")
        if not isinstance(args, list) or len(args) != WRITES[data["kind"]].count("?"):
            return None
        if not all(arg is None or isinstance(arg, int | float | str) for arg in args):
            return None
        return Write(data["kind"], tuple(args), source)


def coalesce(writes: list[Write]) -> list[Write]:
    """The same changes with each message's updates but its last left out (an update sets the whole message)."""
    last = {w.args[-1]: i for i, w in enumerate(writes) if w.kind == "update"}
    return [w for i, w in enumerate(writes) if w.kind != "update" or last[w.args[-1]] == i]


def journals(path: Path) -> list[Path]:
    """The journals of writes that earlier runs could not make, oldest first."""
    return sorted(path.parent.glob(JOURNAL_GLOB.format(name=path.name)))


class StoreWriter:
    """The thread that owns the database's write connection and applies the queued writes in order."""

    def __init__(self, path: Path, notes: deque[str]) -> None:
        self.path = path
        self.notes = notes  # for the UI to show; appended from this thread
        self.cond = threading.Condition()
        self.queue: deque[Write] = deque()
        self.queued = 0  # writes put so far
        self.done = 0  # of those, the ones written (or dropped for good), counted in queue order
        self.pending: list[Write] = []  # taken from the queue by the thread, not written yet
        self.forget: list[tuple[int, Path]] = []  # journals to delete once `done` reaches their last write
        self.skipped: Counter[Path] = Counter()  # of each journal: lines that are not writes
        self.refused: Counter[Path] = Counter()  # of each journal: writes the database refused for good
        self.closing = False
        self.deadline = float("inf")
        self.journal: Path | None = None  # where close() put what it could not write
        self.thread = threading.Thread(target=self._run, name="specchat-store", daemon=True)
        self.thread.start()

    def put(self, write: Write) -> None:
        with self.cond:
            self.queue.append(write)
            self.queued += 1
            self.cond.notify_all()

    def replay(self, journal: Path) -> None:
        """Queue a journal's writes; the file goes once they are written (kept aside if some could not be). One that
        cannot be read (it raised OSError at the start) stays where it is, with a note."""
        try:
            lines = journal.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as exc:
            self._note(f"cannot read {journal.name} ({exc.strerror or exc}): its changes are not applied; it stays")
            return
        for line in filter(str.strip, lines):
            write = Write.from_json(line, journal)
            if write is None:
                self.skipped[journal] += 1
            else:
                self.put(write)
        with self.cond:
            self.forget.append((self.queued, journal))

    def flush(self, timeout: float) -> bool:
        """Wait until every write put so far is written; False if `timeout` seconds pass first."""
        with self.cond:
            target = self.queued
            return self.cond.wait_for(lambda: self.done >= target, timeout)

    def close(self, timeout: float | None = None) -> Path | None:
        """Write what is queued, waiting at most `timeout` seconds (CLOSE_WAIT_S) for the database; what is left
        goes to a journal, whose path is returned."""
        with self.cond:
            self.closing = True
            self.deadline = time.monotonic() + (CLOSE_WAIT_S if timeout is None else timeout)
            self.cond.notify_all()
        self.thread.join()
        return self.journal

    # --- the thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        db: sqlite3.Connection | None = None
        waiting_since: float | None = None
        noted = False
        while True:
            with self.cond:
                while not self.queue and not self.pending and not self.closing:
                    self.cond.wait()
                self.pending = coalesce(self.pending + list(self.queue))  # bounded while the database waits
                self.queue.clear()
                taken = self.queued
                if not self.pending or (self.closing and time.monotonic() > self.deadline):
                    break
            try:
                db = db or self._connect()
                self._apply(db, self.pending)
            except sqlite3.Error as exc:  # locked, disk full, I/O: the writes wait and are tried again
                waiting_since = waiting_since or time.monotonic()
                if not noted and time.monotonic() - waiting_since >= NOTE_AFTER_S:
                    self._note(self._waiting_note(exc))
                    noted = True
                with self.cond:
                    self.cond.wait(RETRY_S)  # a close() or a new write wakes it sooner
                continue
            self.pending = []
            self._written(taken)
            if noted:
                self._note(f"{self.path.name}: the changes that waited are saved")
            waiting_since, noted = None, False
        if not self.pending or self._write_journal(self.pending):
            self._written(taken)  # written, or kept in the new journal (which holds what older ones still held)
        else:
            with self.cond:  # lost; flush() must not wait for them, and older journals stay
                self.done = taken
                self.cond.notify_all()
        if db is not None:
            db.close()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_S)
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL: a commit survives a crash of the app, fsync at checkpoints
        return db

    def _apply(self, db: sqlite3.Connection, writes: list[Write]) -> None:
        """All writes in one transaction; if the database refuses one for good, each in its own, dropping (with a
        note) those it refuses."""
        try:
            self._transaction(db, writes)
        except REFUSED:
            for write in writes:
                try:
                    self._transaction(db, [write])
                except REFUSED as exc:
                    log.warning("dropped %s: %s", write, exc)
                    if write.source is not None:
                        self.refused[write.source] += 1
                    self._note(f"{self.path.name}: one change could not be saved and is dropped ({exc})")

    @staticmethod
    def _transaction(db: sqlite3.Connection, writes: list[Write]) -> None:
        db.execute("BEGIN IMMEDIATE")  # the write lock now, or "database is locked" before any change
        try:
            for write in writes:
                db.execute(WRITES[write.kind], write.args)
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise

    def _written(self, taken: int) -> None:
        """The first `taken` writes are in: journals holding only those go, then flush() returns."""
        with self.cond:
            done_with = [journal for last, journal in self.forget if last <= taken]
            self.forget = [(last, journal) for last, journal in self.forget if last > taken]
        for journal in done_with:
            self._forget(journal)
        with self.cond:
            self.done = taken
            self.cond.notify_all()

    def _forget(self, journal: Path) -> None:
        """A replayed journal's writes are in: delete it, or keep it aside if some of it could not be saved (lines
        that are not writes, writes the database refused: deleted, they were lost). A file that cannot be removed (it
        raised OSError in this thread, which then ended: nothing more was saved) stays, with a note."""
        skipped, refused = self.skipped.pop(journal, 0), self.refused.pop(journal, 0)
        try:
            if not skipped and not refused:
                journal.unlink(missing_ok=True)
                return
            kept = journal.with_name(f"{journal.name}.not-saved-{time.strftime('%Y%m%d-%H%M%S')}")
            journal.rename(kept)
        except OSError as exc:
            self._note(
                f"{journal.name} cannot be removed ({exc.strerror or exc}): it stays, and the next start applies it again"
            )
            return
        why = []
        if skipped:
            why.append(
                f"{skipped} lines are not changes and are skipped"
                if skipped > 1
                else "1 line is not a change and is skipped"
            )
        if refused:
            why.append(f"{refused} changes could not be saved" if refused > 1 else "1 change could not be saved")
        self._note(f"{journal.name}: {', '.join(why)}; the file is kept as {kept.name}")

    def _waiting_note(self, exc: sqlite3.Error) -> str:
        count = len(self.pending)
        locked = isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)
        why = "is locked by another process" if locked else f"cannot be written ({exc})"
        return f"{self.path.name} {why}: {count} changes wait and are tried again; the chat goes on"

    def _note(self, text: str) -> None:
        self.notes.append(text)

    def _write_journal(self, writes: list[Write]) -> bool:
        """What could not be written by the close: to a journal the next start replays, with a note on stderr."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        journal = self.path.with_name(f"{self.path.name}.unsaved-{stamp}-{os.getpid()}.jsonl")
        try:
            with journal.open("w", encoding="utf-8") as f:
                f.writelines(write.to_json() + "\n" for write in writes)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            log.error(
                "specchat: error: %d changes to %s are lost: cannot write %s (%s)", len(writes), self.path, journal, exc
            )
            return False
        self.journal = journal
        log.warning(
            "specchat: note: %s could not be written before exit; %d changes are kept in %s and saved at the next start",
            self.path,
            len(writes),
            journal.name,
        )
        return True
