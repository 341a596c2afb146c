"""The HTTP layer's ceiling: `specchat serve`'s app over a synthetic token source instead of a model.

    python benchmarks/serve_ceiling.py [--clients 32] [--max-tokens 256] [--step-ms 5] [--busy-ms 0]
                                       [--client openai|raw] [--baseline REF] [--rounds 3] [--profile FILE]
                                       [--stream-interval-ms MS]

A benchmark harness, never part of the product: it measures what the server (specchat/server/app.py and the
ASGI stack under it) and its streaming clients can carry when the engine is not the limit, which the real CPU
engine (~70 tok/s a session) cannot show. TokenSource stands in for the engine with the interface the server
consumes (engine.api.ServedEngine: submit listen_only, apply between steps, listeners called once per step with
that step's events, cancel, encode_prompt, max_position): every running request gets one token per step, as a
TextDelta, and a Finished after --max-tokens. A step holds the interpreter lock for --busy-ms of Python work
(the step loop's planning, input building, postprocess and detokenization), letting it go every 50 us as each
torch call does, then sleeps --step-ms (the device's time: the lock is free), then hands its events to the
listeners. The server's work on one step's events then competes with the next step's Python for the lock, as it
does with the real engine.
At 32 clients, --step-ms 5 emits ~6,400 tok/s, the H200's in-process rate at 32 sessions (docs/serve.md).

The server runs in a process of its own (as `specchat serve` does), one per tree: this checkout and, with
--baseline REF, REF's tree checked out into a temporary git worktree, first on that process's sys.path. Rounds
alternate between the trees; each round also times the same requests on an in-process TokenSource (the
engine's rate, what the HTTP side is held to). Per side: aggregate tok/s = completion tokens / wall time of all
streams; text chunks per request; the server process's CPU time per 1,000 tokens (same round) outside the token source's
thread (the HTTP layer's own cost, which on a 2-core machine is the figure to trust: the client processes
compete for the same cores). --profile FILE records the first tree's server with py-spy (raw collapsed stacks)
during its HTTP rounds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import psutil
from serve_clients import STREAMERS, client_run, free_port

REPO = Path(__file__).resolve().parent.parent
PROMPT_IDS = list(range(100, 132))  # every prompt "encodes" to 32 tokens: the tokenizer is not what is measured
HANDOFF_S = 50e-6  # --busy-ms is spent in slices this long, each followed by a release of the lock
# Token texts with what JSON must escape (quotes, a newline, a backslash) and non-ASCII, as model output has.
WORDS = [" the", " quick", " brown", ' "fox"', " jumps", "\n", " over", " a", " lazy", " café", " \\d", " dog."]


@dataclass(slots=True)
class SyntheticRequest:
    """A running request of the token source: its texts so far, up to max_tokens."""

    max_tokens: int
    texts: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)


class SyntheticHandle:
    """A submitted request of the token source; its events go to the listeners only."""

    def __init__(self, source: TokenSource, request_id: int) -> None:
        self.source = source
        self.request_id = request_id

    def cancel(self) -> None:
        self.source.cancel(self.request_id)


class TokenSource:
    """The engine as the server consumes it, emitting one token per running request per step, no model."""

    def __init__(self, step_s: float, busy_s: float, max_position: int = 8192) -> None:
        self.step_s, self.busy_s = step_s, busy_s
        self.max_position = max_position
        self.tokenizer = SimpleNamespace(chat_template_source="")
        self.listeners: list = []
        self.thread_id: int | None = None  # the step loop's native thread id (its CPU time is not the server's)
        self._running: dict[int, SyntheticRequest] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._stop = False
        self._thread: threading.Thread | None = None

    def encode_prompt(self, prompt, system=None, raw: bool = False, tools=None) -> list[int]:
        return PROMPT_IDS

    def submit(self, prompt, sampling=None, spec=None, *, listen_only: bool = False) -> SyntheticHandle:
        """On the step loop's thread (the server submits inside `apply`)."""
        request_id = next(self._ids)
        self._running[request_id] = SyntheticRequest(sampling.max_tokens)
        return SyntheticHandle(self, request_id)

    def apply(self, command) -> Future:
        done: Future = Future()
        self._commands.put((command, done))
        self._wake.set()
        return done

    def cancel(self, request_id: int) -> None:
        self.apply(lambda: self._running.pop(request_id, None))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="token-source", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        self.thread_id = threading.get_native_id()
        while not self._stop:
            while not self._commands.empty():
                command, done = self._commands.get()
                command()
                done.set_result(None)
            if not self._running:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            self._python_work(self.busy_s)  # the step's Python: plan, inputs, postprocess, detokenization
            time.sleep(self.step_s)  # the device's time: the interpreter lock is free
            events = self._emit()
            for listener in self.listeners:
                listener(events)

    def _emit(self) -> list:
        """A token for every running request, and the Finished of those that reached their max_tokens."""
        from specchat.engine.sequence import Finished, TextDelta
        from specchat.engine.stats import SpecStats

        events: list = []
        for request_id, request in list(self._running.items()):
            text = WORDS[len(request.texts) % len(WORDS)]
            request.texts.append(text)
            count = len(request.texts)
            events.append(TextDelta(request_id, text, [count]))
            if count == request.max_tokens:
                elapsed = time.perf_counter() - request.started
                stats = SpecStats(steps=count, emitted=count)
                ids = list(range(count))
                text = "".join(request.texts)
                events.append(Finished(request_id, "length", text, ids, len(PROMPT_IDS), stats, elapsed, elapsed))
                del self._running[request_id]
        return events

    @staticmethod
    def _python_work(seconds: float) -> None:
        """Hold the interpreter lock for `seconds`, letting go every HANDOFF_S as a torch op does."""
        end = time.perf_counter() + seconds
        while (now := time.perf_counter()) < end:
            slice_end = min(end, now + HANDOFF_S)
            while time.perf_counter() < slice_end:
                pass
            time.sleep(0)


