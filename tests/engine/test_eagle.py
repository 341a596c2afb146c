"""EAGLE-3 heads: the file layout vLLM and SGLang load, drafting equal to what training computes, and learning.

Lossless decoding with an EAGLE head (greedy equality with plain decoding, seeded sampling) is in
test_spec_decode.py, beside the other drafters.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.drafters import Drafter
from specchat.engine.drafters.eagle import (
    CATCH_UP_ROWS,
    LINEARS,
    EagleConfig,
    EagleDrafter,
    EagleHead,
    default_aux_layers,
    is_eagle_dir,
)
from specchat.engine.runner import StepBatch
from specchat.engine.train_eagle import EagleTrainConfig, EagleTrainer, train_eagle
from specchat.errors import ConfigError, ModelFormatError
from specchat.quant.fp4_linear import Fp4Linear
from tests.conftest import save_tiny_hf
from tests.kernels.interpreter import DEVICE, kernel_test, run_under_interpreter, subprocess_test


def random_head(model, draft_vocab: int = 2000, seed: int = 0) -> EagleHead:
    """A random head whose logits are spread enough that its argmax is clear."""
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.for_target(model.cfg, draft_vocab))
    with torch.no_grad():
        head.lm_head.weight.mul_(8.0)
        head.draft_vocab.copy_(torch.randperm(model.cfg.vocab_size)[:draft_vocab].sort().values)
    return head


def random_eagle(engine, draft_vocab: int = 2000, graphs: bool = True) -> EagleDrafter:
    return EagleDrafter(random_head(engine.model, draft_vocab), engine.model, engine.pool.capacity_tokens, graphs)


def test_files_use_the_eagle3_layout_and_load_back(tiny_engine, tmp_path):
    head = random_head(tiny_engine.model)
    head.save(tmp_path / "eagle", {"model": "tiny"})
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 2000
    assert is_eagle_dir(tmp_path / "eagle") and not is_eagle_dir(tmp_path)
    loaded = EagleHead.load(tmp_path / "eagle", tiny_engine.model.cfg)
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)
    for name, tensor in head.state_dict().items():  # bf16 in the file
        torch.testing.assert_close(loaded.state_dict()[name].float(), tensor.float(), atol=2e-2, rtol=1e-2)


def test_a_head_in_the_published_layout_loads(tiny_engine, tmp_path):
    """A checkpoint written the way EAGLE-3 heads are published: unfused q/k/v, a d2t offset map, a `model.`
    prefix on some names, and no eagle_config (the default aux layers 2, N/2, N-3)."""
    cfg = tiny_engine.model.cfg
    h, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    draft = torch.tensor([0, 1, 2, 7, 100, 4000])
    tensors = {
        "fc.weight": torch.randn(h, 3 * h),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": torch.randn(q, 2 * h),
        "midlayer.self_attn.k_proj.weight": torch.randn(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": torch.randn(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": torch.randn(h, q),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.mlp.gate_proj.weight": torch.randn(inter, h),
        "midlayer.mlp.up_proj.weight": torch.randn(inter, h),
        "midlayer.mlp.down_proj.weight": torch.randn(h, inter),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": torch.randn(len(draft), h),
        "d2t": draft - torch.arange(len(draft)),
    }
    folder = tmp_path / "published"
    folder.mkdir()
    save_file(
        {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in tensors.items()},
        str(folder / "model.safetensors"),
    )
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": len(draft),
        "rms_norm_eps": 1e-5,
    }
    (folder / "config.json").write_text(json.dumps(config))
    drafter = EagleDrafter.from_dir(folder, tiny_engine.model, 256)
    assert drafter.head.draft_vocab.tolist() == draft.tolist()
    assert drafter.taps == tuple(i - 1 for i in default_aux_layers(cfg.num_layers))

    del tensors["midlayer.mlp.up_proj.weight"]
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=r"lacks tensor 'midlayer\.mlp\.up_proj\.weight'"):
        EagleHead.load(folder, cfg)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelFormatError, match="not an EAGLE-3 head config"):
        EagleHead.load(folder, cfg)


def test_a_head_for_another_target_is_refused(tiny_engine, tmp_path):
    other = EagleConfig.for_target(tiny_engine.model.cfg, 100)
    other.target_hidden_size *= 2
    head = EagleHead(other)
    head.save(tmp_path / "wide", {})
    with pytest.raises(ConfigError, match=r"EAGLE-3 head .* reads hidden"):
        EagleDrafter.from_dir(tmp_path / "wide", tiny_engine.model, 256)


class Recording(Drafter):
    """Wraps a drafter and keeps, for each call, every request's tokens and the drafts proposed for it."""

    def __init__(self, inner: EagleDrafter) -> None:
        self.inner, self.taps, self.tap_history = inner, inner.taps, inner.tap_history
        self.calls: list[list[tuple[list[int], list[int]]]] = []

    def propose(self, seqs, ks):
        drafts = self.inner.propose(seqs, ks)
        self.calls.append([(list(s.all_ids), d.tokens) for s, d in zip(seqs, drafts, strict=True)])
        return drafts

    def release(self, seq) -> None:
        self.inner.release(seq)


