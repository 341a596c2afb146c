"""Draft heads: small residual blocks on the target's own hidden state propose the next k tokens.

Medusa (Cai et al. 2024): the hidden state h_t at a tap layer (the last layer: Medusa; an earlier one: early
exit) already predicted the newest token x_{t+1} through the target's lm_head; head i (1-based) is a residual
block whose output, through the target's own final norm and lm_head, predicts x_{t+1+i}. Heads share the
target's lm_head, so each one is only a block of hidden x hidden weights.

Sequential variant (Hydra, Ankner et al. 2024; EAGLE, Li et al. 2024): head i also reads the embedding of
the token before the one it predicts (x_{t+i}: the newest token for head 1, then each head's own draft) and
the state s_{i-1} of the head before it instead of h_t:

    parallel:    s_i = h_t     + f_i(norm(h_t))
    sequential:  s_i = s_{i-1} + f_i([norm(s_{i-1}); norm(E[x_{t+i}])]),   s_0 = h_t
    f_i(u) = W_down silu(W_up u)    (W_down starts at zero, so every head starts as the target's own lm_head)

Draft vocabulary: on a CPU one lm_head product (49k x 576 for the default model) costs as much as a fifth of
a target step, once per draft token for sequential heads. Heads therefore choose from the `draft_vocab`
most frequent tokens of their training data only (as FR-Spec, Zhao et al. 2025, does for EAGLE): the
target still verifies every draft, so this changes speed, never the output. Where the target reads its weights
as GGUF blocks on the CPU, the heads and those lm_head rows are read as Q8_0 blocks too (heads_cpu.py).

File format: a safetensors file with the head weights and `draft_vocab` (token ids, int64), and metadata
"format" = HEADS_FORMAT, "config" = HeadsConfig as JSON, "target" = what the heads were trained on.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specchat.engine.cpu_weights import BlockLinear
from specchat.engine.cuda_graph import GraphedFunction
from specchat.engine.drafters import heads_cpu
from specchat.engine.drafters.base import Draft, Drafter
from specchat.engine.fusion import fuse
from specchat.engine.model import RMSNorm, Transformer
from specchat.engine.sampling import probs_from_logits, sample_from_probs
from specchat.errors import ConfigError, ModelFormatError
from specchat.kernels import cpu_ops, draft_heads
from specchat.quant.fp4_linear import Fp4Linear
from specchat.safetensors_io import save_tensors

if TYPE_CHECKING:
    from specchat.engine.runner import TokenContext
    from specchat.engine.sequence import Sequence

HEADS_FORMAT = "specchat-draft-heads-v1"


@dataclass(slots=True)
class HeadsConfig:
    """Shape of a set of draft heads and the target they read."""

    hidden_size: int
    vocab_size: int  # the target's vocabulary (draft_vocab ids index it)
    num_layers: int  # the target's depth, to check the tap against
    num_heads: int  # heads = the most tokens drafted per step
    tap: int  # target layer whose output (residual stream) the heads read
    sequential: bool = True
    ffn_size: int = 0  # width of each head's hidden layer; 0 = hidden_size
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ConfigError(f"draft heads: need at least one head, got {self.num_heads}")
        if not 0 <= self.tap < self.num_layers:
            raise ConfigError(f"draft heads: tap layer {self.tap} outside the target's {self.num_layers} layers")
        if self.ffn_size == 0:
            self.ffn_size = self.hidden_size

    @classmethod
    def for_model(cls, model: Transformer, num_heads: int, tap: int | None = None, **kw) -> HeadsConfig:
        c = model.cfg
        tap = c.num_layers - 1 if tap is None else tap
        return cls(c.hidden_size, c.vocab_size, c.num_layers, num_heads, tap, rms_norm_eps=c.rms_norm_eps, **kw)


class HeadBlock(nn.Module):
    """One draft head: s_prev (+ the previous token's embedding) -> s, a residual SiLU MLP."""

    act = staticmethod(F.silu)  # heads_cpu.pack_heads: the C kernel's, as its draft chain computes it

    def __init__(self, cfg: HeadsConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.state_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.embed_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.sequential else None
        self.up = nn.Linear(2 * d if cfg.sequential else d, cfg.ffn_size, bias=False)
        self.down = nn.Linear(cfg.ffn_size, d, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, state: torch.Tensor, prev_embed: torch.Tensor | None = None) -> torch.Tensor:
        """state [N, d], prev_embed [N, d] (sequential heads only) -> next state [N, d]."""
        u = self.state_norm(state)
        if self.embed_norm is not None:
            u = torch.cat([u, self.embed_norm(prev_embed)], dim=-1)  # [N, 2d]
        return state + self.down(self.act(self.up(u)))


class DraftHeads(nn.Module):
    """The trained part: num_heads blocks plus the draft vocabulary they choose from."""

    def __init__(self, cfg: HeadsConfig, draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(HeadBlock(cfg) for _ in range(cfg.num_heads))
        vocab = torch.arange(cfg.vocab_size) if draft_vocab is None else draft_vocab.long()
        self.register_buffer("draft_vocab", vocab)  # [Vd] target token ids

    def teacher_forced(self, hidden: torch.Tensor, prev_embeds: torch.Tensor | None) -> torch.Tensor:
        """hidden [N, d] (h_t), prev_embeds [K, N, d] (E[x_{t+1..t+K}], sequential only) -> states [K, N, d].

        Training feeds the true previous tokens; drafting feeds each head's own choice (`HeadsDrafter`).
        """
        states, state = [], hidden
        for i, block in enumerate(self.blocks):
            if self.cfg.sequential:
                state = block(state, prev_embeds[i])
                states.append(state)
            else:
                states.append(block(hidden))
        return torch.stack(states)

    def save(self, path: Path, target: dict) -> None:
        tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in self.state_dict().items()}
        tensors["draft_vocab"] = self.draft_vocab.long().contiguous()
        meta = {"format": HEADS_FORMAT, "config": json.dumps(asdict(self.cfg)), "target": json.dumps(target)}
        save_tensors(tensors, path, metadata=meta)

    @classmethod
    def load(cls, path: Path) -> tuple[DraftHeads, dict]:
        """(heads in fp32 on the CPU, the "target" metadata)."""
        from safetensors import SafetensorError, safe_open
        from safetensors.torch import load_file

        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path))
        except (OSError, SafetensorError) as exc:
            raise ModelFormatError(f"{path}: cannot read draft heads ({exc})") from None
        if meta.get("format") != HEADS_FORMAT:
            raise ModelFormatError(f"{path}: not a draft heads file (format {meta.get('format')!r})")
        try:
            heads = cls(HeadsConfig(**json.loads(meta["config"])), tensors["draft_vocab"])
            heads.load_state_dict({name: t.float() for name, t in tensors.items()})
            target = json.loads(meta.get("target", "{}"))
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:  # metadata or tensors missing or misshapen
            raise ModelFormatError(
                f"{path}: draft heads file without a usable config ({type(exc).__name__}: {exc})"
            ) from None
        return heads, target


