"""The CPU kernels as a model transform (engine/cpu_fusion.py) and the C paged attention of the KV batch, against the
plain modules and `--eager`: same logits within float32 rounding, same greedy tokens, speculation still exact.

The kernels themselves are held to their references in tests/kernels/test_cpu_ops.py.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine import cpu_fusion
from specchat.engine.cpu_weights import Bf16Linear, BlockLinear, blocks_for_any_rows
from specchat.engine.kv_cache import KVPool
from specchat.engine.model import Block, Linear, RMSNorm, Rotary, SiluAndMul, Transformer
from specchat.kernels import cpu_attention, cpu_block, cpu_gemv, cpu_ops
from tests.engine.test_fusion import CFG, logits

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler for the CPU kernels")

PROMPTS = ["hello there", "the quick brown fox jumps over the lazy dog", "a b a b a b a b"]
FEEDS = [[3, 14, 15, 9, 26, 5, 35], [8], [9, 7, 9, 3, 2], [3], [8, 4]]  # prefill, decode, verify of 5: 16 slots


def counted(monkeypatch, owner, name: str) -> list:
    """owner.name wrapped to count its calls: the list each call appends to."""
    calls, function = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a: calls.append(1) or function(*a))
    return calls


def test_fuse_swaps_blocks_norms_rotary_and_activation_and_unfuse_swaps_them_back():
    model = Transformer(CFG)
    parameters = list(model.parameters())
    assert cpu_fusion.fuse(model) == 2 * 5 + 2  # block, two norms, rotary, act per layer + the final norm, model
    assert isinstance(model.layers[0], cpu_fusion.CpuBlock) and isinstance(model.norm, cpu_fusion.CpuRMSNorm)
    assert isinstance(model, cpu_fusion.CpuTransformer)
    assert cpu_fusion.fuse(model) == 0  # already fused
    assert cpu_fusion.unfuse(model) == 12
    assert type(model.layers[0]) is Block and type(model.norm) is RMSNorm and type(model) is Transformer
    assert type(model.layers[1].attn.rotary) is Rotary and type(model.layers[1].mlp.act) is SiluAndMul
    assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))  # the same tensors


def test_a_bfloat16_model_gets_the_bf16_linears_only_and_keeps_its_logits_close():
    """A bf16 model's linears read their weights through cpu_gemv.bf16_linear (float32 sums: close to torch's bf16
    linears, not equal); its norms and the rest stay torch's. unfuse swaps them back."""
    torch.manual_seed(0)
    model = Transformer(CFG).eval().to(torch.bfloat16)
    ids = torch.randint(0, CFG.vocab_size, (11,))
    with blocks_for_any_rows():  # (11 rows: the kernel either way)
        want = logits(model, ids)
        linears = sum(type(m) is Linear for m in model.modules())
        assert cpu_fusion.fuse(model) == linears > 0
        assert type(model.lm_head) is Bf16Linear and type(model.norm) is RMSNorm and type(model.layers[0]) is Block
        torch.testing.assert_close(logits(model, ids), want, rtol=0.05, atol=0.05)
    assert cpu_fusion.unfuse(model) == linears and type(model.lm_head) is Linear
    assert torch.equal(logits(model, ids), want)


def test_bf16_linear_takes_the_kernel_for_a_steps_rows_and_torch_elsewhere():
    torch.manual_seed(1)
    linear = Linear(64, 40, bias=True).to(torch.bfloat16)
    weight, bias = linear.weight, linear.bias
    cpu_fusion.swap_classes(linear, cpu_fusion.BF16)
    x = torch.randn(3, 5, 64).bfloat16()  # 15 rows, batched dims kept
    got = linear(x)
    want = (cpu_gemv.bf16_linear_ref(x.reshape(-1, 64).float(), weight) + bias.float()).bfloat16().view(3, 5, 40)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    rows = torch.randn(cpu_gemv.MAX_ROWS + 1, 64).bfloat16()  # a prompt: torch's GEMM, unless every row decodes
    assert torch.equal(linear(rows), torch.nn.functional.linear(rows, weight, bias))
    with blocks_for_any_rows():
        assert torch.equal(linear(rows)[:15], linear(rows[:15]))
    linear.weight = torch.nn.Parameter(torch.randn(40, 64).bfloat16())  # replaced: bound again
    assert torch.equal(linear(x[0]), (cpu_gemv.bf16_linear_ref(x[0].float(), linear.weight) + bias.float()).bfloat16())
    odd = Linear(48, 8, bias=False).to(torch.bfloat16)  # 48 = 1.5 blocks: torch's linear
    cpu_fusion.swap_classes(odd, cpu_fusion.BF16)
    assert torch.equal(odd(x[0, :, :48].contiguous()), torch.nn.functional.linear(x[0, :, :48], odd.weight))


