"""What rank 0 adds to an engine over a sharded model, so that the workers follow every step.

- `send_forwards`: a forward pre-hook on the model that sends each call's arguments (`ForwardPlan`) before rank 0
  runs it; the runner, the scheduler and the speculation step stay as they are, and whatever calls the target
  (plain decoding, verification of drafts, prefill chunks) reaches every rank in the same order.
- `MirroredStore`: rank 0's KV page store, passing on the two changes to pages made outside a forward.
- `FixedWeights`: the weight switch with the format chosen at load (the live toggle is not offered with --tp).
- `tp_drafter_check`: drafters that need the whole target in one process are refused in one line.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from specchat.config import WHOLE_HEAD_DRAFTERS
from specchat.engine.drafters import Drafter
from specchat.engine.kv_cache import KVPool
from specchat.engine.kv_pages import PageStore
from specchat.engine.model import Transformer
from specchat.engine.tp.group import TPGroup
from specchat.engine.tp.messages import CopySlots, ForwardPlan, Reencode
from specchat.errors import ConfigError
from specchat.kernels.kv_quant import DEFAULT_RULE
from specchat.quant.handler import Progress, WeightSwitch
from specchat.registry import ModelSpec, resolve

FORWARD = inspect.signature(Transformer.forward)


def send_forwards(model: Transformer, group: TPGroup, pool: KVPool) -> None:
    """Send each forward's arguments to the workers before rank 0 runs it."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        call = FORWARD.bind(module, *args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        if a["kv"].pool is not pool:  # the workers hold pages only for the target's own pool
            raise RuntimeError("a tensor-parallel model runs only over its own KV pool")
        group.send(ForwardPlan.of_call(a["ids"], a["positions"], a["kv"], a["taps"], a["logits_at"]))

    model.register_forward_pre_hook(hook, with_kwargs=True)


class MirroredStore:
    """Rank 0's PageStore; page copies and format switches are sent to the workers, then made here.

    Everything else (the forward's reads and writes, the accounting) is the wrapped store's own.
    """

    def __init__(self, store: PageStore, group: TPGroup) -> None:
        self.inner = store
        self.group = group

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.group.send(CopySlots(src.cpu(), dst.cpu()))
        self.inner.copy_slots(src, dst)

    def reencode(
        self,
        fmt: str,
        num_slots: int,
        src: torch.Tensor,
        dst: torch.Tensor,
        rotate: bool = True,
        rule: str = DEFAULT_RULE,
    ) -> MirroredStore:
        self.group.send(Reencode(fmt, num_slots, src.cpu(), dst.cpu(), rotate, rule))
        return MirroredStore(self.inner.reencode(fmt, num_slots, src, dst, rotate, rule), self.group)


class FixedWeights(WeightSwitch):
    """The weight switch of a sharded model: reports the format chosen at load, refuses to change it."""

    def prepare(self, fmt: str, progress: Progress | None = None) -> None:
        self._refuse_change(fmt)

    def set(self, fmt: str) -> None:
        self._refuse_change(fmt)

    def _refuse_change(self, fmt: str) -> None:
        if fmt != self.current:
            raise ConfigError(
                f"the weights cannot switch to {fmt} while --tp splits the model; start it with --weights {fmt}"
            )


def tp_drafter_check(build: Callable[[str], Drafter], target: ModelSpec | None, tp: int) -> Callable[[str], Drafter]:
    """`build` (a DrafterCache's), refusing in one line the drafters a target sharded over `tp` GPUs cannot serve."""

    def checked(name: str) -> Drafter:
        kind, _, arg = name.partition(":")
        if kind == "default":
            kind, _, arg = (target.default_drafter("cuda", tp) if target else "none").partition(":")
        if kind in WHOLE_HEAD_DRAFTERS:
            raise ConfigError(
                f"--tp: the {kind} drafter reads the target's whole output head, which --tp splits over the "
                "ranks; use ngram, eagle or draft-model:OTHER"
            )
        if kind == "draft-model" and target is not None and resolve(arg or None).where == target.where:
            raise ConfigError("--tp: draft-model would draft with the sharded target itself; name another model")
        return build(name)

    return checked
