"""`specchat train-heads` end to end on the tiny random model: stages, resumption, a usable heads file."""

from __future__ import annotations

import json

import pytest
import torch

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.drafters.heads import DraftHeads, HeadsDrafter
from specchat.engine.train_heads import (
    CATEGORIES,
    SYNTH_PREFIX,
    TrainConfig,
    generate_answers,
    greedy_run_tokens_per_step,
    held_out_ids,
    load_prompt_set,
    lr_factor,
    train_heads,
    user_turn_opening,
    write_whole,
)
from specchat.errors import ConfigError


def test_prompt_set_has_every_category_and_both_splits():
    prompts = load_prompt_set()
    for category in CATEGORIES:
        mine = [p for p in prompts if p["category"] == category]
        assert {p["split"] for p in mine} == {"train", "eval"}
        assert all(p["messages"][-1]["role"] == "user" for p in mine)
    assert len({p["id"] for p in prompts}) == len(prompts)
    # code-edit snippets held out for benchmarks never appear in a training prompt
    edits = [p for p in prompts if p["category"] == "code_edit"]
    held_out_code = {p["messages"][-1]["content"].split("```", 1)[1] for p in edits if p["split"] == "eval"}
    trained_code = {p["messages"][-1]["content"].split("```", 1)[1] for p in edits if p["split"] == "train"}
    assert not held_out_code & trained_code


def test_a_greedy_run_steps_over_the_tokens_its_drafts_got_right():
    """Each step at position i emits min(run_i, k) + 1 tokens and the next starts after them."""
    assert greedy_run_tokens_per_step([torch.tensor([0, 0, 0])], 4) == 1.0
    answer = torch.tensor([2, 0, 0, 5, 0, 0])  # steps at 0 (3 tokens) and 3 (min(5, 4) + 1 = 5, past the end)
    assert greedy_run_tokens_per_step([answer], 4) == 6 / 2
    assert greedy_run_tokens_per_step([answer], 1) == 6 / 4  # steps at 0, 2, 3, 5
    assert greedy_run_tokens_per_step([answer, torch.tensor([0])], 4) == 7 / 3
    # the per-position average of the same runs (the chain estimate's view) is higher: 1 + 7/6 at k = 4
    assert greedy_run_tokens_per_step([], 4) == 1.0


def test_lr_schedule_warms_up_then_decays():
    assert lr_factor(0, 1000) < lr_factor(49, 1000) == pytest.approx(1.0)
    assert lr_factor(999, 1000) == pytest.approx(0.1, abs=1e-3)


def test_train_heads_writes_usable_heads_and_resumes(tiny_engine, tmp_path):
    cfg = TrainConfig(num_heads=2, max_prompts=4, max_tokens=12, samples_per_prompt=1, epochs=2, batch_size=16)
    stages = []
    progress = lambda stage, done, total: stages.append(stage.split()[0])
    out = tmp_path / "heads.safetensors"
    logged: list[str] = []
    report = train_heads(tiny_engine, cfg, out, progress, logged.append)
    assert {"answers", "features", "train"} <= set(stages)
    # the positions line and the report count the same held-out positions (they said 16 and 15)
    [positions] = [line for line in logged if " held out, " in line]
    assert f"{report['eval_positions']} of them scored" in positions
    assert len(report["top1"]) == 2 and all(0.0 <= a <= 1.0 for a in report["top1"])
    assert report["tokens_per_step"][0] >= 1.0
    assert all(1.0 <= run <= k + 1 for k, run in enumerate(report["run_tokens_per_step"], 1))

    heads, target = DraftHeads.load(out)
    assert heads.cfg.num_heads == 2 and heads.cfg.tap == tiny_engine.model.cfg.num_layers - 1
    assert target["train"]["num_heads"] == 2
    answers = (tmp_path / "heads.safetensors.work" / "answers.jsonl").read_text().splitlines()
    assert len(answers) == 4 * 2  # one greedy and one sampled answer per prompt
    assert sum(json.loads(a)["greedy"] for a in answers) == 4

    # A second run with the same data settings reuses answers and features, and resumes the finished training.
    stages.clear()
    again = train_heads(tiny_engine, cfg, out, progress, lambda line: None)
    assert "answers" not in stages and "features" not in stages and "train" not in stages
    assert again["top1"] == pytest.approx(report["top1"])

    # Other training settings (here: head count) share the work directory's data but not its checkpoint.
    more = TrainConfig(num_heads=3, max_prompts=4, max_tokens=12, samples_per_prompt=1, epochs=1, batch_size=16)
    train_heads(
        tiny_engine,
        more,
        tmp_path / "three.safetensors",
        progress,
        lambda line: None,
        out.with_name(out.name + ".work"),
    )
    assert DraftHeads.load(tmp_path / "three.safetensors")[0].cfg.num_heads == 3

    drafter = HeadsDrafter.from_file(out, tiny_engine.model, min_confidence=0.0)  # (a tiny model's heads: unsure)
    tiny_engine.drafters["heads:trained"] = drafter
    fin = tiny_engine.submit("def f(x):", SamplingParams(max_tokens=8), SpecParams("heads:trained", k=2)).result()
    assert len(fin.token_ids) == 8 and fin.stats.drafted > 0


