"""Self-distillation of an EAGLE-3 head (engine/drafters/eagle.py) with training-time test.

Stages, each saved in the work directory so that an interrupted run resumes:

1. answers:  the target answers the `train` prompts (train_heads.generate_answers: greedy + sampled).
2. features: one teacher-forced target forward per answer keeps, for every position, the three tapped hidden
             states (low, mid, high), in bf16.
3. train:    the head runs over whole sequences, `ttt_steps` times (EAGLE-3's "training-time test", Li et al.
             2025). Step 1 reads the target's fused features at every position i and the true next token, and
             predicts x_{i+2}. Step j > 1 reads, at position p, the head's own output of step j-1 at p - 1 and the
             true token x_{p+1}: exactly what drafting feeds the (j)-th draft of a chain anchored at i = p - j + 1.
             Its attention sees what drafting would: the target positions <= i (step 1's keys) and the chain's
             own draft positions i + 1 .. p (step s's key at position i + s - 1, a diagonal of each earlier
             step), which `ChainAttention` builds. Loss: cross-entropy over the draft vocabulary at answer
             positions, step j weighted `step_decay`^(j-1).
4. report:   on held-out greedy answers, per-step top-1 accuracy and the chain estimate of tokens per step at
             k = 1..ttt_steps (draft j counts only where drafts 1..j are all right: then the head was fed what
             greedy drafting would have fed it, so the estimate is what greedy decoding gets).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from specchat.engine.drafters.eagle import EagleConfig, EagleHead
from specchat.engine.runner import StepBatch
from specchat.engine.train_heads import (
    IGNORE,
    Progress,
    check_at_least,
    check_training_set,
    draft_vocab_by_frequency,
    features_kv_full,
    generate_answers,
    greedy_run_tokens_per_step,
    held_out_ids,
    lr_factor,
    read_or_remake,
    with_synth,
)
from specchat.errors import ConfigError, KVCacheFullError
from specchat.writes import write_folder_whole, write_whole

FEATURE_BATCH_TOKENS = 4096  # tokens per teacher-forced target forward


@dataclass(slots=True)
class EagleTrainConfig:
    """What to train and how; (data) fields shape the saved answers and features."""

    draft_vocab: int = 8192
    intermediate_size: int = 0  # 0 = the target's
    max_tokens: int = 384  # (data) per answer
    samples_per_prompt: int = 2  # (data)
    temperature: float = 0.8  # (data)
    eval_fraction: float = 0.1  # (data)
    max_prompts: int = 0  # (data) 0 = all train prompts
    synth_prompts: int = 0  # (data) user prompts the target writes itself (train_heads.synthesize_prompts)
    ttt_steps: int = 5  # drafts per chain trained (k up to this is what the head is good for)
    epochs: int = 6
    batch_tokens: int = 8192  # sequences per optimizer step, by their padded length
    lr: float = 1e-3
    step_decay: float = 0.8
    checkpoint_every: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.ttt_steps <= 16:
            raise ConfigError(f"--ttt-steps must be in [1, 16], got {self.ttt_steps}")
        least = {"draft_vocab": 0, "samples_per_prompt": 0, "synth_prompts": 0, "epochs": 1, "batch_tokens": 1}
        check_at_least(self, least)
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"eval fraction must be in (0, 1), got {self.eval_fraction}")

    def data_key(self) -> dict:
        keys = ("max_tokens", "samples_per_prompt", "temperature", "eval_fraction", "max_prompts", "seed")
        return with_synth({"arch": "eagle", **{k: getattr(self, k) for k in keys}}, self.synth_prompts)

    def train_key(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


class ChainAttention:
    """The attention of one training-time-test step over a padded batch [B, L] (a model.KVAttention).

    Step 1 is causal over the sequence. Step j's query at position p (chain anchored at i = p - j + 1) sees the
    step-1 keys at positions <= i and, for s = 2 .. j, step s's key at position i + s - 1 = p - (j - s).
    """

    def __init__(self, batch: int, length: int, scale: float) -> None:
        self.batch, self.length, self.scale = batch, length, scale
        self.keys: list[torch.Tensor] = []  # per step: [B, L, KVH, D]
        self.values: list[torch.Tensor] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n = self.batch, self.length
        q = q.view(b, n, *q.shape[1:])  # [B, L, H, D]
        self.keys.append(k.view(b, n, *k.shape[1:]))
        self.values.append(v.view(b, n, *v.shape[1:]))
        j = len(self.keys)
        group = q.shape[2] // k.shape[1]
        k1 = self.keys[0].repeat_interleave(group, dim=2)  # [B, L, H, D]
        v1 = self.values[0].repeat_interleave(group, dim=2)
        scores = torch.einsum("bphd,buhd->bhpu", q.float(), k1.float()) * self.scale  # [B, H, L, L]
        pos = torch.arange(n, device=q.device)
        visible = pos[None, :] <= pos[:, None] - (j - 1)  # u <= p - (j - 1)
        scores = scores.masked_fill(~visible, float("-inf"))
        diag_scores, diag_values = [], []
        for s in range(2, j + 1):
            shift = j - s  # step s's key for this chain sits `shift` positions before p
            ks = _shift(self.keys[s - 1], shift).repeat_interleave(group, dim=2)
            vs = _shift(self.values[s - 1], shift).repeat_interleave(group, dim=2)
            diag_scores.append(torch.einsum("bphd,bphd->bhp", q.float(), ks.float()) * self.scale)
            diag_values.append(vs)
        if diag_scores:
            scores = torch.cat([scores, torch.stack(diag_scores, dim=-1)], dim=-1)  # [B, H, L, L + j - 1]
        # A row with no visible key (p < j - 1: no anchor yet) is padding; keep its softmax finite.
        scores = scores.masked_fill(torch.isinf(scores).all(-1, keepdim=True), 0.0)
        weights = scores.softmax(-1)
        out = torch.einsum("bhpu,buhd->bphd", weights[..., :n], v1.float())
        for s, vs in enumerate(diag_values):
            out = out + weights[..., n + s].transpose(1, 2)[..., None] * vs.float()
        return out.to(q.dtype).reshape(b * n, *q.shape[2:])


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x [B, L, ...] moved `by` positions later along L (zeros enter at the front)."""
    if by == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :by]), x[:, :-by]], dim=1)


