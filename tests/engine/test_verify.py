"""Verification: exact greedy cases, and the rejection sampler's output distribution (Leviathan et al. 2023).

`verify` (one request, the reference) and `verify_batch` (every request of a step, one device sync) are held to
the same cases: equal outputs in greedy decoding, the same output distribution when sampling.
"""

from __future__ import annotations

import pytest
import torch

from specchat.config import SamplingParams
from specchat.engine.sampling import probs_from_logits, sample, sample_from_probs
from specchat.engine.verify import plain_tokens, verify, verify_batch

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


def batched(target_logits, draft_tokens, draft_probs, params, generator):
    """verify_batch on a batch of one: the `verify` signature, for the statistical tests."""
    return verify_batch(target_logits, [draft_tokens], [draft_probs], [params], [generator])[0]


@pytest.mark.parametrize("sampler", [verify, batched], ids=["verify", "verify_batch"])
@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled-draft", "point-mass-draft"])
def test_rejection_sampling_converges_to_target_distribution(point_mass, sampler):
    distances = []
    for n in (400, 6000):
        first, second, p = emitted_distributions(sampler, n, seed=3, point_mass=point_mass)
        distances.append((total_variation(first, p[0]), total_variation(second, p[1])))
    (small_1, small_2), (large_1, large_2) = distances
    assert large_1 < small_1 and large_1 + large_2 < small_1 + small_2
    assert large_1 < 0.03 and large_2 < 0.03  # sampling noise at 6k draws over 6 tokens is ~0.01


def test_wrong_sampler_fails_the_same_test():
    first, _, p = emitted_distributions(leviathan_wrong_residual, 6000, seed=3)
    assert total_variation(first, p[0]) > 0.1


