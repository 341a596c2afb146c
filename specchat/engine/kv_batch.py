"""The KV cache as one forward pass sees it: where this step's tokens go and what each request attends to.

Built by `KVPool.prepare` once per step (slots, block tables, attention metadata are computed once, not once per
layer) and handed to the model as its `KVAttention`: each layer writes its new keys/values into the pages and
attends over the request's whole context, with the Triton paged-attention kernel on CUDA and the gathered
reference (`_attend_gathered`) elsewhere; on the CPU, where the pool was built with `cpu_kernels`, decode and
verification steps (and prompts) over dense pages (float32, float16 or bfloat16) go through
kernels/cpu_attention.py's C kernel, which stores the step's keys/values and attends over the pages in one call;
over quantized pages (k8v4, mxfp4) the same call also rotates them and quantizes them as kv_quant does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specchat.engine.kv_pages import DENSE_FORMATS, QUANTIZED_FORMATS
from specchat.kernels import cpu_attention
from specchat.kernels.attention import AttentionMetadata, causal_attention, paged_attention_supported

if TYPE_CHECKING:
    from specchat.engine.kv_cache import KVPool


class KVBatch:
    """The KV cache as seen by one forward pass over a ragged batch; implements model.KVAttention.

    Everything that depends only on where the requests' tokens are (slots, block tables) is built once per
    step, not once per layer.
    """

    def __init__(
        self,
        pool: KVPool,
        q_lens: list[int],
        ctx_lens: list[int],
        tables: list[list[int]],
        new_slots: torch.Tensor,
        scale: float,
    ) -> None:
        self.pool, self.store = pool, pool.store
        self.q_lens, self.ctx_lens, self.tables = q_lens, ctx_lens, tables
        self.new_slots = new_slots  # [T] where this step's tokens go
        self.scale = scale
        # Fresh prefill: every request's whole context is this step's tokens, so attend to them directly.
        self.all_fresh = q_lens == ctx_lens
        self._metadata: AttentionMetadata | None = None
        self._ctx_index: list[torch.Tensor | slice] | None = None
        self._split_parts: tuple[torch.Tensor, torch.Tensor, AttentionMetadata] | None = None
        self._fresh_lens: list[int] = []
        self._cpu_plan: cpu_attention.AttentionPlan | None = None
        # every row, a prompt's too: one kernel for a position whether it is prefilled, decoded or verified, so a
        # prompt from the prefix cache or in other chunks gives the same bits (under int8 rows a 1e-6 difference
        # in the attention moved activations across a rounding step: greedy texts diverged in 13 of 15 prompts)
        store = self.store
        takes = pool.cpu_kernels and cpu_attention.supports(pool.head_dim)
        self._cpu_kernel = (
            takes
            and store.name in DENSE_FORMATS  # float32, float16 or bfloat16 elements
            and store.rotation is None  # keys and values stored as they are
            and store.key_transform is None
        )
        # quantized pages (k8v4, mxfp4): the C kernel rotates the step's rows, quantizes them into their slots
        # (kv_quant's codes, bit for bit) and reads the codes; every row, a prompt's too, as for dense pages
        self._cpu_quantized = takes and store.name in QUANTIZED_FORMATS

    def record(self, ids: torch.Tensor) -> None:
        """Write the step's fed tokens [T] into their slots' ids (`PageStore.ids`), once a forward."""
        self.store.ids[self.new_slots] = ids

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, written: bool = False
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]; see kv_pages for the rotation and the key transform.
        `written`: k and v are already in this step's slots of `dense_pages` (the fused rotary kernel put them)."""
        store = self.store
        pages = self.cpu_pages(layer, q.shape[1], k.shape[1], q.shape[2]) if q.dtype == torch.float32 else None
        if pages is not None:
            plan, k_pages, v_pages, rotation = pages
            if rotation is None:
                return cpu_attention.paged_attention(plan, q, k, v, k_pages, v_pages, torch.get_num_threads())
            return cpu_attention.paged_attention_quantized(
                plan, q, k, v, k_pages, v_pages, rotation, torch.get_num_threads()
            )
        q, k, v = store.rotate_queries(layer, q), store.rotate_keys(layer, k), store.rotate(v)
        if not written:
            store.write(layer, self.new_slots, k, v)
        if self.all_fresh:
            out = self._attend_fresh(q, k, v)
        elif self._paged(q, k, max(self.q_lens)):
            from specchat.kernels import attention_triton

            out = attention_triton.paged_attention(q, store.k[layer], store.v[layer], self.metadata(), self.scale)
        elif self._paged(q, k, max(n for n, c in zip(self.q_lens, self.ctx_lens, strict=True) if n != c)):
            out = self._attend_split(layer, q, k, v)
        else:
            out = self._attend_gathered(layer, q)
        return store.rotate(out)

    def dense_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The layer's key and value pages [KVH, slots, D] and this step's slots [T], where the pages store keys
        and values as they are (dense formats: no rotation, no key transform), so a kernel may write them; None
        for quantized pages."""
        store = self.store
        as_is = store.name in DENSE_FORMATS and store.rotation is None and store.key_transform is None
        if not as_is or store.k[layer] is None:
            return None
        return store.k[layer].data, store.v[layer].data, self.new_slots

    def _paged(self, q: torch.Tensor, k: torch.Tensor, max_q: int) -> bool:
        """The paged-attention kernel takes requests of up to `max_q` new tokens here."""
        return self.pool.device.type == "cuda" and paged_attention_supported(
            q.shape[-1], q.shape[1] // k.shape[1], max_q
        )

    def _attend_split(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A step that mixes fresh prompts with decoding / verifying requests (a new request admitted beside
        running ones): the prompts attend to their own keys, the others go through the paged kernel together,
        instead of every request reading its context back one at a time."""
        from specchat.kernels import attention_triton

        fresh_rows, paged_rows, paged_meta = self._split()
        out = torch.empty_like(q)
        out[fresh_rows] = self._causal_each(q[fresh_rows], k[fresh_rows], v[fresh_rows], self._fresh_lens)
        out[paged_rows] = attention_triton.paged_attention(
            q[paged_rows], self.store.k[layer], self.store.v[layer], paged_meta, self.scale
        )
        return out

    def _split(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Rows of the fresh prompts and of the cached requests, and the cached requests' metadata (once a step)."""
        if self._split_parts is None:
            fresh, cached, start = [], [], 0
            self._fresh_lens = []
            for n, c, table in zip(self.q_lens, self.ctx_lens, self.tables, strict=True):
                if n == c:
                    fresh.extend(range(start, start + n))
                    self._fresh_lens.append(n)
                else:
                    cached.append((range(start, start + n), n, c, table))
                start += n
            device = self.new_slots.device
            meta = AttentionMetadata.build(
                [t for *_, t in cached], [n for _, n, _, _ in cached], [c for _, _, c, _ in cached],
                self.pool.page_size, device,
            )  # fmt: skip
            rows = [r for part, *_ in cached for r in part]
            self._split_parts = (torch.tensor(fresh, device=device), torch.tensor(rows, device=device), meta)
        return self._split_parts

    def _attend_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._causal_each(q, k, v, self.q_lens)

    def _causal_each(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """Causal attention of consecutive prompts of these lengths, each over its own keys (no page read)."""
        kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, T, D]
        if len(lens) == 1:
            return causal_attention(q, kh, vh, self.scale)
        outs, start = [], 0
        for n in lens:
            rows = slice(start, start + n)
            outs.append(causal_attention(q[rows], kh[:, rows], vh[:, rows], self.scale))
            start += n
        return torch.cat(outs)

    def _attend_gathered(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The reference path: read each request's context back from its pages."""
        outs, start = [], 0
        for n, index in zip(self.q_lens, self.ctx_index(), strict=True):
            k, v = self.store.read(layer, index, q.dtype)  # [KVH, ctx_len, D]
            outs.append(causal_attention(q[start : start + n], k, v, self.scale))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def metadata(self) -> AttentionMetadata:
        if self._metadata is None:
            self._metadata = AttentionMetadata.build(
                self.tables, self.q_lens, self.ctx_lens, self.pool.page_size, self.pool.device
            )
        return self._metadata

    def cpu_pages(
        self, layer: int, heads: int, kv_heads: int, head_dim: int
    ) -> tuple[cpu_attention.AttentionPlan, cpu_attention.Pages, cpu_attention.Pages, object] | None:
        """Where the CPU attention kernel applies to this step (a pool with `cpu_kernels`): the step's plan, the
        layer's key and value pages and how they are rotated: dense pages (float32, float16 or bfloat16 tensors
        [KVH, slots, D]) and None, or quantized ones (kv_quant.PageTensor) and their cpu_attention.PageRotation."""
        store = self.store
        if self._cpu_kernel:
            return self.cpu_plan(heads, kv_heads, head_dim), store.k[layer].data, store.v[layer].data, None
        if self._cpu_quantized:
            rotation = store.cpu_rotation(layer)
            return self.cpu_plan(heads, kv_heads, head_dim), store.k[layer], store.v[layer], rotation
        return None

    def cpu_plan(self, heads: int, kv_heads: int, head_dim: int) -> cpu_attention.AttentionPlan:
        """The step as the CPU attention kernel reads it (once a step)."""
        if self._cpu_plan is None:
            meta = self.metadata()
            name = self.store.name
            self._cpu_plan = cpu_attention.AttentionPlan(
                meta.block_tables, meta.q_starts, meta.q_lens, meta.ctx_lens, self.new_slots, self.pool.page_size,
                heads, kv_heads, head_dim, self.store.num_slots, self.scale, DENSE_FORMATS.get(name, torch.float32),
                QUANTIZED_FORMATS.get(name),
            )  # fmt: skip
        return self._cpu_plan

    def ctx_index(self) -> list[torch.Tensor | slice]:
        """Per request, the slots of its whole context: a slice when its pages are consecutive (no copy)."""
        if self._ctx_index is None:
            self._ctx_index = [self.pool.slots(t, 0, n) for t, n in zip(self.tables, self.ctx_lens, strict=True)]
        return self._ctx_index
