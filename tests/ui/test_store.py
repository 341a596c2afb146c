"""The chat store heals and never loses a write (issue 19): a file that is not a chat database is moved aside and a
new one started, with a note; writes return at once and wait out another process's lock; what the exit could not
write is kept in a journal that the next start applies."""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specchat.ui import store_writer
from specchat.ui.store import ChatStore
from specchat.ui.store_writer import Write, coalesce, journals


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "chats.sqlite3"


def fill(store: ChatStore, conversations: int = 3, messages: int = 4) -> dict[int, list[str]]:
    """Conversations of user/assistant messages; their texts by conversation id."""
    texts = {}
    for c in range(conversations):
        cid = store.new_conversation(f"chat {c}", "tiny")
        texts[cid] = [f"message {c}.{m} " + "words " * 50 for m in range(messages)]
        for m, text in enumerate(texts[cid]):
            store.add_message(cid, "user" if m % 2 == 0 else "assistant", text)
    return texts


def contents(store: ChatStore, cid: int) -> list[str]:
    return [m.content for m in store.messages(cid)]


def hold_lock(path: Path, seconds: float) -> subprocess.Popen:
    """Another process holding the database's write lock for `seconds` (returns once it holds it)."""
    code = (
        "import sqlite3, sys, time\n"
        "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "db.execute('BEGIN IMMEDIATE')\n"
        "print('locked', flush=True)\n"
        "time.sleep(float(sys.argv[2]))\n"
        "db.execute('COMMIT')\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# --- plain use ------------------------------------------------------------------------------------------------------
def test_writes_return_at_once_and_reads_see_them_in_order(path):
    store = ChatStore(path)
    texts = fill(store)
    for cid, expected in texts.items():  # no flush: a read waits for the writes made before it
        assert contents(store, cid) == expected
    assert [c.id for c in store.conversations()] == sorted(texts, reverse=True)
    store.close()
    again = ChatStore(path)
    assert {c.id: contents(again, c.id) for c in again.conversations()} == texts
    assert again.take_notes() == []
    again.close()


@pytest.mark.parametrize("meta", ['{"footer": "12 tok', "[1, 2]", '"a string"', b"\xff\xfe"])
def test_a_message_whose_meta_does_not_read_still_opens(path, meta):
    """A stored meta that is not a JSON object (a damaged page, another program's edit) raised JSONDecodeError when
    the chat was opened, or handed the UI a list where it reads meta["footer"]: the message opens without it."""
    store = ChatStore(path)
    conversation = store.new_conversation("t", "m")
    kept = store.add_message(conversation, "user", "hello", {"footer": "fine"})
    odd = store.add_message(conversation, "assistant", "hi")
    store.writer.flush(5)
    store.db.execute("UPDATE messages SET meta = ? WHERE id = ?", (meta, odd))
    store.db.commit()
    messages = store.messages(conversation)
    assert [(m.id, m.content, m.meta) for m in messages] == [(kept, "hello", {"footer": "fine"}), (odd, "hi", None)]
    store.close()


def test_ids_made_by_two_stores_at_once_never_collide(path):
    first, second = ChatStore(path), ChatStore(path)
    cids = [first.new_conversation("a", "m"), second.new_conversation("b", "m")]
    made: dict[str, list[int]] = {"first": [], "second": []}

    def add(name: str, store: ChatStore, cid: int) -> None:
        made[name] = [store.add_message(cid, "user", str(i)) for i in range(500)]

    threads = [threading.Thread(target=add, args=args) for args in zip(made, (first, second), cids, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert first.flush(10) and second.flush(10)  # a store's reads wait for its own writes, not another's
    assert all(ids == sorted(ids) for ids in made.values())  # increasing: ids keep the order messages were made in
    assert len(set(made["first"]) | set(made["second"])) == 1000
    assert [len(first.messages(cid)) for cid in cids] == [500, 500] == [len(second.messages(cid)) for cid in cids]
    first.close()
    second.close()


def test_an_old_database_with_small_ids_keeps_its_order(path):
    db = sqlite3.connect(path, isolation_level=None)  # as the store wrote before ids were made here: 1, 2, 3
    store = ChatStore(path)
    store.close()
    db.execute("INSERT INTO conversations VALUES (1, 'old', 'm', 0, 0)")
    db.execute("INSERT INTO messages VALUES (1, 1, 'user', 'first', NULL, 0)")
    db.close()
    store = ChatStore(path)
    store.add_message(1, "assistant", "second")
    assert contents(store, 1) == ["first", "second"]
    assert store.recent_prompts() == ["first"]
    store.close()


def test_updates_of_one_message_coalesce_to_the_last():
    writes = [
        Write("message", (7, 1, "assistant", "", None, 0.0)),
        Write("update", ("a", None, 7)),
        Write("update", ("x", None, 8)),
        Write("update", ("ab", None, 7)),
        Write("delete", (2,)),
        Write("update", ("abc", '{"reason": "stop"}', 7)),
    ]
    assert coalesce(writes) == [writes[0], writes[2], writes[4], writes[5]]


# --- a file that is not a chat database -------------------------------------------------------------------------------
def truncate_half(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def zero_pages(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[3 * 4096 : 8 * 4096] = bytes(5 * 4096)
    file.write_bytes(bytes(data))


def other_tables(file: Path) -> None:
    file.unlink()
    db = sqlite3.connect(file)
    db.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, body TEXT)")
    db.commit()
    db.close()


BROKEN = {
    "junk bytes": lambda file: file.write_bytes(os.urandom(100_000)),
    "text": lambda file: file.write_text("these are my notes, not a database\n" * 100),
    "truncated to half": truncate_half,
    "pages zeroed": zero_pages,
    "another program's messages table": other_tables,
}


@pytest.mark.parametrize("damage", BROKEN.values(), ids=BROKEN.keys())
def test_a_file_that_is_not_a_chat_database_is_moved_aside(path, damage):
    store = ChatStore(path)
    fill(store, conversations=30)  # more than a few pages, so that damage lands inside them
    store.close()
    damage(path)
    broken = path.read_bytes()
    store = ChatStore(path)
    [note] = store.take_notes()
    [aside] = path.parent.glob("chats.sqlite3.broken-*")
    assert aside.read_bytes() == broken  # kept as it was, for the user to look at
    assert "was not a readable chat database" in note and f"moved to {aside.name}" in note
    cid = store.new_conversation("fresh", "tiny")
    store.add_message(cid, "user", "hello")
    assert [c.title for c in store.conversations()] == ["fresh"] and contents(store, cid) == ["hello"]
    store.close()
    assert ChatStore(path).take_notes() == []  # the new file stays


def test_an_empty_file_is_a_new_database_without_a_note(path):
    path.write_bytes(b"")
    store = ChatStore(path)
    assert store.take_notes() == [] and store.conversations() == []
    store.close()


# --- another process's lock -------------------------------------------------------------------------------------------
def test_a_lock_held_by_another_process_delays_writes_but_loses_none(path, monkeypatch):
    monkeypatch.setattr(store_writer, "NOTE_AFTER_S", 0.5)
    store = ChatStore(path)
    holder = hold_lock(path, 3.0)
    started = time.perf_counter()
    texts = fill(store, conversations=2, messages=30)
    cid = next(iter(texts))
    reply = store.add_message(cid, "assistant", "")
    for n in range(1, 200):  # a streamed reply: one update each time more is shown
        store.update_message(reply, "token " * n)
    assert time.perf_counter() - started < 0.5  # the writes did not wait for the lock
    assert not store.flush(0.2)
    noted = lambda: list(store.notes)  # a copy: the writer thread appends meanwhile
    wait_for(lambda: any("locked by another process" in n for n in noted()), timeout=5)
    holder.wait()
    assert store.flush(10)
    assert contents(store, cid) == [*texts[cid], "token " * 199]
    notes = store.take_notes()
    assert "changes wait and are tried again" in notes[0] and "the changes that waited are saved" in notes[-1]
    store.close()


def test_what_the_exit_could_not_write_is_saved_at_the_next_start(path, monkeypatch, caplog):
    monkeypatch.setattr(store_writer, "CLOSE_WAIT_S", 0.3)
    store = ChatStore(path)
    early = fill(store, conversations=1)
    assert store.flush(5)
    holder = hold_lock(path, 2.0)
    late = fill(store, conversations=2)
    with caplog.at_level(logging.WARNING):
        store.close()
    [journal] = journals(path)
    assert any(journal.name in r.getMessage() and "saved at the next start" in r.getMessage() for r in caplog.records)
    holder.wait()
    again = ChatStore(path)
    assert {c.id: contents(again, c.id) for c in again.conversations()} == early | late
    assert journals(path) == []
    again.close()


def test_a_journal_cut_short_or_tampered_with_applies_only_its_writes(path):
    store = ChatStore(path)
    cid = store.new_conversation("chat", "tiny")
    store.close()
    lines = [
        Write("message", (10, cid, "user", "kept", None, 0.0)).to_json(),
        '{"kind": "sql", "args": ["DROP TABLE messages"]}',  # not a kind of write
        '{"kind": "update", "args": ["too", "few"]}',
        "not json",
        Write("message", (11, cid, "assistant", "also kept", None, 0.0)).to_json(),
        Write("update", ("cut", None, 11)).to_json()[:20],  # the last line of a journal cut short
    ]
    path.with_name(f"{path.name}.unsaved-20261201-000000-1.jsonl").write_text("\n".join(lines))
    store = ChatStore(path)
    assert contents(store, cid) == ["kept", "also kept"]
    assert journals(path) == []
    store.close()


def test_a_write_refused_for_good_is_dropped_alone_with_a_note(path):
    store = ChatStore(path)
    gone, kept = store.new_conversation("deleted elsewhere", "m"), store.new_conversation("kept", "m")
    assert store.flush(5)
    other = sqlite3.connect(path, isolation_level=None)  # another process deletes a conversation, holds the lock
    other.execute("PRAGMA foreign_keys=ON")
    other.execute("BEGIN IMMEDIATE")
    other.execute("DELETE FROM conversations WHERE id = ?", (gone,))
    store.add_message(kept, "user", "before")  # one batch: the refused write must not take these with it
    store.add_message(gone, "user", "to a conversation that no longer exists")
    store.add_message(kept, "user", "after")
    other.execute("COMMIT")
    other.close()
    assert store.flush(10)
    assert contents(store, kept) == ["before", "after"]
    assert any("could not be saved and is dropped" in n for n in store.take_notes())
    store.close()


# --- a file damaged while the app runs --------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", [BROKEN["text"], BROKEN["truncated to half"]], ids=["text", "truncated to half"])
def test_a_file_damaged_while_open_is_a_note_and_its_writes_are_kept(path, monkeypatch, damage):
    """A database overwritten or cut short after the start made every read raise sqlite3.DatabaseError ("database
    disk image is malformed"): the history, a chat being opened, ended the app with a traceback."""
    monkeypatch.setattr(store_writer, "CLOSE_WAIT_S", 0.3)
    store = ChatStore(path)
    cid = next(iter(fill(store, conversations=30)))
    store.close()  # the messages in the main file, not the WAL: reads go to the damaged pages
    store = ChatStore(path)
    damage(path)
    assert store.conversations() == [] and store.messages(cid) == [] and store.conversation(cid) is None
    assert store.recent_prompts() == [] and store.search("message") == []
    [note] = store.take_notes()  # one, however many reads failed
    assert note.startswith("chats.sqlite3 is damaged (database disk image is malformed)")
    store.add_message(cid, "user", "typed after the damage")
    store.close()
    [journal] = journals(path)  # kept for the next start, which moves the damaged file aside
    assert "typed after the damage" in journal.read_text()


# --- an unsaved-writes file that cannot be read, or holds what is not a write ------------------------------------------
def journal_of(path: Path, lines: list[str]) -> Path:
    journal = path.with_name(f"{path.name}.unsaved-20261201-000000-1.jsonl")
    journal.write_text("\n".join(lines) + "\n")
    return journal


def test_a_journal_that_cannot_be_read_is_a_note_and_stays(path):
    """A journal the start could not read ended `specchat run` with an OSError's traceback."""
    journal = path.with_name(f"{path.name}.unsaved-20261201-000000-1.jsonl")
    journal.mkdir()  # what read_text() cannot read, even as root
    store = ChatStore(path)
    [note] = store.take_notes()
    assert note.startswith(f"cannot read {journal.name} (Is a directory): its changes are not applied")
    cid = store.new_conversation("goes on", "m")
    assert store.flush(2) and store.conversation(cid).title == "goes on"
    store.close()
    assert journals(path) == [journal]  # left for the user (and the next start)


def test_a_malformed_journal_never_stops_the_start_or_the_writes(path):
    """A journal line whose kind was not a string (a list) ended the start with a TypeError's traceback; one whose
    values were not SQL values (a list) made every write of the session wait for good, noted as "cannot be written"
    and never saved. Lines that are not writes were skipped silently and the journal deleted with them: now it is
    kept aside, with a note."""
    store = ChatStore(path)
    cid = store.new_conversation("chat", "tiny")
    store.close()
    lines = [
        Write("message", (10, cid, "user", "kept", None, 0.0)).to_json(),
        '{"kind": ["message"], "args": []}',
        '{"kind": "rename", "args": [["a", "list"], 1]}',
        "[" * 100_000,  # too deep for json
        Write("message", (11, cid, "assistant", "also kept", None, 0.0)).to_json(),
    ]
    journal = journal_of(path, lines)
    store = ChatStore(path)
    assert contents(store, cid) == ["kept", "also kept"]
    store.add_message(cid, "user", "after")
    assert store.flush(2) and contents(store, cid) == ["kept", "also kept", "after"]
    assert journals(path) == []
    [kept] = path.parent.glob(f"{journal.name}.not-saved-*")
    assert kept.read_text().splitlines() == lines
    [note] = store.take_notes()
    assert note == f"{journal.name}: 3 lines are not changes and are skipped; the file is kept as {kept.name}"
    store.close()


def test_a_journal_whose_changes_the_database_refuses_is_kept(path):
    """The writes kept while the database was damaged continue chats of that file; the next start moves it aside,
    and the new database refused them (their conversation is not in it): dropped, and the journal deleted, so those
    messages were lost. Now the journal is kept aside, with a note."""
    lines = [Write("message", (10, 12345, "user", "a message of a chat in the damaged file", None, 0.0)).to_json()]
    journal = journal_of(path, lines)
    store = ChatStore(path)
    assert store.flush(2)
    assert journals(path) == []
    [kept] = path.parent.glob(f"{journal.name}.not-saved-*")
    assert kept.read_text().splitlines() == lines
    notes = store.take_notes()
    assert f"{journal.name}: 1 change could not be saved; the file is kept as {kept.name}" in notes
    store.close()


def test_a_journal_that_cannot_be_removed_never_stops_the_writes(path, monkeypatch):
    """Removing a replayed journal raised OSError in the writer's thread, which ended: nothing more was saved."""
    store = ChatStore(path)
    cid = store.new_conversation("chat", "tiny")
    store.close()
    journal = journal_of(path, [Write("message", (10, cid, "user", "replayed", None, 0.0)).to_json()])

    def refuse(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    store = ChatStore(path)
    store.add_message(cid, "user", "after")
    assert store.flush(2) and contents(store, cid) == ["replayed", "after"]
    assert store.take_notes() == [
        f"{journal.name} cannot be removed (Permission denied): it stays, and the next start applies it again"
    ]
    store.close()


def test_what_was_typed_on_a_damaged_file_survives_the_next_start(path, monkeypatch):
    """The whole way of a file damaged while open: the next start moves it aside and applies the kept writes; a new
    chat's are saved, and a message of a chat that is only in the damaged file stays in the kept journal."""
    monkeypatch.setattr(store_writer, "CLOSE_WAIT_S", 0.3)
    store = ChatStore(path)
    old = next(iter(fill(store, conversations=30)))
    store.close()
    store = ChatStore(path)
    BROKEN["text"](path)
    store.add_message(old, "user", "to an old chat")
    new = store.new_conversation("new chat", "m")
    store.add_message(new, "user", "to a new chat")
    store.close()
    [journal] = journals(path)
    again = ChatStore(path)
    assert again.flush(2) and contents(again, new) == ["to a new chat"]
    [aside] = path.parent.glob("chats.sqlite3.broken-*")
    [kept] = path.parent.glob(f"{journal.name}.not-saved-*")
    assert "to an old chat" in kept.read_text()
    notes = again.take_notes()
    assert f"moved to {aside.name}" in notes[0] and f"the file is kept as {kept.name}" in notes[-1]
    again.close()