def test_fused_model_keeps_the_logits_and_unfuse_restores_them():
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    ids = torch.randint(0, CFG.vocab_size, (11,))
    want = logits(model, ids)
    cpu_fusion.fuse(model)
    torch.testing.assert_close(logits(model, ids), want, rtol=1e-5, atol=1e-5)
    cpu_fusion.unfuse(model)
    assert torch.equal(logits(model, ids), want)


@pytest.fixture(scope="module")
def tiny_eager(tiny_model_dir):
    from specchat.engine.engine import Engine

    return Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", eager=True))


def greedy(engine, prompt: str, drafter: str = "none", tokens: int = 32) -> list[int]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    return engine.submit(engine.encode_prompt(prompt), params, SpecParams(drafter=drafter)).result().token_ids


def test_a_bfloat16_cpu_engine_reads_its_linears_through_the_kernel_and_eager_does_not(tiny_model_dir):
    from specchat.engine.engine import Engine

    fast, eager = (
        Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="bfloat16", eager=flag))
        for flag in (False, True)
    )
    assert type(fast.model.lm_head) is Bf16Linear and type(eager.model.lm_head) is Linear
    prompt = "the cat sat on the mat"
    # the kernel sums in float32, torch's bf16 linears their own way: the texts start alike on a random model
    assert greedy(fast, prompt, tokens=4) == greedy(eager, prompt, tokens=4)
    assert len(greedy(fast, prompt, "ngram", tokens=8)) == 8


def test_default_cpu_engine_is_fused_and_eager_is_not(tiny_engine, tiny_eager):
    assert tiny_engine.pool.cpu_kernels and not tiny_eager.pool.cpu_kernels
    assert all(isinstance(b, cpu_fusion.CpuBlock) for b in tiny_engine.model.layers)
    assert not any(isinstance(m, cpu_fusion.CpuBlock) for m in tiny_eager.model.modules())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_eager(tiny_engine, tiny_eager, prompt, monkeypatch):
    calls = counted(monkeypatch, cpu_attention, "paged_attention")
    assert greedy(tiny_engine, prompt) == greedy(tiny_eager, prompt)
    assert len(calls) >= 31 * tiny_engine.model.cfg.num_layers  # every decode step attended in C


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculation_exact_on_fused_path(tiny_engine, prompt):
    assert greedy(tiny_engine, prompt, "ngram") == greedy(tiny_engine, prompt)


@pytest.mark.slow
def test_default_model_fused_equals_eager_over_a_long_answer(default_engine):
    """The default model on the block kernels with float rows (GGUF blocks + these kernels) against --eager for
    128 tokens; tests/engine/test_cpu_weights.py holds three shorter answers and ngram speculation on the same
    engine."""
    from specchat.engine.engine import Engine

    assert all(isinstance(b, cpu_fusion.CpuBlock) for b in default_engine.model.layers)
    eager = Engine.load(EngineConfig(device="cpu", dtype="float32", eager=True))
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    assert greedy(default_engine, prompt, tokens=128) == greedy(eager, prompt, tokens=128)


