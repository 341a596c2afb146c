"""Drafters on their own: n-gram lookup cases, the draft model's cache bookkeeping, heads files and shapes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch

from specchat.config import SamplingParams, SpecParams
from specchat.engine.adaptive import AdaptiveK
from specchat.engine.drafters import make_drafter
from specchat.engine.drafters.draft_model import DraftModelDrafter
from specchat.engine.drafters.heads import DraftHeads, HeadsConfig, HeadsDrafter
from specchat.engine.drafters.ngram import NgramDrafter, NgramIndex
from specchat.errors import ConfigError, ModelFormatError
from specchat.registry import ModelSpec


def lookup(tokens: list[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index.lookup(tokens, k)


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 4, 9, 1, 2, 3], 3, [4, 9, 1]),  # tail [1, 2, 3] seen before: copy what followed
        ([1, 2, 3, 4, 9, 1, 2, 3], 1, [4]),
        ([5, 6, 7, 5, 6, 8, 5, 6], 2, [8, 5]),  # two earlier matches: the most recent wins
        ([1, 2, 7, 3, 9, 8, 2, 3], 2, [9, 8]),  # [2, 3] absent before, [3] present: fall back to n = 1
        ([1, 2, 3, 4], 3, []),  # nothing repeats
        ([4, 4, 4], 5, [4] * 5),  # the continuation reaches the newest token: its period (1) continues
        ([1, 2, 3, 1, 2], 4, [3, 1, 2, 3]),  # period 3
    ],
)
def test_ngram_lookup_cases(tokens, k, expected):
    assert lookup(tokens, k) == expected


def test_ngram_min_n_refuses_short_matches():
    assert lookup([1, 2, 7, 3, 9, 8, 2, 3], 2, min_n=2) == []


def test_ngram_incremental_index_equals_one_built_at_once():
    tokens = torch.randint(0, 5, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    grown = NgramIndex(1, 4)
    for end in range(1, len(tokens) + 1):
        grown.extend(tokens[:end])
    whole = NgramIndex(1, 4)
    whole.extend(tokens)
    assert grown.follows == whole.follows


def test_ngram_drafter_reads_only_the_newest_tokens_and_drafts_as_from_the_whole_list():
    """The drafter hands its index only the tokens from `window_start` on (and reads a match's continuation in
    place): step by step, matches inside the prompt, across its end and inside the output alike, its drafts and
    entries equal an index fed the whole token list."""
    from specchat.engine.sequence import Sequence

    tokens = torch.randint(0, 6, (160,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = Sequence.__new__(Sequence)
    seq.seq_id, seq.prompt_ids, seq.output_ids = 0, tokens[:60], []
    drafter, whole = NgramDrafter(1, 4), NgramIndex(1, 4)
    for end in range(60, len(tokens) + 1):
        seq.output_ids = tokens[60:end]
        whole.extend(tokens[:end])
        for k in (1, 4, 8):
            (draft,) = drafter.propose([seq], [k])
            assert draft.tokens == whole.lookup(tokens[:end], k), (end, k)
    assert drafter.indexes[0].follows == whole.follows


def test_ngram_drafter_bad_settings():
    with pytest.raises(ConfigError):
        NgramDrafter(min_n=3, max_n=2)


def test_make_drafter_names(tiny_engine):
    assert make_drafter("none", tiny_engine).name == "none"
    assert make_drafter("ngram", tiny_engine).name == "ngram"
    with pytest.raises(ConfigError, match="unknown drafter"):
        make_drafter("medusa", tiny_engine)
    with pytest.raises(ConfigError, match="no trained draft heads"):
        make_drafter("heads", tiny_engine)  # the tiny model has no registry entry with heads
    with pytest.raises(ConfigError, match=r"draft heads file: no such file /nonexistent/heads\.safetensors"):
        make_drafter("heads:/nonexistent/heads.safetensors", tiny_engine)


def test_the_default_drafter_follows_the_device(tiny_engine, monkeypatch):
    """models.toml's `cpu_drafter` is `default` on the CPU, `drafter` elsewhere and under --tp (no heads there)."""
    spec = ModelSpec("tiny", "gguf", path="tiny.gguf", drafter="ngram", cpu_drafter="none")
    assert spec.default_drafter("cpu") == "none" and spec.default_drafter("cuda") == "ngram"
    assert spec.default_drafter(None) == "ngram" and spec.default_drafter("cpu", tp=2) == "ngram"
    assert spec.default_drafter_varies() and not replace(spec, cpu_drafter="ngram").default_drafter_varies()
    assert ModelSpec("tiny", "gguf", path="tiny.gguf").default_drafter("cpu") == "none"
    with pytest.raises(ConfigError, match="unknown drafter"):
        ModelSpec("tiny", "gguf", path="tiny.gguf", cpu_drafter="medusa")
    monkeypatch.setattr(tiny_engine, "model_spec", spec)  # the tiny engine runs on the CPU
    assert make_drafter("default", tiny_engine).name == "none"
    monkeypatch.setattr(tiny_engine, "model_spec", replace(spec, cpu_drafter=None))
    assert make_drafter("default", tiny_engine).name == "ngram"


