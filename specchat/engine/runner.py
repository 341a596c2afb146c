"""One target forward over a ragged batch: flatten the requests' tokens, run the model, split the results."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from collections.abc import Sequence as Seq
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from specchat.engine.kv_cache import KVPool
from specchat.engine.model import Transformer

DECODE_ROWS = 16  # a request feeding at most this many tokens after its cached context decodes with the others


@dataclass(slots=True)
class StepBatch:
    """Per-step metadata: which tokens each request feeds and which rows need logits."""

    seq_ids: list[int]
    feeds: list[list[int]]  # tokens each request feeds this step
    start_positions: list[int]  # position of each request's first fed token (= tokens already cached)
    logit_rows: list[int]  # how many trailing rows of each feed need logits (0 for a mid-prompt chunk)

    @property
    def num_tokens(self) -> int:
        return sum(len(f) for f in self.feeds)


class Rows(Seq):
    """Each request's part of a step's flat rows (a tensor, or {tap layer: tensor}), split on first use: a step of
    many requests that runs ahead reads its flat rows and seldom these (on the H200 at 32 sessions the splits and
    per-request dicts were ~60 us of a drafting step's host time)."""

    __slots__ = ("_parts", "flat", "sizes")

    def __init__(self, flat: torch.Tensor | dict[int, torch.Tensor], sizes: list[int]) -> None:
        self.flat, self.sizes, self._parts = flat, sizes, None

    def _split(self) -> list:
        if self._parts is None:
            if isinstance(self.flat, dict):
                split = {layer: h.split(self.sizes) for layer, h in self.flat.items()}
                self._parts = [{layer: parts[i] for layer, parts in split.items()} for i in range(len(self.sizes))]
            else:
                self._parts = list(self.flat.split(self.sizes))
        return self._parts

    def __getitem__(self, i):
        return self._split()[i]

    def __len__(self) -> int:
        return len(self.sizes)


class RowOf(Mapping):
    """{tap layer: [1, d]}: row i of each of a step's per-request rows {tap layer: [n, d]}, sliced where read (what a
    request keeps of a drafting step run ahead, whose next step drafts on the device and reads none of it)."""

    __slots__ = ("i", "rows")

    def __init__(self, rows: dict[int, torch.Tensor], i: int) -> None:
        self.rows, self.i = rows, i

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.rows[layer][self.i : self.i + 1]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(slots=True)
class TokenContext:
    """Where a step's requests' tokens are on the device, for a drafter that reads them there (kernels/ngram.py):
    every forward writes its fed tokens into the KV pool's slots beside their keys (`PageStore.ids`)."""

    ids: torch.Tensor  # [slots] the token at each slot of the pool
    tables: torch.Tensor  # [B, W] int32 each request's pages
    positions: torch.Tensor  # [B] int64 in a StepOutput each request's first fed position; for a drafter its newest
    page_size: int


@dataclass(slots=True)
class StepOutput:
    flat_logits: torch.Tensor  # [sum(logit_rows), vocab] fp32, the requests' rows one after another
    logits: Seq[torch.Tensor]  # per request: [logit_rows, vocab], views of flat_logits
    hidden: Seq[dict[int, torch.Tensor]]  # per request: {layer: [len(feed), hidden]}
    # [rows] the fed tokens on the device, for a step that ran as one forward (on graphs: until the next replay)
    ids: torch.Tensor | None = None
    # {layer: [rows, hidden]} every request's tapped rows one after another, where the step ran as one forward
    flat_hidden: dict[int, torch.Tensor] | None = None
    source: object = None  # the CUDA graph whose outputs these are, where the step was one replay (cuda_graph.py)
    context: Callable[[], TokenContext] | None = None  # where a step that ran as one forward has its tokens


class ModelRunner:
    """Runs the target model over a StepBatch, with the KV pool as its cache."""

    pads_widths = False  # whether padded_width makes a step's decoding requests as wide as the widest
    # whether forward returns before the device has run the step, so that the host can prepare the next one
    # meanwhile (SpecStep's step ahead); the eager runner's forward has run when it returns (on a CPU)
    overlaps = False

    def __init__(self, model: Transformer, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.scale = model.cfg.head_dim**-0.5

    def padded_width(self, widths: Seq[int]) -> int | None:
        """For a step in which every request feeds its newest token and its drafts (`widths` = 1 + k each): the
        one width this runner wants them padded to, or None to run them ragged. The eager runner takes any
        batch as it is; a CUDA-graph runner replays one graph for a uniform width (cuda_graph.py)."""
        return None

    def can_run_ahead(self, batch: StepBatch, taps: Seq[int] = (), advanced: bool = False) -> bool:
        """Whether `forward(batch, ids=...)` (a plain decode step), or with `advanced` `forward_advanced(batch,
        ...)` for any advance, runs without capturing or compiling anything (a step launched ahead of the host
        must not stall it)."""
        return True

    def replay_after(
        self, out: StepOutput, key: Hashable, fn: Callable[..., tuple[torch.Tensor, ...]], baked: Hashable = None
    ) -> tuple[torch.Tensor, ...] | None:
        """fn over a step's outputs as one graph replay bound to them (CudaGraphRunner); None here: the caller runs
        its own way."""
        return None

    def bind_after(
        self, q: int, taps: Seq[int], key: Hashable, fn: Callable[..., tuple[torch.Tensor, ...]], baked: Hashable = None
    ) -> None:
        """Prepare `replay_after` of fn for steps of width q that tap `taps` (nothing to prepare here)."""

    def invalidate(self) -> None:
        """The model's weights or the KV pool's format switched: drop whatever was built over the old ones (a
        CUDA-graph runner's graphs; nothing here)."""

    def forward_advanced(
        self, batch: StepBatch, ids: torch.Tensor, advance: torch.Tensor, taps: Seq[int] = ()
    ) -> StepOutput:
        """A step of q tokens per request whose fed tokens (ids [n*q]) and start positions (batch.start_positions
        + advance [n], 0 <= advance < q) are on the device, not known to the host yet: the step after a drafting
        step, launched before the host reads how many drafts it accepted (SpecStep). The pool holds each request's
        positions up to batch.start_positions + q - 1 (the drafting step's); afterwards it holds at least the
        step's own (the caller truncates to start + q once it knows the start). This reference reads both to
        the host, which on the CPU costs nothing; the CUDA-graph runner moves the step's metadata on the device."""
        starts = [s + a for s, a in zip(batch.start_positions, advance.tolist(), strict=True)]
        for seq_id, start in zip(batch.seq_ids, starts, strict=True):
            self.pool.truncate(seq_id, start)
        feeds = ids.view(len(starts), -1).tolist()
        return self.forward(StepBatch(batch.seq_ids, feeds, starts, batch.logit_rows), taps)

    def forward(self, batch: StepBatch, taps: Seq[int] = (), ids: torch.Tensor | None = None) -> StepOutput:
        """The target over `batch`. ids: the fed tokens as a device tensor (the previous step's, not read back
        yet), in place of batch.feeds' values, for a step of one token per request."""
        if not self.pool.cpu_kernels:
            return self._forward(batch, taps, ids)
        # With the CPU kernels, a step's decoding requests (newest token and drafts, or a short prompt, after cached
        # context: what the whole-block call takes) run together with the block kernels for any row count, and
        # every other request alone. So a request's rows take the same kernels whatever else its step holds: the
        # whole-block call and the output head's blocks for decoding, the block kernels or the float GEMM by its
        # own chunk's length for a prompt. Run as one forward, a step of more than cpu_gemv.MAX_ROWS rows took the
        # float GEMM for every row, so a request's greedy text depended on what it was batched with (under int8
        # rows speculative and plain runs of one prompt diverged).
        from specchat.engine.cpu_weights import blocks_for_any_rows

        n = len(batch.feeds)
        short = DECODE_ROWS
        decoding = [i for i in range(n) if batch.start_positions[i] > 0 and len(batch.feeds[i]) <= short]
        parts = ([decoding] if decoding else []) + [[i] for i in sorted(set(range(n)) - set(decoding))]
        assert ids is None or len(parts) == 1, "tokens on the device feed a step of decoding requests only"
        outputs = []
        for rows in parts:
            with blocks_for_any_rows() if rows is decoding else nullcontext():
                outputs.append((rows, self._forward(batch if len(parts) == 1 else sub_batch(batch, rows), taps, ids)))
        return outputs[0][1] if len(parts) == 1 else joined(batch, outputs)

    @torch.inference_mode()
    def _forward(self, batch: StepBatch, taps: Seq[int] = (), ids: torch.Tensor | None = None) -> StepOutput:
        if ids is None:
            ids = torch.tensor([t for f in batch.feeds for t in f], dtype=torch.long, device=self.device)
        else:
            assert all(len(f) == 1 for f in batch.feeds) and ids.shape == (len(batch.feeds),), ids.shape
        positions = torch.tensor(
            [p for f, s in zip(batch.feeds, batch.start_positions, strict=True) for p in range(s, s + len(f))],
            dtype=torch.long,
            device=self.device,
        )
        kv = self.pool.prepare(batch.seq_ids, [len(f) for f in batch.feeds], self.scale)
        kv.record(ids)
        rows, start = [], 0
        for feed, n in zip(batch.feeds, batch.logit_rows, strict=True):
            start += len(feed)
            rows.extend(range(start - n, start))
        logits_at = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits, hidden = self.model(ids, positions, kv, taps=taps, logits_at=logits_at)
        lens = [len(f) for f in batch.feeds]

        def context() -> TokenContext:
            starts = torch.tensor(batch.start_positions, device=self.device)
            return TokenContext(self.pool.store.ids, kv.metadata().block_tables, starts, self.pool.page_size)

        return StepOutput(logits, Rows(logits, batch.logit_rows), Rows(hidden, lens), ids, hidden, context=context)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, copied there from pinned memory where it is a GPU: a copy from pageable
    memory waits for every launch before it in the stream, so the host could not run ahead of the device (on the
    H200 such a copy in a prompt's step behind a step launched ahead cost ~1 ms of the host's time)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def sub_batch(batch: StepBatch, rows: list[int]) -> StepBatch:
    """The requests `rows` of a step, as a step of their own."""
    return StepBatch(
        [batch.seq_ids[i] for i in rows],
        [batch.feeds[i] for i in rows],
        [batch.start_positions[i] for i in rows],
        [batch.logit_rows[i] for i in rows],
    )


def joined(batch: StepBatch, outputs: list[tuple[list[int], StepOutput]]) -> StepOutput:
    """The outputs of a step's parts (each the requests `rows` run as a step of their own) in the step's order."""
    n = len(batch.feeds)
    logits: list[torch.Tensor | None] = [None] * n
    hidden: list[dict[int, torch.Tensor]] = [{}] * n
    for rows, out in outputs:
        for j, i in enumerate(rows):
            logits[i], hidden[i] = out.logits[j], out.hidden[j]
    flat = torch.cat(logits)
    return StepOutput(flat, list(flat.split(batch.logit_rows)), hidden)