def with_gguf_blocks(model: Transformer, seed: int = 0) -> Transformer:
    """Every block linear as a BlockLinear over random GGUF blocks (Q4_1, the down projection Q8_0), its float
    weight their dequantization: what cpu_weights.pack_blocks makes of a GGUF file."""
    g = torch.Generator().manual_seed(seed)
    for block in model.layers:
        for linear, kind in ((block.attn.wqkv, "q4_1"), (block.attn.wo, "q4_1"), (block.mlp.w_gate_up, "q4_1"),
                             (block.mlp.w_down, "q8_0")):  # fmt: skip
            n, k = linear.weight.shape
            d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
            if kind == "q4_1":
                blocks = (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), d, -8 * d)
                linear.weight.data = cpu_gemv.q4_dequantize(*blocks)
            else:
                blocks = (torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), d)
                linear.weight.data = cpu_gemv.q8_dequantize(*blocks)
            linear.__class__, linear.kind = BlockLinear, kind
            for name, value in zip(("codes", "d", "m"), blocks, strict=False):
                linear.register_buffer(name, value, persistent=False)
    return model


def run_steps(
    model: Transformer,
    feeds: list[list[int]],
    cpu_kernels: bool = True,
    kv_format: str = "auto",
    key_transform=None,
    taps: tuple[int, ...] = (),
) -> tuple[list, KVPool]:
    """Feed one request's tokens step by step through a KV pool; the logits of each step's rows (with `taps`:
    (logits, {layer: hidden}) each)."""
    cfg = model.cfg
    pool = KVPool(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 4, torch.float32, "cpu", kv_format=kv_format,
        cpu_kernels=cpu_kernels, key_transform=key_transform,
    )  # fmt: skip
    pool.add(0, [t for feed in feeds for t in feed])
    out, start = [], 0
    with torch.inference_mode():
        for feed in feeds:
            kv = pool.prepare([0], [len(feed)], cfg.head_dim**-0.5)
            positions = torch.arange(start, start + len(feed))
            logits_and_hidden = model(torch.tensor(feed), positions, kv, taps)
            out.append(logits_and_hidden if taps else logits_and_hidden[0])
            start += len(feed)
    return out, pool


def test_all_blocks_in_one_call_equal_one_call_a_block():
    """decode_layers runs decode_block for each block in turn: bit-equal logits, tapped hidden states and KV pages,
    for prefill, decode and verification steps."""
    torch.manual_seed(4)
    model = with_gguf_blocks(Transformer(CFG).eval(), seed=4)
    cpu_fusion.fuse(model)
    taps = (0, CFG.num_layers - 1)
    with pytest.MonkeyPatch.context() as m:
        layers = counted(m, cpu_block, "decode_layers")
        whole, whole_pool = run_steps(model, FEEDS, taps=taps)
        assert len(layers) == len(FEEDS)  # one call a step, the prefill's too
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cpu_fusion.CpuTransformer, "run_blocks", Transformer.run_blocks)
        blocks = counted(m, cpu_block, "decode_block")
        each, each_pool = run_steps(model, FEEDS, taps=taps)
        assert len(blocks) == len(FEEDS) * CFG.num_layers
    for (a, hidden_a), (b, hidden_b) in zip(whole, each, strict=True):
        assert torch.equal(a, b) and hidden_a.keys() == hidden_b.keys() == set(taps)
        assert all(torch.equal(hidden_a[i], hidden_b[i]) for i in taps)
    for layer in range(CFG.num_layers):
        assert torch.equal(whole_pool.store.k[layer].data[:, :16], each_pool.store.k[layer].data[:, :16])
        assert torch.equal(whole_pool.store.v[layer].data[:, :16], each_pool.store.v[layer].data[:, :16])


def test_a_prompts_rows_split_among_threads_keep_the_bits():
    """From PARALLEL_ROWS (32) rows a block's norms, RoPE, SiLU and residual add are split among the threads; every
    row's arithmetic is its own, so 1 and 2 threads give the same logits and pages. (These blocks take float rows;
    i8_gemm's rows quantized by the threads are tests/kernels/test_cpu_gemv_i8.py's 40- and 33-row cases.)"""
    torch.manual_seed(5)
    model = with_gguf_blocks(Transformer(CFG).eval(), seed=5)
    cpu_fusion.fuse(model)
    feeds = [[(7 * i) % 50 + 1 for i in range(40)], [3], [4, 5, 6]]
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs.append(run_steps(model, feeds))
    finally:
        torch.set_num_threads(before)
    (one, one_pool), (two, two_pool) = runs
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    for layer in range(CFG.num_layers):
        assert torch.equal(one_pool.store.k[layer].data[:, :44], two_pool.store.k[layer].data[:, :44])
        assert torch.equal(one_pool.store.v[layer].data[:, :44], two_pool.store.v[layer].data[:, :44])