def test_load_warms_up_the_default_drafter(tiny_model_dir, monkeypatch):
    """Engine.load warms up the model's default drafter on its device beside plain decoding (on CUDA its tapped
    step graphs and drafting graphs: a chat's first answer captures none); nothing more where it names none."""
    from specchat.config import EngineConfig
    from specchat.engine import engine as engine_module

    asked = []
    monkeypatch.setattr(engine_module.Engine, "warm_up", lambda self, progress, **kw: asked.append(kw["drafters"]))
    load_parts = engine_module.load_parts
    for spec in (ModelSpec("tiny", "dir", path="x", drafter="ngram", cpu_drafter="draft-model"), None):
        monkeypatch.setattr(
            engine_module, "load_parts", lambda config, progress, s=spec: replace(load_parts(config, progress), spec=s)
        )
        engine_module.Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    assert asked == [["draft-model"], []]  # the CPU's default; a model outside models.toml drafts with none


def random_heads(model, sequential: bool = True, num_heads: int = 3, draft_vocab: int = 0) -> DraftHeads:
    """Heads whose blocks are random (the trained init leaves W_down at zero), so drafts vary."""
    cfg = HeadsConfig.for_model(model, num_heads, sequential=sequential)
    vocab = torch.randperm(model.cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:draft_vocab]
    heads = DraftHeads(cfg, vocab if draft_vocab else None)
    torch.manual_seed(1)
    for block in heads.blocks:
        torch.nn.init.normal_(block.down.weight, std=0.5)
    return heads


def test_heads_file_round_trip(tiny_engine, tmp_path):
    heads = random_heads(tiny_engine.model, draft_vocab=1000)
    path = tmp_path / "h.safetensors"
    heads.save(path, {"model": "tiny"})
    loaded, target = DraftHeads.load(path)
    assert target == {"model": "tiny"} and loaded.cfg == heads.cfg
    assert torch.equal(loaded.draft_vocab, heads.draft_vocab)
    for a, b in zip(loaded.parameters(), heads.parameters(), strict=True):
        torch.testing.assert_close(a, b.to(torch.bfloat16).float())  # stored in bf16


@pytest.mark.slow
def test_heads_file_for_another_model_is_refused(tiny_engine, default_engine, tmp_path):
    path = tmp_path / "h.safetensors"
    random_heads(tiny_engine.model).save(path, {})
    with pytest.raises(ConfigError, match="trained for hidden"):
        HeadsDrafter.from_file(path, default_engine.model)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelFormatError):
        DraftHeads.load(tmp_path / "junk.safetensors")


@dataclass
class FakeSeq:
    """What a drafter reads of a request."""

    seq_id: int
    all_ids: list[int]
    sampling: SamplingParams
    hidden: dict = field(default_factory=dict)
    generator: torch.Generator | None = None
    adaptive: AdaptiveK | None = None

    @property
    def newest(self) -> int:
        return self.all_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    def tokens_from(self, start: int, stop: int | None = None) -> list[int]:
        return self.all_ids[start:stop]


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "parallel"])
def test_heads_propose_from_tapped_hidden_state(tiny_engine, sequential):
    heads = random_heads(tiny_engine.model, sequential=sequential, draft_vocab=500)
    drafter = HeadsDrafter(heads, tiny_engine.model, cpu_blocks=False)  # the float modules (test_heads_cpu: packed)
    hidden = {heads.cfg.tap: torch.randn(1, tiny_engine.model.cfg.hidden_size)}
    greedy = FakeSeq(1, [5, 6, 7], SamplingParams(), hidden)
    sampled = FakeSeq(2, [5, 6, 7], SamplingParams(temperature=1.0), hidden, torch.Generator().manual_seed(0))
    untapped = FakeSeq(3, [5, 6, 7], SamplingParams())  # just switched to heads: no hidden state yet
    drafts = drafter.propose([greedy, sampled, untapped], [5, 2, 2])

    assert len(drafts[0].tokens) == 3 and drafts[0].probs is None  # capped at the number of heads
    assert set(drafts[0].tokens) <= set(heads.draft_vocab.tolist())
    q = drafts[1].probs
    assert len(drafts[1].tokens) == 2 and q.shape == (2, tiny_engine.model.cfg.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(2))
    outside = torch.ones(q.shape[-1], dtype=torch.bool)
    outside[heads.draft_vocab] = False
    assert float(q[:, outside].sum()) == 0.0  # heads only ever draft from their draft vocabulary
    assert drafts[2].tokens == []


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "parallel"])
def test_heads_greedy_chain_equals_step_by_step_drafting(tiny_engine, sequential):
    """The device-only chain (what a CUDA graph captures) drafts what the position-by-position reference does."""
    heads = random_heads(tiny_engine.model, sequential=sequential, num_heads=4, draft_vocab=500)
    drafter = HeadsDrafter(heads, tiny_engine.model, cpu_blocks=False)  # the float modules (test_heads_cpu: packed)
    torch.manual_seed(2)
    hidden = torch.randn(3, tiny_engine.model.cfg.hidden_size)
    prev = torch.tensor([5, 17, 99])
    group = [FakeSeq(i, [1, int(p)], SamplingParams()) for i, p in enumerate(prev)]
    for depth in (1, 4):
        chain = drafter.greedy_chain(depth, hidden, prev)
        steps = drafter.draft_steps(group, hidden, prev, depth)
        assert chain.shape == (3, depth)
        assert chain.T.tolist() == [tokens for tokens, _ in steps]
        assert all(q is None for _, probs in steps for q in probs)
    # propose() takes the chain for an all-greedy group: the same drafts
    seqs = [FakeSeq(i, [1, int(p)], SamplingParams(), {heads.cfg.tap: hidden[i : i + 1]}) for i, p in enumerate(prev)]
    drafts = drafter.propose(seqs, [4, 2, 3])
    drafter.warm_up(8)  # on the CPU the chain runs directly: nothing to capture
    assert not drafter.chain.graphs
    full = drafter.greedy_chain(4, hidden, prev).tolist()
    assert [d.tokens for d in drafts] == [full[0][:4], full[1][:2], full[2][:3]]


