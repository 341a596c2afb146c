"""Speculative verification: which drafted tokens the target keeps, and the token it adds.

Terms (used across the engine and its stats):
- draft tokens d_1..d_k: proposed by a drafter for the positions after the request's last token;
- accepted: the longest prefix d_1..d_a the target agrees with (0 <= a <= k);
- recovered token: when d_{a+1} is rejected, the target's replacement for it;
- bonus token: when all k drafts are accepted, the target's next token after d_k.
Each step therefore emits a + 1 tokens: the accepted drafts plus one recovered or bonus token.

Greedy: accept while d_i equals the target's argmax; the argmax at the first mismatch is the recovered token,
so the output equals plain greedy decoding token for token.

Sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Alg. 1):
accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); on rejection draw the recovered token from
normalize(max(0, p_i - q_i)); when every draft is accepted draw the bonus from p_{k+1}. p is the target's
distribution after temperature / top-k / top-p (the same processing plain sampling uses); q is the drafter's.
A deterministic drafter is a point mass: q_i = onehot(d_i). The emitted tokens are then distributed exactly
as if the target had sampled them one at a time.
"""

from __future__ import annotations

import torch

from specchat.config import SamplingParams
from specchat.engine.sampling import probs_from_logits, sample_from_probs
from specchat.kernels import cpu_ops


def verify(
    target_logits: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, list[int]]:
    """target_logits [k+1, V] at [last token, d_1..d_k]; draft_probs [k, V] or None for a point mass.

    Returns (accepted count a, emitted tokens d_1..d_a + [recovered or bonus]).
    """
    k = len(draft_tokens)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need k + 1 = {k + 1} rows of target logits, got {target_logits.shape[0]}")
    if params.greedy:
        target = target_logits.argmax(-1).tolist()  # [k+1]
        a = 0
        while a < k and draft_tokens[a] == target[a]:
            a += 1
        return a, [*draft_tokens[:a], target[a]]

    p = probs_from_logits(target_logits, params)  # [k+1, V]
    if k == 0:
        return 0, [int(sample_from_probs(p[0], generator))]
    drafts = torch.tensor(draft_tokens, device=p.device)
    p_draft = p[:k].gather(-1, drafts[:, None]).squeeze(-1)  # [k] p_i(d_i)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, drafts[:, None]).squeeze(-1).to(p.dtype)  # [k] q_i(d_i)
    u = torch.rand(k, generator=generator, device=p.device)
    accept = u * q_draft < p_draft  # u < p/q without dividing by q = 0
    rejected = (~accept).nonzero()
    if len(rejected) == 0:
        return k, [*draft_tokens, int(sample_from_probs(p[k], generator))]
    a = int(rejected[0])
    if draft_probs is None:
        residual = p[a].clone()
        residual[draft_tokens[a]] = 0.0
    else:
        residual = (p[a] - draft_probs[a].to(p.dtype)).clamp_min(0.0)
    total = residual.sum()
    # The residual is empty only when p_a <= q_a everywhere, i.e. p_a == q_a, where rejection has probability 0;
    # guard against round-off anyway by falling back to p_a.
    residual = residual / total if total > 0 else p[a]
    return a, [*draft_tokens[:a], int(sample_from_probs(residual, generator))]


