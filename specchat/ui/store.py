"""Conversations on disk: SQLite in the data dir, written as they happen.

Each write is its own transaction (autocommit, WAL journal), so a crash keeps every message already written; a
reply being streamed is saved when it starts and updated as it grows (at most every `FLUSH_S` seconds), then
once more when it ends.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from specchat.registry import cache_dir

FLUSH_S = 0.5  # longest time a streamed reply's text stays only in memory

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


def default_path() -> Path:
    """chats.sqlite3 in $SPECCHAT_HOME (else ~/.cache/specchat)."""
    return cache_dir() / "chats.sqlite3"


class ChatStore:
    """Conversations and their messages; every method commits before it returns."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def new_conversation(self, title: str, model: str) -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations (title, model, created, updated) VALUES (?, ?, ?, ?)", (title, model, now, now)
        )
        return int(cur.lastrowid)

    def add_message(self, conversation_id: int, role: str, content: str, meta: dict | None = None) -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO messages (conversation_id, role, content, meta, created) VALUES (?, ?, ?, ?, ?)",
            (conversation_id, role, content, json.dumps(meta) if meta else None, now),
        )
        self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return int(cur.lastrowid)

    def update_message(self, message_id: int, content: str, meta: dict | None = None) -> None:
        self.db.execute(
            "UPDATE messages SET content = ?, meta = ? WHERE id = ?",
            (content, json.dumps(meta) if meta else None, message_id),
        )

    def conversations(self, limit: int = 200) -> list[Conversation]:
        """Newest first."""
        rows = self.db.execute(
            f"{SELECT_CONVERSATIONS} GROUP BY c.id ORDER BY c.updated DESC, c.id DESC LIMIT ?", (limit,)
        ).fetchall()
        return [Conversation(*row) for row in rows]

    def conversation(self, conversation_id: int) -> Conversation | None:
        row = self.db.execute(f"{SELECT_CONVERSATIONS} WHERE c.id = ? GROUP BY c.id", (conversation_id,)).fetchone()
        return Conversation(*row) if row else None

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self.db.execute(
            "SELECT id, role, content, meta FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [StoredMessage(i, role, content, json.loads(meta) if meta else None) for i, role, content, meta in rows]

    def recent_prompts(self, limit: int = 500) -> list[str]:
        """The user's latest prompts, oldest first (for input history)."""
        rows = self.db.execute(
            "SELECT content FROM messages WHERE role = 'user' ORDER BY id DESC LIMIT ?", (limit,)
        ).fetchall()
        return [content for (content,) in reversed(rows)]

    def delete_conversation(self, conversation_id: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def search(self, text: str, limit: int = 200) -> list[Conversation]:
        """Conversations whose title or any message contains `text` (case-insensitive for ASCII), newest first."""
        pattern = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        query = (
            f"{SELECT_CONVERSATIONS} WHERE c.title LIKE ?1 ESCAPE '\\' OR c.id IN "
            "(SELECT conversation_id FROM messages WHERE content LIKE ?1 ESCAPE '\\') "
            "GROUP BY c.id ORDER BY c.updated DESC, c.id DESC LIMIT ?2"
        )
        return [Conversation(*row) for row in self.db.execute(query, (pattern, limit)).fetchall()]

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        """Give a conversation a new title (its place in the list, by last update, stays)."""
        self.db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))
