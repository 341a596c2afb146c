"""Decode and verification speed on a random-weight model of a real shape, built directly on the device.

Speed does not depend on the weights' values, so no checkpoint is needed: the model is created with random
weights where it runs. Each configuration prefills `batch` requests with `context` random tokens (one forward
each, timed: the prefill speed, after one untimed prompt of the same length), then times `steps` engine steps
through the real ModelRunner and KV pool.

Speculative rows use a benchmark-only drafter of set acceptance rate: every step feeds [last token + k random
drafts] per request through the real target forward and greedy verification (argmax over all k + 1 rows),
then keeps a accepted drafts, a drawn from the chain-acceptance distribution of the per-position rates
`acceptance` (r_1, r_2, ...: draft j is accepted with probability r_j once drafts 1 .. j-1 were, the last rate
standing for every later position; one rate r gives P(a = j) = r^j (1 - r) for j < k, P(a = k) = r^k), and
truncates the KV of the rest. Per-position rates measured on a real model and drafter
(benchmarks/tree_estimate.py prints the heads') carry its acceptance to another model's shape. Real drafters
cost extra drafting time; this measures the target side only, and says so in its label.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from specchat.config import KV_FORMATS
from specchat.engine.kv_cache import KVPool
from specchat.engine.kv_pages import bytes_per_token
from specchat.engine.model import ModelConfig, Transformer
from specchat.engine.runner import ModelRunner, StepBatch
from specchat.engine.stats import percentile
from specchat.errors import ConfigError
from specchat.quant.modules import quantize_linears, select_linears, weight_bytes

SHAPES = {
    "llama-3.1-8b": ModelConfig(
        arch="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position=131072,
    ),
    "smollm2-135m": ModelConfig(
        arch="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        max_position=8192,
        tie_embeddings=True,
    ),
    "tiny": ModelConfig(  # a smoke test of the benchmark itself
        arch="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position=1024,
    ),
}
INIT_STD = 0.02
WARMUP_STEPS = 4
PAGE_SIZE = 16


@dataclass(slots=True)
class SyntheticCase:
    batch: int
    weights: str = "bf16"  # "mxfp4", "int4" (gpt-fast's), or the dtype of unquantized weights ("float32", ...)
    kv: str = "bf16"
    k: int = 0  # drafts per step (0 = plain decode)
    acceptance: tuple[float, ...] = (0.0,)  # per-position acceptance of the benchmark-only drafter

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ConfigError(f"--batch sizes must be >= 1, got {self.batch}")
        if self.kv not in KV_FORMATS:
            raise ConfigError(f"--kv takes KV formats among {', '.join(KV_FORMATS)}, got {self.kv!r}")
        if self.k < 0:
            raise ConfigError(f"--k must list draft counts >= 0, got {self.k}")
        if not self.acceptance or not all(0.0 <= r <= 1.0 for r in self.acceptance):
            raise ConfigError(f"--acceptance rates must be in [0, 1], got {self.acceptance}")

    @property
    def acceptance_label(self) -> str:
        return ",".join(f"{r:g}" for r in self.acceptance)


@dataclass(slots=True)
class SyntheticResult:
    case: SyntheticCase
    tok_per_s: float  # aggregate over the batch
    step_ms: float  # median wall time of one step
    tokens_per_step: float  # per request
    latency_p50_ms: float  # per-token latency: a step's time over the tokens it gave a request
    latency_p99_ms: float
    weights_bytes: int
    kv_bytes_per_token: int
    prefill_tok_per_s: float = 0.0  # the requests' prompts, one forward each


def pool_pages(case: SyntheticCase, context: int, steps: int, warmup: int = WARMUP_STEPS) -> int:
    """KV pages for a case: every request's context, its steps' tokens and a spare page."""
    tokens_per_seq = context + (warmup + steps) * (case.k + 1) + PAGE_SIZE
    return case.batch * (-(-tokens_per_seq // PAGE_SIZE) + 1)


def estimate_bytes(cfg: ModelConfig, dtype: torch.dtype, cases: list[SyntheticCase], context: int, steps: int) -> int:
    """Peak memory of a run, roughly: the dense weights (counted on the meta device; MXFP4 packs them while
    they are still there, so dense + packed at the peak), the largest case's KV pool, and the prefill's
    activations (fp32 logits and the MLP's hidden rows of one request's context)."""
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(cfg).parameters())
    element = torch.finfo(dtype).bits // 8
    weights = params * element * (2 if any(c.weights in ("mxfp4", "int4") for c in cases) else 1)
    kv = max(
        pool_pages(c, context, steps)
        * PAGE_SIZE
        * bytes_per_token(c.kv, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        for c in cases
    )
    prefill = context * (cfg.vocab_size * 4 + 3 * cfg.intermediate_size * element)
    return weights + kv + prefill


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Transformer:
    """A Transformer of the given shape with N(0, INIT_STD) weights, created on `device`."""
    with torch.device(device):
        model = Transformer(cfg)
    model = model.to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD)
    return model.eval().requires_grad_(False)


def quantize_all(model: Transformer) -> None:
    """Every linear to MXFP4 in place, the untied output head included (as gpt-fast's int4 yardstick does),
    by round to nearest with the OCP rule."""
    quantize_linears(model, select_linears(model, "all"), "ocp")


def sample_accepted(rng: random.Random, k: int, rates: tuple[float, ...]) -> int:
    """Accepted drafts of k: draft j + 1 is accepted at rate rates[j] (the last rate for every later one) while
    every draft before it was."""
    a = 0
    while a < k and rng.random() < rates[min(a, len(rates) - 1)]:
        a += 1
    return a


def run_case(
    model: Transformer,
    case: SyntheticCase,
    context: int,
    steps: int,
    warmup: int = WARMUP_STEPS,
    seed: int = 0,
    runner_factory=ModelRunner,
) -> SyntheticResult:
    """Time `steps` decode / verify steps of `case.batch` requests that each start with `context` tokens."""
    cfg = model.cfg
    device = next(model.parameters()).device
    pool = KVPool(
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        num_pages=pool_pages(case, context, steps, warmup),
        page_size=PAGE_SIZE,
        dtype=next(model.parameters()).dtype,
        device=device,
        kv_format=case.kv,
    )
    runner = runner_factory(model, pool)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    warm = -1  # an untimed prompt first: kernels compiled, workspaces allocated for a prompt this long
    prompt = torch.randint(0, cfg.vocab_size, (context,), generator=gen).tolist()
    pool.add(warm, prompt)
    runner.forward(StepBatch([warm], [prompt], [0], [1]))
    pool.free(warm)
    lengths, prefill_s = [], 0.0
    for b in range(case.batch):
        prompt = torch.randint(0, cfg.vocab_size, (context,), generator=gen).tolist()
        pool.add(b, prompt)
        sync()
        t0 = time.perf_counter()
        runner.forward(StepBatch([b], [prompt], [0], [1]))
        sync()
        prefill_s += time.perf_counter() - t0
        lengths.append(context)
    step_times, latencies, emitted = [], [], 0
    for i in range(warmup + steps):
        feeds = [torch.randint(0, cfg.vocab_size, (1 + case.k,), generator=gen).tolist() for _ in range(case.batch)]
        batch = StepBatch(list(range(case.batch)), feeds, [n - 1 for n in lengths], [1 + case.k] * case.batch)
        # positions n-1.. : the newest token (uncached) then the drafts, as in the scheduler
        for b in range(case.batch):
            pool.truncate(b, lengths[b] - 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = runner.forward(batch)
        verdicts = [logits.argmax(-1) for logits in out.logits]  # greedy verification's work
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        del verdicts
        for b in range(case.batch):
            a = sample_accepted(rng, case.k, case.acceptance)
            pool.truncate(b, lengths[b] + a)  # keep the newest token and the accepted drafts
            lengths[b] += a + 1
            if i >= warmup:
                emitted += a + 1
                latencies.extend([dt * 1e3 / (a + 1)] * (a + 1))
        if i >= warmup:
            step_times.append(dt)
    total = sum(step_times)
    return SyntheticResult(
        case=case,
        tok_per_s=emitted / total,
        step_ms=percentile(step_times, 50) * 1e3,  # the median as the per-token P50 takes it
        tokens_per_step=emitted / (steps * case.batch),
        latency_p50_ms=percentile(latencies, 50),
        latency_p99_ms=percentile(latencies, 99),
        weights_bytes=weight_bytes(model),
        kv_bytes_per_token=pool.bytes_per_token,
        prefill_tok_per_s=case.batch * context / prefill_s,
    )