def test_drafting_feeds_the_head_what_training_time_test_trains(tiny_engine, tmp_path):
    """The drafts of a chain equal the argmax that training computes at the same rows: ChainAttention's masks
    and shifts see exactly the keys, features and positions that drafting uses."""
    drafter = random_eagle(tiny_engine)
    tiny_engine.drafters["eagle:recorded"] = recorder = Recording(drafter)
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    # prompts no other test sends: a prefix-cache hit would leave the head without the cached positions' rows
    prompts = ["Eagle chain check: the quick brown fox", "# eagle chain check\ndef add(a, b):\n    return"]
    handles = [tiny_engine.submit(p, sampling, SpecParams("eagle:recorded", k=3)) for p in prompts]
    for handle in handles:
        handle.result()
    trainer = EagleTrainer(tiny_engine, EagleTrainConfig(ttt_steps=3), tmp_path / "work", lambda *a: None, print)
    index = trainer._vocab_index(drafter.head.draft_vocab)
    checked = 0
    for call in recorder.calls:
        for tokens, drafts in call:
            if len(drafts) < 3:
                continue
            seq = tokens + drafts  # the chain's tokens: the drafts are the labels of steps 1..3
            tiny_engine.pool.add(-1, [])  # no prefix reuse: every position is fed
            out = tiny_engine.runner.forward(StepBatch([-1], [seq], [0], [0]), taps=sorted(set(drafter.taps)))
            tiny_engine.pool.free(-1)
            hidden = torch.cat([out.hidden[0][t] for t in drafter.taps], dim=-1)
            feats = {"ids": torch.tensor(seq), "prompt": 0, "hidden": hidden, "eval": False}
            _, right, _ = trainer.chain(drafter.head, [feats], index)
            anchor = len(tokens) - 2  # the newest token's predecessor: its row predicts the first draft
            assert [bool(right[j][0, anchor + j]) for j in range(3)] == [True, True, True], (tokens, drafts)
            checked += 1
    assert checked >= 4


def test_training_learns_the_tiny_models_answers(tiny_engine, tmp_path):
    cfg = EagleTrainConfig(
        max_prompts=24,
        max_tokens=40,
        samples_per_prompt=1,
        epochs=30,
        draft_vocab=2000,
        ttt_steps=3,
        batch_tokens=2048,
        eval_fraction=0.25,
    )
    stages = []
    out = tmp_path / "eagle"
    report = train_eagle(tiny_engine, cfg, out, lambda stage, *_: stages.append(stage.split()[0]), lambda line: None)
    assert {"answers", "features", "train"} <= set(stages)
    # chance is 1 in 2,000 draft tokens (0.0005); the random tiny model's answers are close to noise, yet the
    # trained head predicts its held-out answers 20x better than chance, at every step of the chain
    assert report["eval_positions"] > 100 and min(report["top1"]) > 0.01, report
    assert report["tokens_per_step"][2] > report["tokens_per_step"][0] > 1.0, report
    assert all(1.0 <= run <= k + 1 for k, run in enumerate(report["run_tokens_per_step"], 1)), report
    tiny_engine.drafters["eagle:trained"] = EagleDrafter.from_dir(out, tiny_engine.model, 4096)
    fin = tiny_engine.submit("def f(x):", SamplingParams(max_tokens=12), SpecParams("eagle:trained", k=3)).result()
    assert len(fin.token_ids) >= 1 and fin.stats.drafted > 0


