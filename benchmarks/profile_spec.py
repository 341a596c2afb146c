"""Where a speculative step's time goes on the real default model: phases, graph vs eager forwards, host hot spots.

    PYTHONPATH=. python benchmarks/profile_spec.py --device cuda --sessions 1,8 --configs none,ngram:4

For each (sessions, config) the engine runs the shipped session prompts (benchmarks/session_prompts.txt) with
at most `sessions` in flight, twice: once plain, for tok/s and ms per step; once with every phase of the step
(schedule, draft, forward, verify, postprocess) wrapped in a device synchronize and timed, and the forwards
counted as CUDA-graph replays or eager runs. The synchronized pass costs overlap, so its phases add up to more
than the plain step; they say where the time goes, the plain pass says how much there is. --cprofile adds the
host functions with the most own time over the plain pass. Requests run to their max tokens past the end-of-text
token, as `specchat bench` runs them (--stop-at-eos ends them there, as this profile did before 2026-12-04).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gc
import io
import os
import pstats
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

import specchat.engine.spec_step as spec_step_module
from specchat.bench.sessions import run_sessions
from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.adaptive import DraftGate
from specchat.engine.cuda_graph import GraphedFunction
from specchat.engine.engine import Engine
from specchat.engine.runner import ModelRunner
from specchat.engine.sequence import StepEvent

PROMPTS = Path(__file__).with_name("session_prompts.txt")


def spec_of(config: str) -> SpecParams:
    """'none' | 'DRAFTER:K' | 'DRAFTER:auto'."""
    if config == "none":
        return SpecParams(drafter="none", k=0)
    drafter, _, k = config.rpartition(":")
    return SpecParams(drafter=drafter, k=None if k == "auto" else int(k))


class Phases:
    """Wraps the step's phases with synchronized timers (installed for one pass, removed after)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ms: dict[str, float] = defaultdict(float)
        self.forwards: Counter = Counter()
        self.saved: list[tuple[object, str, object]] = []

    def sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def timed(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            self.sync()
            t0 = time.perf_counter()
            result = original(*args, **kwargs)
            self.sync()
            self.ms[label] += (time.perf_counter() - t0) * 1e3
            return result

        self.saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def __enter__(self) -> Phases:
        runner = self.engine.runner
        key = getattr(runner, "_graph_key", None)
        original_forward = runner.forward

        def counted(batch, taps=(), ids=None):
            self.forwards["graph" if key is not None and key(batch, taps) is not None else "eager"] += 1
            return original_forward(batch, taps, ids)

        self.saved.append((runner, "forward", original_forward))
        runner.forward = counted
        self.timed(self.engine.scheduler, "schedule", "schedule")
        self.timed(self.engine.spec_step, "draft", "draft")
        self.timed(runner, "forward", "forward")
        self.timed(spec_step_module, "verify_batch", "verify")
        self.timed(spec_step_module, "plain_tokens", "verify")  # steps without drafts
        self.timed(self.engine.scheduler, "postprocess", "postprocess")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self.saved):
            if isinstance(owner, type(spec_step_module)):
                setattr(owner, name, original)
            else:
                owner.__dict__.pop(name, None)  # the instance attribute: the class's method shows again


