"""Shared fixtures: the real default model (fetched once into the cache) and tiny random HF models.

Tests that load the real model are marked `slow`; `python -m pytest -m "not slow"` runs the fast suite, which
downloads nothing (the tiny models' tokenizer is built here: tests/tiny_tokenizer.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specchat.config import EngineConfig
from tests.tiny_tokenizer import save_tiny_tokenizer

TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def save_tiny_hf(path: Path, overrides: dict | None = None, seed: int = 0) -> Path:
    """A random HF model (Llama or Qwen2 per model_type) saved as safetensors in `path`, with the test tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = {**TINY_LLAMA, **(overrides or {})}
    model_type = cfg_dict.pop("model_type")
    cfg_dict.pop("architectures")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0; make them random so tests see them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    save_tiny_tokenizer(path, config.vocab_size)
    return path


@pytest.fixture(scope="session", autouse=True)
def derived_caches_go_with_the_session(tmp_path_factory):
    """What the engine derives from a model (registry.derived_dir: a converted tokenizer, dequantized weights, CPU
    blocks, a KV transform) is cached in the user's cache by the model's path, and the tests' models live in
    temporary folders: each run left ~30 folders there (341, 1.8 GB, on a machine that ran the suite for a few
    days). At the session's end the folders of its models (GGUF files and HF folders under its temporary
    directory, child processes' included) go; no other's."""
    from specchat.registry import derived_dir

    yield
    base = tmp_path_factory.getbasetemp()
    for path in base.rglob("*"):  # (one walk: a GGUF file, or an HF folder by its config.json)
        if path.suffix != ".gguf" and path.name != "config.json":
            continue
        model = path if path.suffix == ".gguf" else path.parent
        try:
            folder = derived_dir(model)
        except OSError:  # gone meanwhile
            continue
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from specchat.registry import fetch, resolve

    return fetch(resolve("smollm2-135m"))


@pytest.fixture(scope="session")
def default_engine():
    """The real default model on CPU in float32 with float activation rows and float32 KV pages (shared: tests must
    not leave requests running). fp32 rows and pages, not the default's int8 rows (where the CPU has VNNI) and
    float16 pages: the parity tests hold this path to the eager one and to transformers bit for bit; the int8 rows
    and half-width pages have their own tests (tests/engine/test_cpu_act.py, test_cpu_fusion.py)."""
    from specchat.engine.engine import Engine

    return Engine.load(EngineConfig(device="cpu", dtype="float32", cpu_act="fp32", kv_format="fp32"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama with the test tokenizer: loads in a blink, runs anywhere, downloads nothing."""
    return save_tiny_hf(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path, tmp_path_factory):
    """The tiny model on CPU. Its plain "draft-model" drafter is a second tiny model (another seed): the
    registry's default draft model is the real one, which has another tokenizer."""
    from specchat.engine.engine import Engine

    engine = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    draft_dir = save_tiny_hf(tmp_path_factory.mktemp("tiny-draft"), seed=1)
    engine.drafters["draft-model"] = engine.drafter(f"draft-model:{draft_dir}")
    return engine


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))