def verify_batch(
    logits: torch.Tensor,
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[tuple[int, list[int]]]:
    """`verify` for every request of a step at once, with a single device-to-host copy.

    logits [sum(k_i + 1), V]: the requests' rows one after another (request i's k_i + 1 rows at its drafts).
    Greedy requests share one argmax over all rows; a sampling request keeps its own generator and draws the
    recovered token for every position at once (`_sample_on_device`). Everything stays on the device until
    the one `.tolist()` at the end. Returns (accepted, emitted) per request, as `verify` does.
    """
    argmax = cpu_ops.argmax(logits)  # [rows]; the greedy requests' targets
    sampled, start = [], 0
    for tokens, probs, sp, gen in zip(drafts, draft_probs, params, generators, strict=True):
        rows = logits[start : start + len(tokens) + 1]
        start += len(tokens) + 1
        if not sp.greedy:
            sampled.append(_sample_on_device(rows, tokens, probs, sp, gen))
    if start != logits.shape[0]:
        raise ValueError(f"need {start} rows of target logits, got {logits.shape[0]}")
    host = torch.cat([argmax, *sampled]).tolist() if sampled else argmax.tolist()
    results, start, s = [], 0, len(argmax)
    for tokens, sp in zip(drafts, params, strict=True):
        k = len(tokens)
        if sp.greedy:
            target = host[start : start + k + 1]
            a = 0
            while a < k and tokens[a] == target[a]:
                a += 1
            results.append((a, [*tokens[:a], target[a]]))
        else:
            a, last = host[s], host[s + 1]
            s += 2
            results.append((a, [*tokens[:a], last]))
        start += k + 1
    return results


def greedy_verdicts(target: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    """Greedy verification of a uniform step left on the device: target [B, q], the argmax at each request's q
    rows (its newest token and k = q - 1 drafts), fed [B, q] those tokens -> accepted [B]. Request b emits
    target[b, :accepted[b] + 1], what `verify_batch` returns for greedy requests, so that a drafting step's next
    one can be launched before the host reads the verdicts (SpecStep)."""
    return (target[:, :-1] == fed[:, 1:]).long().cumprod(1).sum(1)


def plain_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """The next token of each request of a step without drafts (logits [n, V], one row each), left on the device:
    what `verify_batch` emits for k = 0, by the same operations (the argmax; `_sample_on_device`'s draw), so that
    a step can feed them to the next one before the host reads them (SpecStep's step ahead)."""
    tokens = cpu_ops.argmax(logits)
    if all(sp.greedy for sp in params):
        return tokens
    # row by row, without an index tensor from the host (on a GPU, a host-to-device copy from pageable memory
    # waits for the stream: the step ahead would not overlap)
    rows = [
        tokens[i] if sp.greedy else _sample_on_device(logits[i : i + 1], [], None, sp, gen)[1]
        for i, (sp, gen) in enumerate(zip(params, generators, strict=True))
    ]
    return torch.stack(rows)


def _sample_on_device(
    target_logits: torch.Tensor, tokens: list[int], draft_probs: torch.Tensor | None, params: SamplingParams, generator
) -> torch.Tensor:
    """Rejection sampling (the algorithm of `verify`) without leaving the device -> [accepted, last token].

    The recovered token is drawn for every position, from normalize(max(0, p_i - q_i)), and the bonus from
    p_{k+1}, one draw per row; the row at the first rejection is kept. Each row's draw is independent of the
    acceptance draws, so the kept token has exactly the distribution `verify` draws it from.
    """
    k = len(tokens)
    p = probs_from_logits(target_logits, params)  # [k+1, V]
    if k == 0:
        return torch.stack([torch.zeros((), dtype=torch.long, device=p.device), sample_from_probs(p[0], generator)])
    drafts = torch.tensor(tokens, device=p.device)
    p_draft = p[:k].gather(-1, drafts[:, None]).squeeze(-1)  # [k] p_i(d_i)
    # q: the drafter's distributions, or point masses on the drafts for a deterministic drafter
    q = torch.zeros_like(p[:k]).scatter_(-1, drafts[:, None], 1.0) if draft_probs is None else draft_probs.to(p.dtype)
    q_draft = q.gather(-1, drafts[:, None]).squeeze(-1)  # [k] q_i(d_i)
    u = torch.rand(k, generator=generator, device=p.device)
    accepted = (u * q_draft < p_draft).long().cumprod(0).sum()  # leading accepts
    residual = (p[:k] - q).clamp_min(0.0)  # [k, V]
    total = residual.sum(-1, keepdim=True)
    # Empty only where p_i <= q_i everywhere (p_i == q_i: rejection has probability 0); fall back to p_i.
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p[:k])
    choices = sample_from_probs(torch.cat([residual, p[k:]]), generator)  # [k+1]
    return torch.stack([accepted, choices[accepted]])
