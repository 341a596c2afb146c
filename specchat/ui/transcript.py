"""A chat saved as a file: Markdown for reading, JSON for tools."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

ROLE_HEADINGS = {"system": "System", "user": "You", "assistant": "Assistant"}


def to_markdown(title: str, messages: list[dict]) -> str:
    """`# title`, then one `## Role` section per message."""
    parts = [f"# {title}\n"]
    for m in messages:
        parts.append(f"## {ROLE_HEADINGS.get(m['role'], m['role'].title())}\n\n{m['content'].strip()}\n")
    return "\n".join(parts)


def to_json(title: str, model: str, messages: list[dict]) -> str:
    """{"title", "model", "messages": [{"role", "content", ...}]} (OpenAI-style messages)."""
    return json.dumps({"title": title, "model": model, "messages": messages}, indent=2, ensure_ascii=False) + "\n"


def transcript_path(folder: Path, title: str, suffix: str) -> Path:
    """A new file name in `folder` from the title and the time, never overwriting one."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()[:40] or "chat"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = folder / f"specchat-{slug}-{stamp}{suffix}"
    n = 1
    while path.exists():
        n += 1
        path = folder / f"specchat-{slug}-{stamp}-{n}{suffix}"
    return path
