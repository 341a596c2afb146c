"""What one EAGLE-3 draft position costs against one target step, at a real model's width (random weights).

    python benchmarks/eagle_cost.py [--shape llama-3.1-8b] [--context 512] [--batch 1,8] [--draft-vocab 32000]
                                    [--weights bf16,mxfp4] [--rows 5]

Target: a plain decode step of the synthetic model (bench/synthetic.py), through the engine's runner (CUDA
graphs on CUDA unless --eager). Head: one draft position of an EAGLE-3 head at the target's width (fc + one
decoder layer + the draft-vocabulary lm_head + argmax), through EagleHead with its own paged KV cache of the same
context, eagerly (the catch-up and ungraphed chains run so); and, on CUDA, as the drafter's greedy chain runs it
after the catch-up: EagleDrafter's captured chain of depth 2 and 4 (one graph replay and one read-back each), a
position costing (depth 4 - depth 2) / 2; and the catch-up over --rows newly verified rows a request before the
chain, eager and on its graph. Medians over --steps; the ratio is the issue-13 yardstick (<= 8%).
--weights: bf16 (both dense), mxfp4 (every linear of the target, its output head included, as `bench --synthetic
--weights mxfp4` quantizes it, and of the head, as the drafter takes its target's form: EagleHead.to_mxfp4).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specchat.bench.synthetic import SHAPES, quantize_all, random_model
from specchat.engine.cuda_graph import CTX_BUCKETS
from specchat.engine.drafters.eagle import CATCH_UP_ROWS, LINEARS, EagleConfig, EagleDrafter, EagleHead
from specchat.engine.fusion import fuse, fuse_linears
from specchat.engine.kv_cache import KVPool
from specchat.engine.loading import make_runner
from specchat.engine.runner import StepBatch
from specchat.quant.fp4_linear import Fp4Linear
from specchat.quant.modules import quantize_linears


def timed(fn, steps: int, device: torch.device) -> float:
    """Median milliseconds of fn() over `steps` calls (after 3 warm-up calls)."""
    times = []
    for i in range(steps + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def measure(model, head: EagleHead, batch: int, context: int, steps: int, eager: bool) -> tuple[float, float]:
    """(target step ms, draft position ms) for `batch` requests of `context` tokens."""
    cfg, device = model.cfg, next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    pages = batch * (context // 16 + 8)
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pages, 16, dtype, device)
    runner = make_runner(model, pool, eager=eager)
    head_pool = KVPool(1, cfg.num_kv_heads, cfg.head_dim, pages, 16, dtype, device, rotate=False)
    scale = head.cfg.head_dim**-0.5
    ids = list(range(batch))
    for b in ids:
        prompt = torch.randint(0, cfg.vocab_size, (context,)).tolist()
        pool.add(b, [])
        runner.forward(StepBatch([b], [prompt], [0], [1]))
        head_pool.add(b, [])
        kv = head_pool.prepare([b], [context], scale)
        u = head.fc(torch.randn(context, 3 * cfg.hidden_size, device=device, dtype=dtype))
        head(model.embed(torch.tensor(prompt, device=device)), u, torch.arange(context, device=device), kv)

    def target_step() -> None:
        for b in ids:
            pool.truncate(b, context)
        runner.forward(StepBatch(ids, [[1]] * batch, [context] * batch, [1] * batch))

    token = torch.ones(batch, dtype=torch.long, device=device)
    state = torch.randn(batch, cfg.hidden_size, device=device, dtype=dtype)
    position = torch.full((batch,), context, device=device)

    def draft_position() -> None:
        for b in ids:
            head_pool.truncate(b, context)
        kv = head_pool.prepare(ids, [1] * batch, scale)
        logits, _ = head(model.embed(token), state, position, kv)
        head.draft_vocab[logits.argmax(-1)].tolist()  # the drafter reads its choice back at each position

    return timed(target_step, steps, device), timed(draft_position, steps, device)


def drafter_at(model, head: EagleHead, batch: int, context: int) -> tuple[EagleDrafter, list[int]]:
    """An EagleDrafter of `head` and its requests 0..batch-1, each with `context` positions in the head's cache."""
    drafter = EagleDrafter(head, model, pool_tokens=batch * (context + 64))
    ids = list(range(batch))
    for b in ids:
        drafter.pool.add(b, [])
        drafter.pool.append(b, context)
    return drafter, ids