def inprocess_rate(args: argparse.Namespace) -> tuple[int, float]:
    """The token source alone, the same requests submitted at once -> (tokens, wall seconds)."""
    from specchat.engine.sequence import Finished

    source = TokenSource(args.step_ms / 1000, args.busy_ms / 1000)
    finished, all_done = [], threading.Event()

    def listener(events) -> None:
        finished.extend(e for e in events if isinstance(e, Finished))
        if len(finished) == args.clients:
            all_done.set()

    source.listeners.append(listener)
    source.start()
    start = time.perf_counter()
    sampling = SimpleNamespace(max_tokens=args.max_tokens)
    for _ in range(args.clients):
        source.apply(lambda: source.submit(PROMPT_IDS, sampling))
    all_done.wait()
    wall = time.perf_counter() - start
    source.close()
    return sum(len(f.token_ids) for f in finished), wall


def serve(args: argparse.Namespace) -> None:
    """The server process: the app over a token source on --serve-port; one JSON line on stdout when ready."""
    import uvicorn

    import specchat
    from specchat.server.app import create_app

    source = TokenSource(args.step_ms / 1000, args.busy_ms / 1000)
    source.start()
    options = {} if args.stream_interval_ms is None else {"stream_interval_s": args.stream_interval_ms / 1000}
    config = uvicorn.Config(
        create_app(source, "synthetic", **options), host="127.0.0.1", port=args.serve_port, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started or source.thread_id is None:
        time.sleep(0.05)
    print(json.dumps({"specchat": specchat.__file__, "token_source_thread": source.thread_id}), flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin
    server.should_exit = True
    thread.join(10)
    source.close()


class ServerProcess:
    """A server process over one tree, and its CPU time outside the token source's thread."""

    def __init__(self, tree: Path, args: argparse.Namespace) -> None:
        self.tree, self.port = tree, free_port()
        command = [sys.executable, __file__, "--serve-port", str(self.port)]
        command += ["--step-ms", str(args.step_ms), "--busy-ms", str(args.busy_ms)]
        if tree == REPO and args.stream_interval_ms is not None:
            command += ["--stream-interval-ms", str(args.stream_interval_ms)]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        ready = json.loads(self.process.stdout.readline())
        if not ready["specchat"].startswith(str(tree)):
            raise RuntimeError(f"the server for {tree} imported specchat from {ready['specchat']}")
        self.source_thread = ready["token_source_thread"]
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def http_cpu_s(self) -> float:
        """User + system seconds of the process so far, less the token source's thread."""
        proc = psutil.Process(self.process.pid)
        total = sum(proc.cpu_times()[:2])
        source = sum(t.user_time + t.system_time for t in proc.threads() if t.id == self.source_thread)
        return total - source

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(20)


def checkout(ref: str, folder: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder), ref], check=True)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=5.0, help="a step's sleep: the device's time, lock free")
    ap.add_argument("--busy-ms", type=float, default=0.0, help="a step's Python work, holding the lock")
    ap.add_argument(
        "--stream-interval-ms", type=float, help="this checkout's create_app(stream_interval_s=...); default: its own"
    )
    ap.add_argument("--client", choices=list(STREAMERS), default="openai")
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each side is shown")
    ap.add_argument("--baseline", metavar="REF", help="also serve REF's tree, side by side")
    ap.add_argument("--profile", type=Path, help="py-spy raw stacks of the first tree's server in its HTTP rounds")
    ap.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)  # the server process (see serve())
    args = ap.parse_args()
    if args.serve_port is not None:
        serve(args)
        return
    with tempfile.TemporaryDirectory(prefix="serve-ceiling-") as tmp:
        trees = {"this checkout": REPO}
        if args.baseline:
            sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.baseline], capture_output=True)
            trees[f"baseline {sha.stdout.decode().strip()}"] = checkout(args.baseline, Path(tmp) / "baseline")
        try:
            run(args, trees)
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees.popitem()[1])])