def test_changed_data_settings_refuse_the_old_work_dir(tiny_engine, tmp_path):
    cfg = TrainConfig(num_heads=1, max_prompts=2, max_tokens=4, samples_per_prompt=0, epochs=1, batch_size=8)
    train_heads(tiny_engine, cfg, tmp_path / "h.safetensors", lambda *a: None, lambda line: None)
    changed = TrainConfig(num_heads=1, max_prompts=2, max_tokens=5, samples_per_prompt=0, epochs=1, batch_size=8)
    with pytest.raises(ConfigError, match="other settings"):
        train_heads(tiny_engine, changed, tmp_path / "h.safetensors", lambda *a: None, lambda line: None)


def test_work_files_cut_short_are_made_again(tiny_engine, tmp_path):
    """A run killed while writing a work file (Ctrl-C during a checkpoint's save) left it torn, and every later run
    ended in a traceback (JSONDecodeError, SafetensorError, torch's "failed finding central directory")."""
    cfg = TrainConfig(num_heads=1, max_prompts=2, max_tokens=8, samples_per_prompt=1, epochs=1, batch_size=8)
    out, lines = tmp_path / "h.safetensors", []
    train_heads(tiny_engine, cfg, out, lambda *a: None, lines.append)
    work = out.with_name(out.name + ".work")
    (checkpoint,) = work.glob("checkpoint-*.pt")
    torn = {"answers.jsonl": b'{"id": "x", "gre', "features.safetensors": b"\x10", checkpoint.name: b"PK\x03\x04"}
    for name, data in torn.items():
        (work / name).write_bytes(data)
    stages = []
    lines.clear()
    train_heads(tiny_engine, cfg, out, lambda stage, *a: stages.append(stage.split()[0]), lines.append)
    assert {"answers", "features", "train"} <= set(stages)
    assert sorted(line.split("/")[-1].split()[0] for line in lines if "damaged" in line) == sorted(torn)
    assert DraftHeads.load(out)[0].cfg.num_heads == 1
    assert sorted(p.name for p in work.iterdir()) == sorted([*torn, "config.json"])  # whole again, no partials
    assert len([json.loads(line) for line in (work / "answers.jsonl").read_text().splitlines()]) == 2 * 2


def test_answers_of_a_stopped_run_are_kept_and_only_the_rest_answered(tiny_model_dir, tmp_path):
    """Ctrl-C in the answers stage (hours for the whole prompt set on a CPU) lost every answer made so far."""
    from specchat.engine.engine import Engine

    cfg = TrainConfig(num_heads=1, max_prompts=3, max_tokens=6, samples_per_prompt=1, epochs=1, batch_size=8)
    path, partial = tmp_path / "answers.jsonl", tmp_path / "answers.partial.jsonl"
    load = lambda: Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))

    def stop_after_two(stage, done, total):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_answers(load(), cfg, path, stop_after_two, lambda line: None)
    kept = partial.read_text().splitlines()
    assert len(kept) == 2 and not path.exists()
    partial.write_text(partial.read_text() + '{"id": "x", "jo')  # and a line torn by a kill
    counts, lines = [], []
    records = generate_answers(load(), cfg, path, lambda stage, done, total: counts.append((done, total)), lines.append)
    assert counts == [(3, 6), (4, 6), (5, 6), (6, 6)]  # only the 4 answers missing were made
    assert lines == ["2 of 6 answers from a run that stopped; answering the rest"]
    assert len(records) == 6 and len({r["job"] for r in records}) == 6 and sum(r["greedy"] for r in records) == 3
    assert all(json.loads(line) in records for line in kept)
    assert not partial.exists() and len(path.read_text().splitlines()) == 6