@torch.inference_mode()
def measure_chain(model, head: EagleHead, batch: int, context: int, steps: int) -> tuple[float, float]:
    """(greedy chain of depth 2 ms, of depth 4 ms) through EagleDrafter's CUDA-graph chain, `batch` requests with
    `context` positions in the head's cache (their keys as the pool holds them: the cost, not the values)."""
    cfg, device = model.cfg, next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    drafter, ids = drafter_at(model, head, batch, context)
    assert drafter.chain.enabled, "the chain runs on CUDA graphs only"
    logits = torch.randn(batch, head.cfg.draft_vocab_size, device=device)
    s = torch.randn(batch, cfg.hidden_size, device=device, dtype=dtype)
    position = torch.full((batch,), context, device=device)
    ctx = next(b for b in CTX_BUCKETS if b >= context + 4)

    def chain(depth: int) -> None:
        for b in ids:
            drafter.pool.truncate(b, context)
        drafter._graphed_steps(ids, depth, ctx, logits, s, position)  # (its read-back included)

    return timed(lambda: chain(2), steps, device), timed(lambda: chain(4), steps, device)


@torch.inference_mode()
def measure_catch_up(model, head: EagleHead, batch: int, context: int, steps: int, rows: int) -> tuple[float, float]:
    """(eager ms, graphed ms) of EagleDrafter's catch-up over `rows` newly verified rows a request (k = 4 with
    every draft accepted: 5), `batch` requests with `context` positions in the head's cache: what a drafting step
    runs before its chain (the host's padding and reservation included, the read-back of the chain not)."""
    cfg, device = model.cfg, next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    drafter, ids = drafter_at(model, head, batch, context)
    taps = [torch.randn(rows, 3 * cfg.hidden_size, device=device, dtype=dtype) for _ in ids]
    tokens = [[1] * rows for _ in ids]
    firsts = [context] * batch
    width = next(r for r in CATCH_UP_ROWS if r >= rows)
    ctx = next(b for b in CTX_BUCKETS if b >= context + width)

    def catch_up(graphed: bool) -> None:
        for b in ids:
            drafter.pool.truncate(b, context)
        if graphed:
            drafter._graphed_catch_up(ids, taps, tokens, firsts, width, ctx)
        else:
            drafter.eager_catch_up(ids, taps, tokens, firsts)

    return timed(lambda: catch_up(False), steps, device), timed(lambda: catch_up(True), steps, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument(
        "--rows", type=int, default=5, help="newly verified rows a request for the catch-up (k + 1 at most)"
    )
    ap.add_argument("--weights", default="bf16,mxfp4", help="bf16 and/or mxfp4 (target and head), in this order")
    args = ap.parse_args()
    formats = args.weights.split(",")
    if formats not in (["bf16"], ["mxfp4"], ["bf16", "mxfp4"]):  # (quantizing in place cannot be undone)
        ap.error(f"--weights: bf16, mxfp4 or bf16,mxfp4, got {args.weights!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(SHAPES[args.shape], dtype, device)
    vocab = min(args.draft_vocab, model.cfg.vocab_size)
    head = EagleHead(EagleConfig.for_target(model.cfg, vocab)).to(device=device, dtype=dtype).eval()
    graphs = device.type == "cuda" and not args.eager
    print("| shape | weights | batch | target step ms | eager draft position ms | ratio | graphed chain depth 2 / 4 ms | "
          "graphed position ms | ratio | catch-up eager / graphed ms |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    if graphs:  # the head as EagleDrafter runs it on CUDA (measure_chain's drafter would fuse it in place anyway)
        fuse(head)
        fuse_linears(head)
    cases = [(w, int(b)) for w in formats for b in args.batch.split(",")]
    for weights, batch in cases:
        if weights == "mxfp4" and not any(isinstance(m, Fp4Linear) for m in model.modules()):
            quantize_all(model)
            quantize_linears(head, LINEARS, dtype=dtype)
        t_target, t_draft = measure(model, head, batch, args.context, args.steps, args.eager)
        row = f"| {args.shape} | {weights} | {batch} | {t_target:.3f} | {t_draft:.3f} | {t_draft / t_target:.1%} |"
        if graphs:
            t2, t4 = measure_chain(model, head, batch, args.context, args.steps)
            per = (t4 - t2) / 2
            eager_up, graphed_up = measure_catch_up(model, head, batch, args.context, args.steps, args.rows)
            row += f" {t2:.3f} / {t4:.3f} | {per:.3f} | {per / t_target:.1%} | {eager_up:.3f} / {graphed_up:.3f} |"
        else:
            row += " - | - | - | - |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