class DraftVocabOutput:
    """The target's final norm + the lm_head rows of the draft vocabulary (frozen): state -> draft logits."""

    def __init__(self, model: Transformer, draft_vocab: torch.Tensor) -> None:
        self.norm = model.norm
        head = model.lm_head
        if isinstance(head, Fp4Linear) or (isinstance(head, BlockLinear) and not head.holds_weight):
            # MXFP4, or GGUF blocks without their float weight (cpu_weights.release_unread_weights): only these
            # rows dequantized
            rows = head.rows(draft_vocab.to(head.codes.device), model.norm.weight.dtype)
        else:
            weight = head.weight.detach()
            full = len(draft_vocab) == weight.shape[0]
            rows = weight if full else weight[draft_vocab.to(weight.device)].contiguous()  # [Vd, d]
        # a linear over those rows (heads_cpu.pack_for_cpu swaps it for one reading them as GGUF blocks)
        self.rows = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
        self.rows.weight = nn.Parameter(rows, requires_grad=False)

    def __call__(self, state: torch.Tensor) -> torch.Tensor:
        """state [..., d] -> logits [..., Vd] in fp32."""
        return self.rows(self.norm(state)).float()


def choose_tokens(
    seqs: list[Sequence],
    logits: torch.Tensor,
    draft_vocab: torch.Tensor,
    vocab_size: int,
    drawing: list[bool] | None = None,
) -> tuple[list[int], list[torch.Tensor | None]]:
    """Draft logits [B, Vd] over `draft_vocab` (target ids) -> a token per request, and the distribution q it was
    drawn from over the full vocabulary (None for a greedy request: a point mass on the argmax).

    drawing: which requests draft at this position (default: all). A sampled request past its own k takes the
    argmax without a draw from its generator (its token there is never drafted): a batch drafts as deep as its
    deepest k, and a seeded request's draws, and so its text, must not depend on the k of the others."""
    best = draft_vocab[cpu_ops.argmax(logits)].tolist()
    tokens, probs = [], []
    for b, seq in enumerate(seqs):
        if seq.sampling.greedy or (drawing is not None and not drawing[b]):
            tokens.append(best[b])
            probs.append(None)
            continue
        q_draft = probs_from_logits(logits[b], seq.sampling)  # [Vd]
        tokens.append(int(draft_vocab[sample_from_probs(q_draft, seq.generator)]))
        probs.append(torch.zeros(vocab_size, device=q_draft.device).index_copy_(0, draft_vocab, q_draft))
    return tokens, probs


