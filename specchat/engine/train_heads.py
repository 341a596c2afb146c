"""Self-distillation of draft heads: the target answers the shipped prompts, heads learn its own next tokens.

Medusa-2's self-distillation (Cai et al. 2024, sec. 2.3.2): train on the target's own outputs rather than a
fixed corpus, so the heads learn what this model says, not what people wrote. Stages, each saved in a work
directory beside the output file so that a run interrupted anywhere resumes where it stopped:

1. answers:  the engine answers every `train` prompt (all submitted at once; the scheduler batches them):
             one greedy answer each, plus `samples_per_prompt` sampled ones for variety. With `synth_prompts`
             the target first writes that many user prompts of its own (Magpie, Xu et al. 2024: sampled from
             its chat template's opening of a user turn), each answered greedily beside the shipped ones.
2. features: one teacher-forced target forward per answer captures h_t at the tap layer for every position t
             whose next token x_{t+1} the target wrote, the window x_{t+1} .. x_{t+1+K}, and the target's greedy
             next token g_j = argmax p(. | x_1 .. x_j) at j = t .. t+K (the same forward's logits).
3. train:    head i learns, from h_t (and, sequential heads, x_{t+1} .. x_{t+i}), what the target does after
             that prefix, by cross-entropy over the draft vocabulary: labels "soft" (the default) its whole
             distribution there (h_{t+i} through the final norm and the draft rows: row t+i of the same
             answer's features), "greedy" its choice g_{t+i}, "text" the answer's own token x_{t+1+i}. In a
             sampled answer (temperature 0.8) 28% of the tokens are not the target's greedy choice after their
             own prefix, yet "text" labels teach them as the answer; the soft labels carry the target's whole
             distribution at every position, of greedy and sampled answers alike (docs/speculative.md compares
             the three by real runs). Head i's loss weighs depth_decay^(i-1) (Medusa's 0.8^i). Checkpoints
             every `checkpoint_every` steps.
4. report:   per-head top-1 accuracy on held-out answers (teacher-forced) and the chain estimate of tokens per
             step at k = 1..K (head i counts only where heads 1..i are all right), then the heads file.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from safetensors import SafetensorError

from specchat.config import SamplingParams, SpecParams
from specchat.engine.drafters.base import DATA_DIR
from specchat.engine.drafters.heads import DraftHeads, DraftVocabOutput, HeadsConfig
from specchat.engine.runner import StepBatch
from specchat.engine.sequence import Finished
from specchat.errors import ConfigError, KVCacheFullError
from specchat.writes import write_whole

PROMPTS_DIR = DATA_DIR / "prompts"
CATEGORIES = ("code", "math", "chat", "tool_use", "code_edit")
IGNORE = -100  # label of positions past the end of an answer, or outside the draft vocabulary
# Sampled answers go out under a varied system message: more varied answers, and no two requests the same.
SYSTEM_VARIANTS = (
    "You are a helpful AI assistant.",
    "You are a concise assistant. Answer directly.",
    "You are a friendly assistant who explains things step by step.",
    "You are an expert programmer and careful writer.",
    "You are a patient teacher.",
    "You are a precise assistant; keep answers short and correct.",
)
LABELS = ("greedy", "text", "soft")
# Prompts the target writes itself (Magpie): each is sampled under one of these system messages (None: the
# template's own default), which steer it toward the kinds of request the shipped prompt set holds.
SYNTH_SYSTEMS = (
    None,
    "You are a helpful AI assistant.",
    "You are an expert programmer. Users ask you to write, explain, review and fix code.",
    "You are a math tutor. Users ask you to solve problems and explain the steps.",
    "You are a concise assistant for everyday questions, writing and planning.",
)
SYNTH_PREFIX = "synth-"  # the ids of synthesized prompts
SYNTH_MAX_TOKENS = 160  # per synthesized user message; one cut at this length is dropped
SYNTH_MIN_CHARS = 12
USER_MARK = "\x00specchat-user-message\x00"  # stands in for a user message, to find where the template puts it
MAX_HEADS = 16  # features keep the next MAX_HEADS + 1 tokens of every position, so any head count reuses them
FEATURE_BATCH_TOKENS = 4096  # tokens per teacher-forced forward
WARMUP_STEPS = 50
MIN_LR_FRACTION = 0.1  # cosine decay ends at this fraction of the peak learning rate

Progress = Callable[[str, int, int], None]  # (stage, done, total)


def load_prompt_set(split: str | None = None, categories: tuple[str, ...] = CATEGORIES) -> list[dict]:
    """The shipped prompts ({"id", "split", "messages", "category"}), optionally one split only."""
    prompts = []
    for category in categories:
        for line in (PROMPTS_DIR / f"{category}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if split is None or record["split"] == split:
                prompts.append({**record, "category": category})
    return prompts


@dataclass(slots=True)
class TrainConfig:
    """What to train and how. Fields marked (data) shape the saved answers and features; changing them needs a
    fresh work directory. The others only shape training, so variants can share one work directory."""

    num_heads: int = 4
    tap: int | None = None  # (data) None = the last layer
    sequential: bool = True
    ffn_size: int = 0  # 0 = hidden size
    draft_vocab: int = 16384  # most frequent answer tokens the heads may draft; 0 = the whole vocabulary
    max_tokens: int = 384  # (data) per answer
    samples_per_prompt: int = 2  # (data) sampled answers per prompt, besides the greedy one
    temperature: float = 0.8  # (data) of the sampled answers
    eval_fraction: float = 0.1  # (data) answers held out for the accuracy report
    max_prompts: int = 0  # (data) use only the first N train prompts; 0 = all
    synth_prompts: int = 0  # (data) user prompts the target writes itself, answered greedily beside the shipped ones
    epochs: int = 4
    batch_size: int = 512
    lr: float = 2e-3
    depth_decay: float = 0.8
    # "greedy": the target's argmax after each prefix; "text": the answer's own next token; "soft": the target's
    # whole distribution (over the draft vocabulary) after each prefix, from the tapped h of the last layer;
    # None: soft where the last layer is tapped, else greedy (HeadTrainer decides, knowing the layer count)
    labels: str | None = None
    checkpoint_every: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.num_heads <= MAX_HEADS:
            raise ConfigError(f"--heads must be in [1, {MAX_HEADS}], got {self.num_heads}")
        least = {"draft_vocab": 0, "samples_per_prompt": 0, "synth_prompts": 0, "epochs": 1, "batch_size": 1}
        check_at_least(self, least)
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"eval fraction must be in (0, 1), got {self.eval_fraction}")
        if self.labels is not None and self.labels not in LABELS:
            raise ConfigError(f"labels must be one of {', '.join(LABELS)}, got {self.labels!r}")

    def data_key(self) -> dict:
        keys = ("tap", "max_tokens", "samples_per_prompt", "temperature", "eval_fraction", "max_prompts", "seed")
        return with_synth({k: getattr(self, k) for k in keys}, self.synth_prompts)

    def train_key(self) -> str:
        """Names this training run's checkpoint, so runs with other settings never resume from it."""
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


