"""CUDA graphs for decode and verification steps: the model's forward captured once per shape, then replayed.

At batch 1 an 8B-parameter model runs ~700 kernels per token; launching them one by one from Python costs
more than the GPU takes to run them. A captured graph replays them all with one launch. Shapes are bucketed:
a graph serves steps in which every request feeds the same number q of tokens (1 for plain decode, k + 1 for
verification), with the batch padded up to a bucket size and the attention's context split for a bucket of
maximum context length. Padding requests attend to q tokens of a scratch page of their own and are ignored.

A verification step whose requests draft different k is made uniform before it gets here: SpecStep pads every
request to the widest one (`padded_width`) with rows that are never verified. Hidden-state taps that drafters
read are static outputs of the captured graph (one graph per tap set), copied out at each replay.

A fresh prompt (its first chunk: it attends only to its own keys) of up to PREFILL_BUCKETS[-1] tokens (a full chunk
of the scheduler's; buckets up to the model's context) replays a prefill graph of the next bucket's length: padding
tokens go at its end, where causal attention keeps them out of the real rows, and write their keys to the scratch
page. A prompt after cached context (a later chat turn, an
agent's next call) of up to PROMPT_WIDTHS[-1] new tokens replays the step graph of that width through the paged
kernel, together with the other such prompts of its width (32 sessions' next turns: one replay, not 32), its
padding written past its end and truncated after. A step that mixes prompts with decoding is split
(`split_mixed_step`): the decoding requests (padded to one width by SpecStep) replay their graph, the prompts
after cached context of each width theirs, each fresh prompt its prefill graph, and what is left (a longer
prompt) runs eagerly through ModelRunner, which stays the reference for all of it: tests/engine/test_cuda_graph.py
and test_engine_cuda.py hold them equal.

A replay's inputs (token ids, positions, slots, context lengths, block tables) go to the device in two copies
from pinned host buffers (`_Staging`), whatever the batch. Drafters' chains use `GraphedFunction`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from specchat.engine.fusion import FusedLinear
from specchat.engine.kv_batch import KVBatch
from specchat.engine.kv_cache import KVPool
from specchat.engine.model import Transformer
from specchat.engine.runner import ModelRunner, Rows, StepBatch, StepOutput, TokenContext, joined, sub_batch, to_device
from specchat.kernels import dense_gemv, pdl
from specchat.kernels.attention import AttentionMetadata, paged_attention_supported
from specchat.kernels.mxfp4_matmul import graphed_steps
from specchat.quant.fp4_linear import Fp4Linear

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_GRAPH_Q = 9  # tokens per request in a captured step: k + 1 for k <= 8
CTX_BUCKETS = (1024, 4096, 16384, 65536, 131072)
# fresh prompts up to a full chunk (the scheduler's max_batch_tokens) replay a graph: an eager forward costs ~1 ms of
# host work a layer, which bounds prompts of up to ~2,000 tokens even on an 8B model (docs/benchmarks.md)
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
PROMPT_WIDTHS = (16, 32)  # prompts after cached context of up to 32 new tokens replay a step graph this wide
PROMPT_GRAPH_ROWS = 512  # prompts of one width replay together up to this many rows (32 of 16, 16 of 32)
SCRATCH_SEQ = -1  # the pool entry holding the padding requests' page


def _bucket(value: int, buckets: Seq[int]) -> int | None:
    return next((b for b in buckets if b >= value), None)


def _batch_buckets_up_to(sessions: int) -> list[int]:
    """The batch buckets a run of up to `sessions` requests at once can meet."""
    top = _bucket(min(sessions, BATCH_BUCKETS[-1]), BATCH_BUCKETS)
    return [b for b in BATCH_BUCKETS if b <= top]


class StaticKVBatch(KVBatch):
    """A KVBatch whose attention metadata lives in fixed device buffers (what a captured graph reads); for a
    prefill graph (`meta` None) one fresh prompt of q tokens that attends to its own keys."""

    def __init__(
        self, pool: KVPool, meta: AttentionMetadata | None, new_slots: torch.Tensor, q: int, scale: float
    ) -> None:
        if meta is None:
            super().__init__(pool, [q], [q], [[0]], new_slots, scale)
        else:
            batch = meta.block_tables.shape[0]
            super().__init__(pool, [q] * batch, [meta.max_ctx_len] * batch, [[0]] * batch, new_slots, scale)
        self.static_meta = meta

    def metadata(self) -> AttentionMetadata:
        assert self.static_meta is not None, "a prefill graph attends to its own keys"
        return self.static_meta

    # Its tables are the metadata's, on the device: cached context is read by the paged kernel only (whose shapes
    # the graphs' makers check before they capture), never gathered through the host's tables or the CPU kernel.
    # (On a CPU that is the Triton interpreter: what tests the graphed functions' padding without a GPU.)
    def cpu_pages(self, layer: int, heads: int, kv_heads: int, head_dim: int) -> None:
        return None

    def _paged(self, q: torch.Tensor, k: torch.Tensor, max_q: int) -> bool:
        return True


class _Staging:
    """A graph's inputs packed in two device buffers (int64: token ids, positions, slots...; int32: context lengths
    and block tables) with pinned host twins, so a replay costs two host-to-device copies whatever the batch.
    `pad64` / `pad32` hold what the padding rows read (set at capture); each replay starts from them."""

    def __init__(self, dev64: torch.Tensor, dev32: torch.Tensor) -> None:
        self.dev64, self.dev32 = dev64, dev32
        self.host64 = torch.empty(dev64.shape, dtype=dev64.dtype, pin_memory=True)
        self.host32 = torch.empty(dev32.shape, dtype=dev32.dtype, pin_memory=True)
        self.h64, self.h32 = self.host64.numpy(), self.host32.numpy()
        self.pad64 = self.pad32 = None
        self.copied = torch.cuda.Event()

    def seal(self) -> None:
        """Keep the buffers' current values as the padding every replay starts from."""
        self.pad64, self.pad32 = self.dev64.cpu().numpy(), self.dev32.cpu().numpy()

    def begin(self) -> tuple:
        """The host buffers (numpy views), reset to the padding, once their last copy to the device is done."""
        self.copied.synchronize()  # a graph may be replayed twice in a step (two prompts of one width)
        self.h64[:] = self.pad64
        self.h32[:] = self.pad32
        return self.h64, self.h32

    def send(self) -> None:
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        self.copied.record()


