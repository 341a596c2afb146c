"""Checkpoints -> our Transformer: GGUF files (through the `gguf` package) and HF safetensors directories.

Both paths produce a ModelConfig and a state dict in our parameter names (model.py): q/k/v are concatenated
into `wqkv`, gate/up into `w_gate_up`. Everything a user can get wrong (missing or truncated files, an
unsupported architecture, shapes that do not match the config) ends in a ModelFormatError naming it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path

import numpy as np
import torch

from specchat.config import HF_ARCHITECTURES
from specchat.engine.gguf_file import GGUFFile, dequantize
from specchat.engine.model import ModelConfig, RotaryEmbedding, Transformer, skeleton
from specchat.engine.weights_cache import read_converted, write_converted
from specchat.errors import ModelFormatError, path_problem
from specchat.quant.checkpoint import is_mxfp4_checkpoint, read_mxfp4_state
from specchat.safetensors_io import read_json_object, read_safetensors

Progress = Callable[[str, int, int], None]  # (what, done, total)
# (config, GGUF tensors by name) -> the names of those the caller reads another way (load_gguf's `defer`)
Deferral = Callable[[ModelConfig, dict[str, object]], set[str]]

SUPPORTED_GGUF = ("llama", "qwen2")
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what a checkpoint's tensors may be
GGUF_CACHE_MAX_BYTES = 2 << 30  # dequantized GGUF weights are cached for models up to this size in float32

log = logging.getLogger(__name__)

# GGUF files parsed within one_parse_per_file(), per thread (a context variable: another thread's load, the TUI's
# on its executor, has its own)
_readers: ContextVar[dict[Path, GGUFFile] | None] = ContextVar("gguf_readers", default=None)


@contextlib.contextmanager
def one_parse_per_file() -> Iterator[None]:
    """Within it, `gguf_reader` parses each GGUF file once: a first load reads its tensors for the float weights
    and again for the CPU kernels' blocks (a parse maps the file and reads its vocabulary: ~0.1 s)."""
    outer = _readers.get()
    token = _readers.set({} if outer is None else outer)  # (nested: the outer scope's)
    try:
        yield
    finally:
        _readers.reset(token)


def gguf_reader(path: Path) -> GGUFFile:
    """The parsed GGUF file at `path` (shared within one_parse_per_file). Raises ModelFormatError on a file that
    cannot be opened or is damaged."""
    shared = _readers.get()
    if shared is not None and path in shared:
        return shared[path]
    reader = GGUFFile(path)
    if shared is not None:
        shared[path] = reader
    return reader


# --- checking a model's shape -------------------------------------------------------------------------------
def positive_int(value, key: str, where: Path) -> int:
    """A shape entry of a config: a positive integer (not a bool, a string or a float), else ModelFormatError."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ModelFormatError(f"{where}: {key} must be a positive integer, got {value!r}")
    return int(value)


def positive_float(value, key: str, where: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number) or not 0 < value < math.inf:
        raise ModelFormatError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def token_ids(value, key: str, where: Path) -> tuple[int, ...]:
    """A token id or a list of them (None: none)."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
            raise ModelFormatError(f"{where}: {key} must be a token id or a list of them, got {value!r}")
    return tuple(int(v) for v in values)


def check_shape(cfg: ModelConfig, where: Path) -> ModelConfig:
    """Relations between the shape entries that the model code relies on."""
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelFormatError(
            f"{where}: {cfg.num_heads} attention heads cannot be shared by {cfg.num_kv_heads} key/value heads"
        )
    if cfg.head_dim % 2:
        raise ModelFormatError(f"{where}: the head dimension must be even for rotary embeddings, got {cfg.head_dim}")
    return cfg


