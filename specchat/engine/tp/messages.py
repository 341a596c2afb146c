"""What rank 0 tells the workers, and what a worker does with it.

Rank 0 keeps the scheduler, the KV pool's bookkeeping (block tables, prefix cache), the drafters and the UI. The
workers keep only their shard of the model and their heads' KV pages, so they need to hear of exactly two kinds of
event: a forward pass (`ForwardPlan`: the step's tokens and where their keys and values go, the metadata a
`KVBatch` is built from) and a change to the pages outside a forward (`CopySlots` when a shared page is copied
before a write, `Reencode` when the KV format switches). Every rank applies them in the order rank 0 sent them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specchat.engine.kv_batch import KVBatch
from specchat.engine.kv_cache import KVPool
from specchat.engine.model import Transformer


@dataclass(slots=True)
class WorkerState:
    """What a worker holds: its shard of the model and its KV pool (made by rank 0's `PoolSpec`)."""

    model: Transformer
    device: torch.device
    pool: KVPool | None = None


@dataclass(slots=True)
class PoolSpec:
    """The KV pool every rank builds alike: same pages, same format, the rank's KV heads."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    dtype: torch.dtype
    kv_format: str
    rotate: bool

    @classmethod
    def of(cls, pool: KVPool, dtype: torch.dtype) -> PoolSpec:
        return cls(
            pool.num_layers,
            pool.num_kv_heads,
            pool.head_dim,
            pool.num_pages,
            pool.page_size,
            dtype,
            pool.store.name,
            pool.rotate,
        )

    def apply(self, worker: WorkerState) -> None:
        worker.pool = KVPool(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.num_pages,
            self.page_size,
            self.dtype,
            worker.device,
            self.kv_format,
            self.rotate,
        )


@dataclass(slots=True)
class ForwardPlan:
    """One call of the model's forward, as rank 0 makes it (engine.model.Transformer.forward's arguments, with the
    KVBatch given by its metadata). Tensors travel on the host."""

    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    q_lens: list[int]
    ctx_lens: list[int]
    tables: list[list[int]]
    new_slots: torch.Tensor  # [T]
    scale: float
    taps: tuple[int, ...]
    logits_at: torch.Tensor | None  # [rows]

    @classmethod
    def of_call(
        cls, ids: torch.Tensor, positions: torch.Tensor, kv: KVBatch, taps, logits_at: torch.Tensor | None
    ) -> ForwardPlan:
        host = torch.device("cpu")
        return cls(
            ids.to(host),
            positions.to(host),
            list(kv.q_lens),
            list(kv.ctx_lens),
            [list(t) for t in kv.tables],
            kv.new_slots.to(host),
            kv.scale,
            tuple(taps),
            None if logits_at is None else logits_at.to(host),
        )

    @torch.inference_mode()
    def apply(self, worker: WorkerState) -> None:
        dev = worker.device
        kv = KVBatch(worker.pool, self.q_lens, self.ctx_lens, self.tables, self.new_slots.to(dev), self.scale)
        logits_at = None if self.logits_at is None else self.logits_at.to(dev)
        worker.model(self.ids.to(dev), self.positions.to(dev), kv, taps=self.taps, logits_at=logits_at)


@dataclass(slots=True)
class CopySlots:
    """Copy the keys/values of slots `src` into slots `dst` (a shared page made private before a write)."""

    src: torch.Tensor
    dst: torch.Tensor

    def apply(self, worker: WorkerState) -> None:
        worker.pool.store.copy_slots(self.src.to(worker.device), self.dst.to(worker.device))


@dataclass(slots=True)
class Reencode:
    """Switch the pages to another format (engine.kv_pages.PageStore.reencode's arguments)."""

    fmt: str
    num_slots: int
    src: torch.Tensor
    dst: torch.Tensor
    rotate: bool
    rule: str

    def apply(self, worker: WorkerState) -> None:
        store = worker.pool.store
        dev = worker.device
        worker.pool.store = store.reencode(
            self.fmt, self.num_slots, self.src.to(dev), self.dst.to(dev), self.rotate, self.rule
        )


@dataclass(slots=True)
class Stop:
    """The engine closes: the worker leaves its loop and exits."""

    def apply(self, worker: WorkerState) -> None:
        return None
