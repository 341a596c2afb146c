"""What the HTTP layer costs: N streaming clients of `specchat serve` against the same requests in-process.

    python benchmarks/serve_load.py [--clients 32] [--max-tokens 64] [--device cpu] [--model smollm2-135m]
                                    [--stream-interval-ms 10]

One engine, one run, its step loop on its own thread on both sides: in-process, the N prompts are submitted at once
and waited for; over HTTP, the same engine is served on a free port and N threads of the official `openai` client,
spread over --client-procs processes (clients are other programs: they do not share the server's interpreter
lock), stream the same prompts at once.
Both sides decode greedily and stop at EOS or --max-tokens, so they do the same work, each from a cold prefix cache,
in --rounds alternating rounds (best of each side shown). Aggregate tok/s = completion tokens of all requests /
wall time; over HTTP it runs from the first request sent to the last stream's end, the clients built before
(serve_clients.py; the figures in docs/serve.md before the synthetic-source harness also timed the 32
`openai.OpenAI()` constructions). Prints a markdown row per side and the ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import uvicorn
from serve_clients import client_run, free_port

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine
from specchat.server import STREAM_INTERVAL_S
from specchat.server.app import create_app

PROMPTS = Path(__file__).resolve().parent / "session_prompts.txt"


def serve_in_thread(
    engine: Engine, name: str, stream_interval_s: float
) -> tuple[uvicorn.Server, threading.Thread, str]:
    port = free_port()
    app = create_app(engine, name, stream_interval_s=stream_interval_s)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}/v1"


def inprocess_run(engine: Engine, prompts: list[str], sampling: SamplingParams) -> tuple[int, float]:
    """All prompts at once through the engine's API -> (completion tokens, wall seconds)."""
    start = time.perf_counter()
    handles = [engine.submit([{"role": "user", "content": p}], sampling, SpecParams("none", k=0)) for p in prompts]
    tokens = sum(len(h.result().token_ids) for h in handles)
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of each side is shown")
    ap.add_argument("--client-procs", type=int, default=4, help="client processes the streaming clients share")
    ap.add_argument(
        "--stream-interval-ms",
        type=float,
        default=STREAM_INTERVAL_S * 1000,
        help="the server's stream interval (specchat serve's option; 0: a chunk at every step)",
    )
    args = ap.parse_args()
    lines = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [lines[i % len(lines)] for i in range(args.clients)]
    engine = Engine.load(EngineConfig(model=args.model, device=args.device, max_running=max(64, args.clients)))
    name = engine.model_spec.alias if engine.model_spec else args.model
    sampling = SamplingParams(max_tokens=args.max_tokens)
    engine.warm_up(sessions=args.clients)  # on a GPU: every graph the runs replay
    engine.submit(prompts[0], SamplingParams(max_tokens=4)).result()
    inproc_runs, http_runs = [], []
    engine.start()
    server, thread, url = serve_in_thread(engine, name, args.stream_interval_ms / 1000)
    procs = max(1, min(args.client_procs, args.clients))
    pool = ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"))
    client_run(pool, procs, url, name, prompts[:procs], 4)  # warm-up: the client processes start and import
    for _ in range(args.rounds):  # in-process, then HTTP, each from a cold prefix cache
        engine.pool.clear_prefix_cache()
        inproc_runs.append(inprocess_run(engine, prompts, sampling))
        engine.pool.clear_prefix_cache()
        totals, wall = client_run(pool, procs, url, name, prompts, args.max_tokens)
        http_runs.append((totals.tokens, wall))
    pool.shutdown()
    server.should_exit = True
    thread.join(10)
    engine.close()
    in_tokens, in_wall = min(inproc_runs, key=lambda r: r[1])
    tokens, wall = min(http_runs, key=lambda r: r[1])
    in_rate, http_rate = in_tokens / in_wall, tokens / wall
    print("| side | clients | completion tokens | wall s | aggregate tok/s | vs in-process |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| in-process (Engine.submit) | {args.clients} | {in_tokens} | {in_wall:.1f} | {in_rate:.1f} | 1.00x |")
    print(
        f"| HTTP, openai client streaming | {args.clients} | {tokens} | {wall:.1f} | {http_rate:.1f} "
        f"| {http_rate / in_rate:.2f}x |"
    )


if __name__ == "__main__":
    main()
