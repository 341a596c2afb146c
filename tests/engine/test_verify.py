"""Verification: exact greedy cases, and the rejection sampler's output distribution (Leviathan et al. 2023)."""

from __future__ import annotations

import pytest
import torch

from specchat.config import SamplingParams
from specchat.engine.sampling import probs_from_logits, sample_from_probs
from specchat.engine.verify import verify

GREEDY = SamplingParams()
V = 6  # vocabulary of the statistical tests


def one_hot_logits(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    """Target logits [len(tokens), vocab] whose argmax row by row is `tokens`."""
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


@pytest.mark.parametrize(
    ("target", "draft", "accepted", "emitted"),
    [
        ([3, 4, 5, 6], [3, 4, 5], 3, [3, 4, 5, 6]),  # all accepted: the bonus token follows
        ([3, 4, 5, 6], [3, 1, 5], 1, [3, 4]),  # second draft rejected: recovered token 4
        ([3, 4, 5, 6], [0, 4, 5], 0, [3]),  # first rejected: only the target's own token
        ([7], [], 0, [7]),  # no drafts: plain decoding
    ],
)
def test_greedy_keeps_longest_agreeing_prefix(target, draft, accepted, emitted):
    assert verify(one_hot_logits(target), draft, None, GREEDY, None) == (accepted, emitted)


def test_rows_must_match_draft_length():
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify(one_hot_logits([1, 2]), [1, 2], None, GREEDY, None)


def test_sampled_point_mass_draft_that_target_is_sure_of_is_accepted():
    logits = torch.full((3, 8), -1e4)
    logits[0, 2] = logits[1, 5] = logits[2, 1] = 0.0  # p is one-hot: accept probability p(d) / 1 = 1
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    assert verify(logits, [2, 5], None, params, gen) == (2, [2, 5, 1])


def leviathan_wrong_residual(target_logits, draft_tokens, draft_probs, params, generator):
    """A deliberately wrong sampler: on rejection it resamples from p instead of normalize(max(0, p - q))."""
    p = probs_from_logits(target_logits, params)
    for i, d in enumerate(draft_tokens):
        q = draft_probs[i]
        if torch.rand((), generator=generator) * q[d] >= p[i, d]:
            return i, [*draft_tokens[:i], int(sample_from_probs(p[i], generator))]
    return len(draft_tokens), [*draft_tokens, int(sample_from_probs(p[-1], generator))]


def emitted_distributions(sampler, n: int, seed: int, point_mass: bool = False):
    """Run `sampler` n times on fixed random p (3 positions) and q (2 drafts) over V tokens.

    Returns (empirical distribution of the 1st emitted token, of the 2nd given at least 2 emitted, p).
    The synthetic target's rows do not depend on earlier tokens, so emitted token i should follow p_i.
    """
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1)) * 1.5
    params = SamplingParams(temperature=1.0)
    p = probs_from_logits(target_logits, params)
    q = torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(2)) * 1.5, dim=-1)
    if point_mass:
        fixed = [int(q[0].argmax()), int(q[1].argmax())]
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        if point_mass:
            drafts, probs = fixed, None
        else:
            drafts, probs = [int(sample_from_probs(q[i], gen)) for i in range(2)], q
        _, emitted = sampler(target_logits, drafts, probs, params, gen)
        first[emitted[0]] += 1
        if len(emitted) >= 2:
            second[emitted[1]] += 1
    return first / first.sum(), second / second.sum(), p


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled-draft", "point-mass-draft"])
def test_rejection_sampling_converges_to_target_distribution(point_mass):
    distances = []
    for n in (400, 6000):
        first, second, p = emitted_distributions(verify, n, seed=3, point_mass=point_mass)
        distances.append((total_variation(first, p[0]), total_variation(second, p[1])))
    (small_1, small_2), (large_1, large_2) = distances
    assert large_1 < small_1 and large_1 + large_2 < small_1 + small_2
    assert large_1 < 0.03 and large_2 < 0.03  # sampling noise at 6k draws over 6 tokens is ~0.01


def test_wrong_sampler_fails_the_same_test():
    first, _, p = emitted_distributions(leviathan_wrong_residual, 6000, seed=3)
    assert total_variation(first, p[0]) > 0.1


def test_seeded_sampling_is_deterministic():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    q = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    runs = [verify(logits, [1, 2, 3], q, params, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert runs[0] == runs[1]
