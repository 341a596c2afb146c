"""The Memory panel: weights and KV cache (format, bytes, what bf16 would take), process memory."""

from __future__ import annotations

from textual.reactive import reactive
from textual.widgets import Static

from specchat.ui.figures import NA, count, size


def weights_format(memory: dict) -> str:
    """The engine's name for the weight format, else one read off the bytes per linear weight."""
    if memory.get("weights_format"):
        return str(memory["weights_format"])
    linear, bf16 = memory.get("linear_weight_bytes"), memory.get("linear_weight_bytes_bf16")
    if not linear or not bf16:
        return NA
    bits = 16 * linear / bf16
    return {32.0: "fp32", 16.0: "16-bit"}.get(round(bits, 2), f"{bits:.2f}-bit")


def memory_text(memory: dict) -> str:
    """Two columns: what, and how many bytes."""
    if not memory:
        return "reading…"
    if "error" in memory:
        return f"[red]{memory['error']}[/red]"
    linear, bf16 = memory.get("linear_weight_bytes"), memory.get("linear_weight_bytes_bf16")
    ratio = f"  (×{linear / bf16:.2f})" if linear and bf16 else ""
    used, capacity = memory.get("kv_used_tokens"), memory.get("kv_capacity_tokens")
    gpu = memory.get("gpu_bytes")
    lines = [
        f"weights [b]{weights_format(memory):<6}[/b] {size(memory.get('weights_bytes'))}",
        f"  linear       {size(linear)}",
        f"  as bf16      {size(bf16)}{ratio}",
        f"KV      [b]{memory.get('kv_format', NA):<6}[/b] {size(memory.get('kv_bytes_per_token'))}/token",
        f"  as bf16      {size(memory.get('kv_bytes_per_token_bf16'))}/token",
        f"  used         {count(used)} / {count(capacity)} tokens",
    ]
    if memory.get("kv_bytes") is not None:
        lines.append(f"  pool         {size(memory['kv_bytes'])}")
    lines += [
        f"max context    {count(memory.get('max_context'))} tokens",
        f"RSS            {size(memory.get('rss_bytes'))}",
        f"GPU            {size(gpu) if gpu is not None else NA}",
    ]
    return "\n".join(lines)


class MemoryPanel(Static):
    """Where the bytes are."""

    memory: reactive[dict] = reactive(dict, init=False)

    def on_mount(self) -> None:
        self.border_title = "Memory"
        self.update(memory_text({}))

    def watch_memory(self, memory: dict) -> None:
        """Show the new figures."""
        self.update(memory_text(memory))
