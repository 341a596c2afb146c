"""Prompt lookup on the device (kernels/ngram.py): the reference finds what the host's NgramIndex finds, and the
Triton kernel what the reference does."""

from __future__ import annotations

import random

import pytest
import torch

from specchat.kernels import ngram
from tests.engine.test_drafters import lookup
from tests.kernels.interpreter import DEVICE, kernel_test, run_under_interpreter, subprocess_test

PAGE = 4


def paged(requests: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [pages * PAGE], tables [B, W] int32): each request's tokens in pages scattered over a pool with room to
    spare (its other slots hold a token no request has)."""
    gen = random.Random(seed)
    pages = 2 * sum(-(-len(r) // PAGE) for r in requests) + 1
    free = list(range(pages))
    gen.shuffle(free)
    width = max(-(-len(r) // PAGE) for r in requests) + 1
    ids = torch.full((pages * PAGE,), 7777, dtype=torch.long)
    tables = torch.zeros(len(requests), width, dtype=torch.int32)
    for b, tokens in enumerate(requests):
        for i in range(-(-len(tokens) // PAGE)):
            page = free.pop()
            tables[b, i] = page
            chunk = tokens[i * PAGE : (i + 1) * PAGE]
            ids[page * PAGE : page * PAGE + len(chunk)] = torch.tensor(chunk)
    return ids, tables


def host_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int] | None:
    """NgramIndex's draft; None without a match."""
    return lookup(tokens, k, min_n, max_n) or None


def test_a_match_near_the_end_continues_its_period():
    assert host_lookup([1, 2, 3, 1, 2], 4, 2, 4) == [3, 1, 2, 3]  # [1, 2] matched 3 back: the period is 3
    assert host_lookup([7, 5, 5, 5], 5, 2, 4) == [5] * 5
    assert host_lookup([1, 2, 3, 4, 1, 2], 2, 2, 4) == [3, 4]


def cases(seed: int, count: int = 24) -> list[list[int]]:
    gen = random.Random(seed)
    out = []
    for _ in range(count):
        vocab = gen.choice([3, 5, 12, 40])  # small vocabularies repeat: matches of every length
        out.append([gen.randrange(vocab) for _ in range(gen.randrange(1, 60))])
    out += [[5], [5, 5], [1, 2], [1, 2, 1, 2], [3, 3, 3, 3, 3], [9, 8, 7, 6]]
    return out


def device_args(requests: list[list[int]], device: str = "cpu"):
    """The lookup's inputs for requests whose last token is the newest (not in the pages)."""
    ids, tables = paged([r[:-1] for r in requests])
    lengths = torch.tensor([len(r) - 1 for r in requests])
    newest = torch.tensor([r[-1] for r in requests])
    return ids.to(device), tables.to(device), lengths.to(device), newest.to(device)


@pytest.mark.parametrize("k", [1, 4, 7])
@pytest.mark.parametrize(("min_n", "max_n"), [(2, 4), (1, 3), (3, 3)])
def test_reference_finds_what_the_host_index_finds(k, min_n, max_n):
    requests = cases(k * 10 + max_n)
    drafts, found = ngram.lookup_ref(*device_args(requests), PAGE, k, min_n, max_n, window=64)
    for b, tokens in enumerate(requests):
        expected = host_lookup(tokens, k, min_n, max_n)
        assert bool(found[b]) == (expected is not None), tokens
        if expected is not None:
            assert drafts[b].tolist() == expected, tokens


def test_reference_searches_its_window_only():
    tokens = [1, 2, 3, 9, 9, 9, 9, 9, 9, 9, 1, 2]  # the only earlier [1, 2] is 10 positions back
    found = [bool(ngram.lookup_ref(*device_args([tokens]), PAGE, 2, 2, 4, window=w)[1][0]) for w in (12, 11)]
    assert found == [True, False]


@kernel_test
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize(
    ("min_n", "max_n", "window"),
    [(2, 4, 64), (2, 4, 9), (2, 4, 4096), (3, 4, 64), (2, 2, 64), (2, 3, 5), (1, 3, 64), (1, 1, 9)],
)
def test_kernel_matches_reference(k, min_n, max_n, window):
    requests = cases(k + window, count=40) + [[random.Random(s).randrange(4) for _ in range(3000)] for s in range(2)]
    args = device_args(requests, DEVICE)
    tables = args[1]
    big = torch.zeros(tables.shape[0], tables.shape[1] + 3, dtype=torch.int32, device=DEVICE)  # a wider table
    big[:, : tables.shape[1]] = tables
    ids, _, lengths, newest = args
    drafts, found = ngram.lookup(ids, big, lengths, newest, PAGE, k, min_n, max_n, window)
    ref_drafts, ref_found = ngram.lookup_ref(ids, big, lengths, newest, PAGE, k, min_n, max_n, window)
    assert torch.equal(found.cpu(), ref_found.cpu())
    live = ref_found.cpu()
    assert torch.equal(drafts.cpu()[live], ref_drafts.cpu()[live])


@subprocess_test
def test_kernels_under_interpreter():
    run_under_interpreter([__file__], "kernel")
