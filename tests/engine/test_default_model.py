"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' own GGUF loader."""

from __future__ import annotations

import pytest
import torch

from specchat.config import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in two sentences.",
]


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, torch_dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)


def test_logits_match_transformers_gguf_loader(default_engine, hf_model):
    ids = default_engine.encode_prompt(PROMPTS[1])
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    runner = default_engine.runner
    from specchat.engine.runner import StepBatch

    runner.pool.add(-1, [])  # no prefix sharing: this test feeds the whole prompt
    try:
        got = runner.forward(StepBatch([-1], [ids], [0], [len(ids)])).logits[0]
    finally:
        runner.pool.free(-1)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_64_tokens_equal_transformers(default_engine, hf_model, prompt):
    ids = default_engine.encode_prompt(prompt)
    with torch.no_grad():
        hf_out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
    ours = default_engine.submit(ids, SamplingParams(max_tokens=64, ignore_eos=True)).result()
    assert ours.token_ids == hf_out


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi there"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3? ünïcödé ✓"},
        ],
    ],
)
def test_chat_template_equals_apply_chat_template(default_engine, hf_tokenizer, messages):
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert default_engine.tokenizer.render_chat(messages) == expected
    expected_ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(expected_ids, "keys"):  # transformers >= 5 returns a BatchEncoding
        expected_ids = expected_ids["input_ids"]
    assert default_engine.tokenizer.encode_chat(messages) == list(expected_ids)


def test_stops_at_end_of_turn(default_engine):
    out = default_engine.submit("Say only the word yes.", SamplingParams(max_tokens=64)).result()
    assert out.reason == "stop"
    assert "<|im_end|>" not in out.text
    assert default_engine.tokenizer.backend.token_to_id("<|im_end|>") not in out.token_ids
