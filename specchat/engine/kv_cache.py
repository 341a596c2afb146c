"""Paged KV cache: a fixed pool of pages, per-request block tables, and the per-step `KVBatch` view.

Terms: a *page* holds the keys and values of `page_size` consecutive tokens of one request, for every layer.
A request's *block table* lists its pages in order; token position p lives in page table[p // page_size] at
offset p % page_size, i.e. in *slot* table[p // page_size] * page_size + p % page_size.

The pool only does bookkeeping; how a page stores numbers is the page store's business (`DensePages` here:
the model dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specchat.errors import KVCacheFullError
from specchat.kernels.attention import causal_attention


class DensePages:
    """Pages in a plain floating dtype: k/v [layers, num_pages * page_size, KVH, D]."""

    name = "dense"

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [T, KVH, D] at slots [T]."""
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v [len(slots), KVH, D] of the given slots."""
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)


@dataclass(slots=True)
class SeqSlots:
    """Where one request's tokens are, for one step."""

    q_len: int  # new tokens fed this step
    ctx_len: int  # tokens in context after this step's tokens are stored
    ctx_slots: torch.Tensor  # [ctx_len] slots of the whole context, in position order


class KVBatch:
    """The KV cache as seen by one forward pass over a ragged batch; implements model.KVAttention."""

    def __init__(self, pool: KVPool, seqs: list[SeqSlots], new_slots: torch.Tensor, scale: float) -> None:
        self.pool = pool
        self.seqs = seqs
        self.new_slots = new_slots  # [T] where this step's tokens go
        self.scale = scale
        # Fresh prefill: every request's whole context is this step's tokens, so attend to them directly.
        self.all_fresh = all(s.q_len == s.ctx_len for s in seqs)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.store.write(layer, self.new_slots, k, v)
        outs = []
        start = 0
        for s in self.seqs:
            qs = q[start : start + s.q_len]
            if self.all_fresh:
                ks, vs = k[start : start + s.q_len], v[start : start + s.q_len]
            else:
                ks, vs = self.pool.store.read(layer, s.ctx_slots)
            outs.append(causal_attention(qs, ks, vs, self.scale))
            start += s.q_len
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class KVPool:
    """A fixed pool of pages shared by all requests."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_pages <= 0:
            raise KVCacheFullError("the KV memory budget is too small for a single page")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_pages, self.page_size = num_pages, page_size
        self.device = torch.device(device)
        self.store = DensePages(num_layers, num_pages * page_size, num_kv_heads, head_dim, dtype, self.device)
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVPool:
        per_token = DensePages.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        num_pages = budget_bytes // (per_token * page_size)
        return cls(num_layers, num_kv_heads, head_dim, num_pages, page_size, dtype, device)

    # --- accounting -------------------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        return self.store.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.store.k.dtype)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        """Pages a request could get now."""
        return len(self.free_pages)

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # --- per-request bookkeeping ------------------------------------------------------------------------
    def add(self, seq_id: int, token_ids: list[int]) -> int:
        """Start a block table for a request; returns how many of its leading tokens are already cached."""
        self.tables[seq_id] = []
        self.lengths[seq_id] = 0
        return 0

    def free(self, seq_id: int, token_ids: list[int] | None = None) -> None:
        """Release a request's pages (token_ids: its tokens, for caches that keep finished prefixes)."""
        self.free_pages.extend(reversed(self.tables.pop(seq_id)))
        del self.lengths[seq_id]

    def length(self, seq_id: int) -> int:
        return self.lengths[seq_id]

    def truncate(self, seq_id: int, length: int) -> None:
        """Forget every token at position >= length (speculative rollback); frees pages no longer needed."""
        if not 0 <= length <= self.lengths[seq_id]:
            raise ValueError(f"cannot truncate request {seq_id} of {self.lengths[seq_id]} tokens to {length}")
        table = self.tables[seq_id]
        keep = self.pages_for(length)
        self.free_pages.extend(reversed(table[keep:]))
        del table[keep:]
        self.lengths[seq_id] = length

    def extra_pages_needed(self, seq_id: int, num_new: int) -> int:
        return max(0, self.pages_for(self.lengths[seq_id] + num_new) - len(self.tables[seq_id]))

    def can_append(self, needs: dict[int, int]) -> bool:
        """Whether every request in `needs` (seq_id -> new tokens) can grow by that many tokens at once."""
        return sum(self.extra_pages_needed(s, n) for s, n in needs.items()) <= self.num_free_pages

    def _reserve(self, seq_id: int, num_new: int) -> None:
        extra = self.extra_pages_needed(seq_id, num_new)
        if extra > len(self.free_pages):
            raise KVCacheFullError(
                f"KV cache full: {num_new} more tokens need {extra} pages, {len(self.free_pages)} free"
            )
        table = self.tables[seq_id]
        for _ in range(extra):
            table.append(self.free_pages.pop())

    def _slots(self, seq_id: int, start: int, stop: int) -> torch.Tensor:
        pos = torch.arange(start, stop)
        table = torch.tensor(self.tables[seq_id], dtype=torch.long)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    def prepare(self, seq_ids: list[int], num_new: list[int], scale: float) -> KVBatch:
        """Reserve room for each request's new tokens and return the step's view of the cache."""
        if not self.can_append(dict(zip(seq_ids, num_new, strict=True))):
            raise KVCacheFullError("KV cache full: not enough free pages for this step")
        seqs, new_slots = [], []
        for seq_id, n in zip(seq_ids, num_new, strict=True):
            self._reserve(seq_id, n)
            start = self.lengths[seq_id]
            self.lengths[seq_id] = start + n
            ctx = self._slots(seq_id, 0, start + n)
            seqs.append(SeqSlots(q_len=n, ctx_len=start + n, ctx_slots=ctx.to(self.device)))
            new_slots.append(ctx[start:])
        return KVBatch(self, seqs, torch.cat(new_slots).to(self.device), scale)
