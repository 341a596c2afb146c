"""How the CUDA-graph runner splits a step that mixes decoding requests with prompts (pure logic, runs anywhere)."""

from __future__ import annotations

from specchat.engine.cuda_graph import split_mixed_step
from specchat.engine.runner import StepBatch


def test_decoding_requests_stay_together_beside_a_new_prompt():
    """Seven requests decoding one token each after cached context, one prompt of 14 tokens after a cached system
    prompt: one group of the seven (one replay), the prompt in its own. A 1-token feed also fits a prompt graph;
    taking those there made such a step 8 replays (11 ms instead of ~3 on the H200 at 8 sessions)."""
    feeds = [[5]] * 7 + [list(range(14))]
    batch = StepBatch(list(range(8)), feeds, [40 + i for i in range(7)] + [32], [1] * 8)
    assert split_mixed_step(batch, lambda i: ("prompt", 16), lambda g: 32) == [[7], list(range(7))]


def test_prompts_of_one_graph_go_together_up_to_its_size():
    """Five prompts after cached context: those of one width share replays of at most group_size; a fresh prompt
    keeps its own prefill graph; verifying requests group; a prompt no graph takes joins the rest."""
    feeds = [[1, 2, 3, 4, 5], list(range(10)), list(range(12)), list(range(300)), list(range(20)), list(range(9))]
    feeds += [list(range(11)), [6, 7, 8, 9, 10]]
    starts = [50, 32, 32, 0, 0, 32, 32, 60]
    batch = StepBatch(list(range(8)), feeds, starts, [5, 1, 1, 1, 1, 1, 1, 5])
    groups = {1: ("prompt", 16), 2: ("prompt", 16), 4: ("prefill", 4), 5: ("prompt", 16), 6: ("prompt", 16)}
    parts = split_mixed_step(batch, groups.get, lambda g: 3 if g[0] == "prompt" else 1)
    assert parts == [[1, 2, 5], [6], [4], [0, 7], [3]]
