"""KVPool bookkeeping and page formats, without a model: allocate / append / truncate / fork / free, prefix
sharing with refcounts and LRU eviction, exhaustion, format conversion and bytes per token."""

from __future__ import annotations

import pytest
import torch

from specchat.engine.kv_cache import KVPool
from specchat.engine.kv_pages import bytes_per_token, hadamard, rotation_matrix
from specchat.errors import KVCacheFullError
from tests.conftest import save_tiny_hf

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 2, 2, 64, 4


def make_pool(num_pages: int = 8, kv_format: str = "fp32", rotate: bool = True) -> KVPool:
    return KVPool(LAYERS, KV_HEADS, HEAD_DIM, num_pages, PAGE, torch.float32, "cpu", kv_format, rotate)


def feed(pool: KVPool, seq_id: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Append n tokens with random keys/values to every layer, as a forward would; returns layer 0's k, v."""
    start = pool.lengths.get(seq_id, 0)
    batch = pool.prepare([seq_id], [n], 1.0)
    batch.record(1000 * seed + torch.arange(start, start + n))  # the tokens: what a drafter on the device reads
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, n, KV_HEADS, HEAD_DIM, generator=gen)
    for layer in range(LAYERS):
        pool.store.write(layer, batch.new_slots, pool.store.rotate(k), pool.store.rotate(v))
    return k, v


def tokens(pool: KVPool, seq_id: int) -> list[int]:
    """A request's token ids read back from its pages' slots."""
    return pool.store.ids[pool.slots(pool.tables[seq_id], 0, pool.lengths[seq_id])].tolist()


