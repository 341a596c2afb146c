"""How the CUDA-graph runner splits a step that mixes decoding requests with prompts (pure logic, runs anywhere)."""

from __future__ import annotations

from specchat.engine.cuda_graph import split_mixed_step
from specchat.engine.runner import StepBatch


def test_decoding_requests_stay_together_beside_a_new_prompt():
    """Seven requests decoding one token each after cached context, one prompt of 14 tokens after a cached system
    prompt: one group of the seven (one replay), the prompt alone (its graph). A 1-token feed also fits a batch-1
    prompt graph; taking those alone made such a step 8 replays (11 ms instead of ~3 on the H200 at 8 sessions)."""
    feeds = [[5]] * 7 + [list(range(14))]
    batch = StepBatch(list(range(8)), feeds, [40 + i for i in range(7)] + [32], [1] * 8)
    assert split_mixed_step(batch, lambda i: True) == [[7], list(range(7))]


def test_verifying_requests_group_and_the_rest_runs_together():
    """Verifying requests (newest token + drafts, a logit row each) group; a prompt no graph takes joins the rest."""
    feeds = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], list(range(300)), list(range(20)), list(range(40))]
    batch = StepBatch([0, 1, 2, 3, 4], feeds, [50, 60, 0, 0, 16], [5, 5, 1, 1, 1])
    alone = {3}  # say only request 3's prompt fits a prefill graph
    assert split_mixed_step(batch, alone.__contains__) == [[3], [0, 1], [2, 4]]