class SlowSteps:
    """Times every step of the plain pass (a step ends with its tokens read back, so wall time is step time) with
    what it ran (decoding requests and their widths, prompts, graphs captured in it), to say what the slow steps
    are: the ones that add the ITL P99 that tokens per second alone hides."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.steps: list[tuple[float, str]] = []
        self.captures = 0
        self.caps: dict[int, Counter] = defaultdict(Counter)  # id(DraftGate) -> steps allowed at each cap
        self.saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner: object, name: str, around) -> None:
        original = getattr(owner, name)
        self.saved.append((owner, name, original))
        setattr(owner, name, around(original))

    def __enter__(self) -> SlowSteps:
        def step(original):
            def timed():
                captures, t0 = self.captures, time.perf_counter()
                continued = self.engine.spec_step.continued
                events = original()
                ms = (time.perf_counter() - t0) * 1e3
                new = self.captures - captures
                calls = " ".join(f"{name} {t:.1f}" for name, t in self.calls)
                self.steps.append((ms, self.plan + (f" +{new} graphs captured" if new else "") + f" | {calls}"))
                ahead = "ran ahead" if self.engine.spec_step.continued > continued else "not ahead"
                self.kinds[f"{self.kind}, {ahead}"].append(ms)
                records = [e.record for e in events if isinstance(e, StepEvent)]
                if self.cap is not None and records and "prompts" not in self.kind:  # decoding alone, gated
                    self.by_cap[self.cap].append(
                        (ms, sum(r.k for r in records) / len(records), sum(r.emitted for r in records) / len(records))
                    )
                self.cap = None
                self.calls = []
                return events

            return timed

        def schedule(original):
            def described():
                plan, events = original()
                widths = Counter(len(i.feed) + i.k for i in plan.items if len(i.feed) == 1)
                prompts = [len(i.feed) for i in plan.items if len(i.feed) > 1]
                self.plan = f"decode {dict(sorted(widths.items()))} prompts {prompts} taps {sorted(plan.taps)}"
                drafting = "drafting" if any(w > 1 for w in widths) else "plain"
                self.kind = f"{drafting}{', prompts' if prompts else ''}{', taps' if plan.taps else ''}"
                return plan, events

            return described

        def counted(original):
            def capture(*args, **kwargs):
                self.captures += 1
                return original(*args, **kwargs)

            return capture

        def timed(name):
            def around(original):
                def call(*args, **kwargs):
                    t0 = time.perf_counter()
                    result = original(*args, **kwargs)
                    self.calls.append((name, (time.perf_counter() - t0) * 1e3))
                    return result

                return call

            return around

        self.plan, self.kind, self.calls = "", "", []
        self.cap: int | None = None  # the cap the gate allowed the step being run (--k auto)
        # cap -> (ms, drafts a request, tokens a request) of each step of decoding requests alone it was allowed
        self.by_cap: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
        self.kinds: dict[str, list[float]] = defaultdict(list)  # kind of step -> its steps' ms
        self.waited0 = self.engine.spec_step.waited_s
        self._wrap(self.engine, "step", step)
        # the runner's ways to run a forward, host time of each (an eager forward's is its kernel launches)
        for name in ("_prefill", "_cached_prompts", "_replay"):
            if hasattr(self.engine.runner, name):
                self._wrap(self.engine.runner, name, timed(name.strip("_")))
        self._wrap(ModelRunner, "forward", timed("eager"))
        self._wrap(self.engine.scheduler, "schedule", schedule)
        scheduler = self.engine.scheduler  # host time in each part of the step, unsynced
        parts = ((scheduler, "schedule"), (self.engine.spec_step, "run"), (scheduler, "postprocess"))
        self.phases = HostCalls([*((o, n, n) for o, n in parts), (self.engine, "_deliver", "deliver")]).__enter__()
        runner = self.engine.runner
        for name in ("_capture", "_capture_prefill", "_capture_after"):
            if hasattr(runner, name):
                self._wrap(runner, name, counted)
        self._wrap(GraphedFunction, "capture", counted)

        def allow(original):
            def counted_allow(gate):
                cap = original(gate)
                self.caps[id(gate)][cap] += 1
                self.cap = cap
                return cap

            return counted_allow

        self._wrap(DraftGate, "allow", allow)
        return self

    def __exit__(self, *exc) -> None:
        self.phases.__exit__()
        for owner, name, original in reversed(self.saved):
            if isinstance(owner, type):
                setattr(owner, name, original)
            else:
                owner.__dict__.pop(name, None)

    def report(self, n: int = 10) -> str:
        times = sorted(ms for ms, _ in self.steps)
        if not times:
            return "  no steps"
        median = times[len(times) // 2]
        slow = [ms for ms in times if ms > 2 * median]
        lines = [
            f"  steps {len(times)}, median {median:.2f} ms, p99 {times[int(0.99 * (len(times) - 1))]:.2f} ms; "
            f"{len(slow)} steps over 2x the median take {sum(slow):.1f} of {sum(times):.1f} ms; graphs captured "
            f"{self.captures}"
        ]
        lines += [f"    {ms:7.2f} ms  {what}" for ms, what in sorted(self.steps, reverse=True)[:n]]
        waited = (self.engine.spec_step.waited_s - self.waited0) * 1e3
        ms = self.phases.ms
        parts = {**ms, "run": ms["run"] - waited, "waited on the device": waited}
        lines.append(
            "  host ms per step (no sync; run less its wait to read the device's output): "
            + ", ".join(f"{name} {ms / len(times):.3f}" for name, ms in parts.items())
        )
        by_total = sorted(self.kinds.items(), key=lambda kv: -sum(kv[1]))
        lines.append("  by kind (steps, total ms, median ms): " + "; ".join(
            f"{kind}: {len(ms)}, {sum(ms):.1f}, {sorted(ms)[len(ms) // 2]:.2f}" for kind, ms in by_total
        ))  # fmt: skip
        if self.by_cap:  # what the steps the gate allowed each cap did: what its prices are made of
            lines.append(
                "  steps of decoding alone by the cap their gate allowed (steps, median ms, drafts a request, tokens "
                "a request, ms a token of a request): "
                + "; ".join(
                    f"cap {cap}: {len(steps)}, {sorted(m for m, _, _ in steps)[len(steps) // 2]:.2f}, "
                    f"{sum(k for _, k, _ in steps) / len(steps):.2f}, {sum(t for _, _, t in steps) / len(steps):.2f}, "
                    f"{sum(m for m, _, _ in steps) / sum(t for _, _, t in steps):.3f}"
                    for cap, steps in sorted(self.by_cap.items())
                )
            )
        return "\n".join(lines)


# What --host-calls times (inclusive host time, unsynced): the parts of a step on the GPU's path whose host work
# grows with the batch. Entries: (module, attribute path).
HOST_CALLS = [
    ("specchat.engine.spec_step", "SpecStep._drafts_ahead"),
    ("specchat.engine.spec_step", "SpecStep._verdicts_ahead"),
    ("specchat.engine.spec_step", "SpecStep._read"),
    ("specchat.engine.spec_step", "_DraftAhead.rows"),
    ("specchat.engine.spec_step", "_DraftAhead.take_back"),
    ("specchat.engine.cuda_graph", "GraphedFunction.__call__"),
    ("specchat.engine.cuda_graph", "CudaGraphRunner.forward_advanced"),
    ("specchat.engine.cuda_graph", "CudaGraphRunner._replay"),
    ("specchat.engine.cuda_graph", "_Staging.begin"),
    ("specchat.engine.cuda_graph", "_Staging.send"),
    ("specchat.engine.kv_cache", "KVPool.reserve"),
    ("specchat.engine.kv_cache", "KVPool.truncate"),
    ("specchat.engine.kv_cache", "KVPool.can_append"),
    ("specchat.kernels.cpu_ops", "argmax"),
    ("torch", "stack"),
    ("torch.cuda", "CUDAGraph.replay"),
    ("specchat.engine.scheduler", "Scheduler._keep_hidden"),
    ("specchat.engine.sequence", "Sequence.append_tokens"),
    ("specchat.engine.stats", "SpecStats.observe_step"),
    ("specchat.engine.telemetry", "EngineMetrics.observe_events"),
]


def host_calls() -> list[tuple[object, str, str]]:
    """HOST_CALLS as HostCalls' targets."""
    import importlib

    targets = []
    for module, path in HOST_CALLS:
        owner = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        targets.append((owner, name, path))
    return targets