def with_synth(key: dict, synth_prompts: int) -> dict:
    """A data key with the synthesized prompts' count, named only where there are some: work directories made
    before the option keep their key."""
    return {**key, "synth_prompts": synth_prompts} if synth_prompts else key


FLAGS = {"samples_per_prompt": "samples"}  # config fields whose train-heads flag has another name


def check_at_least(cfg, least: dict[str, int]) -> None:
    """Each field of a training config against its least value, as one error naming the flag and the value."""
    for field, bound in least.items():
        if (value := getattr(cfg, field)) < bound:
            flag = "--" + FLAGS.get(field, field).replace("_", "-")
            raise ConfigError(f"{flag} must be >= {bound}, got {value}")


class HeadTrainer:
    """Runs the four stages for `engine`'s model; `work` holds everything needed to resume."""

    def __init__(self, engine, cfg: TrainConfig, work: Path, progress: Progress, log: Callable[[str], None]):
        self.model = engine.model
        last = self.model.cfg.num_layers - 1
        self.tap = last if cfg.tap is None else cfg.tap
        if cfg.labels == "soft" and self.tap != last:
            raise ConfigError("--labels soft reads the target's logits from the tapped layer: it needs the last one")
        cfg = replace(cfg, labels=cfg.labels or ("soft" if self.tap == last else "greedy"))
        self.engine, self.cfg, self.work, self.progress, self.log = engine, cfg, work, progress, log
        self.device = engine.device
        work.mkdir(parents=True, exist_ok=True)
        key_file = work / "config.json"
        if key_file.is_file() and json.loads(key_file.read_text()) != cfg.data_key():
            raise ConfigError(f"{work} holds data made with other settings; delete it or choose another --work")
        key_file.write_text(json.dumps(cfg.data_key()))

    # --- 1. answers -------------------------------------------------------------------------------------
    def answers(self) -> list[dict]:
        return generate_answers(self.engine, self.cfg, self.work / "answers.jsonl", self.progress, self.log)

    # --- 2. features ------------------------------------------------------------------------------------
    def features(self, records: list[dict]) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file, save_file

        path = self.work / "features.safetensors"
        feats = read_or_remake(path, lambda p: load_file(str(p)), self.log)
        if feats is not None and "greedy" in feats:  # features of an older version lack the greedy labels: made again
            return feats
        K = MAX_HEADS
        held_out = self._held_out_ids(records)
        hidden, windows, greedy, is_eval = [], [], [], []
        batch: list[dict] = []
        for n, record in enumerate(records):
            # Held-out prompts keep only their greedy answer: the report measures agreement with greedy decoding.
            if record["greedy"] or record["id"] not in held_out:
                batch.append(record)
            tokens = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in batch)
            if not batch or (tokens < FEATURE_BATCH_TOKENS and n + 1 < len(records)):
                continue
            seqs = [r["prompt_ids"] + r["output_ids"] for r in batch]
            # logits from position P-1 on (each request's trailing T-P+1 rows): the greedy choice at every t
            logit_rows = [len(s) - len(r["prompt_ids"]) + 1 for r, s in zip(batch, seqs, strict=True)]
            out = tapped_forward(self.engine, seqs, logit_rows, self.tap)
            for r, seq, h, logits in zip(batch, seqs, out.hidden, out.logits, strict=True):
                # h_t for t = P-1 .. T-2: the positions whose next token x_{t+1} the target wrote.
                first, last = len(r["prompt_ids"]) - 1, len(seq) - 1
                if last <= first:
                    continue
                padded = torch.tensor(seq + [IGNORE] * (K + 1))
                starts = torch.arange(first + 1, last + 1)  # t + 1
                windows.append(padded[starts[:, None] + torch.arange(K + 1)])  # [n, K+1]: x_{t+1} .. x_{t+1+K}
                # g_j for j = P-1 .. T-2 (g_{T-1} would guess past the answer): [n, K+1] windows g_t .. g_{t+K}
                g = torch.cat((logits[: last - first].argmax(-1).cpu(), torch.full((K + 1,), IGNORE)))
                greedy.append(g[(starts - first - 1)[:, None] + torch.arange(K + 1)])
                hidden.append(h[self.tap][first:last].float().cpu())  # [n, d]
                is_eval.append(torch.full((last - first,), r["id"] in held_out, dtype=torch.bool))
            batch = []
            self.progress("features", n + 1, len(records))
        feats = {
            "hidden": torch.cat(hidden).contiguous(),
            "windows": torch.cat(windows).contiguous(),
            "greedy": torch.cat(greedy).contiguous(),
            "is_eval": torch.cat(is_eval),
        }
        write_whole(path, lambda p: save_file(feats, str(p)))
        return feats

    def _draft_vocab(self, records: list[dict]) -> torch.Tensor:
        return draft_vocab_by_frequency(records, self.cfg.draft_vocab, self.engine)

    def _held_out_ids(self, records: list[dict]) -> set[str]:
        return held_out_ids(records, self.cfg.eval_fraction, self.cfg.seed)

    # --- 3. train ---------------------------------------------------------------------------------------
    def train(self, records: list[dict], feats: dict[str, torch.Tensor]) -> DraftHeads:
        cfg = self.cfg
        head_cfg = HeadsConfig.for_model(
            self.model, cfg.num_heads, self.tap, sequential=cfg.sequential, ffn_size=cfg.ffn_size
        )
        torch.manual_seed(cfg.seed)
        heads = DraftHeads(head_cfg, self._draft_vocab(records)).to(self.device)
        output = DraftVocabOutput(self.model, heads.draft_vocab)
        hidden = feats["hidden"].to(self.device)
        windows = feats["windows"][:, : cfg.num_heads + 1].to(self.device)  # [N, K+1]
        labels = None  # [N, K] indices into the draft vocab: head i's label is g_{t+i} (greedy) or x_{t+1+i} (text)
        if cfg.labels != "soft":
            targets = feats["greedy" if cfg.labels == "greedy" else "windows"][:, 1 : cfg.num_heads + 1]
            labels = self._draft_labels(targets.to(self.device), heads.draft_vocab)
        offsets = torch.arange(1, cfg.num_heads + 1, device=self.device)
        train_rows = (~feats["is_eval"]).nonzero().squeeze(-1)
        check_training_set(len(train_rows), len(feats["is_eval"]), "positions")
        steps_per_epoch = math.ceil(len(train_rows) / cfg.batch_size)
        total = cfg.epochs * steps_per_epoch
        opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=0.0)
        step = self._resume(heads, opt)
        weights = torch.tensor([cfg.depth_decay**i for i in range(cfg.num_heads)], device=self.device)
        model_dtype = self.model.lm_head.weight.dtype
        heads.train()
        while step < total:
            epoch, i = divmod(step, steps_per_epoch)
            order = train_rows[torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(epoch))]
            rows = order[i * cfg.batch_size : (i + 1) * cfg.batch_size].to(self.device)
            lr = cfg.lr * lr_factor(step, total)
            for group in opt.param_groups:
                group["lr"] = lr
            with torch.autocast(self.device.type, dtype=model_dtype, enabled=model_dtype != torch.float32):
                logits = self._forward(heads, output, hidden[rows], windows[rows])  # [K, B, Vd]
                if labels is None:  # soft: row t + i of the same answer holds h_{t+i}, the target's own logits
                    with torch.no_grad():
                        ahead = (rows[:, None] + offsets).clamp_max(len(hidden) - 1)  # [B, K]
                        teacher = output(hidden[ahead]).transpose(0, 1)  # [K, B, Vd]
                    valid = windows[rows, 1:] >= 0  # [B, K]: x_{t+1+i} exists, so row t + i is this answer's
                    per_head = per_head_soft_loss(logits.float(), teacher.float(), valid)
                else:
                    per_head = per_head_loss(logits.float(), labels[rows])
                loss = per_head @ weights / weights.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            self.progress(f"train loss {loss.item():.3f}", step, total)
            if step % cfg.checkpoint_every == 0 or step == total:
                state = {"heads": heads.state_dict(), "opt": opt.state_dict(), "step": step}
                write_whole(self.checkpoint, partial(torch.save, state))
        return heads.eval()

    @property
    def checkpoint(self) -> Path:
        return self.work / f"checkpoint-{self.cfg.train_key()}.pt"

    def _resume(self, heads: DraftHeads, opt: torch.optim.Optimizer) -> int:
        load = lambda p: torch.load(p, map_location=self.device, weights_only=True)
        state = read_or_remake(self.checkpoint, load, self.log)
        if state is None:
            return 0
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["opt"])
        self.log(f"resuming from {self.checkpoint} at step {state['step']}")
        return state["step"]

    def _draft_labels(self, targets: torch.Tensor, draft_vocab: torch.Tensor) -> torch.Tensor:
        """Token ids [N, K] -> indices into the draft vocabulary, IGNORE where absent or past the end."""
        index = torch.full((self.model.cfg.vocab_size,), IGNORE, dtype=torch.long, device=targets.device)
        index[draft_vocab] = torch.arange(len(draft_vocab), device=targets.device)
        return torch.where(targets >= 0, index[targets.clamp_min(0)], IGNORE)

    def _forward(self, heads: DraftHeads, output: DraftVocabOutput, h: torch.Tensor, win: torch.Tensor):
        """h [B, d], win [B, K+1] -> draft logits [K, B, Vd] with teacher forcing."""
        prev = None
        if heads.cfg.sequential:
            with torch.no_grad():
                prev = self.model.embed(win[:, :-1].clamp_min(0)).transpose(0, 1).float()  # [K, B, d]
        return output(heads.teacher_forced(h, prev))

    # --- 4. report ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def report(self, heads: DraftHeads, feats: dict[str, torch.Tensor]) -> dict:
        """Per-head top-1 accuracy on held-out answers, and the chain estimate of tokens per step."""
        output = DraftVocabOutput(self.model, heads.draft_vocab.to(self.device))
        rows = feats["is_eval"].nonzero().squeeze(-1)
        K = heads.cfg.num_heads
        hits, valid, chain = torch.zeros(K), torch.zeros(K), torch.zeros(K)
        runs = []  # per held-out position: how many drafts in a row the heads get right (the chain it starts)
        for start in range(0, len(rows), self.cfg.batch_size):
            r = rows[start : start + self.cfg.batch_size]
            win = feats["windows"][r, : K + 1].to(self.device)
            model_dtype = self.model.lm_head.weight.dtype
            with torch.autocast(self.device.type, dtype=model_dtype, enabled=model_dtype != torch.float32):
                logits = self._forward(heads, output, feats["hidden"][r].to(self.device).float(), win)
            guess = heads.draft_vocab.to(self.device)[logits.argmax(-1)].T  # [B, K] token ids
            right = guess == win[:, 1:]
            present = win[:, 1:] >= 0
            hits += (right & present).sum(0).cpu()
            valid += present.sum(0).cpu()
            chain += (right.cumprod(-1).bool() & present).sum(0).cpu()
            runs.append((right & present).long().cumprod(-1).sum(-1).cpu())
        accuracy = (hits / valid.clamp_min(1)).tolist()
        chain_rate = (chain / valid[0].clamp_min(1)).tolist()
        tokens_per_step = [1 + sum(chain_rate[:k]) for k in range(1, K + 1)]
        # rows of one answer are consecutive; its last row has no next-next token
        ends = (feats["windows"][rows, 1] < 0).nonzero().squeeze(-1) + 1
        answers = list(torch.cat(runs).tensor_split(ends[:-1].tolist())) if len(rows) else []
        run = [greedy_run_tokens_per_step(answers, k) for k in range(1, K + 1)]
        return {
            "top1": accuracy,
            "tokens_per_step": tokens_per_step,
            "run_tokens_per_step": run,
            "eval_positions": int(valid[0]),
        }


