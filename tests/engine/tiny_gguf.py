"""A tiny random Llama as a GGUF file (float32 tensors, the test tokenizer as GGUF metadata): the GGUF paths of the
loader, its weights cache and the tokenizer conversion, without the default model's download."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.tiny_tokenizer import CHATML_TEMPLATE, tiny_tokenizer_json

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 512, 64, 128, 2, 4, 2


def write_tiny_gguf(path: Path, seed: int = 0, blocks: bool = False) -> Path:
    """A 2-layer llama GGUF with a byte-level BPE vocabulary (ids 0-2 special, bos 1, eos 2) and a ChatML template;
    with `blocks`, the linears' weights stored as Q8_0 blocks (what the CPU block kernels read), else float32."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize

    model = json.loads(tiny_tokenizer_json(VOCAB))["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
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
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_q.weight": (HEADS * head_dim, HIDDEN),
            b + "attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
            b + "attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
            b + "attn_output.weight": (HIDDEN, HEADS * head_dim),
            b + "attn_norm.weight": (HIDDEN,),
            b + "ffn_norm.weight": (HIDDEN,),
            b + "ffn_gate.weight": (FFN, HIDDEN),
            b + "ffn_up.weight": (FFN, HIDDEN),
            b + "ffn_down.weight": (HIDDEN, FFN),
        }
    for name, shape in shapes.items():
        data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if blocks and len(shape) == 2 and name != "token_embd.weight":
            q8 = GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quantize(data, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