class HostCalls:
    """Wraps calls with perf_counter timers for one pass (each call's time includes the calls inside it): targets
    (owner, attribute, label), the owner a module, a class or an instance; `host_calls()` names HOST_CALLS'."""

    def __init__(self, targets: list[tuple[object, str, str]]) -> None:
        self.targets = targets
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.saved: list[tuple[object, str, object, bool]] = []

    def __enter__(self) -> HostCalls:
        for owner, name, label in self.targets:
            own = name in vars(owner)  # restored as it was: the owner's own attribute, or none (a class's method)
            original = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)

            def timed(*args, _original=original, _label=label, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.ms[_label] += (time.perf_counter() - t0) * 1e3
                    self.calls[_label] += 1

            self.saved.append((owner, name, vars(owner).get(name), own))
            setattr(owner, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original, own in reversed(self.saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self.saved.clear()

    def report(self, steps: int) -> str:
        rows = sorted(self.ms.items(), key=lambda kv: -kv[1])
        return "  host us per step by call (inclusive): " + "; ".join(
            f"{path} {ms * 1e3 / steps:.0f} ({self.calls[path] / steps:.1f}x)" for path, ms in rows
        )


class ProcessTime:
    """What the process did besides the engine's own thread over a pass: each thread's CPU time (Linux:
    /proc/self/task), the calling thread's CPU time against the wall, and the garbage collector's passes and time.
    A step on the GPU is host-bound at 32 sessions, so another thread busy on the same cores, or a collector pass,
    shows as a slower step."""

    def __enter__(self) -> ProcessTime:
        self.gc = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)
        self.threads = self._thread_ticks()
        self.wall, self.cpu = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.thread_time() - self.cpu
        after = self._thread_ticks()
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.others: dict[str, float] = defaultdict(float)  # by thread name (torch's pool threads share one)
        for tid, (name, ticks) in after.items():
            if tid != threading.get_native_id():
                self.others[name] += (ticks - self.threads.get(tid, (name, 0))[1]) * 1e3 / tick
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            entry = self.gc[info["generation"]]
            entry[0] += 1
            entry[1] += time.perf_counter() - self._gc_start

    @staticmethod
    def _thread_ticks() -> dict[int, tuple[str, int]]:
        """{thread id: (name, user + system clock ticks)} of this process's threads (empty off Linux)."""
        ticks = {}
        for task in Path("/proc/self/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            ticks[int(task.name)] = (name, int(fields[11]) + int(fields[12]))
        return ticks

    def report(self, steps: int) -> str:
        busy = {name: round(ms) for name, ms in sorted(self.others.items(), key=lambda kv: -kv[1]) if ms > 0}
        gcs = ", ".join(f"gen{g} {n} ({s * 1e3:.1f} ms)" for g, (n, s) in self.gc.items() if n)
        return (
            f"  process: this thread's CPU {self.cpu * 1e3:.0f} of {self.wall * 1e3:.0f} ms wall; other threads' CPU ms "
            f"{busy or 'none'}; collector {gcs or 'idle'} ({sum(s for _, s in self.gc.values()) * 1e6 / max(1, steps):.1f}"
            " us a step)"
        )


def kernel_table(profile: torch.profiler.profile, steps: int, n: int, cuda: bool = True) -> str:
    """The n kernels (on the CPU: ops) with the most own time over the plain pass, per step (graph replays'
    kernels included)."""
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = [e for e in profile.key_averages() if own(e) > 0]
    total = sum(map(own, events))
    where = "device" if cuda else "CPU"
    lines = [f"  {where} time {total / 1e3:.1f} ms over {steps} steps ({total / max(1, steps):.1f} us/step); top:"]
    for e in sorted(events, key=lambda e: -own(e))[:n]:
        lines.append(f"    {own(e) / max(1, steps):7.1f} us/step {e.count / max(1, steps):6.1f}/step  {e.key[:90]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sessions", default="1,8")
    parser.add_argument("--configs", default="none,ngram:4")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=32, help="requests per run, cycled over the prompts (as bench)")
    parser.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="end requests at the model's end-of-text token (default: max tokens each, as `specchat bench`)",
    )
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() after the warm-up (as vLLM's engine does)"
    )
    parser.add_argument("--host-calls", action="store_true", help="host time per step of HOST_CALLS (unsynced)")
    parser.add_argument(
        "--kernels", type=int, default=0, help="print the N kernels with the most device time (torch profiler)"
    )
    parser.add_argument(
        "--host-ops", type=int, default=0, help="print the N torch ops with the most host time, calls per step"
    )
    args = parser.parse_args()
    engine = Engine.load(EngineConfig(model=args.model, device=args.device))
    prompts = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=not args.stop_at_eos)
    configs = args.configs.split(",")
    drafters = [spec_of(c).drafter for c in args.configs.split(",")]
    engine.warm_up(sessions=max(map(int, args.sessions.split(","))), drafters=drafters)  # every graph replayed
    for config in configs:  # warm-up: drafters built, kernels compiled
        run_sessions(engine, prompts, 8, SamplingParams(max_tokens=16), spec_of(config))
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    header = f"{'sessions':>8} {'config':>10} {'tok/s':>8} {'ms/step':>8} {'tok/step':>8}  phases (ms/step, synced)"
    print(header)
    for sessions in map(int, args.sessions.split(",")):
        for config in configs:
            profiler = cProfile.Profile() if args.cprofile else None
            activity = getattr(torch.profiler.ProfilerActivity, engine.device.type.upper())  # CUDA or CPU
            activities = [activity] * bool(args.kernels) + [torch.profiler.ProfilerActivity.CPU] * bool(args.host_ops)
            kernels = torch.profiler.profile(activities=list(set(activities))) if activities else None
            calls = HostCalls(host_calls()) if args.host_calls else contextlib.nullcontext()
            with SlowSteps(engine) as slow, kernels or contextlib.nullcontext(), calls, ProcessTime() as process:
                if profiler:
                    profiler.enable()
                plain = run_sessions(engine, prompts, sessions, sampling, spec_of(config), requests=args.requests)
                if profiler:
                    profiler.disable()
            steps = len(slow.steps)
            gates = {
                f"{'+'.join(drafters)} x{size}": {
                    f"k<={cap}" if cap else "plain": round(ms, 3) for cap, ms in sorted(gate.ms_per_token.items())
                }
                for (drafters, size), gate in sorted(engine.scheduler.gates.items())
            }
            caps = {
                f"{'+'.join(drafters)} x{size}": dict(sorted(slow.caps[id(gate)].items()))
                for (drafters, size), gate in sorted(engine.scheduler.gates.items())
                if slow.caps[id(gate)]
            }
            # the synced pass's times are not a step's: its gates are dropped (copies: it changes the gates in place)
            learnt = copy.deepcopy(engine.scheduler.gates)
            with Phases(engine) as phases:
                run_sessions(engine, prompts, sessions, sampling, spec_of(config), requests=args.requests)
            engine.scheduler.gates = learnt
            synced_steps = max(1, sum(phases.forwards.values()))
            parts = " ".join(f"{name} {ms / synced_steps:.2f}" for name, ms in phases.ms.items())
            forwards = ", ".join(f"{kind} {n}" for kind, n in sorted(phases.forwards.items()))
            print(
                f"{sessions:>8} {config:>10} {plain.tok_per_s:>8.1f} {plain.wall_s * 1e3 / steps:>8.2f}"
                f" {plain.tokens_per_step:>8.2f}  ITL p99 {plain.itl_p99_ms or 0:.2f} ms; {parts} | forwards: {forwards}",
                flush=True,
            )
            print(slow.report(), flush=True)
            print(process.report(steps), flush=True)
            if gates:
                print(f"  draft gates after the timed pass, ms per emitted token: {gates}", flush=True)
                print(f"  steps of the timed pass by the cap its gate allowed: {caps}", flush=True)
            if args.kernels:
                print(kernel_table(kernels, steps, args.kernels, engine.device.type == "cuda"), flush=True)
            if args.host_calls:
                print(calls.report(steps), flush=True)
            if args.host_ops:
                print(kernel_table(kernels, steps, args.host_ops, cuda=False), flush=True)
            if profiler:
                out = io.StringIO()
                stats = pstats.Stats(profiler, stream=out)
                stats.sort_stats("tottime").print_stats(18)
                stats.sort_stats("cumtime").print_stats("specchat", 30)  # where each step's host time goes, by caller
                print("\n".join(out.getvalue().splitlines()[6:]), flush=True)


if __name__ == "__main__":
    main()