def context(pool: KVPool, seq_id: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's keys/values [ctx, KVH, D] read back from its pages, un-rotated."""
    index = pool.slots(pool.tables[seq_id], 0, pool.lengths[seq_id])
    k, v = pool.store.read(layer, index, torch.float32)
    return pool.store.rotate(k).transpose(0, 1), pool.store.rotate(v).transpose(0, 1)


def test_bytes_per_token():
    bf16 = bytes_per_token("bf16", 30, 3, 64)
    assert bf16 == 2 * 30 * 3 * 64 * 2 and bytes_per_token("fp32", 30, 3, 64) == 2 * bf16
    # MXFP4: 64 / 2 code bytes + 64 / 32 scale bytes per row = 4.25 bits per element: 73.4% less than bf16
    assert bytes_per_token("mxfp4", 30, 3, 64) == 2 * 30 * 3 * (32 + 2)
    assert 1 - bytes_per_token("mxfp4", 32, 8, 128) / bytes_per_token("bf16", 32, 8, 128) == pytest.approx(
        0.734, abs=1e-3
    )
    assert 1 - bytes_per_token("k8v4", 32, 8, 128) / bytes_per_token("bf16", 32, 8, 128) == pytest.approx(
        0.609, abs=1e-3
    )


def test_capacity_follows_the_budget():
    budget = 1 << 20
    dense = KVPool.from_budget(budget, LAYERS, KV_HEADS, HEAD_DIM, PAGE, torch.float32, "cpu", "bf16")
    fp4 = KVPool.from_budget(budget, LAYERS, KV_HEADS, HEAD_DIM, PAGE, torch.float32, "cpu", "mxfp4")
    assert dense.capacity_tokens * dense.bytes_per_token <= budget
    assert fp4.capacity_tokens == pytest.approx(dense.capacity_tokens * 128 / 34, rel=0.01)
    assert fp4.store.nbytes <= budget


def test_hadamard_is_orthonormal_and_symmetric():
    h = hadamard(64)
    torch.testing.assert_close(h @ h, torch.eye(64), atol=1e-6, rtol=0)
    r = rotation_matrix(96)  # blocks of 32
    torch.testing.assert_close(r @ r, torch.eye(96), atol=1e-6, rtol=0)
    assert torch.equal(r, r.T)


def test_append_truncate_free_return_pages():
    pool = make_pool()
    assert pool.add(1, list(range(10))) == 0
    feed(pool, 1, 10)  # 3 pages
    assert pool.used_pages == 3 and pool.length(1) == 10
    pool.truncate(1, 4)  # back to one full page
    assert pool.used_pages == 1 and pool.length(1) == 4
    with pytest.raises(ValueError):
        pool.truncate(1, 5)
    pool.free(1)
    assert pool.num_free_pages == pool.num_pages and pool.cached_pages == 0


def test_truncate_keeps_the_kept_tokens():
    pool = make_pool()
    pool.add(1, [])
    k, v = feed(pool, 1, 9)
    pool.truncate(1, 6)
    k2, v2 = feed(pool, 1, 3, seed=1)
    got_k, got_v = context(pool, 1)
    torch.testing.assert_close(got_k, torch.cat([k[:6], k2]))
    torch.testing.assert_close(got_v, torch.cat([v[:6], v2]))


def test_fork_shares_full_pages_and_copies_the_last():
    pool = make_pool()
    pool.add(1, [])
    k, _ = feed(pool, 1, 6)  # one full page + 2 tokens
    pool.fork(1, 2)
    assert pool.tables[2][0] == pool.tables[1][0] and pool.tables[2][1] != pool.tables[1][1]
    assert pool.refcount[pool.tables[1][0]] == 2
    ka, _ = feed(pool, 1, 1, seed=1)
    kb, _ = feed(pool, 2, 1, seed=2)
    torch.testing.assert_close(context(pool, 1)[0], torch.cat([k, ka]))
    torch.testing.assert_close(context(pool, 2)[0], torch.cat([k, kb]))
    assert tokens(pool, 1) == [*range(6), 1006] and tokens(pool, 2) == [*range(6), 2006]  # the copied page's too
    pool.free(1)
    assert pool.refcount[pool.tables[2][0]] == 1
    pool.free(2)
    assert pool.num_free_pages == pool.num_pages


def test_prefix_pages_are_shared_and_cached():
    pool = make_pool()
    prompt = list(range(100, 111))  # 11 tokens: 2 full pages + 3
    pool.add(1, prompt)
    k, _ = feed(pool, 1, 11)
    # a concurrent request with the same prompt takes the 2 full pages (never the last token)
    assert pool.add(2, prompt) == 8
    assert pool.tables[2][:2] == pool.tables[1][:2] and pool.prefix_hit_tokens == 8
    feed(pool, 2, 3, seed=1)
    torch.testing.assert_close(context(pool, 2)[0][:8], k[:8])
    pool.free(1, prompt)
    pool.free(2, prompt)
    assert pool.cached_pages == 2 and pool.num_free_pages == pool.num_pages  # cached pages count as free
    # exactly page-aligned prompt: one page fewer, so its last token is fed
    assert pool.add(3, prompt[:8]) == 4
    # a different first page shares nothing, even if later pages match
    assert pool.add(4, [7, *prompt[1:]]) == 0


def test_evictable_pages_go_least_recently_used_first():
    pool = make_pool(num_pages=4)
    a, b = list(range(8)), list(range(50, 58))
    for seq_id, prompt in ((1, a), (2, b)):
        pool.add(seq_id, prompt)
        feed(pool, seq_id, 8)
        pool.free(seq_id, prompt)  # both full pages cached
    assert pool.cached_pages == 4 and pool.num_free_pages == 4
    assert pool.add(3, b) == 4  # touches b's first page: a's pages are now the oldest
    pool.free(3, b)
    pool.add(4, [])
    feed(pool, 4, 8)  # needs 2 pages: evicts a's
    assert pool.cached_pages == 2
    assert pool.add(5, a) == 0 and pool.add(6, b) == 4


def test_truncate_into_a_shared_page_copies_it():
    pool = make_pool()
    prompt = list(range(9))
    pool.add(1, prompt)
    k, _ = feed(pool, 1, 9)
    assert pool.add(2, prompt) == 8
    feed(pool, 2, 1)
    pool.truncate(2, 6)  # rewinds into page 1, which request 1 still reads
    assert pool.tables[2][1] != pool.tables[1][1]
    feed(pool, 2, 3, seed=5)
    torch.testing.assert_close(context(pool, 1)[0], k)


def test_exhaustion_raises_and_leaves_requests_alone():
    pool = make_pool(num_pages=3)
    pool.add(1, [])
    k, _ = feed(pool, 1, 8)
    pool.add(2, [])
    assert not pool.can_append({1: 1, 2: 8})
    with pytest.raises(KVCacheFullError, match="KV cache full"):
        pool.prepare([1, 2], [1, 8], 1.0)
    assert pool.length(1) == 8 and pool.length(2) == 0 and pool.used_pages == 2
    torch.testing.assert_close(context(pool, 1)[0], k)
    with pytest.raises(KVCacheFullError, match="too small"):
        make_pool(num_pages=0)


@pytest.mark.parametrize(("source", "target"), [("fp32", "mxfp4"), ("mxfp4", "k8v4"), ("k8v4", "bf16")])
def test_convert_keeps_live_pages(source, target):
    pool = make_pool(num_pages=16, kv_format=source)
    prompt = list(range(10))
    pool.add(1, prompt)
    feed(pool, 1, 10)
    pool.add(2, [])
    feed(pool, 2, 3, seed=1)
    before = [context(pool, s) for s in (1, 2)]
    pool.add(3, prompt)  # publishes request 1's prompt pages
    pool.free(3, prompt)
    tables = {s: list(pool.tables[s]) for s in (1, 2)}
    pool.convert(target)
    assert pool.store.name == target and pool.used_pages == 4
    if pool.num_pages >= 16:
        assert {s: pool.tables[s] for s in (1, 2)} == tables  # page numbers survive when the pool does not shrink
    for seq_id, (k, v) in zip((1, 2), before, strict=True):
        got_k, got_v = context(pool, seq_id)
        # what writing the same rows straight into the new format would give
        direct = make_pool(num_pages=8, kv_format=target)
        direct.add(9, [])
        batch = direct.prepare([9], [k.shape[0]], 1.0)
        direct.store.write(0, batch.new_slots, direct.store.rotate(k), direct.store.rotate(v))
        want_k, want_v = context(direct, 9)
        torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_v, want_v, atol=1e-5, rtol=1e-5)
    assert pool.add(4, prompt) == 8  # the prefix index survived the renumbering