def check_compatible(cfg: HeadsConfig, model: Transformer, where: str) -> None:
    c = model.cfg
    if (cfg.hidden_size, cfg.vocab_size, cfg.num_layers) != (c.hidden_size, c.vocab_size, c.num_layers):
        raise ConfigError(
            f"draft heads {where} were trained for hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
            f"{cfg.num_layers} layers; this model has {c.hidden_size}, {c.vocab_size}, {c.num_layers}"
        )


class HeadsDrafter(Drafter):
    """Drafts with trained heads from each request's tapped hidden state (seq.hidden)."""

    name = "heads"

    def __init__(
        self,
        heads: DraftHeads,
        model: Transformer,
        graphs: bool = True,
        cpu_blocks: bool = True,
        draft_rows: int | None = None,
        min_confidence: float | None = None,
    ) -> None:
        """draft_rows: draft from the first (most frequent) entries of the heads' draft vocabulary only, fewer
        output rows to read per draft position (default: heads_cpu.DRAFT_ROWS where the heads read Q8_0 blocks on
        the CPU, all of them elsewhere). min_confidence: a greedy chain of packed heads stops before the first
        draft whose chain probability falls below it (default heads_cpu.drafting's; 0: the step's k always)."""
        weight = model.norm.weight  # (the model's device and dtype; an MXFP4 lm_head's .weight dequantizes it whole)
        packed = cpu_blocks and heads_cpu.packable(model)
        self.packed = packed  # the heads read Q8_0 blocks on the CPU (heads_cpu)
        tuned = heads_cpu.drafting(model)
        self.hybrid_k = tuned.hybrid_k if packed else None  # what they draft at most in ngram+heads
        if draft_rows is None and packed:
            draft_rows = heads_cpu.DRAFT_ROWS
        self.heads = heads.to(device=weight.device, dtype=weight.dtype).eval()
        self.cfg = heads.cfg
        self.taps = (heads.cfg.tap,)
        self.embed = model.embed
        self.vocab_size = model.cfg.vocab_size
        self.draft_vocab = self.heads.draft_vocab[:draft_rows]  # [Vd]
        self.output = DraftVocabOutput(model, self.draft_vocab)
        self.c_chain = None  # packed heads bound for the greedy chain as one C call (heads_cpu.chain_weights)
        self.c_chain_gemms: list[nn.Linear] = []  # its linears that take the float GEMM for some row counts
        self.min_confidence = tuned.min_confidence if min_confidence is None else min_confidence
        if packed:  # on the CPU the heads read Q8_0 blocks (the target's own rows where it reads GGUF blocks)
            heads_cpu.pack_for_cpu(self, model)
        if self.c_chain is not None and self.min_confidence > 0:  # its confidence gate picks each draft's length
            self.gated_k = min(tuned.gated_k, self.cfg.num_heads)
        if graphs and weight.is_cuda:  # the heads' norms as the target's fused kernel: 10 launches less a head
            fuse(self.heads)
        # the greedy chain's fused kernels where they run (SPECCHAT_FUSED_HEADS=0: the plain chain, for A/B runs)
        self.fused_chain = os.environ.get("SPECCHAT_FUSED_HEADS", "1") != "0"
        # greedy drafting: a CUDA graph per batch bucket and depth, over the embedding the model has now
        self.chain = GraphedFunction(
            self.greedy_chain, lambda: tuple(p.data_ptr() for p in self.embed.parameters()), enabled=graphs
        )

    @classmethod
    def from_file(
        cls,
        path: Path,
        model: Transformer,
        graphs: bool = True,
        cpu_blocks: bool = True,
        draft_rows: int | None = None,
        min_confidence: float | None = None,
    ) -> HeadsDrafter:
        heads, _ = DraftHeads.load(path)
        check_compatible(heads.cfg, model, str(path))
        return cls(heads, model, graphs, cpu_blocks, draft_rows=draft_rows, min_confidence=min_confidence)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        # A request whose hidden state was not tapped yet (it just switched drafters) skips one step.
        ready = [i for i, seq in enumerate(seqs) if self.cfg.tap in seq.hidden]
        drafts = [Draft([]) for _ in seqs]
        if not ready:
            return drafts
        depth = min(max(ks[i] for i in ready), self.cfg.num_heads)
        greedy = [i for i in ready if seqs[i].sampling.greedy]
        # greedy requests: the whole chain in one launch or C call, one read-back; with packed heads (the C chain
        # and its gate) also where sampled requests share the step, which then draft on their own
        if len(greedy) == len(ready) or (self.c_chain is not None and greedy):
            for i, chain in zip(greedy, self.greedy_drafts([seqs[i] for i in greedy], depth), strict=True):
                drafts[i] = Draft(chain[: min(ks[i], depth)])
            ready = [i for i in ready if not seqs[i].sampling.greedy]
            if not ready:
                return drafts
        group, own = [seqs[i] for i in ready], [min(ks[i], depth) for i in ready]
        rows, newest = [seq.hidden[self.cfg.tap][-1] for seq in group], [seq.newest for seq in group]
        steps = self.draft_steps(group, *self.chain_inputs(rows, newest), depth, own)
        for b, k in enumerate(own):
            tokens = [steps[j][0][b] for j in range(k)]
            qs = [steps[j][1][b] for j in range(k)]
            drafts[ready[b]] = Draft(tokens, None if qs[0] is None else torch.stack(qs))
        return drafts

    def greedy_drafts(self, group: list[Sequence], depth: int) -> list[list[int]]:
        """Greedy requests' drafts, up to `depth` each: the packed heads' C chain cut where its confidence falls
        below min_confidence, else the (graphed) chain."""
        rows = [seq.hidden[self.cfg.tap][-1] for seq in group]  # [d] each: h_t
        newest = [seq.newest for seq in group]
        packed = heads_cpu.draft_chain(self, depth, rows, newest)
        if packed is None:
            return self.chain(depth, *self.chain_inputs(rows, newest)).tolist()  # [B, depth]
        chain, confidence = packed
        if self.min_confidence <= 0:
            return chain
        return [heads_cpu.confident_prefix(c, p, self.min_confidence) for c, p in zip(chain, confidence, strict=True)]

    def draft_on_device(
        self, depth: int, hidden: dict[int, torch.Tensor], newest: torch.Tensor, context: TokenContext | None = None
    ) -> torch.Tensor | None:
        """The chain greedy_drafts replays (`greedy_chain`); not for packed heads, whose C chain runs on the host."""
        if not self.drafts_on_device(depth):
            return None
        return self.greedy_chain(depth, hidden[self.cfg.tap].to(self.output.rows.weight.dtype), newest)

    def drafts_on_device(self, depth: int | None = None) -> bool:
        """Heads draft on the device up to one token a head, where they are not packed."""
        return not self.packed and (depth is None or depth <= self.cfg.num_heads)

    def chain_inputs(self, rows: list[torch.Tensor], newest: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's h_t [d] and newest token -> hidden [B, d] in the heads' dtype, prev [B]."""
        hidden = torch.stack(rows).to(self.output.rows.weight.dtype)
        return hidden, torch.tensor(newest, device=hidden.device)

    def draft_steps(
        self, group: list[Sequence], hidden: torch.Tensor, prev: torch.Tensor, depth: int, ks: list[int] | None = None
    ) -> list[tuple[list[int], list[torch.Tensor | None]]]:
        """Position by position, each request's token (greedy or sampled with its generator) and the distribution
        it was drawn from: [(tokens [B], probs [B])] * depth. ks: each request's own k (default: depth); past it
        a sampled request draws nothing (`choose_tokens`), its entries there are not its drafts. The reference
        `greedy_chain` is held to."""
        ks = [depth] * len(group) if ks is None else ks
        if not self.cfg.sequential:
            states = torch.stack([block(hidden) for block in self.heads.blocks[:depth]])  # [depth, B, d]
            logits = self.output(states)  # [depth, B, Vd]
            return [
                choose_tokens(group, logits[j], self.draft_vocab, self.vocab_size, [j < k for k in ks])
                for j in range(depth)
            ]
        state, steps = hidden, []
        for j, block in enumerate(self.heads.blocks[:depth]):
            state = block(state, self.embed(prev).to(state.dtype))  # [B, d] (packed heads: float32)
            drawing = [j < k for k in ks]
            tokens, probs = choose_tokens(group, self.output(state), self.draft_vocab, self.vocab_size, drawing)
            steps.append((tokens, probs))
            prev = torch.tensor(tokens, device=hidden.device)
        return steps

    def greedy_chain(self, depth: int, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h_t [B, d] and the newest tokens [B] -> the heads' greedy drafts [B, depth], all on the device (what
        `chain` captures): on a Triton device in five launches a head (kernels/draft_heads_triton.py), else
        `plain_chain`. Packed heads on the CPU run it as one C call instead (`greedy_drafts`:
        heads_cpu.draft_chain, the same calls in the same order)."""
        blocks, rows = self.heads.blocks[:depth], self.output.rows.weight
        if self.fused_chain and draft_heads.supported(hidden, blocks, self.embed.weight, rows):
            from specchat.kernels import draft_heads_triton

            return draft_heads_triton.greedy_chain(blocks, self.embed.weight, self.output.norm, rows,
                                                   self.draft_vocab, hidden, prev)  # fmt: skip
        return self.plain_chain(depth, hidden, prev)

    def plain_chain(self, depth: int, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """`greedy_chain` in plain PyTorch, the fused chain's reference (`draft_steps` is this one's)."""
        if not self.cfg.sequential:
            states = torch.stack([block(hidden) for block in self.heads.blocks[:depth]])  # [depth, B, d]
            return self.draft_vocab[cpu_ops.argmax(self.output(states))].T
        state, tokens = hidden, []
        for block in self.heads.blocks[:depth]:
            state = block(state, self.embed(prev).to(state.dtype))
            prev = self.draft_vocab[cpu_ops.argmax(self.output(state))]
            tokens.append(prev)
        return torch.stack(tokens, dim=1)

    def warm_up(self, sessions: int) -> None:
        """Capture the chain's graphs (every depth, every batch bucket up to `sessions`') before the first step."""
        weight = self.output.rows.weight

        def row(depth: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.zeros(1, self.cfg.hidden_size, dtype=weight.dtype, device=weight.device),
                    torch.zeros(1, dtype=torch.long, device=weight.device))  # fmt: skip

        self.chain.warm_up(sessions, range(1, self.cfg.num_heads + 1), row)