@dataclass(slots=True)
class _Prefill:
    graph: torch.cuda.CUDAGraph
    staging: _Staging  # int64 [P ids | P positions | P slots | 1 last row]; int32 unused
    last: torch.Tensor  # [1] the row whose logits are wanted (the prompt's last token)
    logits: torch.Tensor  # [1, vocab]
    hidden: dict[int, torch.Tensor]  # {tap layer: [P, hidden]}


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    staging: _Staging  # int64 [R ids | R positions | R slots | B advance]; int32 [B ctx lens | B x W block tables]
    batch: int  # B
    width: int  # W, block table entries per request
    logits: torch.Tensor  # [B*q, vocab] output
    hidden: dict[int, torch.Tensor]  # {tap layer: [B*q, hidden]} outputs
    keep: tuple  # what else the graph reads (the metadata's fixed tensors): it must live as long as the graph
    context: TokenContext  # where its requests' tokens are (static views of its staging)
    # graphs that read this one's outputs (`CudaGraphRunner.replay_after`): key -> (what they baked in, the
    # graph, its outputs)
    after: dict = field(default_factory=dict)


class CudaGraphRunner(ModelRunner):
    """ModelRunner that replays CUDA graphs for uniform decode / verify steps on a CUDA device."""

    pads_widths = True
    overlaps = True  # a replay returns once launched

    def __init__(self, model: Transformer, pool: KVPool) -> None:
        super().__init__(model, pool)
        self.graphs: dict[tuple, _Graph] = {}
        self.prefills: dict[tuple[int, tuple[int, ...]], _Prefill] = {}  # (bucket, taps) ->
        self.mempool = torch.cuda.graph_pool_handle()
        self.after_pool = torch.cuda.graph_pool_handle()  # replay_after's graphs
        pool.add(SCRATCH_SEQ, [])
        pool.append(SCRATCH_SEQ, pool.page_size)
        self.scratch_page = pool.tables[SCRATCH_SEQ][0]
        self._signature = self._state_signature()
        self._pdl_rows = self._rows_under_pdl()

    def _rows_under_pdl(self) -> float:
        """The most rows a step may have and launch with programmatic dependent launch (kernels/pdl.py): PDL pays
        where every kernel of a step is ours (measured 1.02-1.05x at batch 1 with MXFP4 weights; 0.97-0.99x with
        cuBLAS GEMMs between the kernels). MXFP4 layers: every step. Dense layers of engine/fusion.py: steps their
        GEMV takes (at most dense_gemv.MAX_ROWS rows; more go to cuBLAS). Otherwise none."""
        w_down = self.model.layers[0].mlp.w_down
        if isinstance(w_down, Fp4Linear):
            return math.inf
        if type(w_down) is FusedLinear and dense_gemv.ENABLED:
            return dense_gemv.MAX_ROWS
        return 0

    def _pdl(self, rows: int) -> bool:
        return rows <= self._pdl_rows

    def _state_signature(self) -> tuple:
        """Identity of what a graph has baked in: the page store's tensors and the model's Linear modules."""
        layer = self.model.layers[0]
        return (id(self.pool.store), id(layer.attn.wqkv), id(layer.mlp.w_down), id(self.model.lm_head))

    def invalidate(self) -> None:
        """Every graph goes now, as when the signature changes (`_check_signature`)."""
        self._reset(self._state_signature())

    def padded_width(self, widths: Seq[int]) -> int | None:
        q = max(widths)
        return q if q <= MAX_GRAPH_Q and _bucket(len(widths), BATCH_BUCKETS) is not None else None

    def _graph_key(self, batch: StepBatch, taps: Seq[int]) -> tuple | None:
        q = len(batch.feeds[0])
        if not 1 <= q <= MAX_GRAPH_Q:
            return None
        if any(len(f) != q for f in batch.feeds) or any(r != q for r in batch.logit_rows):
            return None
        if any(s == 0 for s in batch.start_positions):  # a fresh prompt: prefill runs eagerly
            return None
        cfg = self.model.cfg
        if not paged_attention_supported(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads, q):
            return None
        b = _bucket(len(batch.feeds), BATCH_BUCKETS)
        ctx = _bucket(max(s + q for s in batch.start_positions), CTX_BUCKETS)
        return None if b is None or ctx is None else (b, q, ctx, tuple(sorted(set(taps))))

    def can_run_ahead(self, batch: StepBatch, taps: Seq[int] = (), advanced: bool = False) -> bool:
        """Only where the step's graph is captured already: a capture mid-pipeline would stall it."""
        key = self._advanced_key(batch, taps) if advanced else self._graph_key(batch, taps)
        return self._state_signature() == self._signature and key in self.graphs

    def _advanced_key(self, batch: StepBatch, taps: Seq[int]) -> tuple | None:
        """The graph of a forward_advanced step: the one of its furthest start (advance q - 1), whose context
        bucket holds every advance."""
        q = len(batch.feeds[0])
        furthest = [s + q - 1 for s in batch.start_positions]
        return self._graph_key(StepBatch(batch.seq_ids, batch.feeds, furthest, batch.logit_rows), taps)

    def forward_advanced(
        self, batch: StepBatch, ids: torch.Tensor, advance: torch.Tensor, taps: Seq[int] = ()
    ) -> StepOutput:
        """ModelRunner.forward_advanced on graphs: the pool reserves q more positions per request (room for any
        advance), the host writes the metadata of advance 0, and the graph's first kernel (`advance_step`, in every
        graph of a verification width) moves each request's positions, context length and slots by its advance,
        copied on the device into the graph's staging, so nothing waits for the host. (Launched on its own before
        the replay, that kernel cost ~60 us of host time a step on the H200.)"""
        self._check_signature()  # (a replay: its graph keeps the launches it was captured with)
        return self._replay(self.graphs[self._advanced_key(batch, taps)], batch, len(batch.feeds[0]), ids, advance)

    def forward(self, batch: StepBatch, taps: Seq[int] = (), ids: torch.Tensor | None = None) -> StepOutput:
        self._check_signature()
        with pdl.scope(self._pdl(sum(map(len, batch.feeds)))):  # eager steps; captures choose their own
            return self._dispatch(batch, taps, ids)

    def _dispatch(self, batch: StepBatch, taps: Seq[int], ids: torch.Tensor | None) -> StepOutput:
        """A graph replay (captured first if new), a prefill graph, or the eager forward."""
        key = self._graph_key(batch, taps)
        if key is not None:
            graph = self.graphs.get(key) or self._capture(*key)
            self.graphs[key] = graph
            return self._replay(graph, batch, key[1], ids)
        if ids is not None:  # a decode step no graph takes (a context past the largest bucket)
            return super().forward(batch, taps, ids)
        if len(batch.feeds) == 1 and (bucket := self._prefill_bucket(batch, 0)) is not None:
            return self._prefill(bucket, batch, tuple(sorted(set(taps))))
        if (q := self._prompts_width(batch)) is not None:
            return self._cached_prompts(q, batch, tuple(sorted(set(taps))))
        parts = self._parts(batch)
        if len(parts) == 1:
            return super().forward(batch, taps)
        return joined(batch, [(rows, self.forward(sub_batch(batch, rows), taps)) for rows in parts])

    def _check_signature(self) -> None:
        signature = self._state_signature()
        if signature != self._signature:  # weights or KV format switched: captured pointers are stale
            self._reset(signature)

    def _reset(self, signature: tuple) -> None:
        self.graphs.clear()
        self.prefills.clear()
        # and new pools: PyTorch releases a private pool once no graph holds it, and a capture into a released
        # pool's handle fails (an internal assert of its caching allocator: seen on the H100 at the first capture
        # after a live switch to MXFP4 weights)
        self.mempool = torch.cuda.graph_pool_handle()
        self.after_pool = torch.cuda.graph_pool_handle()
        self._signature = signature
        self._pdl_rows = self._rows_under_pdl()
        self.scratch_page = self.pool.tables[SCRATCH_SEQ][0]  # a shrinking KV switch may renumber it

    def _prefill_bucket(self, batch: StepBatch, i: int) -> int | None:
        """The prefill graph's length for request i, if it feeds a fresh prompt that one can take."""
        n = len(batch.feeds[i])
        if batch.start_positions[i] != 0 or batch.logit_rows[i] > 1:
            return None
        return _bucket(n, self.prefill_buckets)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """PREFILL_BUCKETS up to the first that holds the model's longest context."""
        longest = self.model.cfg.max_position
        return tuple(b for i, b in enumerate(PREFILL_BUCKETS) if i == 0 or PREFILL_BUCKETS[i - 1] < longest)

    def _prompt_width(self, batch: StepBatch, i: int) -> int | None:
        """The width of the step graph that request i's prompt after cached context pads to, if one can take it.
        (Fresh prompts keep their prefill graphs: run through the step graph at position 0 on the H200, their
        greedy outputs differed from the eager runner's in test_fast_path_equals_eager_on_concurrent_requests, on
        its tiny random model. The likely reason: the eager runner attends fresh prompts with SDPA, as the prefill
        graph does, and the step graph with the paged kernel, which rounds differently; prompts after cached
        context take the paged kernel on both paths. Not settled on the device.)"""
        n, start = len(batch.feeds[i]), batch.start_positions[i]
        if start == 0 or batch.logit_rows[i] > 1 or (q := _bucket(n, PROMPT_WIDTHS)) is None:
            return None
        cfg = self.model.cfg
        if not paged_attention_supported(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads, q):
            return None
        if _bucket(start + q, CTX_BUCKETS) is None or not self.pool.can_append({batch.seq_ids[i]: q}):
            return None
        return q

    def _prompts_width(self, batch: StepBatch) -> int | None:
        """The step graph width that every request of the batch (prompts after cached context) pads to, if they
        share one and fit in one replay."""
        widths = {self._prompt_width(batch, i) for i in range(len(batch.feeds))}
        if len(widths) != 1 or (q := widths.pop()) is None or len(batch.feeds) * q > PROMPT_GRAPH_ROWS:
            return None
        return q if self.pool.can_append(dict.fromkeys(batch.seq_ids, q)) else None

    def _graph_group(self, batch: StepBatch, i: int) -> Hashable | None:
        """Which replay request i of a mixed step can join: its own prefill graph (a fresh prompt), or its prompt
        width's (with the step's other prompts after cached context of that width)."""
        if self._prefill_bucket(batch, i) is not None:
            return ("prefill", i)
        q = self._prompt_width(batch, i)
        return None if q is None else ("prompt", q)

    def _parts(self, batch: StepBatch) -> list[list[int]]:
        return split_mixed_step(
            batch,
            lambda i: self._graph_group(batch, i),
            lambda group: PROMPT_GRAPH_ROWS // group[1] if group[0] == "prompt" else 1,
        )

    def warm_up(self, widths: Seq[int], sessions: int = 1, taps: Seq[Seq[int]] = ((),), progress=None) -> None:
        """Capture now the graphs of these step widths (1 for plain decode, k + 1 for verification) for every batch
        bucket up to `sessions`' at the smallest context bucket, the graphs of prompts after cached context (as
        many at once as `sessions`), and the prefill graph of every prompt bucket, for each set of hidden-state
        taps: so that the first steps neither compile kernels nor capture graphs (~50 ms a graph on the default
        model). `progress` hears ("warming up the GPU", done, total)."""
        widths = sorted({q for q in widths if 1 <= q <= MAX_GRAPH_Q})
        tap_keys = sorted({tuple(sorted(set(t))) for t in taps})
        keys = [(b, q, CTX_BUCKETS[0], t) for t in tap_keys for b in _batch_buckets_up_to(sessions) for q in widths]
        cfg = self.model.cfg
        group = cfg.num_heads // cfg.num_kv_heads
        prompts = [q for q in PROMPT_WIDTHS if paged_attention_supported(cfg.head_dim, group, q)]
        keys += [
            (b, q, CTX_BUCKETS[0], t)
            for t in tap_keys
            for q in prompts
            for b in _batch_buckets_up_to(min(sessions, PROMPT_GRAPH_ROWS // q))
        ]
        prefill_keys = [(p, t) for t in tap_keys for p in self.prefill_buckets]
        total = len(keys) + len(prefill_keys)
        for done, key in enumerate(keys, 1):
            if key not in self.graphs:
                self.graphs[key] = self._capture(*key)
            if progress is not None:
                progress("warming up the GPU", done, total)
        for done, key in enumerate(prefill_keys, len(keys) + 1):
            if key not in self.prefills:
                self.prefills[key] = self._capture_prefill(*key)
            if progress is not None:
                progress("warming up the GPU", done, total)

    @torch.inference_mode()
    def _prefill(self, bucket: int, batch: StepBatch, taps: tuple[int, ...]) -> StepOutput:
        """One fresh prompt through the prefill graph of its length bucket."""
        g = self.prefills.get((bucket, taps)) or self._capture_prefill(bucket, taps)
        self.prefills[(bucket, taps)] = g
        n = len(batch.feeds[0])
        _, _, slots = self.pool.reserve(batch.seq_ids, [n])
        h64, _ = g.staging.begin()
        h64[:n] = batch.feeds[0]
        h64[2 * bucket : 2 * bucket + n] = slots
        h64[3 * bucket] = n - 1
        g.staging.send()
        g.graph.replay()
        logits = g.logits[: batch.logit_rows[0]].clone()  # the next replay overwrites the static output
        hidden = {layer: h[:n].clone() for layer, h in g.hidden.items()}
        return StepOutput(logits, [logits], [hidden])

    @torch.inference_mode()
    def _cached_prompts(self, q: int, batch: StepBatch, taps: tuple[int, ...]) -> StepOutput:
        """Prompts after cached context, each padded to q tokens, through the step graph of width q for their
        batch bucket; the padding's keys, written past each prompt's end, are truncated after."""
        lengths = [len(f) for f in batch.feeds]
        b = _bucket(len(lengths), BATCH_BUCKETS)
        key = (b, q, _bucket(max(s + q for s in batch.start_positions), CTX_BUCKETS), taps)
        graph = self.graphs.get(key) or self._capture(*key)
        self.graphs[key] = graph
        padded = StepBatch(
            batch.seq_ids, [f + [0] * (q - len(f)) for f in batch.feeds], batch.start_positions, [q] * len(lengths)
        )
        out = self._replay(graph, padded, q)
        for seq, start, n in zip(batch.seq_ids, batch.start_positions, lengths, strict=True):
            self.pool.truncate(seq, start + n)
        # each prompt's logit rows end at its last real token; index_select copies them out of the static output
        keep = [
            i * q + r
            for i, (n, rows) in enumerate(zip(lengths, batch.logit_rows, strict=True))
            for r in range(n - rows, n)
        ]
        logits = out.flat_logits.index_select(0, to_device(keep, torch.long, self.device))
        hidden = [{layer: h[:n] for layer, h in taps_.items()} for taps_, n in zip(out.hidden, lengths, strict=True)]
        return StepOutput(logits, list(logits.split(batch.logit_rows)), hidden)

    @torch.inference_mode()
    def _capture_prefill(self, bucket: int, taps: tuple[int, ...]) -> _Prefill:
        dev, ps = self.device, self.pool.page_size
        staging = _Staging(
            torch.zeros(3 * bucket + 1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
        )
        ids, positions, new_slots, last = staging.dev64.split([bucket, bucket, bucket, 1])
        positions.copy_(torch.arange(bucket, device=dev))  # a fresh prompt's; padding continues past it
        new_slots.copy_(self.scratch_page * ps + torch.arange(bucket, device=dev) % ps)  # padding: the scratch page
        staging.seal()
        kv = StaticKVBatch(self.pool, None, new_slots, bucket, self.scale)

        def prefill():
            kv.record(ids)
            return self.model(ids, positions, kv, taps=taps, logits_at=last)

        # its warm-ups and capture take one path for MXFP4 weights (kernels/mxfp4_matmul.py); graphs keep the
        # launches they were captured with
        with graphed_steps(), pdl.scope(self._pdl(bucket)):
            graph, (logits, hidden) = capture_graph(prefill, dev, self.mempool, warm_ups=2)
        return _Prefill(graph, staging, last, logits, hidden)

    @torch.inference_mode()
    def _replay(
        self,
        g: _Graph,
        batch: StepBatch,
        q: int,
        ids: torch.Tensor | None = None,
        advance: torch.Tensor | None = None,
    ) -> StepOutput:
        """One replay of g for batch; ids: the fed tokens, already on the device (batch.feeds' are not read);
        advance [n]: each request's start moves by it on the device (forward_advanced)."""
        n = len(batch.feeds)
        # bookkeeping: pages, tables, and where the graph does not make them from the tables (`_capture`), slots
        tables, ctx_lens, slots = self.pool.reserve(batch.seq_ids, [q] * n, slots=q == 1)
        rows, big = n * q, g.batch * q
        if advance is not None:
            ctx_lens = [s + q for s in batch.start_positions]
        h64, h32 = g.staging.begin()
        h64[:rows] = [t for f in batch.feeds for t in f]
        h64[big : big + rows] = [p for s in batch.start_positions for p in range(s, s + q)]
        if q == 1:
            h64[2 * big : 2 * big + rows] = slots
        h32[:n] = ctx_lens
        for i, table in enumerate(tables):
            start = g.batch + i * g.width
            h32[start : start + len(table)] = table
        g.staging.send()
        if ids is not None:
            g.staging.dev64[:rows].copy_(ids)  # after the metadata's copy, in stream order
        if advance is not None:  # the graph's first kernel moves the requests by it (the staged advance is 0)
            g.staging.dev64[3 * big : 3 * big + n].copy_(advance)
        g.graph.replay()
        logits = g.logits[:rows]
        # Tapped states are copied out: the next replay overwrites the static buffers, and drafters read them later.
        hidden = {layer: h[:rows].clone() for layer, h in g.hidden.items()}
        # (ids: the staged tokens, valid until the graph's next replay; the logits until that, or until a replay of
        # a graph captured before this one: the graphs share one memory pool, and an earlier graph's scratch may be
        # a later one's output)
        sizes = [q] * n
        return StepOutput(
            logits, Rows(logits, sizes), Rows(hidden, sizes), g.staging.dev64[:rows], hidden, g, lambda: g.context
        )

    @torch.inference_mode()
    def replay_after(
        self, out: StepOutput, key: Hashable, fn: Callable[..., tuple[torch.Tensor, ...]], baked: Hashable = None
    ) -> tuple[torch.Tensor, ...] | None:
        """`fn(key, logits [R, vocab], ids [R], hidden {tap layer: [R, d]}, context)` -> tensors [B, ...], over the
        rows of the graph replay that made `out` (R = B x q, its batch bucket's: the rows past out's requests are the
        padding's; context: where its requests' tokens are, a `TokenContext` of B rows), replayed as a CUDA graph
        that reads that replay's outputs where they are: no copies in, no launches of its own (as a GraphedFunction,
        a drafting step's argmax, verdicts and next drafts cost ~200 us of host time a step at 32 sessions on the
        H200). Captured on first use for that graph and key (again where
        `baked`, what fn reads besides its inputs, changed); graphs of this kind share one memory pool (each one's
        outputs must be used before the next one runs). None where `out` is not a whole graph replay; `out`'s
        logits must not have been overwritten (see `_replay`: run it before another replay of the runner's graphs)."""
        g = out.source
        if not isinstance(g, _Graph):
            return None
        _, graph, outs = self._bound(g, key, fn, baked)
        graph.replay()
        n = len(out.logits)
        return tuple(o[:n] for o in outs)

    def bind_after(
        self, q: int, taps: Seq[int], key: Hashable, fn: Callable[..., tuple[torch.Tensor, ...]], baked: Hashable = None
    ) -> None:
        """Capture now `replay_after`'s graph of fn for every step graph of width q that taps `taps` (warm-up)."""
        for (_, width, _, tapped), g in self.graphs.items():
            if width == q and set(taps) <= set(tapped):
                self._bound(g, key, fn, baked)

    def _bound(self, g: _Graph, key: Hashable, fn: Callable[..., tuple[torch.Tensor, ...]], baked: Hashable) -> tuple:
        entry = g.after.get(key)
        if entry is None or entry[0] != baked:
            entry = g.after[key] = (baked, *self._capture_after(g, key, fn))
        return entry

    def _capture_after(self, g: _Graph, key: Hashable, fn: Callable[..., tuple[torch.Tensor, ...]]) -> tuple:
        inputs = (key, g.logits, g.staging.dev64[: len(g.logits)], g.hidden, g.context)
        return capture_graph(lambda: fn(*inputs), self.device, self.after_pool)

    @torch.inference_mode()
    def _capture(self, b: int, q: int, ctx: int, taps: tuple[int, ...]) -> _Graph:
        from specchat.kernels import fused_triton

        dev, ps = self.device, self.pool.page_size
        rows, width = b * q, -(-ctx // ps)
        staging = _Staging(
            torch.zeros(3 * rows + b, dtype=torch.long, device=dev),
            torch.zeros(b + b * width, dtype=torch.int32, device=dev),
        )
        ids, positions, new_slots, advance = staging.dev64.split([rows, rows, rows, b])
        ctx_lens, tables = staging.dev32[:b], staging.dev32[b:].view(b, width)
        # Padding requests (and the warm-up) see q tokens of the scratch page, at positions 0..q-1.
        positions.copy_(torch.arange(q, device=dev).repeat(b))
        new_slots.copy_((self.scratch_page * ps + torch.arange(q, device=dev)).repeat(b))
        tables.fill_(self.scratch_page)
        ctx_lens.fill_(q)
        staging.seal()
        meta = AttentionMetadata(
            block_tables=tables,
            q_starts=torch.arange(0, rows, q, dtype=torch.int32, device=dev),
            q_lens=torch.full((b,), q, dtype=torch.int32, device=dev),
            ctx_lens=ctx_lens,
            max_q_len=q,
            max_ctx_len=ctx,
            page_size=ps,
        )
        kv = StaticKVBatch(self.pool, meta, new_slots, q, self.scale)

        def forward():
            if q > 1:  # a width forward_advanced may take: its requests moved by `advance` first (0 elsewhere), and
                # every replay's slots made from the tables here (`_replay` stages none)
                fused_triton.advance_step(positions.view(b, q), new_slots, ctx_lens, tables, advance, ps)
            kv.record(ids)
            return self.model(ids, positions, kv, taps=taps)

        with pdl.scope(self._pdl(rows)):  # graphs keep the launches they were captured with
            graph, (logits, hidden) = capture_graph(forward, dev, self.mempool, warm_ups=2)
        context = TokenContext(self.pool.store.ids, tables, positions.view(b, q)[:, 0], ps)
        return _Graph(graph, staging, b, width, logits, hidden, (meta, kv), context)


def capture_graph(fn: Callable[[], object], device: torch.device, pool=None, warm_ups: int = 1) -> tuple:
    """(a CUDA graph of fn(), what fn returned in it): fn runs `warm_ups` times first on a side stream, so that
    Triton compiles and autotunes outside the capture; `pool`: a memory pool the graph shares with others."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warm_ups):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def split_mixed_step(
    batch: StepBatch, graph_group: Callable[[int], Hashable | None], group_size: Callable[[Hashable], int]
) -> list[list[int]]:
    """A mixed step's requests in groups that each run one forward: the decoding requests (newest token and
    drafts after cached context, a logit row each) together, one graph when they are uniform; the others by the
    graph they can replay (`graph_group(i)`: requests of one group go together, up to `group_size(group)` a
    forward; None: no graph takes it); the rest together, eagerly.

    Decoding requests are grouped first: a 1-token feed after cached context also fits a prompt graph, and taking
    them there would run a step of 8 decoding requests beside one new prompt as 9 replays instead of 2."""
    n = len(batch.feeds)
    decoding = [i for i in range(n) if batch.start_positions[i] > 0 and batch.logit_rows[i] == len(batch.feeds[i])]
    groups: dict[Hashable, list[int]] = {}
    rest = []
    for i in (i for i in range(n) if i not in decoding):
        group = graph_group(i)
        if group is None:
            rest.append(i)
        else:
            groups.setdefault(group, []).append(i)
    chunks = [
        members[j : j + group_size(g)] for g, members in groups.items() for j in range(0, len(members), group_size(g))
    ]
    return [*chunks, *(part for part in (decoding, rest) if part)]


class GraphedFunction:
    """A function of batched tensors, replayed from one CUDA graph per (batch bucket, key) on a CUDA device and
    called directly elsewhere: what a drafter's k-token chain uses, so that drafting costs one launch and one
    read-back per step instead of a few dozen kernels and a host sync per draft position.

    `fn(key, *inputs)` must take inputs whose first dimension is the batch, return a tensor or a tuple of tensors
    whose first dimension is the batch, read nothing from the host and keep every row independent of the others
    (padding rows, filled with `pads` or zeros, are computed and dropped). The tensors it reads are baked into the graphs:
    `signature()` names them (e.g. the data pointers of its weights), and the graphs are dropped when it changes.
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        signature: Callable[[], Hashable] = lambda: None,
        enabled: bool = True,
        pads: Seq[int | float] = (),
    ) -> None:
        self.fn = fn
        self.enabled = enabled  # False (--eager): always call fn
        self.signature = signature
        self._baked = signature()
        self.pads = tuple(pads)  # per input, what its padding rows hold (default 0): e.g. a scratch slot to write to
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor | tuple]] = {}

    @torch.inference_mode()  # the graphs' static buffers are inference tensors
    def __call__(self, key: Hashable, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        n = inputs[0].shape[0]
        bucket = _bucket(n, BATCH_BUCKETS)
        if not self.enabled or inputs[0].device.type != "cuda" or bucket is None:
            return self.fn(key, *inputs)
        if self.signature() != self._baked:  # weights swapped under the graphs
            self.reset()
        graph = self.graphs.get((bucket, key)) or self.capture(bucket, key, inputs)
        graph_, static_in, static_out = graph
        for i, (buf, x) in enumerate(zip(static_in, inputs, strict=True)):
            buf[:n].copy_(x)
            if n < bucket:
                buf[n:].fill_(self._pad(i))
        graph_.replay()
        return tuple(out[:n] for out in static_out) if isinstance(static_out, tuple) else static_out[:n]

    def reset(self) -> None:
        """Drop every graph (what fn reads changed in a way `signature` cannot see: modules moved and back)."""
        self.graphs.clear()
        self._baked = self.signature()

    def warm_up(self, sessions: int, keys: Iterable[Hashable], row: Callable[[Hashable], Seq[torch.Tensor]]) -> None:
        """Capture now the graph of each key for every batch bucket up to `sessions`' (`row(key)`: one row of each
        input, for shapes and types), so that the first steps capture nothing. Nothing to do where fn runs directly."""
        for key in keys:
            like = row(key)
            if not self.enabled or like[0].device.type != "cuda":
                return
            for bucket in _batch_buckets_up_to(sessions):
                self.capture(bucket, key, like)

    @torch.inference_mode()
    def capture(self, bucket: int, key: Hashable, like: Seq[torch.Tensor]) -> tuple:
        """The graph for `bucket` rows of inputs shaped and typed like `like` past its first dimension (captured now
        if new)."""
        if (bucket, key) in self.graphs:
            return self.graphs[(bucket, key)]
        static_in = tuple(
            torch.full((bucket, *x.shape[1:]), self._pad(i), dtype=x.dtype, device=x.device) for i, x in enumerate(like)
        )
        graph, static_out = capture_graph(lambda: self.fn(key, *static_in), like[0].device)
        self.graphs[(bucket, key)] = (graph, static_in, static_out)
        return self.graphs[(bucket, key)]

    def _pad(self, i: int) -> int | float:
        return self.pads[i] if i < len(self.pads) else 0