@pytest.mark.parametrize("sampler", [verify, batched], ids=["verify", "verify_batch"])
def test_seeded_sampling_is_deterministic(sampler):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    q = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    runs = [sampler(logits, [1, 2, 3], q, params, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert runs[0] == runs[1]


def test_batch_equals_one_request_at_a_time_in_greedy_decoding():
    """Random targets and drafts that agree for a random while: verify_batch gives verify's answer per request."""
    gen = torch.Generator().manual_seed(5)
    logits, drafts = [], []
    for _ in range(40):
        k = int(torch.randint(0, 6, (), generator=gen))
        rows = torch.randn(k + 1, 30, generator=gen)
        target = rows.argmax(-1).tolist()
        agree = int(torch.randint(0, k + 1, (), generator=gen))
        drafts.append(target[:agree] + [(t + 1) % 30 for t in target[agree:k]])
        logits.append(rows)
    batch = verify_batch(torch.cat(logits), drafts, [None] * 40, [GREEDY] * 40, [None] * 40)
    assert batch == [verify(rows, d, None, GREEDY, None) for rows, d in zip(logits, drafts, strict=True)]
    assert {a for a, _ in batch} == set(range(6)), "the cases should cover every accepted length"


def test_batch_mixes_greedy_and_sampled_requests():
    """Greedy rows beside a sampling request: each keeps its own rule; a sure target accepts a point mass."""
    sure = torch.full((3, 8), -1e4)
    sure[0, 2] = sure[1, 5] = sure[2, 1] = 0.0
    params = [GREEDY, SamplingParams(temperature=1.0), GREEDY]
    logits = torch.cat([one_hot_logits([3, 4]), sure, one_hot_logits([7])])
    got = verify_batch(logits, [[3], [2, 5], []], [None] * 3, params, [None, torch.Generator().manual_seed(0), None])
    assert got == [(1, [3, 4]), (2, [2, 5, 1]), (0, [7])]


def test_batch_rows_must_match_draft_lengths():
    with pytest.raises(ValueError, match="rows of target logits"):
        verify_batch(one_hot_logits([1, 2, 3]), [[1]], [None], [GREEDY], [None])


def test_plain_tokens_draw_what_verification_emits_without_drafts():
    """A step without drafts: `plain_tokens` (left on the device, what a step ahead feeds on) gives the token
    `verify_batch` emits for k = 0, greedy and seeded sampled requests alike, from the same generator states."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=t, top_k=k, seed=i) for i, (t, k) in enumerate([(0, 0), (0.8, 0), (1.0, 5),
                                                                                          (0, 0), (1.3, 0)])]  # fmt: skip
    for draw in range(20):
        gens_a = [None if p.greedy else torch.Generator().manual_seed(draw * 10 + i) for i, p in enumerate(params)]
        gens_b = [None if p.greedy else torch.Generator().manual_seed(draw * 10 + i) for i, p in enumerate(params)]
        verified = verify_batch(logits, [[]] * 5, [None] * 5, params, gens_a)
        assert plain_tokens(logits, params, gens_b).tolist() == [emitted[0] for _, emitted in verified]


def test_greedy_verdicts_on_the_device_are_verify_batchs():
    """Per request, the accepted count of `greedy_verdicts` and target[:accepted + 1] are what `verify_batch`
    returns for greedy requests: drafts that match the argmax for 0..k positions."""
    from specchat.engine.verify import greedy_verdicts

    torch.manual_seed(0)
    n, q, vocab = 6, 5, 50
    logits = torch.randn(n * q, vocab)
    target = logits.argmax(-1).view(n, q)
    fed = torch.randint(0, vocab, (n, q))
    for b in range(n):  # request b's first b drafts (up to k) match
        fed[b, 1 : 1 + min(b, q - 1)] = target[b, : min(b, q - 1)]
    accepted = greedy_verdicts(target, fed)
    want = verify_batch(logits, [f[1:].tolist() for f in fed], [None] * n, [SamplingParams()] * n, [None] * n)
    assert accepted.tolist() == [a for a, _ in want] and accepted.tolist()[:5] == [0, 1, 2, 3, 4]
    assert [target[b, : a + 1].tolist() for b, a in enumerate(accepted.tolist())] == [e for _, e in want]


def test_vanishing_temperature_and_top_p_sample_the_top_token_instead_of_failing():
    """A temperature or top_p of 1e-300 is 0 in float32: dividing the logits by it, or keeping no token past the
    top one's mass (0 >= 0), gave NaN probabilities and failed the step of every request beside it. A temperature
    below GREEDY_BELOW is greedy; any top_p keeps at least the top token."""
    from specchat.config import GREEDY_BELOW

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    assert SamplingParams(temperature=1e-300).greedy and not SamplingParams(temperature=GREEDY_BELOW).greedy
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(temperature=1e-300), gen).tolist() == [1]
    probs = probs_from_logits(logits, SamplingParams(temperature=0.7, top_p=1e-300))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    # top_p just under the top token's probability keeps it alone, just over keeps the next one too
    top = torch.softmax(logits / 0.7, -1).max().item()
    assert (probs_from_logits(logits, SamplingParams(temperature=0.7, top_p=top * 0.999)) > 0).sum().item() == 1
    assert (probs_from_logits(logits, SamplingParams(temperature=0.7, top_p=top * 1.001)) > 0).sum().item() == 2


def test_an_engine_answers_at_a_vanishing_temperature_and_top_p(tiny_engine):
    """Through the engine (the CLI's and the server's path): the request is answered, greedily where the
    temperature vanishes, and a sampled request beside it is answered too."""
    prompt = "Tell me about the sea."
    greedy = tiny_engine.submit(prompt, SamplingParams(max_tokens=8, ignore_eos=True)).result().token_ids
    handles = [
        tiny_engine.submit(prompt, SamplingParams(temperature=1e-300, max_tokens=8, ignore_eos=True)),
        tiny_engine.submit(prompt, SamplingParams(temperature=0.8, top_p=1e-300, max_tokens=8, ignore_eos=True)),
        tiny_engine.submit(prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)),
    ]
    results = [h.result() for h in handles]
    assert all(r.error is None and len(r.token_ids) == 8 for r in results)
    assert results[0].token_ids == greedy and results[1].token_ids == greedy  # top_p ~0: the top token each step