def test_an_mxfp4_head_computes_with_its_dequantized_values(tiny_engine):
    """The head's MXFP4 form (`follow_weights("mxfp4")`: its linears through the MXFP4 kernels) against its
    reference, the dense head holding the dequantized values: the same draft logits over a request's positions
    (the kernels differ from a float GEMM in summation order only), so the same drafts; speculation with it gives
    plain greedy decoding's outputs; back to the dense form, the linears are the ones loaded and the next switch
    reuses the MXFP4 modules."""
    quantized = random_eagle(tiny_engine, graphs=False)
    quantized.follow_weights("mxfp4")
    assert quantized.weights == "mxfp4"
    assert all(isinstance(quantized.head.get_submodule(name), Fp4Linear) for name in LINEARS)
    reference = random_eagle(tiny_engine, graphs=False)
    with torch.no_grad():
        for name in LINEARS:
            reference.head.get_submodule(name).weight.copy_(
                quantized.head.get_submodule(name).dequantized(torch.float32)
            )
    torch.manual_seed(1)
    n, d = 24, tiny_engine.model.cfg.hidden_size
    tokens = torch.randint(0, tiny_engine.model.cfg.vocab_size, (n,))
    u, positions = torch.randn(n, d), torch.arange(n)
    outputs = []
    for drafter in (quantized, reference):
        drafter.pool.add(0, [])
        kv = drafter.pool.prepare([0], [n], drafter.scale)
        with torch.inference_mode():
            outputs.append(drafter.head(drafter.embed(tokens), u, positions, kv)[0])
        drafter.pool.free(0)
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(outputs[0].argmax(-1), outputs[1].argmax(-1))
    tiny_engine.drafters["eagle:mxfp4"] = quantized
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = tiny_engine.submit("def f(x):", greedy).result().token_ids
    spec = tiny_engine.submit("def f(x):", greedy, SpecParams("eagle:mxfp4", k=3)).result()
    assert spec.token_ids == plain and spec.stats.drafted > 0
    fp4 = {name: quantized.head.get_submodule(name) for name in LINEARS}
    quantized.follow_weights("bf16")
    assert quantized.weights == "bf16"
    fresh = random_head(tiny_engine.model)
    for name in LINEARS:
        assert torch.equal(quantized.head.get_submodule(name).weight, fresh.get_submodule(name).weight)
    quantized.follow_weights("mxfp4")
    assert all(quantized.head.get_submodule(name) is module for name, module in fp4.items())


@kernel_test
def test_the_padded_catch_up_equals_the_eager_one(tmp_path):
    """The catch-up over each request's newly verified rows (a ragged batch of 1..k + 1 rows), padded to a width
    (on CUDA replayed from a graph; on a CPU through the Triton interpreter's paged kernel), gives the eager
    catch-up's draft logits and states, step after step over the keys each one wrote (two copies of each request,
    one caught up eagerly, one padded). Batches of 1, 3 and 5 requests (padding requests in a graph's batch
    bucket), rows up to 9 (k = 8), contexts across pages; head_dim 32, the smallest the paged kernel takes. The
    head's pages start as NaN: a padded tile must read no slot this step did not write (0 x NaN is NaN)."""
    from specchat.engine.engine import Engine

    model = save_tiny_hf(tmp_path / "m", {"hidden_size": 128, "intermediate_size": 256})
    engine = Engine.load(EngineConfig(model=str(model), device=DEVICE, dtype="float32"))
    eagle = random_eagle(engine)
    for pages in (eagle.pool.store.k[0], eagle.pool.store.v[0]):  # what a page holds before it is written
        pages.data.fill_(float("nan"))
    h, vocab = 3 * engine.model.cfg.hidden_size, engine.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)

    def ints(high: int, n: int) -> list[int]:
        return torch.randint(1, high, (n,), generator=gen).tolist()

    with torch.inference_mode():
        for batch in (1, 3, 5):
            context = ints(40, batch)
            rows = [torch.randn(n, h, generator=gen).to(DEVICE) for n in context]
            tokens = [ints(vocab, n) for n in context]
            ids = {padded: [100 * (1 + padded) + i for i in range(batch)] for padded in (False, True)}
            for padded in (False, True):  # the requests' earlier positions, eagerly
                for i in ids[padded]:
                    eagle.pool.add(i, [])
                eagle.eager_catch_up(ids[padded], rows, tokens, [0] * batch)
            for _ in range(3):
                counts = ints(10, batch)
                rows = [torch.randn(m, h, generator=gen).to(DEVICE) for m in counts]
                tokens = [ints(vocab, m) for m in counts]
                firsts = [eagle.pool.lengths[i] for i in ids[False]]
                width = next(r for r in CATCH_UP_ROWS if r >= max(counts))
                eager = eagle.eager_catch_up(ids[False], rows, tokens, firsts)
                padded = eagle._graphed_catch_up(ids[True], rows, tokens, firsts, width, 1024)
                torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
            for i in ids[False] + ids[True]:
                eagle.pool.free(i)
    assert bool(eagle.catch_up.graphs) == (DEVICE == "cuda")


@subprocess_test
def test_kernels_under_interpreter():
    run_under_interpreter([__file__], "padded_catch_up")