# --- GGUF -----------------------------------------------------------------------------------------------
def gguf_config(reader, path: Path) -> ModelConfig:
    arch = reader.get("general.architecture")
    if arch not in SUPPORTED_GGUF:
        raise ModelFormatError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_GGUF)})")

    def number(key: str, default=None, check=positive_int):
        value = reader.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFormatError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return check(value, f"{arch}.{key}", path)

    tokens = reader.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelFormatError(f"{path}: GGUF metadata lacks tokenizer.ggml.tokens (the vocabulary)")
    hidden, heads = number("embedding_length"), number("attention.head_count")
    names = {t.name for t in reader.tensors}
    special = lambda kind: token_ids(reader.get(f"tokenizer.ggml.{kind}_token_id"), f"{kind} token id", path)
    bos = special("bos")
    cfg = ModelConfig(
        arch=arch,
        vocab_size=number("vocab_size", len(tokens)),
        hidden_size=hidden,
        intermediate_size=number("feed_forward_length"),
        num_layers=number("block_count"),
        num_heads=heads,
        num_kv_heads=number("attention.head_count_kv", heads),
        head_dim=number("attention.key_length", hidden // heads),
        rope_theta=number("rope.freq_base", 10000.0, positive_float),
        rms_norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5, positive_float),
        max_position=number("context_length", 4096),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=special("eos"),
    )
    # the model rotates and attends over whole heads of one width: a file that says otherwise (partial rotary, values
    # of another width) would load and answer wrongly without a word
    for key in ("rope.dimension_count", "attention.value_length"):
        if reader.get(f"{arch}.{key}") is not None and number(key) != cfg.head_dim:
            raise ModelFormatError(
                f"{path}: {arch}.{key} is {number(key)}, not the head dimension {cfg.head_dim} (not supported)"
            )
    return check_shape(cfg, path)


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows (interleaved rotary pairs -> HF's rotate-half halves)."""
    rows, cols = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *cols).swapaxes(1, 2).reshape(rows, *cols)


