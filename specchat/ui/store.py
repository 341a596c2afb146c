"""Conversations on disk: SQLite in the data dir, written as they happen, and healed when the file is broken.

Writes return at once: ChatStore makes each row's id itself and queues the write for ui/store_writer.py, whose
thread applies the writes in order, waits out another process's lock and keeps what it could not write by the
exit for the next start. Reads first wait (at most READ_WAIT_S) for the writes made before them. A reply being
streamed is saved when it starts, each time the chat shows more of it, and once more when it ends.

A file that is not a chat database (junk bytes, a damaged page, other tables under our names) is moved aside as
`chats.sqlite3.broken-<time>` and a new one started; `take_notes()` hands the UI what to tell the user.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from specchat.errors import SpecchatError
from specchat.registry import cache_dir
from specchat.ui.store_writer import StoreWriter, Write, journals

READ_WAIT_S = 1.0  # longest a read waits for earlier writes (they wait while another process holds the lock)
ID_RANDOM_BITS = 8  # low bits of a row id: two processes making a row in the same microsecond still differ
SQLITE_CORRUPT, SQLITE_NOTADB = 11, 26  # primary result codes of a file that is not a (whole) database

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    model TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    meta TEXT,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""
COLUMNS = {
    "conversations": {"id", "title", "model", "created", "updated"},
    "messages": {"id", "conversation_id", "role", "content", "meta", "created"},
}
SELECT_CONVERSATIONS = (
    "SELECT c.id, c.title, c.model, c.updated, COUNT(m.id) FROM conversations c "
    "LEFT JOIN messages m ON m.conversation_id = c.id"
)


@dataclass(frozen=True, slots=True)
class Conversation:
    id: int
    title: str
    model: str
    updated: float
    messages: int


@dataclass(frozen=True, slots=True)
class StoredMessage:
    id: int
    role: str
    content: str
    meta: dict | None


def storable(text: str) -> str:
    """Text SQLite takes: a lone surrogate (half an emoji, from a pasted or typed field) as U+FFFD, a pair as its
    character; as it was, one in any write made its thread end with a UnicodeEncodeError, and nothing more was saved."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def read_meta(text: str | None) -> dict | None:
    """A message's stored meta (its footer, why it ended), or None where there is none or it does not read as a JSON
    object (a damaged page's bytes, another program's edit): the message still opens, without its footer, where the
    chat ended with a JSONDecodeError's traceback."""
    if not text:
        return None
    try:
        meta = json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return None
    return meta if isinstance(meta, dict) else None


def default_path() -> Path:
    """chats.sqlite3 in $SPECCHAT_HOME (else ~/.cache/specchat)."""
    return cache_dir() / "chats.sqlite3"


class NotAChatDatabase(Exception):
    """A file SQLite opens whose pages or tables are not what a chat database holds."""


def _connect(path: Path) -> sqlite3.Connection:
    """The reading connection, after checking that the file is a whole chat database."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        problems = [row[0] for row in db.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise NotAChatDatabase(f"damaged: {problems[0]}")
        for table, needed in COLUMNS.items():
            found = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}  # none: a table to create
            if found and needed - found:
                raise NotAChatDatabase(f"its table {table} has no column {sorted(needed - found)[0]}")
        db.execute("PRAGMA journal_mode=WAL")  # after the checks: a file moved aside is kept as it was
        db.executescript(SCHEMA)
    except BaseException:
        db.close()
        raise
    return db


def _broken(exc: Exception) -> bool:
    """A file that is not a (whole) chat database, unlike one that cannot be opened now (locked, no permission)."""
    if isinstance(exc, NotAChatDatabase):
        return True
    code = (exc.sqlite_errorcode or 0) & 0xFF if isinstance(exc, sqlite3.DatabaseError) else 0
    return code in (SQLITE_CORRUPT, SQLITE_NOTADB)


def move_aside(path: Path, reason: str) -> Path:
    """Rename a broken database (and its -wal / -shm files) to `<name>.broken-<time>`; the new name. One that cannot
    be moved (a read-only folder) is a SpecchatError naming it and `reason` (it was an OSError's traceback); so is a
    -wal left behind, which a new database of that name would take for its own."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.broken-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.broken-{stamp}-{n}")
    try:
        path.rename(aside)
    except OSError as exc:
        raise SpecchatError(
            f"{path}: not a readable chat database ({reason}), and cannot move it aside ({exc.strerror or exc}); "
            "move it away to start a new one"
        ) from None
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        try:
            if side.exists():
                side.rename(aside.with_name(aside.name + suffix))
        except OSError as exc:
            raise SpecchatError(
                f"{path}: not a readable chat database ({reason}); moved to {aside.name}, but cannot move {side.name} "
                f"aside ({exc.strerror or exc}); move it beside {aside.name} to start a new one"
            ) from None
    return aside


def open_database(path: Path) -> tuple[sqlite3.Connection, str | None]:
    """A connection to the chat database at `path`, and a note for the user if a broken file was moved aside."""
    try:
        return _connect(path), None
    except (sqlite3.DatabaseError, NotAChatDatabase) as exc:
        if not _broken(exc):
            raise SpecchatError(f"{path}: cannot open the chat database ({exc})") from None
        reason = str(exc)
    aside = move_aside(path, reason)
    try:
        db = _connect(path)
    except (sqlite3.DatabaseError, NotAChatDatabase) as exc:
        raise SpecchatError(
            f"{path}: not a readable chat database ({reason}); moved to {aside.name}, but cannot start a new one ({exc})"
        ) from None
    return db, f"{path} was not a readable chat database ({reason}): moved to {aside.name}; a new one is started"


