"""The host's own work per engine step, on the CPU: what a GPU step costs the host besides its kernels.

    PYTHONPATH=. python benchmarks/host_loop.py --sessions 8,32 [--cprofile]

On the H200 at 32 sessions both plain and drafting steps are host-bound (docs/benchmarks.md, nineteenth session:
a heads step ~2.4 ms against ~1.2 ms of kernels), so the Python work per request per step is what limits them.
This runs a tiny random model on the CPU with the GPU's step path forced on (steps launched ahead, every request
padded to one width, drafts made and verified "on the device" by a table drafter that taps a hidden row, as the
heads do) and reports wall time per step less the time in the model's forward, the argmax and the drafting step's
verdicts and next drafts (one graph replay on a GPU): the host's own work, which on a GPU runs beside the kernels.
Configurations: `none` (plain decoding), a drafter's name (drafting k = 4: `table`, a bigram table that taps a
hidden row; `ngram`) and NAME-off (that drafter under `--k auto` with its batch's draft gate held at cap 0 for every
step: what an adaptive drafter costs the host where the gate keeps drafting off, as at 32 sessions on the H200).
glibc's allocator is told to keep large blocks (mallopt): a step's logits (160 rows of the vocabulary at 32
sessions drafting, 31 MB) would otherwise be mapped and unmapped every step, ~0.8 ms a step that a GPU, whose
graphs keep their buffers, does not pay (and that came and went from run to run).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import ctypes.util
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.adaptive import DraftGate
from specchat.engine.engine import Engine
from specchat.kernels import cpu_ops
from tests.conftest import save_tiny_hf
from tests.engine.test_step_ahead import BigramDrafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", default="8,32")
    parser.add_argument("--configs", default="none,table")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the least host time is reported")
    parser.add_argument("--cprofile", action="store_true", help="the host functions with the most own time")
    args = parser.parse_args()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks up to 32 MB from the heap, reused
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: and kept
    engine = Engine.load(EngineConfig(model=str(save_tiny_hf(Path(tempfile.mkdtemp()))), device="cpu", dtype="float32"))
    vocab = engine.model.cfg.vocab_size
    engine.drafters["table"] = BigramDrafter(torch.randint(0, vocab, (vocab,), generator=torch.Generator()), (1,))
    engine.spec_step.runs_ahead = True  # the GPU's path: steps ahead, one width per step
    engine.scheduler.uniform_widths = True
    excluded = [0.0]  # seconds in the model's forward and the argmax (device work on a GPU)

    def timed(fn):
        def call(*a, **kw):
            t = time.perf_counter()
            result = fn(*a, **kw)
            excluded[0] += time.perf_counter() - t
            return result

        return call

    engine.runner._forward = timed(engine.runner._forward)
    cpu_ops.argmax = timed(cpu_ops.argmax)  # (spec_step and verify read it from the module)
    verdicts = engine.spec_step._verdicts  # verdicts and next drafts: one graph replay on a GPU
    verdicts.fn = timed(verdicts.fn)

    def run(sessions: int, spec: SpecParams) -> tuple[int, float, float]:
        """Steps, host ms a step, and the share of steps whose result a step launched ahead had computed."""
        sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(sessions):
            engine.submit(f"prompt number {i}: tell me about things", sampling, spec)
        steps, excluded[0], t0 = 0, 0.0, time.perf_counter()
        continued = engine.spec_step.continued
        while engine.scheduler.has_work():
            engine.step()
            steps += 1
        ahead = (engine.spec_step.continued - continued) / steps
        return steps, (time.perf_counter() - t0 - excluded[0]) * 1e3 / steps, ahead

    print(
        f"{'sessions':>8} {'config':>7} {'steps':>6} {'host ms/step':>12} {'host us/request/step':>20} {'ran ahead':>9}"
    )
    for sessions in map(int, args.sessions.split(",")):
        for config in args.configs.split(","):
            gate_off = config.endswith("-off")
            if config == "none":
                spec = SpecParams("none", k=0)
            else:
                spec = SpecParams(config.removesuffix("-off"), k=None if gate_off else 4)
            allow, peek = DraftGate.allow, DraftGate.peek
            if gate_off:
                DraftGate.allow, DraftGate.peek = (lambda gate: 0), (lambda gate: False)
            run(sessions, spec)  # warm-up
            steps, host, ahead = min((run(sessions, spec) for _ in range(args.repeats)), key=lambda r: r[1])
            print(
                f"{sessions:>8} {config:>7} {steps:>6} {host:>12.3f} {host * 1e3 / sessions:>20.1f} {ahead:>9.0%}",
                flush=True,
            )
            if args.cprofile:
                profiler = cProfile.Profile()
                profiler.enable()
                run(sessions, spec)
                profiler.disable()
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(20)
                print("\n".join(out.getvalue().splitlines()[6:]), flush=True)
            DraftGate.allow, DraftGate.peek = allow, peek


if __name__ == "__main__":
    main()