def greedy_run_tokens_per_step(answers: list[torch.Tensor], k: int) -> float:
    """Tokens per step of greedy speculation at k over held-out answers, from each position's run of right drafts
    (`answers`: per answer, per position in order, how many drafts in a row the drafter gets right there).

    A step at position i emits min(run, k) + 1 tokens and the next step starts after them, as a real run does; the
    per-position chain estimate (`tokens_per_step`) instead averages over every position, which overstates a run
    where easy stretches (crossed in few steps) alternate with hard ones (docs/speculative.md)."""
    positions = steps = 0
    for runs in answers:
        values = runs.tolist()
        i = 0
        while i < len(values):
            i += min(values[i], k) + 1
            steps += 1
        positions += len(values)
    return positions / steps if steps else 1.0


def generate_answers(engine, cfg, path: Path, progress: Progress, log: Callable[[str], None]) -> list[dict]:
    """The target's answers to the `train` prompts (cached in `path`): one greedy answer per prompt plus
    `cfg.samples_per_prompt` sampled ones, all submitted at once so that the scheduler batches them. `cfg` is a
    TrainConfig or EagleTrainConfig (max_prompts, max_tokens, samples_per_prompt, temperature, seed).

    Each answer is appended to ANSWERS.partial.jsonl as it finishes, so a run stopped here (Ctrl-C, a kill: the
    answers of the whole prompt set take hours on a CPU) answers only the rest when it is run again."""
    records = read_or_remake(path, read_jsonl, log)
    if records is not None:
        return records
    prompts = load_prompt_set("train")[: cfg.max_prompts or None]
    synth = []
    if cfg.synth_prompts:
        synth_path = path.with_name("prompts-synth.jsonl")
        synth = synthesize_prompts(engine, cfg.synth_prompts, cfg.seed, synth_path, progress, log)
    jobs = []  # (key, prompt, messages, sampling); the key names the answer in the partial file
    for n, prompt in enumerate(prompts + synth):
        jobs.append((f"{prompt['id']}/greedy", prompt, prompt["messages"], SamplingParams(max_tokens=cfg.max_tokens)))
        if prompt["id"].startswith(SYNTH_PREFIX):
            continue  # varied already: greedy answers only
        for s in range(cfg.samples_per_prompt):
            seed = cfg.seed * 100_003 + n * 101 + s
            sampling = SamplingParams(temperature=cfg.temperature, seed=seed, max_tokens=cfg.max_tokens)
            messages = with_system(prompt["messages"], SYSTEM_VARIANTS[s % len(SYSTEM_VARIANTS)])
            jobs.append((f"{prompt['id']}/{s}", prompt, messages, sampling))
    partial = path.with_name(path.stem + ".partial" + path.suffix)
    records = answers_so_far(partial, {key for key, *_ in jobs})
    if records:
        log(f"{len(records)} of {len(jobs)} answers from a run that stopped; answering the rest")
    answered = {r["job"] for r in records}
    handles = {}
    for key, prompt, messages, sampling in jobs:
        if key not in answered:
            handle = engine.submit(messages, sampling, SpecParams(drafter="none", k=0), listen_only=True)
            handles[handle.request_id] = (key, prompt, messages, sampling.greedy)
    with partial.open("a") as saved:
        while engine.scheduler.has_work():
            for event in engine.step():
                if isinstance(event, Finished):
                    if event.reason == "error":  # (an answer cut short, by a full KV cache, is no training data)
                        raise ConfigError(f"answering the training prompts: {event.error}")
                    key, prompt, messages, greedy = handles[event.request_id]
                    prompt_ids = engine.encode_prompt(messages)
                    records.append(
                        {"id": prompt["id"], "job": key, "greedy": greedy, "prompt_ids": prompt_ids,
                         "output_ids": event.token_ids}
                    )  # fmt: skip
                    saved.write(json.dumps(records[-1]) + "\n")
                    saved.flush()
                    progress("answers", len(records), len(jobs))
    records.sort(key=lambda r: (r["id"], len(r["output_ids"])))
    write_jsonl(path, records)
    partial.unlink(missing_ok=True)
    return records