class ChatStore:
    """Conversations and their messages. Writes return at once and are applied in order; reads see them."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only home, a file where the folder goes: one line from the CLI, no traceback
            raise SpecchatError(
                f"{self.path}: cannot make the folder of the chat database ({exc.strerror or exc})"
            ) from None
        self.notes: deque[str] = deque(maxlen=32)  # for the UI to show, from this thread and the writer's
        self.told_damaged = False  # a damaged file is told once: every later read fails the same way
        self.db, note = open_database(self.path)
        if note is not None:
            self.notes.append(note)
        self.writer = StoreWriter(self.path, self.notes)
        self.close_writer = weakref.finalize(self, self.writer.close)  # at exit too, if close() is never called
        for journal in journals(self.path):
            self.writer.replay(journal)
        self.last_id = 0

    def close(self) -> None:
        """Write what is queued (what cannot be written goes to a journal for the next start), then close."""
        self.close_writer()
        self.db.close()

    def take_notes(self) -> list[str]:
        """What the user should be told about the file since the last call (a broken file moved aside, a lock)."""
        taken = []
        while self.notes:
            taken.append(self.notes.popleft())
        return taken

    def flush(self, timeout: float = READ_WAIT_S) -> bool:
        """Wait until every write made so far is in the database; False if `timeout` seconds pass first."""
        return self.writer.flush(timeout)

    # --- writes: queued, never waiting for the database -------------------------------------------------------
    def new_id(self) -> int:
        """A row id made here, so that a write never waits for the database to name its row: microseconds since
        the epoch, then ID_RANDOM_BITS random bits; increasing within this store, so ids keep creation order."""
        candidate = ((time.time_ns() // 1000) << ID_RANDOM_BITS) | secrets.randbits(ID_RANDOM_BITS)
        self.last_id = max(candidate, self.last_id + 1)
        return self.last_id

    def new_conversation(self, title: str, model: str) -> int:
        conversation_id, now = self.new_id(), time.time()
        self.writer.put(Write("conversation", (conversation_id, storable(title), storable(model), now, now)))
        return conversation_id

    def add_message(self, conversation_id: int, role: str, content: str, meta: dict | None = None) -> int:
        message_id, now = self.new_id(), time.time()
        meta_text = json.dumps(meta) if meta else None
        self.writer.put(Write("message", (message_id, conversation_id, role, storable(content), meta_text, now)))
        self.writer.put(Write("touch", (now, conversation_id)))
        return message_id

    def update_message(self, message_id: int, content: str, meta: dict | None = None) -> None:
        self.writer.put(Write("update", (storable(content), json.dumps(meta) if meta else None, message_id)))

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        """Give a conversation a new title (its place in the list, by last update, stays)."""
        self.writer.put(Write("rename", (storable(title), conversation_id)))

    def delete_conversation(self, conversation_id: int) -> None:
        self.writer.put(Write("delete", (conversation_id,)))

    # --- reads: after the writes made before them ---------------------------------------------------------------
    def rows(self, query: str, params: tuple) -> list[tuple]:
        """A query's rows once earlier writes are in (waiting at most READ_WAIT_S); none, with a note, if the
        database cannot be read now (locked, an I/O error) or no longer (damaged since the start: it raised
        sqlite3.DatabaseError, and the app ended with a traceback)."""
        self.writer.flush(READ_WAIT_S)
        try:
            return self.db.execute(query, params).fetchall()
        except sqlite3.ProgrammingError:  # our own mistake (a closed store, bad SQL), not the file's
            raise
        except sqlite3.DatabaseError as exc:
            if not _broken(exc):
                note = f"{self.path.name}: cannot read saved conversations now ({exc})"
                if note not in self.notes:  # one note for the reads of one action (the history reads twice)
                    self.notes.append(note)
            elif not self.told_damaged:
                self.told_damaged = True
                self.notes.append(
                    f"{self.path.name} is damaged ({exc}): saved conversations cannot be read; the chat goes on, "
                    "its changes are kept (at exit in an unsaved-writes file) and the next start moves the damaged "
                    "file aside and saves them in a new one"
                )
            return []

    def conversations(self, limit: int = 200) -> list[Conversation]:
        """Newest first."""
        query = f"{SELECT_CONVERSATIONS} GROUP BY c.id ORDER BY c.updated DESC, c.id DESC LIMIT ?"
        return [Conversation(*row) for row in self.rows(query, (limit,))]

    def conversation(self, conversation_id: int) -> Conversation | None:
        rows = self.rows(f"{SELECT_CONVERSATIONS} WHERE c.id = ? GROUP BY c.id", (conversation_id,))
        return Conversation(*rows[0]) if rows else None

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self.rows(
            "SELECT id, role, content, meta FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        )
        return [StoredMessage(i, role, content, read_meta(meta)) for i, role, content, meta in rows]

    def recent_prompts(self, limit: int = 500) -> list[str]:
        """The user's latest prompts, oldest first (for input history)."""
        rows = self.rows("SELECT content FROM messages WHERE role = 'user' ORDER BY id DESC LIMIT ?", (limit,))
        return [content for (content,) in reversed(rows)]

    def search(self, text: str, limit: int = 200) -> list[Conversation]:
        """Conversations whose title or any message contains `text` (case-insensitive for ASCII), newest first."""
        pattern = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        query = (
            f"{SELECT_CONVERSATIONS} WHERE c.title LIKE ?1 ESCAPE '\\' OR c.id IN "
            "(SELECT conversation_id FROM messages WHERE content LIKE ?1 ESCAPE '\\') "
            "GROUP BY c.id ORDER BY c.updated DESC, c.id DESC LIMIT ?2"
        )
        return [Conversation(*row) for row in self.rows(query, (pattern, limit))]
