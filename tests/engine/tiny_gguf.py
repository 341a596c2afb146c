"""A tiny random Llama as a GGUF file (float32 tensors, the test tokenizer as GGUF metadata): the GGUF paths of the
loader, its weights cache and the tokenizer conversion, without the default model's download."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.tiny_tokenizer import CHATML_TEMPLATE, tiny_tokenizer_json

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 512, 64, 128, 2, 4, 2
KQUANT_HIDDEN, KQUANT_FFN = 256, 512  # K-quant rows hold super-blocks of 256

# A Q4_K_M-like file's types (llama.cpp's mix: Q4_K, with Q6_K for attn_v, ffn_down and the output head)
KQUANT_TYPES = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"}

# bytes of a K-quant super-block of 256 values and the offsets of its float16 scales (set to `KQUANT_SCALES`)
KQUANT_LAYOUT = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}
KQUANT_SCALES = {"Q4_K": 2.0**-13, "Q5_K": 2.0**-14, "Q6_K": 2.0**-16}  # powers of two: |w| stays under ~0.1


def random_kquant(gguf_type: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of a [rows, columns] tensor of a K-quant type with sane float16 scales (gguf-py has no K-quant
    quantizer; its dequantizer reads them): every code, sub-block scale and min of the format drawn at random."""
    size, offsets = KQUANT_LAYOUT[gguf_type]
    raw = rng.integers(0, 256, size=(rows * columns // 256, size), dtype=np.uint8)
    scale = np.array([KQUANT_SCALES[gguf_type]], dtype=np.float16).view(np.uint8)
    for offset in offsets:
        raw[:, offset : offset + 2] = scale
    return raw.reshape(rows, -1)


def write_tiny_gguf(
    path: Path,
    seed: int = 0,
    blocks: bool = False,
    kquants: bool = False,
    shape: tuple[int, ...] | None = None,
    tied: bool = False,
) -> Path:
    """A 2-layer llama GGUF with a byte-level BPE vocabulary (ids 0-2 special, bos 1, eos 2) and a ChatML template;
    with `blocks`, the linears' weights stored as Q8_0 blocks (what the CPU block kernels read), else float32; with
    `kquants`, 256 wide and stored as a Q4_K_M file stores them (Q4_K, Q6_K: KQUANT_TYPES). `shape`: (hidden, ffn,
    layers, heads, kv heads) instead (benchmarks/cpu_gguf_large.py writes a 1B-parameter one). `tied`: no output
    tensor (the head is the embedding). With `kquants` the embedding is Q6_K."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize

    hidden, ffn, layers, heads, kv_heads = shape or (
        (KQUANT_HIDDEN, KQUANT_FFN, LAYERS, HEADS, KV_HEADS) if kquants else (HIDDEN, FFN, LAYERS, HEADS, KV_HEADS)
    )

    model = json.loads(tiny_tokenizer_json(VOCAB))["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_context_length(256)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([TokenType.CONTROL if i < 3 else TokenType.NORMAL for i in range(len(tokens))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML_TEMPLATE)
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    shapes = {"token_embd.weight": (VOCAB, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (VOCAB, hidden)
    for i in range(layers):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_q.weight": (heads * head_dim, hidden),
            b + "attn_k.weight": (kv_heads * head_dim, hidden),
            b + "attn_v.weight": (kv_heads * head_dim, hidden),
            b + "attn_output.weight": (hidden, heads * head_dim),
            b + "attn_norm.weight": (hidden,),
            b + "ffn_norm.weight": (hidden,),
            b + "ffn_gate.weight": (ffn, hidden),
            b + "ffn_up.weight": (ffn, hidden),
            b + "ffn_down.weight": (hidden, ffn),
        }
    for name, dims in shapes.items():
        if kquants and len(dims) == 2:
            kind = KQUANT_TYPES.get(name.split(".")[-2], "Q6_K" if name == "token_embd.weight" else "Q4_K")
            writer.add_tensor(name, random_kquant(kind, *dims, rng), raw_dtype=GGMLQuantizationType[kind])
            continue
        data = (rng.standard_normal(dims) * 0.05).astype(np.float32)
        if blocks and len(dims) == 2 and name != "token_embd.weight":
            q8 = GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quantize(data, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