def load_gguf(
    path: Path, progress: Progress | None = None, cache: Path | None = None, defer: Deferral | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read and dequantize every tensor of a GGUF file (float32), renamed to our parameter names.

    Parsing and dequantizing take seconds; with `cache` (a safetensors path) the result is saved once, for
    models of up to GGUF_CACHE_MAX_BYTES in float32, and later loads read it back in a fraction of that. The
    cache heals itself: a cached file that does not load (truncated, not safetensors, tensors that do not fit
    its config) is deleted and rebuilt from the GGUF file, with a note on stderr and in the progress label; a
    cache that cannot be written (a full disk, a read-only folder) is skipped with a note.

    `defer(cfg, tensors)` names GGUF tensors the caller reads another way (the CPU kernels' blocks:
    cpu_weights.deferred_tensors); in a model too large for the cache they are not dequantized but left as meta
    tensors of their shape, so that a large K-quant file on the CPU never holds its linears in float32 (an 8B
    model: 32 GB) on the way to its blocks.
    """
    if cache is not None and cache.exists():
        try:
            return read_converted(cache)
        except (ModelFormatError, OSError) as exc:
            log.warning("specchat: note: %s; rebuilding it from %s", exc, path.name)
            with contextlib.suppress(OSError):  # a file we may not remove is replaced by the rebuilt one, or skipped
                cache.unlink()
            progress = _relabelled(progress, "rebuilding the unreadable cache")
    cfg, sd = _load_gguf(path, progress, defer)
    deferred = any(t.is_meta for t in sd.values())
    if cache is not None and not deferred and sum(t.numel() for t in sd.values()) * 4 <= GGUF_CACHE_MAX_BYTES:
        check_state(skeleton(cfg).state_dict(), sd, path)  # (a model that cannot be built is not cached)
        write_converted(cache, cfg, sd)
    return cfg, sd


def _relabelled(progress: Progress | None, why: str) -> Progress | None:
    """The same progress callback, each label followed by `why`."""
    if progress is None:
        return None
    return lambda what, done, total: progress(f"{what} ({why})", done, total)


def _load_gguf(
    path: Path, progress: Progress | None, defer: Deferral | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = gguf_reader(path)
    cfg = gguf_config(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    large = sum(int(np.prod(t.shape)) for t in reader.tensors) * 4 > GGUF_CACHE_MAX_BYTES
    deferred = defer(cfg, tensors) if defer is not None and large else set()
    raw: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        if t.name in deferred:  # its shape only: gguf lists a tensor's dimensions innermost first
            raw[t.name] = torch.empty(tuple(int(n) for n in reversed(t.shape)), device="meta")
            continue
        try:
            raw[t.name] = dequantize(t)
        except Exception as exc:
            raise ModelFormatError(f"{path}: cannot read tensor {t.name} ({exc})") from None
        if not math.isfinite(raw[t.name].sum()):  # a NaN or an infinity makes the sum one (a pass, no copy)
            raise ModelFormatError(f"{path}: tensor {t.name} holds NaN or infinite values (a damaged file)")
        if progress:
            progress("loading weights", i + 1, total)
    if "rope_freqs.weight" in raw:
        factors = raw.pop("rope_freqs.weight")
        if tuple(factors.shape) != (cfg.head_dim // 2,):  # (one factor per rotary pair; else the first step failed)
            shape = tuple(factors.shape)
            raise ModelFormatError(
                f"{path}: tensor rope_freqs.weight has shape {shape}, the config implies ({cfg.head_dim // 2},)"
            )
        scaling = {"rope_type": "freq_factors", "factors": factors.tolist()}
        cfg.rope_scaling = rope_scaling(scaling, path, cfg.head_dim)  # (checked as config.json's are)
    return cfg, _rename_gguf(raw, cfg, path)


def _tensor_getter(raw: dict[str, torch.Tensor], path: Path):
    """(take, taken): take(name[, rows]) is raw[name] (with `rows` rows if given), or a ModelFormatError naming the
    tensor and the file; taken the names it was asked for (`_check_all_read`)."""

    def take(name: str, rows: int | None = None) -> torch.Tensor:
        if name not in raw:
            raise ModelFormatError(f"{path}: missing tensor {name}")
        taken.add(name)
        if raw[name].dtype not in WEIGHT_DTYPES:  # (float8, integers and bools are not weights it computes with)
            kinds = ", ".join(str(d).removeprefix("torch.") for d in WEIGHT_DTYPES)
            what = str(raw[name].dtype).removeprefix("torch.")
            raise ModelFormatError(f"{path}: tensor {name} is stored as {what} (supported: {kinds})")
        if rows is not None and (raw[name].dim() == 0 or raw[name].shape[0] != rows):
            shape = tuple(raw[name].shape)
            raise ModelFormatError(f"{path}: tensor {name} has shape {shape}, the config implies {rows} rows")
        return raw[name]

    taken: set[str] = set()
    return take, taken


def _check_all_read(raw: dict[str, torch.Tensor], taken: set[str], prefix: str, path: Path) -> None:
    """A layer's tensor that the model has no place for (`prefix` "blk." or "model.layers."): an o_proj or MLP
    bias (Llama's attention_bias, mlp_bias), another architecture's piece. Left out, the model answered wrongly
    without a word. (Rotary tables that old checkpoints saved are recomputed, not read.)"""
    for name in raw:
        if name.startswith(prefix) and name not in taken and "rotary_emb" not in name:
            raise ModelFormatError(f"{path}: tensor {name} has no place in the model (not supported)")


def _check_layer_count(names, prefix: str, cfg: ModelConfig, key: str, path: Path) -> None:
    """Tensors of a layer past the config's count (`prefix` "blk." or "model.layers."): the file holds more layers
    than `key` says, which would load as a model cut short without a word."""
    for name in names:
        index = name[len(prefix) :].partition(".")[0] if name.startswith(prefix) else ""
        if index.isdigit() and int(index) >= cfg.num_layers:
            raise ModelFormatError(
                f"{path}: tensor {name} is of layer {index}, but {key} says the model has {cfg.num_layers}"
            )


def _cat_rows(parts: list[torch.Tensor], what: str, path: Path) -> torch.Tensor:
    """Tensors fused along rows (q/k/v, gate/up), which must agree in every other dimension."""
    if len({tuple(t.shape[1:]) for t in parts}) > 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in parts)
        raise ModelFormatError(f"{path}: the {what} tensors do not fit together (shapes {shapes})")
    if all(t.is_meta for t in parts):  # deferred weights (load_gguf's `defer`): torch.cat's meta kernel imports
        # torch._dynamo, 1.5-1.6 s of a 2.4 s load of a 1B GGUF from its blocks cache (2-core Xeon)
        rows = sum(t.shape[0] for t in parts)
        return torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype, device="meta")
    return torch.cat(parts)


def _rename_gguf(raw: dict[str, torch.Tensor], cfg: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    _check_layer_count(raw, "blk.", cfg, f"{cfg.arch}.block_count", path)
    take, taken = _tensor_getter(raw, path)
    permuted = cfg.arch == "llama"  # llama.cpp permutes q/k rows only for its llama architecture
    sd = {"embed.weight": take("token_embd.weight"), "norm.weight": take("output_norm.weight")}
    sd["lm_head.weight"] = raw.get("output.weight", sd["embed.weight"])
    for i in range(cfg.num_layers):
        b, o = f"blk.{i}.", f"layers.{i}."
        q, k = take(b + "attn_q.weight", cfg.q_size), take(b + "attn_k.weight", cfg.kv_size)
        if permuted:
            q, k = _unpermute_rope(q, cfg.num_heads), _unpermute_rope(k, cfg.num_kv_heads)
        sd[o + "attn.wqkv.weight"] = _cat_rows([q, k, take(b + "attn_v.weight")], b + "attn q/k/v", path)
        if cfg.qkv_bias:
            qb, kb = take(b + "attn_q.bias", cfg.q_size), take(b + "attn_k.bias", cfg.kv_size)
            if permuted:
                qb, kb = _unpermute_rope(qb, cfg.num_heads), _unpermute_rope(kb, cfg.num_kv_heads)
            sd[o + "attn.wqkv.bias"] = _cat_rows([qb, kb, take(b + "attn_v.bias")], b + "attn bias", path)
        sd[o + "attn.wo.weight"] = take(b + "attn_output.weight")
        sd[o + "attn_norm.weight"] = take(b + "attn_norm.weight")
        sd[o + "mlp_norm.weight"] = take(b + "ffn_norm.weight")
        gate_up = [take(b + "ffn_gate.weight"), take(b + "ffn_up.weight")]
        sd[o + "mlp.w_gate_up.weight"] = _cat_rows(gate_up, b + "ffn gate/up", path)
        sd[o + "mlp.w_down.weight"] = take(b + "ffn_down.weight")
    _check_all_read(raw, taken, "blk.", path)
    return sd


# --- HF safetensors directories ----------------------------------------------------------------------------
def hf_config(path: Path) -> ModelConfig:
    """config.json (and generation_config.json's stop tokens) of an HF-style directory -> ModelConfig."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelFormatError(f"{path}: no config.json (not an HF-style model directory)")
    c = read_json_object(cfg_file)
    model_type = c.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ModelFormatError(
            f"{path}: unsupported architecture {model_type!r} (supported: {', '.join(HF_ARCHITECTURES)})"
        )

    def number(key: str, default=None, check=positive_int):
        value = c.get(key)
        if value is None and default is None:
            raise ModelFormatError(f"{cfg_file}: missing key {key!r}")
        return check(default if value is None else value, key, cfg_file)

    heads, hidden = number("num_attention_heads"), number("hidden_size")
    if c.get("hidden_act", "silu") != "silu":  # (the MLP is SwiGLU: another activation would answer wrongly)
        raise ModelFormatError(f"{cfg_file}: hidden_act {c['hidden_act']!r} is not supported (only 'silu')")
    # transformers >= 5 writes rope settings (theta included) as "rope_parameters"; older files as rope_scaling
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelFormatError(f"{cfg_file}: rope_scaling must be an object, got {rope!r}")
    head_dim = number("head_dim", hidden // heads)
    scaling = rope_scaling(rope, cfg_file, head_dim)
    eos_ids = token_ids(c.get("eos_token_id"), "eos_token_id", cfg_file)
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        eos_ids += token_ids(read_json_object(gen_cfg).get("eos_token_id"), "eos_token_id", gen_cfg)
    bos = token_ids(c.get("bos_token_id"), "bos_token_id", cfg_file)
    cfg = ModelConfig(
        arch=model_type,
        vocab_size=number("vocab_size"),
        hidden_size=hidden,
        intermediate_size=number("intermediate_size"),
        num_layers=number("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=number("num_key_value_heads", heads),
        head_dim=head_dim,
        rope_theta=positive_float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0, "rope_theta", cfg_file),
        rms_norm_eps=number("rms_norm_eps", 1e-6, positive_float),
        max_position=number("max_position_embeddings", 4096),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(c.get("attention_bias", False)),
        rope_scaling=scaling,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
    )
    return check_shape(cfg, cfg_file)


def rope_scaling(rope: dict, cfg_file: Path, head_dim: int) -> dict | None:
    """config.json's rope settings -> the scaling model.rope_inv_freq computes (None: plain RoPE), checked: a kind
    it does not compute (yarn, dynamic: a ValueError traceback as the model was built) or a factor it cannot use (a
    KeyError or ValueError traceback; a factor of 0 made every frequency infinite, answers of garbage).
    "freq_factors" is a GGUF's rope_freqs.weight, kept by the MXFP4 checkpoints `specchat quantize` writes."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind == "freq_factors":
        factors = rope.get("factors")
        if not isinstance(factors, list) or len(factors) != head_dim // 2:
            raise ModelFormatError(f"{cfg_file}: the rope scaling's factors must be {head_dim // 2} numbers")
        for value in factors:
            positive_float(value, "a rope scaling factor", cfg_file)
        return rope
    if kind not in ("linear", "llama3"):
        raise ModelFormatError(f"{cfg_file}: rope scaling {kind!r} is not supported (supported: linear, llama3)")
    positive_float(rope.get("factor"), "the rope scaling's factor", cfg_file)
    if kind == "llama3":
        positive_float(rope.get("original_max_position_embeddings"), "original_max_position_embeddings", cfg_file)
        low = positive_float(rope.get("low_freq_factor", 1.0), "low_freq_factor", cfg_file)
        if positive_float(rope.get("high_freq_factor", 4.0), "high_freq_factor", cfg_file) <= low:
            raise ModelFormatError(f"{cfg_file}: the rope scaling's high_freq_factor must be above low_freq_factor")
    return rope


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        valid = isinstance(weight_map, dict) and weight_map
        valid = valid and all(isinstance(n, str) and n and Path(n).name == n for n in weight_map.values())
        if not valid:
            raise ModelFormatError(f"{index}: weight_map must map tensor names to file names in {path}")
        files = [path / n for n in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path}: no *.safetensors files")
    for f in files:
        if not f.is_file():
            raise ModelFormatError(f"{path}: missing weight file {f.name}")
    return files


def load_hf_dir(path: Path, progress: Progress | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = hf_config(path)
    raw: dict[str, torch.Tensor] = {}
    files = safetensors_files(path)
    where: dict[str, Path] = {}
    for i, file in enumerate(files):
        tensors = read_safetensors(file)
        if twice := next((name for name in tensors if name in raw), None):  # (a stray copy beside the shards)
            raise ModelFormatError(f"{path}: tensor {twice} is in both {where[twice].name} and {file.name}")
        raw.update(tensors)
        where.update(dict.fromkeys(tensors, file))
        if progress:
            progress("loading weights", i + 1, len(files))
    return cfg, _rename_hf(raw, cfg, path)


def _rename_hf(raw: dict[str, torch.Tensor], cfg: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    _check_layer_count(raw, "model.layers.", cfg, "num_hidden_layers in config.json", path)
    take, taken = _tensor_getter(raw, path)
    sd = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    sd["lm_head.weight"] = sd["embed.weight"] if cfg.tie_embeddings else take("lm_head.weight")
    for i in range(cfg.num_layers):
        b, o = f"model.layers.{i}.", f"layers.{i}."
        a = b + "self_attn."
        sd[o + "attn.wqkv.weight"] = _cat_rows([take(a + f"{p}_proj.weight") for p in "qkv"], a + "q/k/v", path)
        if cfg.qkv_bias:
            sd[o + "attn.wqkv.bias"] = _cat_rows([take(a + f"{p}_proj.bias") for p in "qkv"], a + "bias", path)
        sd[o + "attn.wo.weight"] = take(a + "o_proj.weight")
        sd[o + "attn_norm.weight"] = take(b + "input_layernorm.weight")
        sd[o + "mlp_norm.weight"] = take(b + "post_attention_layernorm.weight")
        gate_up = [take(b + "mlp.gate_proj.weight"), take(b + "mlp.up_proj.weight")]
        sd[o + "mlp.w_gate_up.weight"] = _cat_rows(gate_up, b + "mlp gate/up", path)
        sd[o + "mlp.w_down.weight"] = take(b + "mlp.down_proj.weight")
    _check_all_read(raw, taken, "model.layers.", path)
    return sd


def load_mxfp4_dir(path: Path, progress: Progress | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """An MXFP4 checkpoint (quant.checkpoint) -> (config, state with dense stand-ins plus the packed linears)."""
    cfg = hf_config(path)
    state = read_mxfp4_state(path, progress)
    if cfg.tie_embeddings:
        state.setdefault("lm_head.weight", state["embed.weight"])
    return cfg, state


# --- building the module ------------------------------------------------------------------------------------
def _placed(t: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`t` on the device in `dtype`; a meta tensor (a deferred GGUF tensor: load_gguf) stays one, in `dtype`."""
    return t.to(dtype=dtype) if t.is_meta else t.to(device=device, dtype=dtype)


def check_state(expected: dict[str, torch.Tensor], state_dict: dict[str, torch.Tensor], where: Path | None) -> None:
    """Every tensor of the model (`expected`: a skeleton's state dict) in `state_dict`, of its shape; else a
    ModelFormatError naming the checkpoint `where`."""
    named = f"{where}: " if where is not None else ""
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise ModelFormatError(
            f"{named}checkpoint lacks {missing[0]}" + (f" and {len(missing) - 1} more" if missing[1:] else "")
        )
    for name, ref in expected.items():
        got, implied = tuple(state_dict[name].shape), tuple(ref.shape)
        if got != implied:
            raise ModelFormatError(f"{named}tensor {name} has shape {got}, the config implies {implied}")


def build_model(
    cfg: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
    where: Path | None = None,
) -> Transformer:
    """Instantiate the Transformer and load the state dict, checking every shape against the config; `where`: the
    checkpoint, which the errors name (a draft model's or the target's)."""
    model = skeleton(cfg)
    expected = model.state_dict()
    check_state(expected, state_dict, where)
    tensors = {name: _placed(state_dict[name], dtype, device) for name in expected}
    if cfg.tie_embeddings:
        tensors["lm_head.weight"] = tensors["embed.weight"]
    model.load_state_dict(tensors, assign=True, strict=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.rope = RotaryEmbedding(cfg).to(device)  # non-persistent buffers were left on meta
    return model.eval().requires_grad_(False)


def load_checkpoint(
    path: Path, progress: Progress | None = None, cache: Path | None = None, defer: Deferral | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A GGUF file or an HF-style directory -> (config, state dict in our names); `cache`, `defer`: see
    load_gguf."""
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file or directory")
    if path.is_dir():
        try:  # (a folder we may not list or enter: globs find nothing in it, stats of its files raise)
            os.listdir(path)
        except OSError as exc:
            raise ModelFormatError(f"{path}: cannot read the directory ({exc.strerror or exc})") from None
        if is_mxfp4_checkpoint(path):  # written by `specchat quantize`: the state also holds packed linears
            return load_mxfp4_dir(path, progress)
        return load_hf_dir(path, progress)
    if problem := path_problem(path, str(path)):  # a FIFO named x.gguf: opening it waits for a writer, forever
        raise ModelFormatError(problem)
    if path.suffix.lower() == ".gguf":
        return load_gguf(path, progress, cache, defer)
    raise ModelFormatError(f"{path}: expected a .gguf file or a directory with config.json + *.safetensors")