def test_draft_model_cache_follows_the_request(tiny_engine):
    drafter = make_drafter(f"draft-model:{tiny_engine.model_spec.path}", tiny_engine)
    assert isinstance(drafter, DraftModelDrafter) and drafter.model is tiny_engine.model  # weights shared
    tiny_engine.drafters["draft-model:self"] = drafter
    handle = tiny_engine.submit(
        "one two", SamplingParams(max_tokens=10, ignore_eos=True), SpecParams("draft-model:self", k=3)
    )
    for _ in handle.events():
        state = drafter.states.get(handle.request_id)
        if state is not None:
            # the draft cache holds exactly the tokens it says it holds
            assert drafter.pool.length(handle.request_id) == len(state.cached)
    assert handle.request_id not in drafter.states  # released with the request
    assert drafter.pool.used_pages == 0


def test_ngram_then_heads_caps_the_heads_drafts_not_the_ngrams(tiny_engine):
    """heads_k: where the n-grams match they draft up to the step's k; where they miss the heads draft at most
    heads_k."""
    from specchat.engine.drafters.hybrid import NgramThenHeads

    heads = HeadsDrafter(random_heads(tiny_engine.model, num_heads=5), tiny_engine.model, cpu_blocks=False)
    hidden = {heads.cfg.tap: torch.randn(1, tiny_engine.model.cfg.hidden_size)}
    repeats = FakeSeq(1, [5, 6, 7, 8, 9, 5, 6], SamplingParams(), hidden)  # "5 6" again: 7 8 9 5 6 followed it
    fresh = FakeSeq(2, [11, 12, 13], SamplingParams(), dict(hidden))
    capped, uncapped = NgramThenHeads(heads, heads_k=2), NgramThenHeads(heads)
    drafts = capped.propose([repeats, fresh], [5, 5])
    assert drafts[0].tokens == [7, 8, 9, 5, 6] and len(drafts[1].tokens) == 2
    assert len(uncapped.propose([fresh], [5])[0].tokens) == 5


def test_ngram_then_heads_drafts_each_source_up_to_its_adaptive_k(tiny_engine):
    """Under adaptive k each source drafts at most its own best k: here the n-grams 3, the heads none."""
    from specchat.engine.drafters.hybrid import NgramThenHeads

    heads = HeadsDrafter(random_heads(tiny_engine.model, num_heads=5), tiny_engine.model, cpu_blocks=False)
    hidden = {heads.cfg.tap: torch.randn(1, tiny_engine.model.cfg.hidden_size)}
    adaptive = AdaptiveK.for_sources(5, ("ngram",))
    adaptive.source_k = {"": 0, "ngram": 3}
    repeats = FakeSeq(1, [5, 6, 7, 8, 9, 5, 6], SamplingParams(), hidden, adaptive=adaptive)
    fresh = FakeSeq(2, [11, 12, 13], SamplingParams(), dict(hidden), adaptive=adaptive)
    drafts = NgramThenHeads(heads).propose([repeats, fresh], [5, 5])
    assert drafts[0].tokens == [7, 8, 9] and drafts[0].source == "ngram"
    assert drafts[1].tokens == []
