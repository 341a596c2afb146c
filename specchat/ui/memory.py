"""The Memory panel: weights and KV cache (format, bytes, what bf16 would take), process memory."""

from __future__ import annotations

from textual.reactive import reactive

from specchat.engine.api import weights_label
from specchat.ui.figures import NA, FigureText, count, size


def weights_format(memory: dict, dtype: str | None = None) -> str:
    """The running weights' name for the panels (engine.api.weights_label)."""
    return weights_label(memory, dtype)


def memory_text(memory: dict, dtype: str | None = None) -> str:
    """Two columns: what, and how many bytes (`dtype`: the model dtype asked for, if any)."""
    if not memory:
        return "reading…"
    if "error" in memory:
        return f"[red]{memory['error']}[/red]"
    linear, bf16 = memory.get("linear_weight_bytes"), memory.get("linear_weight_bytes_bf16")
    ratio = f"  (×{linear / bf16:.2f})" if linear and bf16 else ""
    used, capacity = memory.get("kv_used_tokens"), memory.get("kv_capacity_tokens")
    lines = [
        f"weights [b]{weights_format(memory, dtype)}[/b]",
        f"  total        {size(memory.get('weights_bytes'))}",
        f"  linear       {size(linear)}",
        f"  as bf16      {size(bf16)}{ratio}",
    ]
    if memory.get("weights_restore_bytes"):
        lines.append(f"  kept to undo {size(memory['weights_restore_bytes'])}")
    lines += [
        f"KV      [b]{memory.get('kv_format', NA)}[/b]",
        f"  per token    {size(memory.get('kv_bytes_per_token'))}",
        f"  as bf16      {size(memory.get('kv_bytes_per_token_bf16'))}",
        f"  used         {count(used)} / {count(capacity)} tokens",
    ]
    if memory.get("kv_capacity_bytes") is not None:
        lines.append(f"  pool         {size(memory['kv_capacity_bytes'])}")
    if memory.get("kv_cached_tokens"):
        lines.append(f"  prefix cache {count(memory['kv_cached_tokens'])} tokens")
    sessions = memory.get("max_sessions")
    lines += [
        f"max context    {count(memory.get('max_context'))} tokens",
        *([f"  sessions     {sessions} at max context"] if sessions is not None else []),
        f"RSS            {size(memory.get('rss_bytes'))}",
        f"GPU            {size(memory['gpu_bytes']) if memory.get('gpu_bytes') is not None else NA}",
    ]
    return "\n".join(lines)


class MemoryPanel(FigureText):
    """Where the bytes are."""

    memory: reactive[dict] = reactive(dict, init=False)
    dtype: reactive[str | None] = reactive(None, init=False)  # the model dtype asked for (--dtype); None: default

    def on_mount(self) -> None:
        self.border_title = "Memory"
        self.show(memory_text({}))

    def watch_memory(self, memory: dict) -> None:
        """Show the new figures."""
        self.show(memory_text(memory, self.dtype))

    def watch_dtype(self, dtype: str | None) -> None:
        """Name unquantized weights by the model dtype."""
        self.show(memory_text(self.memory, dtype))