def test_convert_refuses_what_the_budget_cannot_hold():
    pool = make_pool(num_pages=8, kv_format="mxfp4")  # 8 MXFP4 pages' bytes hold 1 fp32 page
    pool.add(1, [])
    feed(pool, 1, 12)
    with pytest.raises(KVCacheFullError, match="cannot switch"):
        pool.convert("fp32")
    assert pool.store.name == "mxfp4" and pool.length(1) == 12 and pool.num_pages == 8


def test_convert_moves_pages_past_the_end_of_a_smaller_pool():
    pool = make_pool(num_pages=16, kv_format="mxfp4")  # the same bytes hold 2 fp32 pages
    pool.add(1, [])
    feed(pool, 1, 40)  # pages 0..9
    pool.add(2, [])
    feed(pool, 2, 7, seed=3)  # pages 10, 11
    before = context(pool, 2)
    pool.free(1)
    pool.convert("fp32")
    assert pool.num_pages == 2 and sorted(pool.tables[2]) == [0, 1]
    torch.testing.assert_close(context(pool, 2), before)
    assert tokens(pool, 2) == [3000 + i for i in range(7)]  # the token ids moved with the pages


def test_the_split_of_a_mixed_step_equals_reading_every_context_back(tmp_path, monkeypatch):
    """A step that admits a prompt beside decoding / verifying requests splits on CUDA: the prompt attends to its
    own keys, the others go through the paged kernel together (KVBatch._attend_split). The same split, with the
    kernel's torch reference in its place, gives the gathered path's logits on the CPU; the CUDA run of the
    kernel itself is tests/engine/test_kv_cuda.py's."""
    import specchat.engine.kv_batch as kv_batch
    from specchat.kernels import attention_triton
    from specchat.kernels.attention import paged_attention_reference
    from tests.engine.test_kv_cuda import mixed_step_logits

    path = save_tiny_hf(tmp_path, {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}, seed=3)
    gathered = mixed_step_logits(path, "cpu")
    monkeypatch.setattr(attention_triton, "paged_attention", paged_attention_reference)
    monkeypatch.setattr(kv_batch.KVBatch, "_paged", lambda self, q, k, max_q: max_q <= 9)
    split = []
    original = kv_batch.KVBatch._attend_split

    def counted(self, *args):
        split.append(1)
        return original(self, *args)

    monkeypatch.setattr(kv_batch.KVBatch, "_attend_split", counted)
    for got, want in zip(mixed_step_logits(path, "cpu"), gathered, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert split  # the mixed step took the split
