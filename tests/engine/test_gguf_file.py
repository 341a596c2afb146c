"""Our GGUF reader (engine/gguf_file.py) against gguf's own: the same metadata, tensors and values, bit for bit;
damaged files end in one ModelFormatError naming what is wrong."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from specchat.engine.gguf_file import GGUFFile, dequantize
from specchat.errors import ModelFormatError
from tests.engine.tiny_gguf import random_kquant, write_tiny_gguf

ROWS, COLUMNS = 6, 256
QUANTIZED = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1")  # gguf-py quantizes these itself
KQUANTS = ("Q4_K", "Q6_K")  # random bytes with sane scales (tiny_gguf.random_kquant)


def every_type_file(path: Path) -> Path:
    """A file with a tensor of each type the loader meets, and metadata of every value type."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((ROWS, COLUMNS)).astype(np.float32)
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("test.u8", 7)
    writer.add_int8("test.i8", -7)
    writer.add_uint16("test.u16", 700)
    writer.add_int16("test.i16", -700)
    writer.add_uint32("test.u32", 70000)
    writer.add_int32("test.i32", -70000)
    writer.add_uint64("test.u64", 2**40)
    writer.add_int64("test.i64", -(2**40))
    writer.add_float32("test.f32", 0.25)
    writer.add_float64("test.f64", 1e-300)
    writer.add_bool("test.bool", True)
    writer.add_string("test.str", "ünïcödé ✓")
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_array("test.floats", [0.5, -1.5])
    writer.add_array("test.strs", ["a", "", "ć"])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_tensor("f32", values)
    writer.add_tensor("f16", values.astype(np.float16))
    writer.add_tensor("vector", values[0])
    writer.add_tensor("bf16", quantize(values, GGMLQuantizationType.BF16), raw_dtype=GGMLQuantizationType.BF16)
    for kind in QUANTIZED:
        writer.add_tensor(kind, quantize(values, GGMLQuantizationType[kind]), raw_dtype=GGMLQuantizationType[kind])
    for kind in KQUANTS:
        raw = random_kquant(kind, ROWS, COLUMNS, rng)
        writer.add_tensor(kind, raw, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("gguf")
    return [
        every_type_file(folder / "types.gguf"),
        write_tiny_gguf(folder / "tiny.gguf"),
        write_tiny_gguf(folder / "blocks.gguf", blocks=True),
    ]


def test_metadata_and_tensors_equal_ggufs_reader(files):
    for path in files:
        ours, theirs = GGUFFile(path), GGUFReader(str(path))
        expected = {key: f.contents() for key, f in theirs.fields.items() if not key.startswith("GGUF.")}
        if "test.nested" in expected:  # gguf's contents() flattens an array of arrays; ours keeps its shape
            assert ours.metadata.pop("test.nested") == [[1, 2], [3]] and expected.pop("test.nested") == [1, 2, 3]
        assert ours.metadata == expected
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
            assert mine.tensor_type == t.tensor_type and mine.shape == tuple(t.shape.tolist())
            assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
            assert np.array_equal(mine.data, np.asarray(t.data), equal_nan=True)
            assert not mine.data.flags.writeable  # a view of the read-only map, as gguf's


def test_dequantize_equals_ggufs_bit_for_bit(files):
    path = files[0]
    for t in GGUFReader(str(path)).tensors:
        mine = next(m for m in GGUFFile(path).tensors if m.name == t.name)
        got = dequantize(mine)
        expected = torch.from_numpy(np.array(gguf_dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32))
        assert got.dtype == torch.float32 and got.shape == expected.shape, t.name
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), t.name  # bits, -0.0 included


def header(version: int = 3, tensors: int = 0, items: int = 0, order: str = "<") -> bytes:
    return b"GGUF" + struct.pack(f"{order}IQQ", version, tensors, items)


def test_damaged_files_name_what_is_wrong(files, tmp_path):
    whole = files[1].read_bytes()
    cases = {
        "empty": (b"", "it is empty"),
        "magic": (b"GGML" + whole[4:], "does not start with 'GGUF'"),
        "version": (header(version=1), "GGUF version 1 is not supported"),
        "big-endian": (header(order=">"), "a big-endian GGUF file is not supported"),
        "header": (whole[:2000], "damaged or truncated"),
        "data": (whole[: len(whole) - 1000], "runs past the end of the file"),
        "items": (header(items=5), "damaged or truncated"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(ModelFormatError, match=message) as info:
            GGUFFile(path)
        assert str(path) in str(info.value), name
    with pytest.raises(ModelFormatError, match="cannot read the file"):
        GGUFFile(tmp_path / "absent.gguf")


def test_arrays_nested_past_pythons_recursion_are_a_damaged_file(tmp_path):
    nested = struct.pack("<Q", 1) + b"x" + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000
    path = tmp_path / "nested.gguf"
    path.write_bytes(header(items=1) + nested + struct.pack("<IQ", 4, 0))
    with pytest.raises(ModelFormatError, match="damaged or truncated"):
        GGUFFile(path)


def tensor_info_at(data: bytes, name: str) -> int:
    """Where tensor `name`'s info goes on after its name: uint32 dims, uint64 dims, uint32 type, uint64 offset."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return data.index(key) + len(key)


def test_damaged_tensor_infos_name_the_tensor(files, tmp_path):
    """A tensor info whose dimensions overflow (their product wrapped numpy's int64 to 0 or below: a ValueError
    traceback from the reshape), is empty, points between alignments, or whose type was altered so that its bytes
    run into its neighbour's (loaded as wrong weights without a word): one ModelFormatError naming the tensor."""
    whole = files[2].read_bytes()  # blocks.gguf: the linears are Q8_0
    at = tensor_info_at(whole, "blk.0.attn_q.weight")
    dims, (kind, offset) = at + 4, struct.unpack_from("<IQ", whole, at + 20)
    assert kind == GGMLQuantizationType.Q8_0

    def patched(fmt: str, where: int, *values: int) -> bytes:
        data = bytearray(whole)
        struct.pack_into(fmt, data, where, *values)
        return bytes(data)

    cases = {
        "wraps to zero": (patched("<QQ", dims, 2**32, 2**32), "runs past the end of the file"),
        "wraps negative": (patched("<QQ", dims, 32, 3 * 2**61), "runs past the end of the file"),
        "largest": (patched("<QQ", dims, 2**64 - 32, 2**64 - 1), "runs past the end of the file"),
        "empty": (patched("<QQ", dims, 0, 64), "has no elements"),
        "misaligned": (patched("<Q", at + 24, offset + 1), "not aligned to 32 bytes"),
        "overlapping": (patched("<I", at + 20, int(GGMLQuantizationType.F32)), "overlap"),
    }
    for case, (data, message) in cases.items():
        path = tmp_path / f"{case}.gguf"
        path.write_bytes(data)
        with pytest.raises(ModelFormatError, match=message) as info:
            GGUFFile(path)
        assert str(path) in str(info.value) and "blk.0.attn_q.weight" in str(info.value), case