def run(args: argparse.Namespace, trees: dict[str, Path]) -> None:
    servers = {label: ServerProcess(tree, args) for label, tree in trees.items()}
    procs = max(1, min(args.client_procs, args.clients))
    pool = ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"))
    prompts = [f"prompt {i}" for i in range(args.clients)]
    for server in servers.values():  # warm-up: the client processes start and import, each server serves once
        client_run(pool, procs, server.url, "synthetic", prompts[:procs], 4, args.client)
    profiler = None
    if args.profile:
        first = next(iter(servers.values())).process.pid
        profiler = subprocess.Popen(
            [
                "py-spy",
                "record",
                "--gil",
                "--rate",
                "250",
                "--pid",
                str(first),
                "--format",
                "raw",
                "-o",
                str(args.profile),
            ]
        )
    inproc, http = [], {label: [] for label in servers}
    for _ in range(args.rounds):
        inproc.append(inprocess_rate(args))
        for label, server in servers.items():
            cpu_before = server.http_cpu_s()
            totals, wall = client_run(pool, procs, server.url, "synthetic", prompts, args.max_tokens, args.client)
            http[label].append((totals, wall, server.http_cpu_s() - cpu_before))
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)
        profiler.wait(60)
    pool.shutdown()
    for server in servers.values():
        server.close()
    in_tokens, in_wall = min(inproc, key=lambda r: r[1])
    in_rate = in_tokens / in_wall
    print(
        f"{args.clients} clients ({args.client}, {procs} processes) x {args.max_tokens} tokens, step {args.step_ms} ms "
        f"sleep + {args.busy_ms} ms busy; stream interval {'default' if args.stream_interval_ms is None else args.stream_interval_ms} ms; "
        f"best of {args.rounds} rounds\n"
    )
    print("| side | aggregate tok/s | vs token source | text chunks a request | server CPU ms / 1k tokens |")
    print("|---|---:|---:|---:|---:|")
    print(f"| token source in-process | {in_rate:,.0f} | 1.00x | | |")
    for label, runs in http.items():
        totals, wall, cpu = min(runs, key=lambda r: r[1])
        rate = totals.tokens / wall
        chunks = totals.text_chunks / args.clients
        cpu_per_k = 1e6 * cpu / totals.tokens
        print(f"| HTTP, {label} | {rate:,.0f} | {rate / in_rate:.2f}x | {chunks:.0f} | {cpu_per_k:.0f} |")


if __name__ == "__main__":
    main()
