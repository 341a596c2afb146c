"""Paged KV cache: a fixed pool of pages, per-request block tables and prefix sharing (a step's view: kv_batch).

Terms: a *page* holds the keys and values of `page_size` consecutive tokens of one request, for every layer.
A request's *block table* lists its pages in order; token position p lives in page table[p // page_size] at
offset p % page_size, i.e. in *slot* table[p // page_size] * page_size + p % page_size. How a page stores
numbers (bf16, MXFP4, ...) is the `PageStore`'s business (engine.kv_pages); the pool only does bookkeeping.

Prefix sharing (as vLLM's automatic prefix caching): a full page is keyed by a hash chain over the tokens
up to its end, key_i = hash((key_{i-1}, tokens of page i)), so equal keys mean equal prefixes (the page's own
tokens and parent key are compared too). A request that starts with a cached prefix takes those pages instead
of recomputing them. Pages are refcounted; a page whose count drops to zero stays cached, *evictable*, and is
handed out again least recently used first, so evictable pages count as free. A page is published (made
findable) once its tokens are known and its keys/values written: prompt pages at the next `add`, pages of
generated tokens when the request is freed. Shared pages are never written: a request only writes positions
past its length, and a page it must rewrite after `truncate` or `fork` is copied first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specchat.engine.kv_batch import KVBatch
from specchat.engine.kv_pages import KEY_TRANSFORM_FORMATS, PageStore, auto_format, bytes_per_token
from specchat.errors import KVCacheFullError

ROOT_KEY = 0  # parent key of a request's first page


@dataclass(slots=True)
class CachedPage:
    """What a published page holds: the prefix key it is found by, its parent's key and its tokens."""

    key: int
    parent: int
    tokens: tuple[int, ...]


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
        kv_format: str = "auto",
        rotate: bool = True,
        key_transform: Callable[[], torch.Tensor] | None = None,
        cpu_kernels: bool = False,
    ) -> None:
        if num_pages <= 0:
            raise KVCacheFullError("the KV memory budget is too small for a single page")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size = page_size
        self.device = torch.device(device)
        fmt = auto_format(dtype, cpu_kernels, head_dim) if kv_format == "auto" else kv_format
        self.rotate = rotate
        self.cpu_kernels = cpu_kernels  # steps attend through kernels/cpu_attention.py (float32 queries)
        self.budget_bytes = num_pages * page_size * bytes_per_token(fmt, num_layers, num_kv_heads, head_dim)
        self._key_transform_source = key_transform  # makes A on first need (kv_transform.load_or_calibrate)
        self._key_transform: torch.Tensor | None = None
        self.store = PageStore(
            fmt, num_layers, num_kv_heads, head_dim, num_pages * page_size, self.device, rotate,
            **self._transform_args(fmt, rotate),
        )  # fmt: skip
        self._reset_pages(num_pages)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}  # tokens known for each request (prompt, or all at free)
        self.keys: dict[int, list[int]] = {}  # prefix keys of each request's leading full pages
        self.prefix_hit_tokens = 0  # tokens taken from the prefix cache instead of being computed

    def _reset_pages(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self.refcount = [0] * num_pages
        self.evictable: OrderedDict[int, None] = OrderedDict()  # published, unreferenced; oldest first
        self.published: dict[int, CachedPage] = {}  # page -> what it holds
        self.index: dict[int, int] = {}  # prefix key -> page

    def _transform_args(self, fmt: str, rotate: bool) -> dict:
        """{"key_transform": A} for a page format that uses the calibrated key transform, else {}."""
        if fmt not in KEY_TRANSFORM_FORMATS or not rotate or self._key_transform_source is None:
            return {}
        if self._key_transform is None:
            self._key_transform = self._key_transform_source()
        return {"key_transform": self._key_transform}

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
        kv_format: str = "auto",
        rotate: bool = True,
        key_transform: Callable[[], torch.Tensor] | None = None,
        cpu_kernels: bool = False,
    ) -> KVPool:
        fmt = auto_format(dtype, cpu_kernels, head_dim) if kv_format == "auto" else kv_format
        page_bytes = bytes_per_token(fmt, num_layers, num_kv_heads, head_dim) * page_size
        num_pages = budget_bytes // page_bytes
        if num_pages <= 0:
            raise KVCacheFullError(
                f"the KV memory budget of {budget_bytes:,} bytes holds no page: one page is {page_bytes:,} bytes "
                f"({page_size} tokens of {fmt} KV) for this model (raise --kv-memory)"
            )
        return cls(
            num_layers, num_kv_heads, head_dim, num_pages, page_size, dtype, device, fmt, rotate, key_transform,
            cpu_kernels,
        )  # fmt: skip

    # --- accounting -------------------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.store.name, self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        """Pages a request could get now (evictable cached pages included)."""
        return len(self.free_pages) + len(self.evictable)

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def cached_pages(self) -> int:
        """Evictable pages kept for prefix sharing."""
        return len(self.evictable)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def memory(self, max_position: int) -> dict:
        """Accounting for the UI, `--json` and benchmarks: format, bytes per token, used / cached / capacity, and
        the longest context and the most concurrent sessions of that length (for a model of `max_position`)."""
        max_context = min(max_position, self.capacity_tokens)
        return {
            "kv_format": self.store.name,
            "kv_bytes_per_token": self.bytes_per_token,
            "kv_bytes_per_token_bf16": bytes_per_token("bf16", self.num_layers, self.num_kv_heads, self.head_dim),
            "kv_capacity_tokens": self.capacity_tokens,
            "kv_capacity_bytes": self.capacity_tokens * self.bytes_per_token,
            "kv_used_tokens": self.used_pages * self.page_size,
            "kv_used_bytes": self.used_pages * self.page_size * self.bytes_per_token,
            "kv_cached_tokens": self.cached_pages * self.page_size,  # evictable prefix cache, counted as free
            "kv_prefix_hit_tokens": self.prefix_hit_tokens,
            "max_context": max_context,
            "max_sessions": self.num_pages // self.pages_for(max_context),  # concurrent, each at max_context
        }

    # --- pages ----------------------------------------------------------------------------------------------
    def _take_page(self) -> int:
        if self.free_pages:
            page = self.free_pages.pop()
        elif self.evictable:
            page, _ = self.evictable.popitem(last=False)  # least recently used
            self._unpublish(page)
        else:
            raise KVCacheFullError(f"KV cache full: all {self.num_pages} pages are in use")
        self.refcount[page] = 1
        return page

    def _claim(self, page: int) -> None:
        if self.refcount[page] == 0:
            del self.evictable[page]
        self.refcount[page] += 1

    def _release(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self.published:
                self.evictable[page] = None
            else:
                self.free_pages.append(page)

    def _unpublish(self, page: int) -> None:
        entry = self.published.pop(page)
        if self.index.get(entry.key) == page:
            del self.index[entry.key]

    def _page_slots(self, pages: list[int]) -> torch.Tensor:
        offsets = torch.arange(self.page_size)
        return (torch.tensor(pages, dtype=torch.long)[:, None] * self.page_size + offsets).flatten().to(self.device)

    def _make_private(self, seq_id: int, i: int) -> None:
        """Make page i of a request safe to write: copy it if shared, unpublish it if only cached."""
        table = self.tables[seq_id]
        page = table[i]
        if self.refcount[page] > 1:
            copy = self._take_page()
            self.store.copy_slots(self._page_slots([page]), self._page_slots([copy]))
            self.refcount[page] -= 1
            table[i] = copy
        elif page in self.published:
            self._unpublish(page)

    def _publish(self, seq_id: int, tokens: list[int]) -> None:
        """Make a request's written full pages with known tokens findable by their prefix key."""
        keys, table = self.keys[seq_id], self.tables[seq_id]
        ps = self.page_size
        for i in range(len(keys), min(self.lengths[seq_id], len(tokens)) // ps):
            parent = keys[-1] if keys else ROOT_KEY
            chunk = tuple(tokens[i * ps : (i + 1) * ps])
            key = hash((parent, chunk))
            keys.append(key)
            if key not in self.index and table[i] not in self.published:
                self.index[key] = table[i]
                self.published[table[i]] = CachedPage(key, parent, chunk)

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. when the weights change and cached keys/values no longer match)."""
        for page in list(self.published):
            self._unpublish(page)
        self.free_pages.extend(reversed(self.evictable))
        self.evictable.clear()
        for keys in self.keys.values():
            keys.clear()

    # --- per-request bookkeeping ------------------------------------------------------------------------
    def add(self, seq_id: int, token_ids: list[int]) -> int:
        """Start a block table for a request; returns how many of its leading tokens are already cached.

        The count is whole pages, and always less than len(token_ids), so at least the last token is fed.
        """
        for running, tokens in self.tokens.items():
            self._publish(running, tokens)
        ps = self.page_size
        matched, keys, parent = [], [], ROOT_KEY
        for i in range((len(token_ids) - 1) // ps):
            chunk = tuple(token_ids[i * ps : (i + 1) * ps])
            key = hash((parent, chunk))
            page = self.index.get(key)
            if page is None or self.published[page].tokens != chunk or self.published[page].parent != parent:
                break
            matched.append(page)
            keys.append(key)
            parent = key
        for page in matched:
            self._claim(page)
        self.tables[seq_id] = matched
        self.keys[seq_id] = keys
        self.tokens[seq_id] = list(token_ids)
        self.lengths[seq_id] = len(matched) * ps
        self.prefix_hit_tokens += len(matched) * ps
        return len(matched) * ps

    def free(self, seq_id: int, token_ids: list[int] | None = None) -> None:
        """Release a request's pages; token_ids (the tokens whose KV is valid) lets its full pages be cached."""
        if token_ids is not None:
            self._publish(seq_id, token_ids)
        for page in reversed(self.tables.pop(seq_id)):  # deepest first: evicted before their parents
            self._release(page)
        del self.lengths[seq_id], self.tokens[seq_id], self.keys[seq_id]

    def fork(self, src_id: int, dst_id: int) -> None:
        """Start request dst_id as a copy of src_id: full pages shared, the partial last page copied."""
        length = self.lengths[src_id]
        partial = length % self.page_size != 0
        if partial and self.num_free_pages == 0:
            raise KVCacheFullError("KV cache full: no free page to fork a request's last page into")
        for page in self.tables[src_id]:
            self._claim(page)
        self.tables[dst_id] = list(self.tables[src_id])
        self.lengths[dst_id] = length
        self.tokens[dst_id] = list(self.tokens[src_id])
        self.keys[dst_id] = list(self.keys[src_id])
        if partial:
            self._make_private(dst_id, len(self.tables[dst_id]) - 1)

    def length(self, seq_id: int) -> int:
        return self.lengths[seq_id]

    def truncate(self, seq_id: int, length: int) -> None:
        """Forget every token at position >= length (speculative rollback); frees pages no longer needed."""
        if not 0 <= length <= self.lengths[seq_id]:
            raise ValueError(f"cannot truncate request {seq_id} of {self.lengths[seq_id]} tokens to {length}")
        table = self.tables[seq_id]
        keep = self.pages_for(length)
        copies = length % self.page_size != 0 and self.refcount[table[keep - 1]] > 1
        if copies and self.num_free_pages + sum(self.refcount[p] == 1 for p in table[keep:]) == 0:
            raise KVCacheFullError("KV cache full: no free page to copy a shared page that truncate rewrites")
        for page in reversed(table[keep:]):
            self._release(page)
        del table[keep:]
        del self.keys[seq_id][length // self.page_size :]
        self.lengths[seq_id] = length
        if length % self.page_size:
            self._make_private(seq_id, keep - 1)

    def can_append(self, needs: dict[int, int]) -> bool:
        """Whether every request in `needs` (seq_id -> new tokens) can grow by that many tokens at once."""
        # (the pages each needs beyond its table, without a method call per request: a step asks this of every
        # running request several times, and at 32 sessions on a GPU the host's bookkeeping is the step's time)
        lengths, tables, ps, extra = self.lengths, self.tables, self.page_size, 0
        for s, n in needs.items():
            extra += max(0, -(-(lengths[s] + n) // ps) - len(tables[s]))
        return extra <= self.num_free_pages

    def append(self, seq_id: int, num_new: int) -> None:
        """Grow a request by num_new tokens, taking pages as needed (their KV is written by the forward)."""
        table, length = self.tables[seq_id], self.lengths[seq_id] + num_new
        extra = -(-length // self.page_size) - len(table)  # (pages_for, inline: a step's hot path)
        if extra > 0:
            if extra > self.num_free_pages:
                raise KVCacheFullError(
                    f"KV cache full: {num_new} more tokens need {extra} pages, {self.num_free_pages} free"
                )
            table.extend(self._take_page() for _ in range(extra))
        self.lengths[seq_id] = length

    def slots(self, table: list[int], start: int, stop: int) -> torch.Tensor | slice:
        """Slots of positions start..stop-1 of a block table: a slice when they are consecutive."""
        ps = self.page_size
        first, last = start // ps, (stop - 1) // ps
        if (
            stop > start
            and table[last] - table[first] == last - first
            and all(table[i + 1] == table[i] + 1 for i in range(first, last))
        ):
            base = table[first] * ps - first * ps
            return slice(base + start, base + stop)
        pos = torch.arange(start, stop)
        pages = torch.tensor(table, dtype=torch.long)[pos // ps]
        return (pages * ps + pos % ps).to(self.device)

    def reserve(
        self, seq_ids: list[int], num_new: list[int], slots: bool = True
    ) -> tuple[list[list[int]], list[int], list[int]]:
        """Room for each request's new tokens: (block tables, context lengths, the new tokens' slots in order),
        all on the host (what a step's metadata is built from); `slots` False: no slots (the caller's device
        makes them from the tables), an empty list."""
        if not self.can_append(dict(zip(seq_ids, num_new, strict=True))):
            raise KVCacheFullError("KV cache full: not enough free pages for this step")
        tables, ctx_lens, new_slots, ps = [], [], [], self.page_size
        for seq_id, n in zip(seq_ids, num_new, strict=True):
            start = self.lengths[seq_id]
            self.append(seq_id, n)
            table = self.tables[seq_id]
            tables.append(list(table))
            ctx_lens.append(start + n)
            if slots and n == 1:  # (a decode step's one token)
                new_slots.append(table[start // ps] * ps + start % ps)
            elif slots:
                new_slots.extend(table[p // ps] * ps + p % ps for p in range(start, start + n))
        return tables, ctx_lens, new_slots

    def prepare(self, seq_ids: list[int], num_new: list[int], scale: float) -> KVBatch:
        """Reserve room for each request's new tokens and return the step's view of the cache."""
        tables, ctx_lens, slots = self.reserve(seq_ids, num_new)
        new = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        return KVBatch(self, list(num_new), ctx_lens, tables, new, scale)

    # --- live format switch -----------------------------------------------------------------------------
    def convert(self, fmt: str, rotate: bool | None = None, rule: str | None = None) -> None:
        """Re-encode every live page into page format fmt, keeping the memory budget.

        The page count follows the budget (a smaller format holds more tokens). Pages keep their numbers unless
        the pool shrinks below them. Cached prefixes are kept, most recently used first, as far as they fit.
        Raises KVCacheFullError, changing nothing, when the live requests alone need more pages than the new
        format has.
        """
        rotate = self.rotate if rotate is None else rotate
        rule = self.store.rule if rule is None else rule
        if fmt == self.store.name and rotate == self.rotate and rule == self.store.rule:
            return
        per_page = bytes_per_token(fmt, self.num_layers, self.num_kv_heads, self.head_dim) * self.page_size
        num_pages = self.budget_bytes // per_page
        live = [p for p in range(self.num_pages) if self.refcount[p] > 0]
        if len(live) > num_pages:
            raise KVCacheFullError(
                f"cannot switch the KV cache to {fmt}: live requests hold {len(live) * self.page_size} tokens, "
                f"the same memory holds {num_pages * self.page_size} tokens in {fmt}"
            )
        room = num_pages - len(live)
        kept = list(self.evictable)[::-1][:room][::-1]  # the most recently used cached pages that fit
        # Pages keep their numbers where the new pool has them; only those past its end move to free numbers.
        order = live + kept
        new_id = {p: p for p in order if p < num_pages}
        vacant = sorted(set(range(num_pages)) - set(new_id))
        new_id.update(zip([p for p in order if p >= num_pages], vacant, strict=False))
        self.store = self.store.reencode(
            fmt,
            num_pages * self.page_size,
            self._page_slots(order),
            self._page_slots([new_id[p] for p in order]),
            rotate,
            rule,
            **self._transform_args(fmt, rotate),
        )
        self.rotate = rotate

        refcount, published = self.refcount, self.published
        self._reset_pages(num_pages)
        self.free_pages = sorted(set(range(num_pages)) - set(new_id.values()), reverse=True)
        for old, new in new_id.items():
            self.refcount[new] = refcount[old]
        for old in kept:
            self.evictable[new_id[old]] = None
        self.published = {new_id[p]: entry for p, entry in published.items() if p in new_id}
        self.index = {entry.key: p for p, entry in self.published.items()}
        self.tables = {s: [new_id[p] for p in table] for s, table in self.tables.items()}
