"""Resident memory of the default engine on the CPU: a first load (nothing cached: the GGUF parsed and dequantized,
the derived files written) and a second one (from the derived files), each in a fresh process.

    python benchmarks/cpu_memory.py [--model smollm2-135m] [--weights auto] [--loads 2] [--answer 32]

A scratch $SPECCHAT_HOME whose models/ links to the real cache's (no download; the kernels' build is copied, so
it is not timed) is made and removed around the loads. Per load: the seconds `Engine.load` took, the process's
resident set after it (ui.bridge.rss_bytes, what the TUI's memory panel shows) and after a short greedy answer,
its peak, and the engine's own accounting of its weights (`memory()`: every weight tensor, and the linears). The
files a load writes are synced to disk before the next one: pages of a file still being written back cannot be
paged out (cpu_build.page_out), which made a load right after the first hold ~38 MB more.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from specchat.registry import cache_dir

CHILD = r"""
import json, resource, sys, time
from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine
from specchat.ui.bridge import rss_bytes

model, weights, answer = sys.argv[1], sys.argv[2], int(sys.argv[3])
start = time.perf_counter()
engine = Engine.load(EngineConfig(model=model, device="cpu", weights=weights))
seconds = time.perf_counter() - start
loaded = rss_bytes()
params = SamplingParams(max_tokens=answer, ignore_eos=True)
engine.submit(engine.encode_prompt("Write a haiku about the sea."), params, SpecParams("none", k=0)).result()
memory = engine.memory()
print(json.dumps({
    "load_s": seconds, "rss_loaded": loaded, "rss_answered": rss_bytes(),
    "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "weights_bytes": memory["weights_bytes"], "linear_weight_bytes": memory["linear_weight_bytes"],
    "weights": memory.get("weights_gguf") or memory["weights_format"],
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", default="auto", help="EngineConfig.weights: auto (as loaded), mxfp4, ...")
    parser.add_argument("--loads", type=int, default=2, help="loads in fresh processes; the first finds no cache")
    parser.add_argument("--answer", type=int, default=32, help="tokens of the greedy answer after each load")
    args = parser.parse_args()

    real = cache_dir()
    home = Path(tempfile.mkdtemp(prefix="specchat-memory-"))
    try:
        (home / "models").symlink_to(real / "models")
        if (real / "kernels").is_dir():
            shutil.copytree(real / "kernels", home / "kernels")
        mb = 2**20
        print(
            f"{'load':>4} | {'load s':>6} | {'RSS loaded':>10} | {'RSS answered':>12} | {'peak':>6} | weights (counted)"
        )
        for load in range(1, args.loads + 1):
            env = {**os.environ, "SPECCHAT_HOME": str(home)}
            done = subprocess.run(
                [sys.executable, "-c", CHILD, args.model, args.weights, str(args.answer)],
                env=env,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                sys.exit(f"load {load} failed:\n{done.stderr[-2000:]}")
            out = done.stdout
            os.sync()  # the derived files just written: dirty page-cache pages cannot be paged out until written back
            r = json.loads(out.strip().splitlines()[-1])
            print(
                f"{load:>4} | {r['load_s']:6.2f} | {r['rss_loaded'] / mb:7.0f} MB | {r['rss_answered'] / mb:9.0f} MB"
                f" | {r['peak'] / mb:3.0f} MB | {r['weights']}: {r['weights_bytes'] / mb:.0f} MB"
                f" (linears {r['linear_weight_bytes'] / mb:.0f} MB)"
            )
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
