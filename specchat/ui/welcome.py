"""What an empty chat says: which model runs where, how it decodes, what to do and the keys that change it."""

from __future__ import annotations

from textwrap import shorten

from rich.markup import escape

from specchat.ui.controls import k_text
from specchat.ui.figures import NA
from specchat.ui.memory import weights_format
from specchat.ui.settings import ChatSettings

SYSTEM_SHOWN = 100  # characters of the system prompt the welcome line quotes

# The bindings the welcome line names, by id (the app shows each one's key, remapped or not), and what they do.
WELCOME_KEYS = (
    ("next_drafter", "drafter"),
    ("k_up", "K+1"),
    ("k_down", "K-1"),
    ("k_auto", "K auto"),
    ("toggle_weights", "weights"),
    ("toggle_kv", "KV"),
    ("new_chat", "new chat"),
    ("history", "history"),
    ("command_palette", "every command"),
)


def welcome_text(
    model: str, device: str | None, settings: ChatSettings, memory: dict, keys: dict[str, str], dtype: str | None
) -> str:
    """Model and device (None: still loading), drafter, K, weights (`dtype`: the model dtype asked for, if any) and
    KV, then the keys (binding id -> key)."""
    model, drafter = escape(model), escape(settings.drafter)  # a path or file name may hold "[...]": not markup
    if device is None:
        head = (
            f"Loading [b]{model}[/b]… Type your message now: it is sent as soon as the model is ready.\n"
            f"drafter {drafter}, K {k_text(settings.k)}"
        )
    else:
        weights = weights_format(memory, dtype) if memory else NA
        head = (
            f"[b]{model}[/b] on {device} · drafter [b]{drafter}[/b], K {k_text(settings.k)} · "
            f"weights {weights} · KV {memory.get('kv_format', NA)}\n"
            "Type a message and press Enter (Ctrl+J: new line). The panels on the right show speculative decoding "
            "live: the drafter proposes K tokens, the model checks them all in one step and keeps those it agrees with."
        )
    if settings.system:
        head += f"\nSystem prompt: {escape(shorten(' '.join(settings.system.split()), SYSTEM_SHOWN))}"
    shortcuts = " · ".join(f"[b]{escape(keys[id_])}[/b] {what}" for id_, what in WELCOME_KEYS if id_ in keys)
    return f"{head}\n{shortcuts}"
