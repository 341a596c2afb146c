"""The drafter interface.

A drafter proposes up to k tokens per request for the positions after the request's newest token. It never
touches the target's KV cache. A deterministic drafter returns probs=None (a point mass on each token);
a sampling drafter returns the distribution q it drew each token from, which verification needs to stay
lossless. Drafters that read the target's hidden states list the layers in `taps`; the engine then keeps,
for each request, the tapped hidden state of the position that produced its newest token (`seq.hidden`, one
row), or with `tap_history` every cached position's that the drafter has not read yet (it clears them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specchat.config import check_drafter_name
from specchat.engine.api import default_drafter_name
from specchat.errors import ConfigError, path_problem

if TYPE_CHECKING:
    from specchat.engine.runner import TokenContext
    from specchat.engine.sequence import Sequence


@dataclass(slots=True)
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] or None for a point mass
    source: str = ""  # which part of a hybrid drafter proposed it ("" = the drafter's own): adaptive K keeps
    # each source's acceptance apart (engine/adaptive.py)


class Drafter:
    """Base class: proposes nothing."""

    name = "none"
    sources: tuple[str, ...] = ()  # Draft.source names its drafts may carry besides "" (adaptive K keeps them apart)
    taps: tuple[int, ...] = ()
    tap_history = False  # True: seq.hidden keeps every row since the drafter last read (and cleared) it
    # where set, the drafter decides each step how many of up to gated_k tokens to draft (its own confidence): under
    # adaptive K a greedy request of it drafts up to gated_k every step instead of following the acceptance it has
    # seen (engine._gated_k)
    gated_k: int | None = None
    reads_context = False  # whether draft_on_device reads the requests' tokens (its `context`)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Up to ks[i] draft tokens for seqs[i]."""
        return [Draft([]) for _ in seqs]

    def draft_on_device(
        self, depth: int, hidden: dict[int, torch.Tensor], newest: torch.Tensor, context: TokenContext | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """The greedy drafts [B, depth] of greedy requests from device tensors alone (hidden: {tap: [B, d]} at
        each request's newest token, newest [B]; for a drafter that `reads_context`, where each request's tokens
        are, its positions the newest token's), the tokens `propose` gives them at k = depth, without a read to
        the host: what lets a drafting step's next one launch before the host reads its verdicts (SpecStep, which
        captures it in a CUDA graph with the verdicts: it must read nothing from the host). A drafter of several
        `sources` returns (drafts, [B] int64: 0 where they are its own, i where its i-th source's). None where the
        drafter cannot (it needs host state, or runs on the host)."""
        return None

    def look_up(
        self, chain: torch.Tensor, newest: torch.Tensor, context: TokenContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For a drafter that `reads_context`: what reading the context makes of the drafts [B, depth] that
        `draft_on_device` gives without one, and their sources; `draft_on_device` with a context is that call
        after the one without (so a step may capture the first in a graph and run this apart)."""
        raise NotImplementedError(f"{type(self).__name__} drafts without reading the context")

    def drafts_on_device(self, depth: int | None = None) -> bool:
        """Whether `draft_on_device` drafts (depth: that many tokens; None: any it can)."""
        return type(self).draft_on_device is not Drafter.draft_on_device

    def release(self, seq: Sequence) -> None:
        """Forget any per-request state (the request finished)."""

    def warm_up(self, sessions: int) -> None:
        """Prepare for batches of up to `sessions` requests before the first step (capture CUDA graphs)."""

    def follow_weights(self, fmt: str) -> None:
        """The target's weights are now `fmt` (config.WEIGHT_FORMATS): a drafter with large weights of its own may
        take the same form (the EAGLE-3 head). Called when it is built and at every switch."""


class NoDrafter(Drafter):
    """Plain decoding."""


DATA_DIR = Path(__file__).resolve().parent.parent.parent / "data"


def make_drafter(name: str, context) -> Drafter:
    """A drafter by its CLI name; `context` is the engine (model, tokenizer, config) it may need.

    none: plain decoding. ngram: prompt lookup. heads: the trained heads models.toml lists for the model, or
    heads:FILE. eagle: the EAGLE-3 head models.toml lists for the model, or eagle:DIR (a head directory in the
    layout vLLM and SGLang load). ngram+heads: prompt lookup where it matches, heads elsewhere. draft-model: the registry's
    default model (or draft-model:NAME) drafting with its own KV. default: the model's models.toml `drafter`
    (`cpu_drafter` on the CPU, where set).
    """
    kind, _, arg = check_drafter_name(name).partition(":")
    if kind == "none":
        return NoDrafter()
    if kind == "default":
        return make_drafter(default_drafter_name(context), context)
    if kind == "ngram":
        from specchat.engine.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if kind == "heads":
        return _heads(arg, context)
    if kind == "eagle":
        from specchat.engine.drafters.eagle import EagleDrafter

        folder = _shipped_file(arg, context, "eagle")
        drafter = EagleDrafter.from_dir(folder, context.model, context.pool.capacity_tokens, not context.config.eager)
        drafter.follow_weights(context.weights.current)
        return drafter
    if kind == "ngram+heads":
        from specchat.engine.drafters.hybrid import NgramThenHeads

        return NgramThenHeads(_heads(arg, context))
    from specchat.engine.drafters.draft_model import load_draft_model_drafter

    return load_draft_model_drafter(arg or None, context)


def _heads(arg: str, context) -> Drafter:
    """The heads in `arg` (default: the model's shipped ones); under --eager the plain float modules (no graphs,
    no Q8_0 blocks on the CPU)."""
    from specchat.engine.drafters.heads import HeadsDrafter

    fast = not context.config.eager
    return HeadsDrafter.from_file(_shipped_file(arg, context, "heads"), context.model, graphs=fast, cpu_blocks=fast)


def _shipped_file(arg: str, engine, kind: str) -> Path:
    """heads:FILE / eagle:DIR, else what the model's registry entry names for `kind` (relative to specchat/data)."""
    if arg:
        path = Path(arg).expanduser()
    else:
        spec = engine.model_spec
        shipped = getattr(spec, kind) if spec is not None else None
        if not shipped:
            alias = spec.alias if spec else "this model"
            arch = " --arch eagle" if kind == "eagle" else ""
            raise ConfigError(
                f"no trained {'EAGLE-3 head' if kind == 'eagle' else 'draft heads'} for {alias}: train them with "
                f"`specchat train-heads {alias}{arch} --out PATH` and pass --drafter {kind}:PATH"
            )
        path = DATA_DIR / shipped
    if (why := path_problem(path, str(path), directory=kind == "eagle")) is not None:
        raise ConfigError(f"{'EAGLE-3 head directory' if kind == 'eagle' else 'draft heads file'}: {why}")
    return path
