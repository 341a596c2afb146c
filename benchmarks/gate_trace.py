"""What a DraftGate saw and chose, step by step: the bench's sessions run (`specchat bench`'s), with every gated
step's (cap, step ms, requests, expected tokens) recorded and each round's gate state printed.

    PYTHONPATH=. python benchmarks/gate_trace.py [--device cuda] [--drafter heads] [--sessions 1] [--requests 32]
        [--rounds 2] [--out trace.json]

For a gate that settles where a fixed k runs faster (H200, one session, the heads alone: --k auto 1.15x plain
where k = 4 ran 1.43x, fortieth session): the trace shows which cap's price is off and why.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specchat.bench.sessions import run_sessions
from specchat.cli.inputs import read_prompt_lines
from specchat.cli.options import spec_params
from specchat.config import EngineConfig, SamplingParams
from specchat.engine.adaptive import GATE_CAPS, DraftGate
from specchat.engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--drafter", default="heads")
    ap.add_argument("--sessions", type=int, default=1)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", default="benchmarks/session_prompts.txt")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    trace: list[dict] = []
    observe = DraftGate.observe

    def traced(gate: DraftGate, cap: int, step_ms: float, tokens: float, requests: int = 1) -> None:
        observe(gate, cap, step_ms, tokens, requests)
        trace.append({"cap": cap, "ms": round(step_ms, 4), "tokens": round(tokens, 3), "requests": requests,
                      "priced": {c: round(t, 4) for c, t in gate.ms_per_token.items()}})  # fmt: skip

    DraftGate.observe = traced
    engine = Engine.load(EngineConfig(model=args.model, device=args.device))
    engine.warm_up(sessions=args.sessions, drafters=[args.drafter])
    prompts = read_prompt_lines(Path(args.prompts), "--prompts")
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for round_ in range(args.rounds):
        for name in ("none", args.drafter):
            r = run_sessions(engine, prompts, args.sessions, sampling, spec_params(name, "auto"), args.requests)
            print(
                f"round {round_} {name}: {r.tok_per_s:.0f} tok/s, tokens/step {r.tokens_per_step}, caps {r.gate_caps}"
            )
        for key, gate in engine.scheduler.gates.items():
            print(f"  gate {key}: priced {gate.ms_per_token} chosen {gate.chosen} every {gate.every} "
                  f"allowed {gate.allowed} expected {[round(gate.expected_tokens([c]), 3) for c in GATE_CAPS]}")  # fmt: skip
    fixed = run_sessions(engine, prompts, args.sessions, sampling, spec_params(args.drafter, "4"), args.requests)
    print(f"k=4 {args.drafter}: {fixed.tok_per_s:.0f} tok/s, tokens/step {fixed.tokens_per_step}")
    if args.out:
        Path(args.out).write_text(json.dumps(trace))
        print(f"{len(trace)} gated steps -> {args.out}")


if __name__ == "__main__":
    main()