def synthesize_prompts(engine, count: int, seed: int, path: Path, progress: Progress, log) -> list[dict]:
    """`count` user prompts the target writes itself (cached in `path`), as prompt-set records.

    Magpie (Xu et al. 2024): an instruct model given its chat template up to the opening of a user turn, and
    nothing more, writes a user's message. Each is sampled (temperature 1, top-p 0.95) under one of
    SYNTH_SYSTEMS in turn; a message cut by the length cap, too short or seen before is dropped, and more are
    asked for, at most four rounds."""
    records = read_or_remake(path, read_jsonl, log)
    if records is not None:
        return records
    openings = [user_turn_opening(engine.tokenizer, system) for system in SYNTH_SYSTEMS]
    records, seen, asked = [], set(), 0
    for _ in range(4):
        handles = {}
        for _ in range(round(1.2 * (count - len(records))) + 1):
            system = asked % len(SYNTH_SYSTEMS)
            sampling = SamplingParams(
                temperature=1.0, top_p=0.95, seed=seed * 1_000_003 + asked, max_tokens=SYNTH_MAX_TOKENS
            )
            handle = engine.submit(list(openings[system]), sampling, SpecParams(drafter="none", k=0), listen_only=True)
            handles[handle.request_id] = system
            asked += 1
        while engine.scheduler.has_work():
            for event in engine.step():
                ended = isinstance(event, Finished) and event.reason == "stop"  # not cut, cancelled or failed
                text = event.text.strip() if ended else ""
                if len(text) < SYNTH_MIN_CHARS or text in seen:
                    continue
                seen.add(text)
                messages = user_message(SYNTH_SYSTEMS[handles[event.request_id]], text)
                records.append({"id": f"{SYNTH_PREFIX}{len(records):05d}", "split": "train", "messages": messages})
                progress("prompts", len(records), count)
                if len(records) == count:  # enough: the messages still being written stop now
                    for request_id in handles:
                        engine.cancel(request_id)
        if len(records) >= count:
            break
    log(f"{len(records)} prompts written by the model ({asked} asked for)")
    write_jsonl(path, records)
    return records


