"""EAGLE-3 draft head: one decoder layer over the target's own hidden states, drafting token by token.

EAGLE (Li et al. 2024) drafts from the target's features instead of from scratch: a single decoder layer reads
the target's hidden state of each position and the embedding of the token that followed it, and predicts the
token after that. EAGLE-3 (Li et al. 2025) fuses three of the target's layers (low, mid, high) instead of the
last one and trains the layer on its own outputs ("training-time test", engine/train_eagle.py). Unlike MLP
heads (heads.py) the layer attends over the whole context, through a KV cache of its own.

At position i the layer reads u_i and e_{i+1} = E[x_{i+1}] and predicts x_{i+2}:

    u_i = fc([h_i^low; h_i^mid; h_i^high])      for a position the target has processed      [h]
        = s_{i-1}                                for a draft position (the layer's own output)
    a_i = [norm_in(e_{i+1}); norm_h(u_i)]                                                        [2h]
    r_i = u_i + Attn(a_i)          attends to positions <= i of the same request (its own KV cache)
    s_i = r_i + MLP(norm_post(r_i))
    logits_i = lm_head(norm(s_i))  over the draft vocabulary; draft id j is target token j + d2t[j]

Drafting for a request whose newest token is x_n: first the layer catches up on the positions the target
processed since the last step (their u from the tapped rows, seq.hidden), which ends at position n - 1 and
gives d_1; then each further draft is one more position fed its predecessor's s and token. Before the next
step, the draft positions are dropped from the layer's cache, since the target's real features replace them.

Files use the layout vLLM and SGLang load for EAGLE-3 heads: a directory with config.json
("architectures": ["LlamaForCausalLMEagle3"], the layer's shape, "draft_vocab_size",
"eagle_config": {"eagle_aux_hidden_state_layer_ids": [...]}) and model.safetensors (fc.weight, midlayer.*,
norm.weight, lm_head.weight, d2t, t2d; embed_tokens.weight only if it does not share the target's). An aux
layer id names the layer whose *input* is tapped, i.e. our tap (a block's output) aux_id - 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specchat.config import WEIGHT_FORMATS
from specchat.engine.cuda_graph import CTX_BUCKETS, SCRATCH_SEQ, GraphedFunction, StaticKVBatch
from specchat.engine.drafters.base import Draft, Drafter
from specchat.engine.drafters.heads import choose_tokens
from specchat.engine.fusion import fuse, fuse_linears
from specchat.engine.kv_cache import KVPool
from specchat.engine.model import MLP, Attention, KVAttention, ModelConfig, RMSNorm, RotaryEmbedding, Transformer
from specchat.errors import ConfigError, ModelFormatError
from specchat.kernels.attention import AttentionMetadata, paged_attention_supported
from specchat.quant.modules import model_dtype, quantize_linears, swap_modules
from specchat.safetensors_io import save_tensors

if TYPE_CHECKING:
    from specchat.engine.sequence import Sequence

ARCHITECTURE = "LlamaForCausalLMEagle3"
LINEARS = ("fc", "attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down", "lm_head")  # EagleHead's, in order
WEIGHTS_FILE = "model.safetensors"
HEAD_FILES = ("config.json", WEIGHTS_FILE)  # what `save` writes in a head's folder
DRAFT_SLACK_TOKENS = 64 * 16  # the head's KV pool holds the target's capacity plus room for drafts in flight
CATCH_UP_ROWS = (2, 3, 5, 9)  # a graphed catch-up's rows per request (the newly verified: 1..k + 1, k up to 8)


@dataclass(slots=True)
class EagleConfig:
    """Shape of an EAGLE-3 head and the target layers it reads."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose input is tapped (vLLM's eagle_aux_hidden_state_layer_ids)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 8192

    def __post_init__(self) -> None:
        if len(self.aux_layer_ids) != 3 or min(self.aux_layer_ids) < 1:
            raise ConfigError(f"EAGLE-3 head: needs three aux layer ids >= 1, got {list(self.aux_layer_ids)}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(f"EAGLE-3 head: draft vocab {self.draft_vocab_size} outside (0, {self.vocab_size}]")

    @property
    def taps(self) -> tuple[int, ...]:
        """Our tap layers (block outputs) for the aux layer ids (block inputs)."""
        return tuple(i - 1 for i in self.aux_layer_ids)

    @classmethod
    def for_target(cls, cfg: ModelConfig, draft_vocab_size: int, intermediate_size: int | None = None) -> EagleConfig:
        """A head as wide as the target, reading its layers 2, N/2 and N-3 (as vLLM and SpecForge default)."""
        n = cfg.num_layers
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=intermediate_size or cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=cfg.hidden_size,
            aux_layer_ids=default_aux_layers(n),
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling,
            max_position=cfg.max_position,
        )

    def layer_config(self) -> ModelConfig:
        """The ModelConfig of the head's one layer (for the engine's Attention, MLP and RoPE modules)."""
        return ModelConfig(
            arch="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            max_position=self.max_position,
            rope_scaling=self.rope_scaling,
        )

    def to_json(self) -> dict:
        """config.json in the EAGLE-3 layout."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position,
            "hidden_act": "silu",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)},
        }

    @classmethod
    def from_json(cls, data: dict, target: ModelConfig, where: str) -> EagleConfig:
        try:
            hidden, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
            aux = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            aux = aux or default_aux_layers(target.num_layers)
            return cls(
                hidden_size=hidden,
                intermediate_size=int(data["intermediate_size"]),
                num_heads=heads,
                num_kv_heads=int(data.get("num_key_value_heads", heads)),
                head_dim=int(data.get("head_dim") or hidden // heads),
                vocab_size=int(data.get("vocab_size", target.vocab_size)),
                draft_vocab_size=int(data.get("draft_vocab_size") or data.get("vocab_size", target.vocab_size)),
                target_hidden_size=int(data.get("target_hidden_size") or hidden),
                aux_layer_ids=tuple(int(i) for i in aux),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-5)),
                rope_theta=float(data.get("rope_theta", 10000.0)),
                rope_scaling=data.get("rope_scaling"),
                max_position=int(data.get("max_position_embeddings", target.max_position)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFormatError(f"{where}: not an EAGLE-3 head config ({type(exc).__name__}: {exc})") from None


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Layers 2, N/2 and N-3 (the inputs vLLM and SpecForge tap by default), kept inside a shallow model."""
    n = num_layers
    return (min(2, n - 1), max(1, n // 2), max(1, n - 3))


class EagleHead(nn.Module):
    """The trained part: fc, the one layer, the final norm, the draft-vocabulary lm_head and its id map."""

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        layer = cfg.layer_config()
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.attn = Attention(layer, 0)
        self.attn.wqkv = nn.Linear(2 * h, layer.q_size + 2 * layer.kv_size, bias=False)  # reads [e; u]
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(layer)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.rope = RotaryEmbedding(layer)
        self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size))  # [Vd] target ids

    def forward(
        self, embeds: torch.Tensor, u: torch.Tensor, positions: torch.Tensor, kv: KVAttention
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, u [T, h], positions [T] -> (draft logits [T, Vd] fp32, s [T, h], the next position's u)."""
        cos, sin = self.rope(positions)
        a = torch.cat([self.input_norm(embeds), self.hidden_norm(u)], dim=-1)  # [T, 2h]
        r = u + self.attn(a, cos, sin, kv)
        s = r + self.mlp(self.post_norm(r))
        return self.lm_head(self.norm(s)).float(), s

    # --- files --------------------------------------------------------------------------------------------
    def state_for_file(self) -> dict[str, torch.Tensor]:
        """Weights under the names of the EAGLE-3 layout (q/k/v and gate/up unfused)."""
        c, layer = self.cfg, self.cfg.layer_config()
        q, k, v = self.attn.wqkv.weight.split([layer.q_size, layer.kv_size, layer.kv_size])
        gate, up = self.mlp.w_gate_up.weight.split([c.intermediate_size, c.intermediate_size])
        d2t = self.draft_vocab - torch.arange(c.draft_vocab_size, device=self.draft_vocab.device)
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool, device=self.draft_vocab.device)
        t2d[self.draft_vocab] = True
        tensors = {
            "fc.weight": self.fc.weight,
            "midlayer.input_layernorm.weight": self.input_norm.weight,
            "midlayer.hidden_norm.weight": self.hidden_norm.weight,
            "midlayer.self_attn.q_proj.weight": q,
            "midlayer.self_attn.k_proj.weight": k,
            "midlayer.self_attn.v_proj.weight": v,
            "midlayer.self_attn.o_proj.weight": self.attn.wo.weight,
            "midlayer.post_attention_layernorm.weight": self.post_norm.weight,
            "midlayer.mlp.gate_proj.weight": gate,
            "midlayer.mlp.up_proj.weight": up,
            "midlayer.mlp.down_proj.weight": self.mlp.w_down.weight,
            "norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight,
        }
        tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in tensors.items()}
        return {**tensors, "d2t": d2t.long().contiguous(), "t2d": t2d}

    def load_file_state(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Inverse of state_for_file; a missing or misshapen tensor is a ModelFormatError naming it."""

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ModelFormatError(f"{where}: EAGLE-3 head lacks tensor {name!r}")
            return tensors[name]

        p = "midlayer."
        qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        state = {
            "fc.weight": take("fc.weight"),
            "input_norm.weight": take(p + "input_layernorm.weight"),
            "hidden_norm.weight": take(p + "hidden_norm.weight"),
            "attn.wqkv.weight": qkv,
            "attn.wo.weight": take(p + "self_attn.o_proj.weight"),
            "post_norm.weight": take(p + "post_attention_layernorm.weight"),
            "mlp.w_gate_up.weight": gate_up,
            "mlp.w_down.weight": take(p + "mlp.down_proj.weight"),
            "norm.weight": take("norm.weight"),
            "lm_head.weight": take("lm_head.weight"),
        }
        d2t = tensors.get("d2t")
        vocab = torch.arange(self.cfg.draft_vocab_size) + (0 if d2t is None else d2t.long())
        own = self.state_dict()
        for name, tensor in state.items():
            if tensor.shape != own[name].shape:
                raise ModelFormatError(
                    f"{where}: {name} has shape {list(tensor.shape)}, expected {list(own[name].shape)}"
                )
        self.load_state_dict({**{n: t.float() for n, t in state.items()}, "draft_vocab": vocab}, strict=False)

    def save(self, folder: Path, target: dict) -> None:
        """config.json + model.safetensors in `folder`; `target` (what it was trained on) goes in the metadata."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.cfg.to_json(), indent=2) + "\n")
        save_tensors(self.state_for_file(), folder / WEIGHTS_FILE, metadata={"specchat": json.dumps(target)})

    @classmethod
    def load(cls, folder: Path, target: ModelConfig) -> EagleHead:
        """An EAGLE-3 head directory (ours, or one published for vLLM / SGLang) -> the head, fp32 on the CPU."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        config_file = folder / "config.json"
        try:
            data = json.loads(config_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelFormatError(f"{config_file}: cannot read an EAGLE-3 head config ({exc})") from None
        if not isinstance(data, dict):
            raise ModelFormatError(f"{config_file}: not an EAGLE-3 head config (a JSON object is expected)")
        cfg = EagleConfig.from_json(data, target, str(config_file))
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{folder}: no .safetensors file with the head's weights")
        tensors: dict[str, torch.Tensor] = {}
        try:
            for file in files:
                tensors.update(load_file(str(file)))
        except (OSError, SafetensorError) as exc:
            raise ModelFormatError(f"{folder}: cannot read the head's weights ({exc})") from None
        head = cls(cfg)
        head.load_file_state({name.removeprefix("model."): t for name, t in tensors.items()}, str(folder))
        return head


def check_target(cfg: EagleConfig, model: Transformer, where: str) -> None:
    c = model.cfg
    if cfg.target_hidden_size != c.hidden_size or cfg.vocab_size != c.vocab_size or max(cfg.taps) >= c.num_layers:
        raise ConfigError(
            f"EAGLE-3 head {where} reads hidden {cfg.target_hidden_size}, vocab {cfg.vocab_size}, layers "
            f"{list(cfg.aux_layer_ids)}; this model has hidden {c.hidden_size}, vocab {c.vocab_size}, "
            f"{c.num_layers} layers"
        )


def is_eagle_dir(path: Path) -> bool:
    """Whether `path` is a directory holding an EAGLE-3 head (its config.json names the architecture)."""
    try:
        return ARCHITECTURE in json.loads((path / "config.json").read_text()).get("architectures", [])
    except (OSError, ValueError, AttributeError):
        return False


class EagleDrafter(Drafter):
    """Drafts with an EAGLE-3 head from each request's tapped hidden states, with a KV cache of its own."""

    name = "eagle"
    tap_history = True

    def __init__(self, head: EagleHead, model: Transformer, pool_tokens: int, graphs: bool = True) -> None:
        # (not the target's lm_head weight: an MXFP4 head's is dequantized whole at each read)
        self.device, self.dtype = model.norm.weight.device, model_dtype(model)
        self.head = head.to(device=self.device, dtype=self.dtype).eval()
        if graphs and self.device.type == "cuda":  # the target's fused kernels (engine/fusion.py): one-kernel norms
            fuse(self.head)
            fuse_linears(self.head)
        # the form of the head's linears (`follow_weights`), and the other form's modules, kept in host memory:
        # the dense ones as loaded while MXFP4 runs, the MXFP4 ones once made (a switch back and forth quantizes once)
        self.weights = WEIGHT_FORMATS[0]
        self._other: dict[str, nn.Module] | None = None
        self.cfg = head.cfg
        self.taps = head.cfg.taps
        self._model = model  # its embedding read where used: a weights switch of a tied target replaces the module
        self.vocab_size = model.cfg.vocab_size
        c = head.cfg
        per_token = 2 * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        self.pool = KVPool.from_budget(
            (pool_tokens + DRAFT_SLACK_TOKENS) * per_token,
            1,
            c.num_kv_heads,
            c.head_dim,
            16,
            self.dtype,
            self.device,
            rotate=False,
        )
        self.real: dict[int, int] = {}  # request -> rows of its cache that hold target positions (not drafts)
        self.scale = c.head_dim**-0.5
        # greedy drafting: the chain after the catch-up is one CUDA graph per batch bucket, depth and context
        # bucket; padding rows write to a scratch page of the head's pool and attend to one key there
        layer = c.layer_config()
        self.group = layer.num_heads // layer.num_kv_heads
        graphs = graphs and self.device.type == "cuda" and paged_attention_supported(c.head_dim, self.group, 1)
        self.pool.add(SCRATCH_SEQ, [])  # (on every device: `padded_catch_up` runs on a CPU in the tests)
        self.pool.append(SCRATCH_SEQ, self.pool.page_size)
        self.scratch_page = self.pool.tables[SCRATCH_SEQ][0]
        scratch_slot = self.scratch_page * self.pool.page_size
        self.chain = GraphedFunction(
            self.greedy_chain,
            lambda: tuple(p.data_ptr() for p in self.embed.parameters()),  # (the head's own: `follow_weights`)
            enabled=graphs,
            pads=(0.0, 0.0, 0, scratch_slot, self.scratch_page, 1),
        )
        # the catch-up over each request's newly verified rows, padded to a bucket of rows per request: a graph
        # per batch bucket, rows bucket and context bucket (a prompt's first catch-up, longer, runs eagerly)
        self.catch_up = GraphedFunction(
            self.padded_catch_up,
            lambda: tuple(p.data_ptr() for p in self.embed.parameters()),
            enabled=graphs,
            pads=(0.0, 0, self.scratch_page),
        )

    @property
    def embed(self) -> nn.Module:
        """The target's token embedding as it is now (a dense table, or an MXFP4 head's rows where tied)."""
        return self._model.embed

    def follow_weights(self, fmt: str) -> None:
        """The head's linears take the target's form (config.WEIGHT_FORMATS): MXFP4 (round to nearest, the MSE
        rule) with MXFP4 target weights, the dense ones (as loaded) otherwise. On an 8B target the head is ~0.42B
        weights, 0.85 GB in bf16 read at every draft position; against an MXFP4 target step, which reads ~4 GB at
        4.25 bits, a bf16 head cost 14% of it a position (docs/benchmarks.md, forty-sixth session). Verification
        keeps drafting lossless either way. The chain's and the catch-up's graphs are dropped: they bake in the
        modules' buffers, and modules brought back from host memory are the same objects at new addresses."""
        assert fmt in WEIGHT_FORMATS, fmt
        if fmt == self.weights:
            return
        if self._other is None:  # the first switch to MXFP4: quantized now
            replaced = quantize_linears(self.head, LINEARS, dtype=self.dtype)
        else:
            replaced = swap_modules(self.head, {name: m.to(self.device) for name, m in self._other.items()})
        self._other = {name: module.to("cpu") for name, module in replaced.items()}
        self.weights = fmt
        self.chain.reset()
        self.catch_up.reset()

    @classmethod
    def from_dir(cls, folder: Path, model: Transformer, pool_tokens: int, graphs: bool = True) -> EagleDrafter:
        head = EagleHead.load(folder, model.cfg)
        check_target(head.cfg, model, str(folder))
        return cls(head, model, pool_tokens, graphs)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        # A request without tapped rows (it just switched drafters) skips one step.
        ready = [i for i, seq in enumerate(seqs) if self.taps[0] in seq.hidden]
        drafts = [Draft([]) for _ in seqs]
        if not ready:
            return drafts
        group = [seqs[i] for i in ready]
        ids = [seq.seq_id for seq in group]
        # 1. Catch up on the positions the target processed: their u from the fused taps, their next tokens.
        rows, tokens, firsts = [], [], []
        for seq in group:
            taps = [seq.hidden[t] for t in self.taps]
            m = taps[0].shape[0]
            first = seq.num_cached - m  # position of the first unread row
            if seq.seq_id not in self.real:
                self.pool.add(seq.seq_id, [])
                self.real[seq.seq_id] = 0
            self.pool.truncate(seq.seq_id, self.real[seq.seq_id])  # drop the last step's draft positions
            self.real[seq.seq_id] += m
            rows.append(torch.cat(taps, dim=-1))  # [m, 3h_t]
            tokens.append(seq.all_ids[first + 1 : seq.num_cached + 1])  # x_{i+1} for each row i
            firsts.append(first)
            seq.hidden = {}
        device = self.device
        counts = [r.shape[0] for r in rows]
        width = next((r for r in CATCH_UP_ROWS if r >= max(counts)), None)
        ctx = width and next((b for b in CTX_BUCKETS if b >= max(self.pool.lengths[i] for i in ids) + width), None)
        if (
            ctx
            and self.catch_up.enabled
            and paged_attention_supported(self.cfg.head_dim, self.group, width)
            and self.pool.can_append(dict.fromkeys(ids, width))
        ):
            logits, s = self._graphed_catch_up(ids, rows, tokens, firsts, width, ctx)
        else:
            logits, s = self.eager_catch_up(ids, rows, tokens, firsts)
        # 2. Then one position per further draft: the previous draft's s and token.
        depth = max(ks[i] for i in ready)
        position = torch.tensor([seq.num_cached for seq in group], device=device)
        longest = max(self.pool.lengths[i] for i in ids) + depth
        ctx = next((b for b in CTX_BUCKETS if b >= longest), None)  # the chain's context bucket
        if depth > 1 and ctx is not None and self.chain.enabled and all(seq.sampling.greedy for seq in group):
            steps = self._graphed_steps(ids, depth, ctx, logits, s, position)
        else:
            steps = []
            own = [min(ks[i], depth) for i in ready]  # past its own k a sampled request draws nothing
            for j in range(depth):
                drawing = [j < k for k in own]
                chosen, probs = choose_tokens(group, logits, self.head.draft_vocab, self.vocab_size, drawing)
                steps.append((chosen, probs))
                if j + 1 == depth:
                    break
                kv = self.pool.prepare(ids, [1] * len(group), self.scale)
                logits, s = self.head(self.embed(torch.tensor(chosen, device=device)), s, position + j, kv)
        for b, i in enumerate(ready):
            k = min(ks[i], depth)
            qs = [steps[j][1][b] for j in range(k)]
            drafts[i] = Draft([steps[j][0][b] for j in range(k)], None if qs[0] is None else torch.stack(qs))
        return drafts

    def eager_catch_up(
        self, ids: list[int], rows: list[torch.Tensor], tokens: list[list[int]], firsts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over each request's unread rows (fused taps [m, 3h_t], the tokens after them, the first one's
        position) -> the draft logits [B, Vd] and state s [B, h] at each request's newest row; the reference of
        `padded_catch_up`."""
        device, counts = self.device, [r.shape[0] for r in rows]
        u = self.head.fc(torch.cat(rows).to(self.dtype))
        kv = self.pool.prepare(ids, counts, self.scale)
        flat = [t for request in tokens for t in request]
        positions = [p for first, m in zip(firsts, counts, strict=True) for p in range(first, first + m)]
        logits, s = self.head(
            self.embed(torch.tensor(flat, device=device)), u, torch.tensor(positions, device=device), kv
        )
        last = torch.tensor(counts, device=device).cumsum(0) - 1
        return logits[last], s[last]

    def _graphed_catch_up(
        self, ids: list[int], rows: list[torch.Tensor], tokens: list[list[int]], firsts: list[int], width: int, ctx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`eager_catch_up` through `catch_up`: each request's rows padded to `width`, as many slots reserved in the
        pool (the padding's truncated again after), one packed int64 row a request (tokens, positions, slots, row
        count, context before)."""
        before = [self.pool.lengths[i] for i in ids]
        counts = [r.shape[0] for r in rows]
        tables, _, slots = self.pool.reserve(ids, [width] * len(ids))
        ints = []
        for b, m in enumerate(counts):
            pad = [0] * (width - m)
            ints.extend(tokens[b] + pad)
            ints.extend([*range(firsts[b], firsts[b] + m), *pad])
            ints.extend(slots[b * width : (b + 1) * width])
            ints.extend((m, before[b]))
        taps = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        if taps.shape[1] < width:
            taps = torch.nn.functional.pad(taps, (0, 0, 0, width - taps.shape[1]))
        device, pages = self.device, ctx // self.pool.page_size
        out = self.catch_up(
            (width, ctx),
            taps.to(self.dtype),
            torch.tensor(ints, device=device).view(len(ids), 3 * width + 2),
            torch.tensor(
                [t + [self.scratch_page] * (pages - len(t)) for t in tables], dtype=torch.int32, device=device
            ),
        )
        for i, n, m in zip(ids, before, counts, strict=True):
            self.pool.truncate(i, n + m)
        return out

    def padded_catch_up(
        self, key: tuple[int, int], taps: torch.Tensor, ints: torch.Tensor, tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up of `width` rows a request (key: width, context bucket), all on the device: fused taps [B,
        width, 3h_t], per request [tokens | positions | slots (width each) | rows m | context before] int64 and its
        block table [B, ctx / page] int32 -> draft logits [B, Vd] and state s [B, h] at row m - 1.

        Rows past m read token 0 at position 0 and write their keys to their own slots past the request's end
        (truncated after), which the real rows, attending causally, never weigh; but the kernel's tiles read them, so
        they must hold numbers this step wrote, not a page's stale bytes (0 x NaN is NaN). Padding requests (m = 0)
        write to the scratch page. `eager_catch_up` is its reference."""
        width, ctx = key
        b, device = taps.shape[0], taps.device
        counts, before = ints[:, 3 * width], ints[:, 3 * width + 1]
        real = torch.arange(width, device=device) < counts[:, None]  # [B, width]
        tokens = ints[:, :width].masked_fill(~real, 0).reshape(-1)
        positions = ints[:, width : 2 * width].masked_fill(~real, 0).reshape(-1)
        scratch = self.scratch_page * self.pool.page_size
        slots = ints[:, 2 * width : 3 * width].masked_fill((counts == 0)[:, None], scratch).reshape(-1)
        q_starts = torch.arange(b, dtype=torch.int32, device=device) * width
        q_lens = torch.full((b,), width, dtype=torch.int32, device=device)
        ctx_lens = (before + width).to(torch.int32)
        meta = AttentionMetadata(tables, q_starts, q_lens, ctx_lens, width, ctx, self.pool.page_size)
        kv = StaticKVBatch(self.pool, meta, slots, width, self.scale)
        u = self.head.fc(taps.reshape(b * width, -1))
        logits, s = self.head(self.embed(tokens), u, positions, kv)
        last = q_starts.long() + counts - 1
        return logits[last], s[last]

    def _graphed_steps(
        self, ids: list[int], depth: int, ctx: int, logits: torch.Tensor, s: torch.Tensor, position: torch.Tensor
    ) -> list[tuple[list[int], list[None]]]:
        """The greedy chain's drafts through `chain`: the pool's room for every draft position is reserved up front
        (what the eager loop reserves position by position), the rest runs on the device."""
        before = [self.pool.lengths[i] for i in ids]
        tables, _, slots = self.pool.reserve(ids, [depth - 1] * len(ids))
        width, device = ctx // self.pool.page_size, logits.device
        padded = [t + [self.scratch_page] * (width - len(t)) for t in tables]
        tokens = self.chain(
            (depth, ctx),
            logits,
            s,
            position,
            torch.tensor(slots, device=device).view(len(ids), depth - 1),
            torch.tensor(padded, dtype=torch.int32, device=device),
            torch.tensor(before, dtype=torch.int32, device=device),
        ).tolist()
        return [([row[j] for row in tokens], [None] * len(ids)) for j in range(depth)]

    def greedy_chain(
        self,
        key: tuple[int, int],
        logits: torch.Tensor,
        s: torch.Tensor,
        position: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        ctx0: torch.Tensor,
    ) -> torch.Tensor:
        """From the catch-up's draft logits [B, Vd] and state s [B, h]: the greedy drafts [B, depth], draft j + 1
        read at position + j with its keys written at slots[:, j] (block tables [B, ctx / page], context ctx0 + j + 1
        of a bucket of ctx), all on the device. The position-by-position loop of `propose` is its reference."""
        depth, ctx = key
        b, device = logits.shape[0], logits.device
        q_starts = torch.arange(b, dtype=torch.int32, device=device)
        q_lens = torch.ones(b, dtype=torch.int32, device=device)
        tokens = []
        for j in range(depth):
            token = self.head.draft_vocab[logits.argmax(-1)]
            tokens.append(token)
            if j + 1 == depth:
                break
            meta = AttentionMetadata(tables, q_starts, q_lens, ctx0 + (j + 1), 1, ctx, self.pool.page_size)
            kv = StaticKVBatch(self.pool, meta, slots[:, j].contiguous(), 1, self.scale)
            logits, s = self.head(self.embed(token), s, position + j, kv)
        return torch.stack(tokens, dim=1)

    def warm_up(self, sessions: int) -> None:
        """Capture the chain's and the catch-up's graphs for k = 2..4 (the default k and below), every batch bucket up
        to `sessions`'."""
        c, device, dtype = self.cfg, self.device, self.dtype
        width, k_max = CTX_BUCKETS[0] // self.pool.page_size, 4

        def row(key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
            depth = key[0]
            return (
                torch.zeros(1, c.draft_vocab_size, device=device),
                torch.zeros(1, c.hidden_size, dtype=dtype, device=device),
                torch.zeros(1, dtype=torch.long, device=device),
                torch.zeros(1, depth - 1, dtype=torch.long, device=device),
                torch.zeros(1, width, dtype=torch.int32, device=device),
                torch.zeros(1, dtype=torch.int32, device=device),
            )

        self.chain.warm_up(sessions, [(depth, CTX_BUCKETS[0]) for depth in range(2, k_max + 1)], row)

        def catch_up_row(key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
            rows = key[0]
            return (
                torch.zeros(1, rows, 3 * c.target_hidden_size, dtype=dtype, device=device),
                torch.zeros(1, 3 * rows + 2, dtype=torch.long, device=device),
                torch.full((1, width), self.scratch_page, dtype=torch.int32, device=device),
            )

        widths = [(rows, CTX_BUCKETS[0]) for rows in CATCH_UP_ROWS if rows <= k_max + 1]
        self.catch_up.warm_up(sessions, widths, catch_up_row)

    def release(self, seq: Sequence) -> None:
        if self.real.pop(seq.seq_id, None) is not None:
            self.pool.free(seq.seq_id)