def test_the_model_writes_prompts_of_its_own_answered_greedily(tiny_model_dir, tmp_path):
    """--synth-prompts (Magpie): messages sampled from the template's opening of a user turn become prompts.

    The tiny random model almost never samples one of its two stop tokens, so here every 16th token ends a turn:
    messages then end in a few tokens, as a real instruct model's do."""
    from specchat.engine.engine import Engine

    engine = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    tokenizer = engine.tokenizer
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hello there"}]
    opening = user_turn_opening(tokenizer, "S")
    assert tokenizer.encode_chat(messages)[: len(opening)] == opening
    assert tokenizer.decode(opening, skip_special_tokens=False).endswith("user\n")
    tokenizer.stop_token_ids = frozenset(range(0, tokenizer.vocab_size, 16))

    cfg = TrainConfig(num_heads=1, max_prompts=2, max_tokens=5, samples_per_prompt=1, synth_prompts=5)
    path, stages = tmp_path / "answers.jsonl", []
    records = generate_answers(engine, cfg, path, lambda stage, done, total: stages.append((stage, total)), print)
    assert ("prompts", 5) in stages
    synth = json.loads("[" + ",".join((tmp_path / "prompts-synth.jsonl").read_text().splitlines()) + "]")
    assert [p["id"] for p in synth] == [f"{SYNTH_PREFIX}{n:05d}" for n in range(5)]
    texts = [p["messages"][-1]["content"] for p in synth]
    assert len(set(texts)) == 5 and all(len(t) >= 12 and t == t.strip() for t in texts)
    assert all(p["messages"][-1]["role"] == "user" for p in synth)
    # the shipped prompts' greedy and sampled answers, and one greedy answer to each synthesized prompt
    jobs = {r["job"] for r in records}
    assert len(records) == 2 * 2 + 5 and {f"{p['id']}/greedy" for p in synth} <= jobs
    assert all(r["greedy"] for r in records if r["id"].startswith(SYNTH_PREFIX))
    # the held-out report stays on shipped prompts only, so it reads the same with or without them
    assert not any(i.startswith(SYNTH_PREFIX) for i in held_out_ids(records, 0.5, 0))
    # the data key names the count only where there is one: work directories made before the option still match
    assert cfg.data_key()["synth_prompts"] == 5 and "synth_prompts" not in TrainConfig().data_key()
    with pytest.raises(ConfigError, match="--synth-prompts must be >= 0"):
        TrainConfig(synth_prompts=-1)

    # Answered again (the answers file gone), the run reuses the prompts it wrote: the answers' keys name them.
    path.unlink()
    stages.clear()
    again = generate_answers(engine, cfg, path, lambda stage, done, total: stages.append((stage, total)), print)
    assert not any(stage == "prompts" for stage, _ in stages)
    assert {r["job"] for r in again} == jobs


def test_a_template_that_rewrites_the_user_message_refuses_synth_prompts(tiny_engine, monkeypatch):
    monkeypatch.setattr(tiny_engine.tokenizer, "render_chat", lambda messages, **kw: "<|im_start|>user\nHELLO")
    with pytest.raises(ConfigError, match="--synth-prompts needs a chat template"):
        user_turn_opening(tiny_engine.tokenizer, None)


