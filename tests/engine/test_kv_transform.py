"""The calibrated key transform of MXFP4 pages (engine.kv_transform): exact in exact arithmetic, the geometric
mean it claims, cached per model and reused, and consistent across a KV format switch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import specchat.engine.kv_cache as kv_cache
from specchat.engine import kv_transform
from specchat.engine.kv_cache import KVPool
from specchat.engine.kv_pages import PageStore
from specchat.engine.loader import build_model, load_checkpoint
from specchat.engine.runner import ModelRunner, StepBatch
from tests.conftest import save_tiny_hf

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 2, 2, 64, 4
TINY = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


def random_transform(seed: int = 0, layers: int = LAYERS, heads: int = KV_HEADS, dim: int = HEAD_DIM):
    """Well-conditioned, non-orthogonal matrices [layers, heads, dim, dim]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.eye(dim) + 0.3 * torch.randn(layers, heads, dim, dim, generator=gen) / dim**0.5


def char_encode(vocab: int):
    return lambda text: [ord(c) % vocab for c in text]


def test_geometric_transform_is_the_geometric_mean():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 500, 16, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 3, 16, dtype=torch.float64)
    sk, sq = x.T @ x / 500, y.T @ y / 500
    a = kv_transform.geometric_transform(sk, sq, eps=0.0)
    m = a @ a.T  # Sk^-1 # Sq solves M Sk M = Sq
    torch.testing.assert_close(m @ sk @ m, sq, atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(a, a.T)


def test_store_transform_keeps_scores_and_inverts():
    store = PageStore("mxfp4", LAYERS, KV_HEADS, HEAD_DIM, 8, torch.device("cpu"), key_transform=random_transform())
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 2 * KV_HEADS, HEAD_DIM, generator=gen)  # two query heads per KV head
    k = torch.randn(7, KV_HEADS, HEAD_DIM, generator=gen)
    for layer in range(LAYERS):
        tq, tk = store.rotate_queries(layer, q), store.rotate_keys(layer, k)
        assert not torch.allclose(tk, store.rotate(k), atol=1e-2)  # the transform changes what is stored
        scores = torch.einsum("thgd,shd->thgs", q.unflatten(1, (KV_HEADS, 2)), k)
        got = torch.einsum("thgd,shd->thgs", tq.unflatten(1, (KV_HEADS, 2)), tk)
        torch.testing.assert_close(got, scores, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(store.unrotate_keys(layer, tk), k, atol=1e-5, rtol=1e-5)


def step_logits(path, pool_format: str, key_transform, device: str = "cpu") -> list[torch.Tensor]:
    """Prefill two prompts, then a step mixing decode, verify and a fresh prompt (on the CPU the fresh and gathered
    paths; on CUDA the split with the paged kernel)."""
    cfg, state = load_checkpoint(path)
    model = build_model(cfg, state, torch.float32, device)
    source = None if key_transform is None else (lambda: key_transform(model, cfg))
    pool = KVPool(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32, 16, torch.float32, device, pool_format, key_transform=source
    )
    assert (pool.store.key_transform is not None) == (key_transform is not None)
    runner = ModelRunner(model, pool)
    ids = torch.randint(0, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b, c = ids[:30], ids[30:55], ids[55:]
    outs = []
    for seq, prompt in enumerate((a, b)):
        pool.add(seq, prompt)
        outs += runner.forward(StepBatch([seq], [prompt], [0], [len(prompt)])).logits
    pool.add(2, c)
    outs += runner.forward(StepBatch([0, 2, 1], [a[:1], c, b[:5]], [30, 0, 25], [1, 1, 5])).logits
    return [out.cpu() for out in outs]


def calibrated(model, cfg):
    a = kv_transform.calibrate(model, char_encode(cfg.vocab_size))
    assert a.shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
    assert not torch.allclose(a, torch.eye(cfg.head_dim).expand_as(a), atol=1e-2)
    return a


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(("device", "tol"), [("cpu", 1e-5), pytest.param("cuda", 1e-4, marks=CUDA)])
def test_transformed_attention_equals_plain_attention_without_quantization(tmp_path, monkeypatch, device, tol):
    """fp32 pages with the calibrated transform (allowed for fp32 here) give the untransformed logits."""
    path = save_tiny_hf(tmp_path, TINY, seed=3)
    plain = step_logits(path, "fp32", None, device)
    monkeypatch.setattr(kv_cache, "KEY_TRANSFORM_FORMATS", ("fp32",))
    for got, want in zip(step_logits(path, "fp32", calibrated, device), plain, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@CUDA
def test_transformed_mxfp4_pages_on_cuda_match_the_cpu_reference(tmp_path):
    """The Triton quantize and paged-attention kernels over transformed keys and queries, against the CPU."""
    path = save_tiny_hf(tmp_path, TINY, seed=3)
    cpu = step_logits(path, "mxfp4", calibrated, "cpu")
    for got, want in zip(step_logits(path, "mxfp4", calibrated, "cuda"), cpu, strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_the_transform_is_cached_per_model_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path / "home"))
    path = save_tiny_hf(tmp_path / "model", TINY, seed=3)
    cfg, state = load_checkpoint(path)
    model = build_model(cfg, state, torch.float32, "cpu")
    encode = char_encode(cfg.vocab_size)
    first = kv_transform.load_or_calibrate(model, encode, path, "bf16")
    assert kv_transform.cache_path(path, "bf16").is_file()
    monkeypatch.setattr(kv_transform, "calibrate", lambda *a: pytest.fail("calibrated again"))
    torch.testing.assert_close(kv_transform.load_or_calibrate(model, encode, path, "bf16"), first, atol=0, rtol=0)
    kv_transform.cache_path(path, "bf16").write_bytes(b"garbage")
    monkeypatch.setattr(kv_transform, "calibrate", lambda *a: first + 1)
    torch.testing.assert_close(kv_transform.load_or_calibrate(model, encode, path, "bf16"), first + 1)


def model_keys(pool: KVPool, seq_id: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's keys/values [ctx, KVH, D] read back from its pages, in the model's basis."""
    index = pool.slots(pool.tables[seq_id], 0, pool.lengths[seq_id])
    k, v = pool.store.read(layer, index, torch.float32)
    return pool.store.unrotate_keys(layer, k.transpose(0, 1)), pool.store.rotate(v).transpose(0, 1)


@pytest.mark.parametrize("route", [("fp32", "mxfp4", "k8v4", "mxfp4", "fp32")])
def test_a_format_switch_reencodes_transformed_keys(route):
    calls = []

    def source():
        calls.append(1)
        return random_transform(2)

    pool = KVPool(LAYERS, KV_HEADS, HEAD_DIM, 16, PAGE, torch.float32, "cpu", route[0], key_transform=source)
    assert not calls  # made on first need only
    pool.add(1, [])
    batch = pool.prepare([1], [10], 1.0)
    k, v = torch.randn(2, 10, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    for layer in range(LAYERS):
        pool.store.write(layer, batch.new_slots, pool.store.rotate_keys(layer, k), pool.store.rotate(v))
    for fmt in route[1:]:
        before = model_keys(pool, 1)
        pool.convert(fmt)
        assert (pool.store.key_transform is not None) == (fmt == "mxfp4")
        same = lambda: random_transform(2)
        direct = KVPool(LAYERS, KV_HEADS, HEAD_DIM, 8, PAGE, torch.float32, "cpu", fmt, key_transform=same)
        direct.add(9, [])
        slots = direct.prepare([9], [10], 1.0).new_slots
        direct.store.write(0, slots, direct.store.rotate_keys(0, before[0]), direct.store.rotate(before[1]))
        for got, want in zip(model_keys(pool, 1), model_keys(direct, 9), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert pool.store.key_transform is None
    torch.testing.assert_close(model_keys(pool, 1)[0], k, atol=0.5, rtol=0.5)  # MXFP4 twice: close, not equal
    assert len(calls) == 1  # made once, reused by the second switch to mxfp4


def test_the_engine_makes_it_on_first_need_and_keeps_it_across_switches(tmp_path, monkeypatch):
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine

    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path / "home"))
    path = save_tiny_hf(tmp_path / "model", TINY, seed=3)
    calls = []
    real = kv_transform.calibrate
    monkeypatch.setattr(kv_transform, "calibrate", lambda *a: calls.append(1) or real(*a))
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", kv_memory=8 << 20)
    engine = Engine.load(config)
    assert engine.pool.store.key_transform is None and not calls  # dense pages: not made
    engine.set_kv("mxfp4")
    made = engine.pool.store.key_transform
    assert made is not None and calls == [1] and kv_transform.cache_path(path, "bf16").is_file()
    engine.set_kv("k8v4")
    assert engine.pool.store.key_transform is None
    engine.set_kv("mxfp4")
    assert engine.pool.store.key_transform is made and calls == [1]
    again = Engine.load(dataclasses.replace(config, kv_format="mxfp4"))
    torch.testing.assert_close(again.pool.store.key_transform, made, atol=0, rtol=0)
    assert calls == [1]  # read from the cache
    off = Engine.load(dataclasses.replace(config, kv_format="mxfp4", kv_key_transform=False))
    assert off.pool.store.key_transform is None
