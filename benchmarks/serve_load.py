"""What the HTTP layer costs: N streaming clients of `specchat serve` against the same requests in-process.

    python benchmarks/serve_load.py [--clients 32] [--max-tokens 64] [--device cpu] [--model smollm2-135m]

One engine, one run: first `bench.sessions.run_sessions` drives it in-process (N requests in flight), then the same
engine is served on a free port and N threads of the official `openai` client stream the same prompts at once.
Both sides decode greedily and stop at EOS or --max-tokens, so they do the same work, each from a cold prefix cache,
in --rounds alternating rounds (best of each side shown). Aggregate tok/s = completion tokens of all requests /
wall time. Prints a markdown row per side and the ratio.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from pathlib import Path

import openai
import uvicorn

from specchat.bench.sessions import run_sessions
from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine
from specchat.server.app import create_app

PROMPTS = Path(__file__).resolve().parent / "session_prompts.txt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_in_thread(engine: Engine, name: str) -> tuple[uvicorn.Server, threading.Thread, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, name), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}/v1"


def client_run(url: str, name: str, prompts: list[str], max_tokens: int) -> tuple[int, float]:
    """All prompts at once, one streaming client each -> (completion tokens, wall seconds)."""
    tokens = [0] * len(prompts)

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        stream = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": prompts[i]}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                tokens[i] = chunk.usage.completion_tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(tokens), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of each side is shown")
    args = ap.parse_args()
    lines = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [lines[i % len(lines)] for i in range(args.clients)]
    engine = Engine.load(EngineConfig(model=args.model, device=args.device, max_running=max(64, args.clients)))
    name = engine.model_spec.alias if engine.model_spec else args.model
    sampling = SamplingParams(max_tokens=args.max_tokens)
    engine.submit(prompts[0], SamplingParams(max_tokens=4)).result()  # warm-up
    inproc_runs, http_runs = [], []
    server, thread, url = None, None, ""
    for _ in range(args.rounds):  # in-process, then HTTP, each from a cold prefix cache
        engine.pool.clear_prefix_cache()
        inproc_runs.append(run_sessions(engine, prompts, args.clients, sampling, SpecParams("none", k=0)))
        engine.pool.clear_prefix_cache()
        engine.start()
        if server is None:
            server, thread, url = serve_in_thread(engine, name)
            client_run(url, name, prompts[:2], 4)  # warm-up over HTTP
            engine.pool.clear_prefix_cache()
        http_runs.append(client_run(url, name, prompts, args.max_tokens))
        engine.close()  # run_sessions drives the steps itself
    server.should_exit = True
    thread.join(10)
    inproc = max(inproc_runs, key=lambda r: r.tok_per_s)
    tokens, wall = min(http_runs, key=lambda r: r[1])
    http_rate = tokens / wall
    print("| side | clients | completion tokens | wall s | aggregate tok/s | vs in-process |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| in-process (run_sessions) | {args.clients} | {inproc.completion_tokens} | {inproc.wall_s:.1f} "
        f"| {inproc.tok_per_s:.1f} | 1.00x |"
    )
    print(
        f"| HTTP, openai client streaming | {args.clients} | {tokens} | {wall:.1f} | {http_rate:.1f} "
        f"| {http_rate / inproc.tok_per_s:.2f}x |"
    )


if __name__ == "__main__":
    main()