def test_a_work_file_write_stopped_midway_keeps_the_last_whole_one(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"step": 200}, path)

    def stopped(part):
        part.write_bytes(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_whole(path, stopped)
    assert torch.load(path, weights_only=True) == {"step": 200}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_draft_labels_map_tokens_into_the_draft_vocab(tiny_engine, tmp_path):
    from specchat.engine.train_heads import IGNORE, HeadTrainer

    trainer = HeadTrainer(tiny_engine, TrainConfig(), tmp_path, lambda *a: None, lambda line: None)
    vocab = torch.tensor([7, 3, 11])
    targets = torch.tensor([[3, 11], [5, IGNORE]])
    assert trainer._draft_labels(targets, vocab).tolist() == [[1, 2], [IGNORE, IGNORE]]


def test_greedy_labels_are_the_targets_argmax_after_each_prefix(tiny_engine, tmp_path):
    """features()' greedy windows: row t, column i holds argmax p(. | x_1 .. x_{t+i}) of a lone teacher-forced
    forward, IGNORE exactly where the answer has no token x_{t+1+i}; training takes columns 1.. as labels."""
    from specchat.engine.runner import StepBatch
    from specchat.engine.train_heads import IGNORE, HeadTrainer

    cfg = TrainConfig(num_heads=2, max_prompts=3, max_tokens=10, samples_per_prompt=1, epochs=1, batch_size=16)
    trainer = HeadTrainer(tiny_engine, cfg, tmp_path, lambda *a: None, lambda line: None)
    records = trainer.answers()
    feats = trainer.features(records)
    greedy, windows = feats["greedy"], feats["windows"]
    assert greedy.shape == windows.shape
    assert torch.equal(greedy >= 0, windows >= 0)
    held_out = trainer._held_out_ids(records)
    row = 0
    for r in records:
        if not (r["greedy"] or r["id"] not in held_out):
            continue
        seq = r["prompt_ids"] + r["output_ids"]
        first, last = len(r["prompt_ids"]) - 1, len(seq) - 1
        tiny_engine.pool.add(-1, [])
        logits = tiny_engine.runner.forward(StepBatch([-1], [seq], [0], [len(seq)])).logits[0]
        tiny_engine.pool.free(-1)
        expected = logits.argmax(-1)
        for t in range(first, last):
            for i in range(greedy.shape[1]):
                want = int(expected[t + i]) if t + i <= last - 1 else IGNORE
                assert int(greedy[row, i]) == want, (r["id"], t, i)
            row += 1
    assert row == len(greedy)
    with pytest.raises(ConfigError, match="labels"):
        TrainConfig(labels="bogus")


def test_soft_labels_are_the_targets_distribution_and_train(tiny_engine, tmp_path):
    """--labels soft: the teacher of head i at row t is the draft-vocabulary logits of h_{t+i} (row t + i of the
    same answer), whose argmax is the greedy label; the loss skips rows past the answer; training runs."""
    from specchat.engine.drafters.heads import DraftVocabOutput
    from specchat.engine.train_heads import HeadTrainer, per_head_soft_loss

    cfg = TrainConfig(num_heads=2, max_prompts=3, max_tokens=10, samples_per_prompt=1, epochs=1, batch_size=16)
    trainer = HeadTrainer(tiny_engine, cfg, tmp_path, lambda *a: None, lambda line: None)
    feats = trainer.features(trainer.answers())
    vocab = torch.arange(tiny_engine.model.cfg.vocab_size)
    output = DraftVocabOutput(tiny_engine.model, vocab)
    n = len(feats["hidden"])
    for i in (1, 2):
        valid = feats["windows"][:, i] >= 0
        rows = valid.nonzero().squeeze(-1)
        with torch.no_grad():
            teacher = output(feats["hidden"][rows + i])
        assert torch.equal(teacher.argmax(-1), feats["greedy"][rows, i])
        assert int(rows.max()) + i < n

    logits = torch.randn(2, 3, 5)
    peaked = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3], [0, 4, 4]]), 5).float() * 1e4
    valid = torch.tensor([[True, True], [True, False], [False, False]])
    soft = per_head_soft_loss(logits, peaked, valid)
    hard = torch.stack(
        [
            torch.nn.functional.cross_entropy(logits[0, :2], torch.tensor([1, 2])),
            torch.nn.functional.cross_entropy(logits[1, :1], torch.tensor([0])),
        ]
    )
    assert torch.allclose(soft, hard)

    soft_cfg = TrainConfig(
        num_heads=2, max_prompts=3, max_tokens=10, samples_per_prompt=1, epochs=1, batch_size=16, labels="soft"
    )
    report = train_heads(
        tiny_engine, soft_cfg, tmp_path / "soft.safetensors", lambda *a: None, lambda line: None, tmp_path
    )
    assert len(report["top1"]) == 2
    assert DraftHeads.load(tmp_path / "soft.safetensors")[1]["train"]["labels"] == "soft"  # the recipe travels
    # unset labels: soft where the last layer is tapped, greedy elsewhere
    assert HeadTrainer(tiny_engine, TrainConfig(), tmp_path / "a", lambda *a: None, print).cfg.labels == "soft"
    assert HeadTrainer(tiny_engine, TrainConfig(tap=0), tmp_path / "b", lambda *a: None, print).cfg.labels == "greedy"
    with pytest.raises(ConfigError, match="last"):
        HeadTrainer(tiny_engine, TrainConfig(labels="soft", tap=0), tmp_path / "x", lambda *a: None, print)