def test_bound_layers_follow_the_weights_and_the_store(monkeypatch):
    """CpuTransformer binds the blocks' weights and pages once and binds again when what they point to changes:
    the linears re-classed for int8 rows, a linear replaced, a new page store. Each step's logits equal the blocks
    asked one by one (Transformer.run_blocks) over a second pool fed the same tokens, on the same weights."""
    from specchat.engine.cpu_weights import as_block_linear, set_activations
    from specchat.kernels import cpu_gemv_i8

    torch.manual_seed(5)
    model = with_gguf_blocks(Transformer(CFG).eval(), seed=5)
    cpu_fusion.fuse(model)
    binds = counted(monkeypatch, cpu_block, "BoundLayers")
    cfg = model.cfg

    def new_pool() -> KVPool:
        pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 4, torch.float32, "cpu", cpu_kernels=True)
        pool.add(0, [t for feed in FEEDS for t in feed])
        return pool

    def step(pool: KVPool, feed: list[int], start: int, one_by_one: bool) -> torch.Tensor:
        with pytest.MonkeyPatch.context() as m, torch.inference_mode():
            if one_by_one:
                m.setattr(cpu_fusion.CpuTransformer, "run_blocks", Transformer.run_blocks)
            kv = pool.prepare([0], [len(feed)], cfg.head_dim**-0.5)
            return model(torch.tensor(feed), torch.arange(start, start + len(feed)), kv, ())[0]

    def replace_wo() -> None:  # layer 1's output projection: new blocks in a new module
        old = model.layers[1].attn.wo
        n, k = old.weight.shape
        d = torch.full((n, k // 32), 0.01).half().float()
        blocks = (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), d, -8 * d)
        linear = torch.nn.Linear(k, n, bias=False)
        linear.weight.data = cpu_gemv.q4_dequantize(*blocks)
        model.layers[1].attn.wo = as_block_linear(linear, "q4_1", blocks)
        set_activations(model.layers[1].attn.wo, activations)

    activations = "fp32"
    changes = [lambda: None, replace_wo, lambda: None, replace_wo, lambda: None]
    if cpu_gemv_i8.available():
        activations = "int8"
        changes[2] = lambda: set_activations(model, "int8")
    bound, each, start = new_pool(), new_pool(), 0
    for feed, change in zip(FEEDS, changes, strict=True):
        change()
        assert torch.equal(step(bound, feed, start, False), step(each, feed, start, True))
        start += len(feed)
    assert len(binds) == 1 + (2 + cpu_gemv_i8.available()) * 1  # the first step, each replacement, int8 rows
    step(new_pool(), FEEDS[0], 0, False)  # a new store
    assert len(binds) == 4 + cpu_gemv_i8.available()


def test_whole_block_call_equals_the_block_one_kernel_at_a_time(monkeypatch):
    """kernels/cpu_block.py chains the same C kernels in the same order: bit-equal logits and KV pages, for
    prefill, decode and verification steps."""
    torch.manual_seed(0)
    model = with_gguf_blocks(Transformer(CFG).eval())
    cpu_fusion.fuse(model)
    feeds = FEEDS
    calls = counted(monkeypatch, cpu_block, "decode_layers")
    whole, whole_pool = run_steps(model, feeds)
    assert len(calls) == len(feeds)  # every step, the prefill too
    monkeypatch.setattr(cpu_fusion.CpuBlock, "block_weights", lambda self: None)
    ops, ops_pool = run_steps(model, feeds)
    assert all(torch.equal(a, b) for a, b in zip(whole, ops, strict=True))
    for layer in range(CFG.num_layers):
        assert torch.equal(whole_pool.store.k[layer].data[:, :16], ops_pool.store.k[layer].data[:, :16])
        assert torch.equal(whole_pool.store.v[layer].data[:, :16], ops_pool.store.v[layer].data[:, :16])
    cpu_fusion.unfuse(model)  # and both are the plain modules and attention within float32 rounding
    plain, _ = run_steps(model, feeds, cpu_kernels=False)
    for a, b in zip(whole, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def mxfp4_model(seed: int, head: bool = False) -> Transformer:
    """The tiny model with MXFP4 block linears, rotated in even layers (RotatedFp4Linear) and not in odd ones, and
    with `head` an MXFP4 lm_head (then every linear of a step reads MXFP4: batch-independent under int8 rows)."""
    from specchat.quant.fp4_linear import Fp4Linear, RotatedFp4Linear

    torch.manual_seed(seed)
    model = Transformer(CFG).eval()
    for i, block in enumerate(model.layers):
        kind = RotatedFp4Linear if i % 2 == 0 else Fp4Linear
        block.attn.wqkv, block.attn.wo = kind.from_linear(block.attn.wqkv), kind.from_linear(block.attn.wo)
        block.mlp.w_gate_up, block.mlp.w_down = (
            kind.from_linear(block.mlp.w_gate_up),
            kind.from_linear(block.mlp.w_down),
        )
    if head:
        model.lm_head = Fp4Linear.from_linear(model.lm_head)
    return model


def test_mxfp4_blocks_run_as_one_call_equal_to_the_kernel_at_a_time(monkeypatch):
    """MXFP4 linears (rotated and not) read by cpu_gemv's fp4 kernel: the whole block in C equals the block one
    module at a time bit for bit, and both the plain modules (mxfp4_linear's dequantized weights, the rotation in
    torch) within float32 rounding over two layers."""
    from specchat.quant.fp4_linear import Fp4Linear

    model = mxfp4_model(2)
    cpu_fusion.fuse(model)
    calls = counted(monkeypatch, cpu_block, "decode_layers")
    whole, whole_pool = run_steps(model, FEEDS)
    assert len(calls) == len(FEEDS)
    monkeypatch.setattr(cpu_fusion.CpuBlock, "block_weights", lambda self: None)
    ops, ops_pool = run_steps(model, FEEDS)
    assert all(torch.equal(a, b) for a, b in zip(whole, ops, strict=True))
    for layer in range(CFG.num_layers):
        assert torch.equal(whole_pool.store.k[layer].data[:, :16], ops_pool.store.k[layer].data[:, :16])
    monkeypatch.setattr(Fp4Linear, "takes_gemm", lambda self, rows: True)  # mxfp4_linear for every row count
    cpu_fusion.unfuse(model)
    plain, _ = run_steps(model, FEEDS, cpu_kernels=False)
    for a, b in zip(whole, plain, strict=True):  # (the rotation as butterflies in C, as a matmul in torch)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_mxfp4_blocks_with_int8_rows_run_as_one_call_and_verify_as_they_decode(monkeypatch):
    """MXFP4 linears with int8 rows (cpu_gemv_i8's kernel, `--cpu-act int8`): the whole blocks in C equal the
    modules one at a time bit for bit, rows verified together equal the same rows decoded one at a time (lossless
    speculation), the prompt takes the whole-block call too, and the logits stay close to float rows'."""
    from specchat.kernels import cpu_gemv_i8
    from specchat.quant.fp4_linear import set_fp4_activations

    if not cpu_gemv_i8.available():
        pytest.skip("no AVX512-VNNI or AVX2")
    model = mxfp4_model(3, head=True)
    assert set_fp4_activations(model, "int8") == 4 * CFG.num_layers + 1
    cpu_fusion.fuse(model)
    prompt, tokens = [3, 14, 15, 9, 26, 5, 35], [8, 9, 7, 9, 3]
    calls = counted(monkeypatch, cpu_block, "decode_layers")
    verified, _ = run_steps(model, [prompt, tokens])
    decoded, _ = run_steps(model, [prompt, *([t] for t in tokens)])
    assert len(calls) == 8  # every step, the prefills too
    assert torch.equal(verified[1], torch.cat(decoded[1:]))
    monkeypatch.setattr(cpu_fusion.CpuBlock, "block_weights", lambda self: None)
    ops, _ = run_steps(model, [prompt, tokens])
    assert torch.equal(verified[1], ops[1]) and torch.equal(verified[0], ops[0])
    monkeypatch.undo()
    set_fp4_activations(model, "fp32")  # the float kernel's buffers back, bound again by the next step
    floats, _ = run_steps(model, [prompt, tokens])
    assert (verified[1] - floats[1]).norm() / floats[1].norm() < 0.02


@pytest.mark.parametrize("kv_format", ["fp16", "bf16"])
def test_half_width_pages_take_the_c_kernel_and_match_the_reference(kv_format, monkeypatch):
    """float16 / bfloat16 pages on the CPU: the whole block in C (the attention widening each element) against the
    plain modules over pages of the same format. Their keys and values differ by float32 rounding before they are
    rounded into the pages, so a page element may land one unit of the format apart; the logits stay close.
    (tests/kernels/test_cpu_ops.py holds the kernel to its reference over the same pages, bit for bit.)"""
    torch.manual_seed(1)
    model = with_gguf_blocks(Transformer(CFG).eval(), seed=1)
    cpu_fusion.fuse(model)
    feeds = FEEDS
    calls = counted(monkeypatch, cpu_block, "decode_layers")
    fused, fused_pool = run_steps(model, feeds, kv_format=kv_format)
    assert len(calls) == len(feeds)
    assert fused_pool.store.k[0].data.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[kv_format]
    cpu_fusion.unfuse(model)
    plain, plain_pool = run_steps(model, feeds, cpu_kernels=False, kv_format=kv_format)
    for layer in range(CFG.num_layers):
        for a, b in (
            (fused_pool.store.k[layer], plain_pool.store.k[layer]),
            (fused_pool.store.v[layer], plain_pool.store.v[layer]),
        ):
            eps = torch.finfo(a.data.dtype).eps
            torch.testing.assert_close(a.data[:, :16].float(), b.data[:, :16].float(), rtol=eps, atol=eps)
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("kv_format", ["k8v4", "mxfp4"])
def test_quantized_pages_take_the_whole_block_in_c_and_match_the_reference(kv_format, monkeypatch):
    """k8v4 / mxfp4 pages on the CPU (rotated; mxfp4 keys through a key transform per KV head): every step, the
    prompt's too, is one C call per block that rotates and quantizes its keys and values into the pages and
    attends over the codes; the same bits as the block one kernel at a time, and the logits of the same engine
    with the attention call swapped for its torch reference (rotation, kv_quant's quantizer, attention over the
    dequantized pages) within float32 rounding."""
    torch.manual_seed(2)
    cfg = dataclasses.replace(CFG, hidden_size=128, head_dim=32)  # (quantized pages: blocks of 32 along head_dim)
    model = with_gguf_blocks(Transformer(cfg).eval(), seed=2)
    cpu_fusion.fuse(model)
    feeds = FEEDS
    g = torch.Generator().manual_seed(3)
    a = torch.eye(32) + 0.1 * torch.randn(cfg.num_layers, cfg.num_kv_heads, 32, 32, generator=g)  # invertible
    steps = functools.partial(run_steps, model, feeds, kv_format=kv_format, key_transform=lambda: a)
    calls = counted(monkeypatch, cpu_block, "decode_layers")
    whole, whole_pool = steps()
    assert len(calls) == len(feeds)  # every step, the prompt too
    assert (whole_pool.store.key_transform is not None) == (kv_format == "mxfp4")
    monkeypatch.setattr(cpu_fusion.CpuBlock, "block_weights", lambda self: None)
    calls = counted(monkeypatch, cpu_attention, "paged_attention_quantized")
    ops, ops_pool = steps()
    assert len(calls) == len(feeds) * cfg.num_layers
    assert all(torch.equal(x, y) for x, y in zip(whole, ops, strict=True))
    for layer in range(cfg.num_layers):
        for x, y in (
            (whole_pool.store.k[layer], ops_pool.store.k[layer]),
            (whole_pool.store.v[layer], ops_pool.store.v[layer]),
        ):
            assert torch.equal(x.data[:, :16], y.data[:, :16]) and torch.equal(x.scales[:, :16], y.scales[:, :16])
    monkeypatch.setattr(cpu_attention, "paged_attention_quantized", cpu_attention.paged_attention_quantized_ref)
    want, _ = steps()
    for x, y in zip(whole, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