def user_turn_opening(tokenizer, system: str | None) -> list[int]:
    """The chat template's tokens up to where a user message begins (after `system`, if given)."""
    text = tokenizer.render_chat(user_message(system, USER_MARK), add_generation_prompt=False)
    if USER_MARK not in text:
        raise ConfigError(
            "--synth-prompts needs a chat template that writes the user's message as given; this model's does not"
        )
    return tokenizer.encode(text[: text.index(USER_MARK)], add_special_tokens=False)


def user_message(system: str | None, text: str) -> list[dict]:
    """A chat of one user message, under `system` where given."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def answers_so_far(partial: Path, keys: set[str]) -> list[dict]:
    """The answers a stopped run appended to `partial` (those of this run's jobs), the file rewritten with just
    them: a line torn by a kill is dropped, and the next answers start on a line of their own."""
    if not partial.is_file():
        return []
    records = []
    for line in partial.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("job") in keys and "output_ids" in record:
            records.append(record)
    records = list({r["job"]: r for r in records}.values())
    write_jsonl(partial, records)
    return records


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines work file."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_jsonl(path: Path, records: list[dict]) -> None:
    """Records as a JSON line each, written whole (write_whole)."""
    write_whole(path, lambda p: p.write_text("".join(json.dumps(r) + "\n" for r in records)))


T = TypeVar("T")
# What reading a work file cut short raises: json (ValueError), safetensors, torch.load's zip reader and unpickler.
TORN_FILE_ERRORS = (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError)


def check_training_set(train: int, total: int, what: str) -> None:
    """Refuse to train on nothing: with every answer held out for the report (--max-prompts 1 holds out its only
    prompt) no step ran, and the untrained heads were written and reported as trained."""
    if train == 0:
        raise ConfigError(
            f"nothing to train on: all {total} {what} are held out for the report (a tenth of the prompts, at least "
            "one); give --max-prompts 2 or more, or --synth-prompts"
        )


def read_or_remake(path: Path, read: Callable[[Path], T], log: Callable[[str], None]) -> T | None:
    """What `read` makes of a work file; None when there is none, or when it does not read (a file torn by a run
    killed while writing it): then it is removed with a line saying so, and made again."""
    if not path.is_file():
        return None
    try:
        return read(path)
    except TORN_FILE_ERRORS as exc:
        log(f"{path} is damaged ({type(exc).__name__}); making it again")
        path.unlink(missing_ok=True)
        return None


def features_kv_full(engine, seqs: list[list[int]]) -> KVCacheFullError:
    """The features' forward over whole answers did not fit the KV pool ("KV cache full: not enough free pages for
    this step" said neither what nor how)."""
    tokens = sum(len(seq) for seq in seqs)
    return KVCacheFullError(
        f"KV cache full: the features of {len(seqs)} answers ({tokens} tokens) need more than the pool holds "
        f"({engine.pool.capacity_tokens} tokens); raise --kv-memory"
    )


def tapped_forward(engine, seqs: list[list[int]], logit_rows: list[int], tap: int):
    """One teacher-forced forward of whole token sequences, each under an id no live request uses and without
    prefix reuse, so that every position is fed and its hidden state at layer `tap` kept (StepOutput.hidden)."""
    ids = [-(i + 1) for i in range(len(seqs))]
    for seq_id in ids:
        engine.pool.add(seq_id, [])
    try:
        return engine.runner.forward(StepBatch(ids, seqs, [0] * len(seqs), logit_rows), taps=[tap])
    except KVCacheFullError:
        raise features_kv_full(engine, seqs) from None
    finally:
        for seq_id in ids:
            engine.pool.free(seq_id)


def held_out_ids(records: list[dict], fraction: float, seed: int) -> set[str]:
    """Prompt ids whose answers are held out for the report (a seeded share of the shipped prompts: the report
    stays one measure whether or not the model wrote prompts of its own)."""
    ids = sorted({r["id"] for r in records if not r["id"].startswith(SYNTH_PREFIX)})
    random.Random(seed).shuffle(ids)
    return set(ids[: max(1, round(len(ids) * fraction))])


def draft_vocab_by_frequency(records: list[dict], size: int, engine) -> torch.Tensor:
    """The `size` most frequent answer tokens, then the end-of-turn tokens, then the rest by id (0: all)."""
    vocab_size = engine.model.cfg.vocab_size
    if size == 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = Counter(t for r in records for t in r["output_ids"])
    # Most frequent answer tokens first, then the end-of-turn tokens (answers end there), then by id.
    ranked = [t for t, _ in counts.most_common()] + sorted(engine.tokenizer.stop_token_ids)
    ranked += [t for t in range(vocab_size) if t not in counts]
    return torch.tensor(list(dict.fromkeys(ranked))[:size])


def with_system(messages: list[dict], text: str) -> list[dict]:
    """messages with `text` opening the system message (added if there is none)."""
    if messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{text} {messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def per_head_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [K, B, Vd], labels [B, K] -> mean cross-entropy per head [K]."""
    return torch.stack([F.cross_entropy(logits[i], labels[:, i], ignore_index=IGNORE) for i in range(logits.shape[0])])


def per_head_soft_loss(logits: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """logits, teacher logits [K, B, Vd], valid [B, K] -> mean cross-entropy per head [K] of the heads' draft
    distributions against the target's (both over the draft vocabulary), over the valid rows."""
    ce = -(teacher.softmax(-1) * logits.log_softmax(-1)).sum(-1)  # [K, B]
    mask = valid.T.float()
    return (ce * mask).sum(-1) / mask.sum(-1).clamp_min(1)


def lr_factor(step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to MIN_LR_FRACTION."""
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS)
    return MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


def train_heads(
    engine, cfg: TrainConfig, out: Path, progress: Progress, log: Callable[[str], None], work: Path | None = None
) -> dict:
    """Train heads for engine's model and write them to `out` (work directory: OUT.work); returns the report."""
    trainer = HeadTrainer(engine, cfg, work or out.with_name(out.name + ".work"), progress, log)
    records = trainer.answers()
    log(f"{len(records)} answers, {sum(len(r['output_ids']) for r in records)} tokens")
    feats = trainer.features(records)
    held_out = feats["is_eval"]
    scored = held_out & (feats["windows"][:, 1] >= 0)  # what report() scores: x_{t+2} exists
    log(
        f"{len(feats['hidden'])} positions, {int(held_out.sum())} held out, {int(scored.sum())} of them scored "
        "(an answer's last position has no token after the next for a head to draft)"
    )
    heads = trainer.train(records, feats)
    report = trainer.report(heads, feats)
    spec = engine.model_spec
    target = {"model": spec.alias if spec else "", "train": asdict(trainer.cfg), "report": report}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_whole(out, lambda part: heads.save(part, target))  # never a torn heads file where --out points
    return report