class EagleTrainer:
    """Runs the four stages for `engine`'s model; `work` holds everything needed to resume."""

    def __init__(self, engine, cfg: EagleTrainConfig, work: Path, progress: Progress, log: Callable[[str], None]):
        self.engine, self.cfg, self.work, self.progress, self.log = engine, cfg, work, progress, log
        self.model = engine.model
        self.device = engine.device
        work.mkdir(parents=True, exist_ok=True)
        key_file = work / "config.json"
        if key_file.is_file() and json.loads(key_file.read_text()) != cfg.data_key():
            raise ConfigError(f"{work} holds data made with other settings; delete it or choose another --work")
        key_file.write_text(json.dumps(cfg.data_key()))
        self.head_cfg = EagleConfig.for_target(self.model.cfg, 1, cfg.intermediate_size or None)

    # --- 2. features ------------------------------------------------------------------------------------
    def features(self, records: list[dict]) -> list[dict]:
        """Per kept answer: {"ids": [T], "prompt": P, "hidden": [T, 3h] bf16, "eval": bool}."""
        path = self.work / "eagle_features.pt"
        feats = read_or_remake(path, lambda p: torch.load(p, weights_only=True), self.log)
        if feats is not None:
            return feats
        held_out = held_out_ids(records, self.cfg.eval_fraction, self.cfg.seed)
        # Held-out prompts keep only their greedy answer: the report measures agreement with greedy decoding.
        kept = [r for r in records if r["greedy"] or r["id"] not in held_out]
        taps = self.head_cfg.taps
        runner, pool = self.engine.runner, self.engine.pool
        out_rows: list[dict] = []
        batch: list[dict] = []
        for n, record in enumerate(kept):
            batch.append(record)
            tokens = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in batch)
            if tokens < FEATURE_BATCH_TOKENS and n + 1 < len(kept):
                continue
            seqs = [r["prompt_ids"] + r["output_ids"] for r in batch]
            ids = [-(i + 1) for i in range(len(batch))]  # ids no live request uses
            for seq_id in ids:
                pool.add(seq_id, [])  # no prefix reuse: every position is fed and tapped
            try:
                out = runner.forward(StepBatch(ids, seqs, [0] * len(seqs), [0] * len(seqs)), taps=sorted(set(taps)))
            except KVCacheFullError:
                raise features_kv_full(self.engine, seqs) from None
            for seq_id, r, seq, hidden in zip(ids, batch, seqs, out.hidden, strict=True):
                pool.free(seq_id)
                fused = torch.cat([hidden[t] for t in taps], dim=-1)  # [T, 3h]
                out_rows.append(
                    {
                        "ids": torch.tensor(seq),
                        "prompt": len(r["prompt_ids"]),
                        "hidden": fused.to(torch.bfloat16).cpu(),
                        "eval": r["id"] in held_out,
                    }
                )
            batch = []
            self.progress("features", n + 1, len(kept))
        write_whole(path, lambda p: torch.save(out_rows, p))
        return out_rows

    # --- 3. train ---------------------------------------------------------------------------------------
    def train(self, records: list[dict], feats: list[dict]) -> EagleHead:
        cfg = self.cfg
        vocab = draft_vocab_by_frequency(records, cfg.draft_vocab, self.engine)
        self.head_cfg = EagleConfig.for_target(self.model.cfg, len(vocab), cfg.intermediate_size or None)
        torch.manual_seed(cfg.seed)
        head = EagleHead(self.head_cfg).to(self.device)
        head.draft_vocab.copy_(vocab.to(self.device))
        with torch.no_grad():  # start from the target's own output rows for the draft vocabulary
            head.lm_head.weight.copy_(self.model.lm_head.weight[vocab.to(self.device)].float())
        train = [f for f in feats if not f["eval"]]
        check_training_set(len(train), len(feats), "answers")
        batches = self._batches(train)
        total = cfg.epochs * len(batches)
        opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
        step = self._resume(head, opt)
        index = self._vocab_index(head.draft_vocab)
        head.train()
        while step < total:
            epoch, i = divmod(step, len(batches))
            order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(cfg.seed + epoch))
            for group in opt.param_groups:
                group["lr"] = cfg.lr * lr_factor(step, total)
            losses, _, _ = self.chain(head, [train[r] for r in batches[int(order[i])]], index)
            weights = torch.tensor([cfg.step_decay**j for j in range(len(losses))], device=self.device)
            loss = torch.stack(losses) @ weights / weights.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            self.progress(f"train loss {loss.item():.3f}", step, total)
            if step % cfg.checkpoint_every == 0 or step == total:
                state = {"head": head.state_dict(), "opt": opt.state_dict(), "step": step}
                write_whole(self.checkpoint, partial(torch.save, state))
        return head.eval()

    def _batches(self, feats: list[dict]) -> list[list[int]]:
        """Indices of sequences of similar length, about batch_tokens padded tokens per batch."""
        order = sorted(range(len(feats)), key=lambda i: len(feats[i]["ids"]))
        batches, current = [], []
        for i in order:
            if current and (len(current) + 1) * len(feats[i]["ids"]) > self.cfg.batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        return [*batches, current] if current else batches

    @property
    def checkpoint(self) -> Path:
        return self.work / f"eagle-checkpoint-{self.cfg.train_key()}.pt"

    def _resume(self, head: EagleHead, opt: torch.optim.Optimizer) -> int:
        load = lambda p: torch.load(p, map_location=self.device, weights_only=True)
        state = read_or_remake(self.checkpoint, load, self.log)
        if state is None:
            return 0
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        self.log(f"resuming from {self.checkpoint} at step {state['step']}")
        return state["step"]

    def _vocab_index(self, draft_vocab: torch.Tensor) -> torch.Tensor:
        """Target token id -> index in the draft vocabulary (IGNORE for tokens outside it)."""
        index = torch.full((self.model.cfg.vocab_size,), IGNORE, dtype=torch.long, device=self.device)
        index[draft_vocab] = torch.arange(len(draft_vocab), device=self.device)
        return index

    def chain(
        self, head: EagleHead, seqs: list[dict], index: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """Run the ttt steps over a batch of sequences -> per step: loss, top-1 right [B, L], labelled rows.

        Row p of every step stands for position p: inputs (u, E[x_{p+1}]), label x_{p+2} (an answer token).
        """
        dev, dtype = self.device, head.lm_head.weight.dtype
        length = max(len(f["ids"]) for f in seqs) - 1  # rows 0 .. T-2 have a next token
        b = len(seqs)
        ids = torch.full((b, length + 2), IGNORE, dtype=torch.long)
        hidden = torch.zeros(b, length, seqs[0]["hidden"].shape[-1], dtype=torch.bfloat16)
        answer = torch.zeros(b, length + 2, dtype=torch.bool)
        for r, f in enumerate(seqs):
            t = len(f["ids"])
            ids[r, :t] = f["ids"]
            hidden[r, : t - 1] = f["hidden"][: t - 1]
            answer[r, f["prompt"] : t] = True
        ids, answer = ids.to(dev), answer.to(dev)
        tokens = ids[:, 1 : length + 1]  # x_{p+1}
        labels = torch.where(answer[:, 2:] & (ids[:, 2:] >= 0), index[ids[:, 2:].clamp_min(0)], IGNORE)  # x_{p+2}
        with torch.no_grad():  # the target's embedding is shared, not trained
            embeds = self.model.embed(tokens.clamp_min(0)).to(dtype).reshape(b * length, -1)
        positions = torch.arange(length, device=dev).repeat(b)
        attention = ChainAttention(b, length, head.cfg.head_dim**-0.5)
        u = head.fc(hidden.to(dev, dtype)).reshape(b * length, -1)
        losses, right, counted = [], [], []
        for j in range(self.cfg.ttt_steps):
            logits, s = head(embeds, u, positions, attention)
            logits = logits.view(b, length, -1)
            step_labels = labels.clone()
            step_labels[:, :j] = IGNORE  # positions p < j have no anchor for the (j+1)-th draft
            losses.append(F.cross_entropy(logits.flatten(0, 1), step_labels.flatten(), ignore_index=IGNORE))
            right.append((logits.argmax(-1) == step_labels) & (step_labels >= 0))
            counted.append(int((step_labels >= 0).sum()))
            u = _shift(s.view(b, length, -1), 1).reshape(b * length, -1)  # the next step's u at p is s at p - 1
        return losses, right, counted

    # --- 4. report ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def report(self, head: EagleHead, feats: list[dict]) -> dict:
        """Per-step top-1 accuracy, the chain estimate of tokens per step and a greedy run's (stepping over each
        answer as speculation does: train_heads.greedy_run_tokens_per_step) on held-out greedy answers."""
        held = [f for f in feats if f["eval"]]
        index = self._vocab_index(head.draft_vocab)
        k = self.cfg.ttt_steps
        hits, valid, chain = torch.zeros(k), torch.zeros(k), torch.zeros(k)
        anchor_total, runs = 0, []
        for batch in self._batches(held):
            seqs = [held[i] for i in batch]
            _, right, counted = self.chain(head, seqs, index)
            length = right[0].shape[1]
            anchors = torch.zeros_like(right[0])
            for r, f in enumerate(seqs):  # anchors: positions whose first draft is an answer token
                anchors[r, max(0, f["prompt"] - 2) : len(f["ids"]) - 2] = True
            alive = anchors.clone()
            run = torch.zeros(alive.shape, dtype=torch.long, device=alive.device)  # right drafts in a row
            for j in range(k):
                # draft j + 1 of the chain anchored at i is row i + j of step j
                step_right = torch.zeros_like(alive)
                step_right[:, : length - j] = right[j][:, j:]
                alive &= step_right
                run += alive
                hits[j] += int(right[j].sum())
                valid[j] += counted[j]
                chain[j] += int(alive.sum())
            anchor_total += int(anchors.sum())
            runs += [run[r, max(0, f["prompt"] - 2) : len(f["ids"]) - 2].cpu() for r, f in enumerate(seqs)]
        positions = max(anchor_total, 1)
        accuracy = (hits / valid.clamp_min(1)).tolist()
        tokens_per_step = [1 + float(chain[: j + 1].sum() / positions) for j in range(k)]
        run_tokens = [greedy_run_tokens_per_step(runs, j + 1) for j in range(k)]
        return {
            "top1": accuracy,
            "tokens_per_step": tokens_per_step,
            "run_tokens_per_step": run_tokens,
            "eval_positions": anchor_total,
        }


def train_eagle(
    engine, cfg: EagleTrainConfig, out: Path, progress: Progress, log: Callable[[str], None], work: Path | None = None
) -> dict:
    """Train an EAGLE-3 head for engine's model into the directory `out` (work: OUT.work); returns the report."""
    trainer = EagleTrainer(engine, cfg, work or out.with_name(out.name + ".work"), progress, log)
    records = generate_answers(engine, cfg, trainer.work / "answers.jsonl", progress, log)
    log(f"{len(records)} answers, {sum(len(r['output_ids']) for r in records)} tokens")
    feats = trainer.features(records)
    log(
        f"{sum(len(f['ids']) for f in feats)} positions in {len(feats)} sequences, {sum(f['eval'] for f in feats)} held out"
    )
    head = trainer.train(records, feats)
    report = trainer.report(head, feats)
    spec = engine.model_spec
    target = {"model": spec.alias if spec else "", "train": asdict(cfg), "report": report}
    write_folder_whole(out, lambda folder: head.save(folder, target))  # (never a config.json beside a torn model)
    return report
