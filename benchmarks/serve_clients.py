"""Streaming clients for the serve benchmarks (serve_load.py, serve_ceiling.py): N at once, in other processes.

Clients are other programs: they run in --client-procs processes of their own, one thread per request, so they do
not share the server's interpreter lock. Each process builds its clients and threads first and all start
together: the wall time runs from the first request sent to the last stream's end, so that it measures serving,
not the ~45 ms of CPU the `openai` client takes to build (8 of them a process are ~0.4 s on 2 cores, longer than
a whole 64-token run on the H200). Two kinds:

- `openai`: the official client, as users run it (it builds a pydantic object from every chunk).
- `raw`: http.client reading the SSE lines and counting them, parsing only the usage chunk; it costs the client
  machine far less per chunk, which matters when the server and its clients share 2 cores (serve_ceiling.py).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

SETUP_S = 2.0  # time the client processes get to build their clients and threads before the common start


@dataclass(slots=True)
class StreamTotals:
    """What a batch of streams brought back: completion tokens (from usage) and SSE chunks that carried text."""

    tokens: int = 0
    text_chunks: int = 0

    def add(self, other: StreamTotals) -> None:
        self.tokens += other.tokens
        self.text_chunks += other.text_chunks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openai_streamer(url: str) -> Callable[[str, str, int], StreamTotals]:
    """A streamed chat completion through the official `openai` client, its client built now (it loads the CA
    bundle: ~45 ms of CPU on this machine; a program builds its client once)."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)

    def stream(name: str, prompt: str, max_tokens: int) -> StreamTotals:
        chunks = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        totals = StreamTotals()
        for chunk in chunks:
            if chunk.usage is not None:
                totals.tokens = chunk.usage.completion_tokens
            elif chunk.choices and chunk.choices[0].delta.content:
                totals.text_chunks += 1
        return totals

    return stream


def raw_streamer(url: str) -> Callable[[str, str, int], StreamTotals]:
    """A streamed chat completion read as SSE lines: `data:` lines counted, only the usage chunk parsed."""
    parts = urlsplit(url)

    def stream(name: str, prompt: str, max_tokens: int) -> StreamTotals:
        body = {
            "model": name,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
        headers = {"content-type": "application/json"}
        connection.request("POST", parts.path + "/chat/completions", json.dumps(body), headers)
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"the server answered {response.status}: {response.read()[:200]!r}")
        data_lines, previous = 0, b""
        for line in response:
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                break
            data_lines += 1
            previous = line
        connection.close()
        usage = json.loads(previous[len(b"data: ") :])["usage"]
        # every data line but the role chunk, the finish-reason chunk and the usage chunk carries text
        return StreamTotals(tokens=usage["completion_tokens"], text_chunks=data_lines - 3)

    return stream


STREAMERS = {"openai": openai_streamer, "raw": raw_streamer}


def client_batch(
    kind: str, url: str, name: str, prompts: list[str], max_tokens: int, start_at: float
) -> tuple[StreamTotals, float, float]:
    """One client process: its clients and threads made first, then at `start_at` (time.perf_counter, the same
    clock in every process) a streaming request per prompt, all at once, one thread each
    -> (totals, when the first request went out, when the last stream ended)."""
    streams = [STREAMERS[kind](url) for _ in prompts]
    results = [StreamTotals() for _ in prompts]
    starts, ends = [0.0] * len(prompts), [0.0] * len(prompts)
    ready = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        ready.wait()
        starts[i] = time.perf_counter()
        results[i] = streams[i](name, prompts[i], max_tokens)
        ends[i] = time.perf_counter()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, start_at - time.perf_counter()))
    ready.wait()
    for thread in threads:
        thread.join()
    totals = StreamTotals()
    for result in results:
        totals.add(result)
    return totals, min(starts), max(ends)


def client_run(
    pool: ProcessPoolExecutor,
    procs: int,
    url: str,
    name: str,
    prompts: list[str],
    max_tokens: int,
    kind: str = "openai",
) -> tuple[StreamTotals, float]:
    """All prompts at once, spread over `procs` client processes -> (totals, wall seconds from the first request
    sent to the last stream's end). The processes build their clients before a common start, SETUP_S ahead: a
    process still building then starts late, and the wall time shows it."""
    start_at = time.perf_counter() + SETUP_S
    parts = [pool.submit(client_batch, kind, url, name, prompts[i::procs], max_tokens, start_at) for i in range(procs)]
    totals, first, last = StreamTotals(), float("inf"), 0.0
    for part in parts:
        batch, start, end = part.result()
        totals.add(batch)
        first, last = min(first, start), max(last, end)
    return totals, last - first
