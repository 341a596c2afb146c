"""Broken inputs for the CLI fuzz suite (test_fuzz.py): text files, models with one file damaged, GGUF headers,
draft heads files, $SPECCHAT_HOME folders and agent scripts, built from the tiny test model."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

BAD_UTF8 = b"hello \xff\xfe world\n"
BROKEN_CONFIG_ENTRIES = {  # config.json entries -> what the error line must say
    "heads_string": ({"num_attention_heads": "two"}, "num_attention_heads"),
    "heads_zero": ({"num_attention_heads": 0}, "num_attention_heads"),
    "hidden_negative": ({"hidden_size": -64}, "hidden_size"),
    "layers_negative": ({"num_hidden_layers": -1}, "num_hidden_layers"),
    "vocab_float": ({"vocab_size": 1.5}, "vocab_size"),
    "heads_bool": ({"num_attention_heads": True}, "num_attention_heads"),
    "heads_missing": ({"num_attention_heads": None}, "num_attention_heads"),
    "kv_heads_not_dividing": ({"num_key_value_heads": 3}, "key/value heads"),
    "head_dim_odd": ({"head_dim": 15}, "head dimension"),
    "rope_not_object": ({"rope_parameters": "fast", "rope_scaling": None}, "rope_scaling"),
    "eos_string": ({"eos_token_id": "two"}, "eos_token_id"),
    "rms_eps_negative": ({"rms_norm_eps": -1}, "rms_norm_eps"),
    "max_position_zero": ({"max_position_embeddings": 0}, "max_position_embeddings"),
}


def safetensors_bytes(header: object) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


def write_gguf(path: Path, arch: str = "llama", heads: int | list[int] = 4, tokens: bool = True) -> None:
    """A GGUF file with a llama-style header and one small tensor (the loader reads the header first)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(heads)
    writer.add_context_length(64)
    if tokens:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["a", "b", "c", "d"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class Fixtures:
    """Broken files built once per module under `root`, beside the tiny model."""

    def __init__(self, root: Path, tiny: Path) -> None:
        self.root, self.tiny = root, tiny
        self.models = root / "models"
        self.text = root / "text"
        self.text.mkdir(parents=True)
        for name, data in {
            "bad.txt": BAD_UTF8,
            "empty.txt": b"",
            "blank.txt": b"   \n\n\t\n",
            "ok.txt": b"hello\nworld\n",
            "one_token.txt": b"x",
            "bad.jsonl": b'{"prompt": "caf\xe9"}\n',
        }.items():
            (self.text / name).write_bytes(data)

    def model(self, name: str, files: dict[str, bytes] | None = None, config: dict | None = None) -> Path:
        """A copy of the tiny model (its files linked, not copied) with some files replaced."""
        out = self.models / name
        out.mkdir(parents=True)
        for src in self.tiny.iterdir():
            (out / src.name).symlink_to(src)
        if config is not None:
            cfg = json.loads((self.tiny / "config.json").read_text())
            cfg.update(config)
            cfg = {k: v for k, v in cfg.items() if v is not None}
            files = {**(files or {}), "config.json": json.dumps(cfg).encode()}
        for file_name, data in (files or {}).items():
            (out / file_name).unlink(missing_ok=True)
            (out / file_name).write_bytes(data)
        return out

    def home(self, name: str, models_toml: bytes) -> Path:
        """A $SPECCHAT_HOME holding this models.toml."""
        home = self.root / "homes" / name
        home.mkdir(parents=True)
        (home / "models.toml").write_bytes(models_toml)
        return home

    def script(self, name: str, body: str, tasks: bytes | None = None) -> Path:
        """An agent script (and its tasks file) on the tiny model."""
        folder = self.root / "agents" / name
        folder.mkdir(parents=True)
        if tasks is not None:
            (folder / "tasks.txt").write_bytes(tasks)
        path = folder / "agent.toml"
        path.write_text(f'model = "{self.tiny}"\n' + body)
        return path


def build_fixtures(root: Path, tiny: Path) -> Fixtures:
    """Every broken model, GGUF file, heads file and agent script the fuzz cases name."""
    fx = Fixtures(root, tiny)
    # config.json
    fx.model("config_list", {"config.json": b"[1, 2]"})
    fx.model("config_not_utf8", {"config.json": b'{"model_type": "llama\xff"}'})
    fx.model("config_not_json", {"config.json": b"{model_type: llama"})
    for name, (entries, _) in BROKEN_CONFIG_ENTRIES.items():
        fx.model(f"config_{name}", config=entries)
    # safetensors
    fx.model("st_header_list", {"model.safetensors": safetensors_bytes([1, 2])})
    no_offsets = {"model.embed_tokens.weight": {"dtype": "F32", "shape": [2]}}
    fx.model("st_no_offsets", {"model.safetensors": safetensors_bytes(no_offsets)})
    reversed_offsets = {"model.embed_tokens.weight": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}
    fx.model("st_reversed_offsets", {"model.safetensors": safetensors_bytes(reversed_offsets)})
    fx.model("st_empty", {"model.safetensors": b""})
    fx.model("st_header_beyond_file", {"model.safetensors": struct.pack("<Q", 1 << 40) + b"{}"})
    fx.model("st_header_not_json", {"model.safetensors": struct.pack("<Q", 4) + b"\xff\xfe{["})
    bad_dtype = safetensors_bytes({"model.embed_tokens.weight": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}})
    fx.model("st_bad_dtype", {"model.safetensors": bad_dtype + b"\0" * 8})
    # side files
    fx.model("index_junk", {"model.safetensors.index.json": b"junk"})
    fx.model("index_list", {"model.safetensors.index.json": b"[1]"})
    fx.model("index_no_map", {"model.safetensors.index.json": b'{"metadata": {}}'})
    fx.model("index_escapes", {"model.safetensors.index.json": b'{"weight_map": {"a": "../../etc/passwd"}}'})
    fx.model("index_missing_shard", {"model.safetensors.index.json": b'{"weight_map": {"a": "shard-2.safetensors"}}'})
    fx.model("generation_config_junk", {"generation_config.json": b"{junk"})
    fx.model("generation_config_list", {"generation_config.json": b"[]"})
    fx.model("generation_config_eos", {"generation_config.json": b'{"eos_token_id": "end"}'})
    fx.model("tokenizer_config_junk", {"tokenizer_config.json": b"{"})
    fx.model("tokenizer_config_template_number", {"tokenizer_config.json": b'{"chat_template": 5}'})
    fx.model("tokenizer_json_junk", {"tokenizer.json": b"not a tokenizer"})
    fx.model("template_syntax", {"chat_template.jinja": b"{% for x in %}"})
    fx.model("template_not_utf8", {"chat_template.jinja": b"{{ '\xff' }}"})
    fx.model("template_fails", {"chat_template.jinja": b"{{ 1 / 0 }}"})
    fx.model("template_raises", {"chat_template.jinja": b"{{ raise_exception('no system role') }}"})
    tokenizer_missing = fx.model("tokenizer_missing")
    (tokenizer_missing / "tokenizer.json").unlink()
    # GGUF
    gguf = fx.root / "gguf"
    gguf.mkdir()
    (gguf / "garbage.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    write_gguf(gguf / "no_tokens.gguf", tokens=False)
    write_gguf(gguf / "heads_zero.gguf", heads=0)
    write_gguf(gguf / "heads_array.gguf", heads=[4, 4])
    write_gguf(gguf / "unsupported.gguf", arch="gpt2")
    write_gguf(gguf / "missing_tensors.gguf")
    # draft heads files
    heads = fx.root / "heads"
    heads.mkdir()
    save_file({"x": torch.zeros(2)}, str(heads / "no_metadata.safetensors"))
    save_file({"x": torch.zeros(2)}, str(heads / "model_format.safetensors"), metadata={"format": "pt"})
    (heads / "junk.safetensors").write_bytes(b"junk" * 8)
    heads_format = {"format": "specchat-draft-heads-v1"}
    save_file({"x": torch.zeros(2)}, str(heads / "no_config.safetensors"), metadata=heads_format)
    partial = {**heads_format, "config": json.dumps({"num_heads": 2})}
    save_file({"x": torch.zeros(2)}, str(heads / "partial_config.safetensors"), metadata=partial)
    # agent scripts
    fx.script("tasks_not_utf8", 'tasks_file = "tasks.txt"\n', BAD_UTF8)
    fx.script("tasks_empty", 'tasks_file = "tasks.txt"\n', b"# nothing\n\n")
    fx.script("tasks_missing", 'tasks_file = "missing.txt"\n')
    fx.script("ok", 'tasks = ["say hi"]\n')
    fx.script("script_not_utf8", "").write_bytes(b'model = "\xff"\n')
    return fx
