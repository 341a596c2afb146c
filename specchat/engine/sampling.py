"""Logits processing and sampling: temperature, top-k, top-p, seeded generators."""

from __future__ import annotations

import torch

from specchat.config import SamplingParams
from specchat.kernels import cpu_ops


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded from params.seed (None: unseeded randomness); greedy needs none."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the distribution actually sampled from, after temperature, top-k and top-p.

    The same function serves plain sampling and both sides of speculative verification, so the
    verifier's target distribution is exactly the one plain decoding samples from.
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (the top token always stays).
        # (the top token by its index, not by the mass before it: a top_p under float32's smallest number, 1e-300,
        # is 0 there, and 0 >= 0 took the top token too, leaving no token: NaN probabilities, a failed step)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        dropped = mass_before >= params.top_p
        dropped[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [..., V] -> token ids [...] (one draw per row)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [..., V] -> token ids [...]; argmax when greedy."""
    if params.greedy:
        return cpu_ops.argmax(logits)
    return sample_from_probs(probs_from_logits(logits, params), generator)
