#!/usr/bin/env bash
# One lease's GPU work for the open issues, in parts that each fit one device call (results in docs/benchmarks.md):
#   COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_lease.sh PART ...
#   PART: tests     the CUDA tests (graphs, KV pages incl. the split prefill+decode step, key transform, kernels)
#         startup   two generate runs (benchmarks/startup_gpu.sh; issue 18)
#         sessions  bench 1/8/32 sessions, DRAFTERS (default none,ngram,heads,eagle) at k = 4 (issue 13)
#         auto      bench 1/8/32 sessions, DRAFTERS (default ngram,heads,eagle) with adaptive K (issue 13)
#         serve     32 streaming openai clients in 4 processes against the in-process bench (issue 16)
# Needs the default model's GGUF under $SPECCHAT_HOME and gguf (plus fastapi/uvicorn/openai for serve). The device's
# .git may be stale, so COMMIT names the tree measured. Each part is bounded by `timeout` and logs to $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
for part in "$@"; do
  log="$OUT/lease_$part.log"
  echo "=== $part $(date -u +%FT%TZ) tree $commit" | tee "$log"
  case $part in
    tests)
      timeout ${TESTS_TIMEOUT:-300} python -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graph.py \
        tests/engine/test_kv_cuda.py tests/engine/test_engine_cuda.py tests/engine/test_kv_transform.py \
        tests/engine/test_kv_cache.py tests/engine/test_int4.py tests/kernels/test_fused.py 2>&1 | tail -30 | tee -a "$log" ;;
    startup)
      OUT=$OUT bash benchmarks/startup_gpu.sh 2>&1 | tee -a "$log" ;;
    sessions|auto)  # benchmarks/spec_gpu.sh's parts (DRAFTERS picks the drafters)
      OUT=$OUT COMMIT=$commit bash benchmarks/spec_gpu.sh "$part" 2>&1 | tee -a "$log" ;;
    serve)
      # 64 tokens a request: a run of well under a second, mostly fixed per-request costs; 256: streaming
      for tokens in 64 256; do
        timeout 200 python benchmarks/serve_load.py --device cuda --clients 32 --max-tokens $tokens 2>&1 | tee -a "$log"
      done ;;
    *) echo "unknown part $part" | tee -a "$log" ;;
  esac
done
