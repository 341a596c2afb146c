"""A smaller model with the same tokenizer drafts k tokens autoregressively (Leviathan et al. 2023).

The draft model has its own KV pool and runner; it never touches the target's cache. Each request remembers
which of its tokens the draft cache holds (`cached`). At every step the cache is cut back to the longest
prefix it shares with the request's tokens (drafts the target rejected fall away), the tokens it lacks are fed
in one batched forward, and then one token per round is drawn for every request still short of its k:
k rounds, each a batched forward over one token per request.

Greedy requests take the draft model's argmax (a point mass, probs=None); sampled requests draw from the draft
model's processed distribution q (same temperature / top-k / top-p as the target) and return q, which
rejection sampling needs to stay lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specchat.engine.drafters.base import Draft, Drafter
from specchat.engine.kv_cache import KVPool
from specchat.engine.kv_pages import bytes_per_token, format_for_dtype
from specchat.engine.model import Transformer
from specchat.engine.runner import ModelRunner, StepBatch
from specchat.engine.sampling import probs_from_logits, sample_from_probs
from specchat.quant.modules import model_dtype

if TYPE_CHECKING:
    from specchat.engine.sequence import Sequence


@dataclass(slots=True)
class DraftState:
    """One request's tokens whose keys/values are in the draft pool, in order."""

    cached: list[int] = field(default_factory=list)


def shared_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelDrafter(Drafter):
    """Drafts with `model` (own `pool`); target_vocab: width of the target's logits, which q must match."""

    name = "draft-model"

    def __init__(self, model: Transformer, pool: KVPool, target_vocab: int, label: str = "draft-model") -> None:
        self.model = model
        self.pool = pool
        self.runner = ModelRunner(model, pool)
        self.target_vocab = target_vocab
        self.name = label
        self.states: dict[int, DraftState] = {}

    def _sync(self, seq: Sequence) -> list[int]:
        """Cut the draft cache back to what still matches the request; return the tokens to feed."""
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = DraftState()
            self.pool.add(seq.seq_id, [])
        tokens = seq.all_ids
        # Keep at least one token to feed: the newest one's logits give the first draft.
        keep = min(shared_prefix_len(state.cached, tokens), len(tokens) - 1)
        self.pool.truncate(seq.seq_id, keep)
        del state.cached[keep:]
        return tokens[keep:]

    def _choose(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """logits [V_draft] -> (draft token, q [V_target] or None for a greedy point mass)."""
        if seq.sampling.greedy:
            return int(logits.argmax()), None
        q = probs_from_logits(logits, seq.sampling)  # [V_draft]
        token = int(sample_from_probs(q, seq.generator))
        if q.shape[-1] != self.target_vocab:  # same tokenizer, but embedding tables may be padded differently
            q = torch.nn.functional.pad(q, (0, self.target_vocab - q.shape[-1]))[: self.target_vocab]
        return token, q

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        feeds = [self._sync(seq) for seq in seqs]
        # Drafting needs room for the fed tokens and k - 1 drafts; requests that do not fit draft nothing.
        active, needs = [], {}
        for i, (seq, feed, k) in enumerate(zip(seqs, feeds, ks, strict=True)):
            needs[seq.seq_id] = len(feed) + k - 1
            if k > 0 and self.pool.can_append(needs):
                active.append(i)
            else:
                del needs[seq.seq_id]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        while active:
            batch = StepBatch(
                seq_ids=[seqs[i].seq_id for i in active],
                feeds=[feeds[i] for i in active],
                start_positions=[self.pool.length(seqs[i].seq_id) for i in active],
                logit_rows=[1] * len(active),
            )
            out = self.runner.forward(batch)
            for i, logits in zip(active, out.logits, strict=True):
                self.states[seqs[i].seq_id].cached.extend(feeds[i])
                token, q = self._choose(seqs[i], logits[0])
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q)
                feeds[i] = [token]
            active = [i for i in active if len(tokens[i]) < ks[i]]
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs, strict=True)]

    def release(self, seq: Sequence) -> None:
        if self.states.pop(seq.seq_id, None) is not None:
            self.pool.free(seq.seq_id)


def load_draft_model_drafter(name: str | None, engine) -> DraftModelDrafter:
    """`draft-model[:NAME]` for `engine`: NAME defaults to the registry's default model.

    When NAME is the engine's own model the weights are shared (a target drafting for itself: acceptance 1,
    useful as a check); otherwise the model is loaded in the engine's dtype on its device and must use the
    same tokenizer as the target.
    """
    from specchat.engine.loader import build_model, load_checkpoint
    from specchat.engine.loading import default_kv_budget, load_tokenizer
    from specchat.errors import ConfigError
    from specchat.registry import fetch, resolve

    spec = resolve(name)
    label = f"draft-model:{spec.alias}" if name else "draft-model"
    own = engine.model_spec
    dtype = model_dtype(engine.model)
    if own is not None and spec.where == own.where:
        model = engine.model
    else:
        path = fetch(spec)
        if load_tokenizer(spec, path).backend.get_vocab() != engine.tokenizer.backend.get_vocab():
            raise ConfigError(f"draft model {spec.alias!r} does not share the target model's tokenizer")
        cfg, state = load_checkpoint(path)
        model = build_model(cfg, state, dtype, engine.device)
    c = model.cfg
    # As many tokens as the target's pool holds, within the device's KV budget.
    per_token = bytes_per_token(format_for_dtype(dtype), c.num_layers, c.num_kv_heads, c.head_dim)
    budget = min(default_kv_budget(engine.device), engine.pool.capacity_tokens * per_token)
    pool = KVPool.from_budget(
        budget, c.num_layers, c.num_kv_heads, c.head_dim, engine.pool.page_size, dtype, engine.device
    )
    return DraftModelDrafter(model, pool, engine.model.cfg.vocab_size, label)
