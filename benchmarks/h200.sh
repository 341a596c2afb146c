#!/usr/bin/env bash
# Every H200 measurement of issues 5 and 6 in one device call (see docs/benchmarks.md for the results):
#   bash benchmarks/h200.sh [PART ...]     PART: env tests matmul sweep floor goals attention attention-sweep
#                                          batch1 sessions profile kv fusion pdl prefill small real verify
#                                          (default: env tests attention batch1 sessions)
# Each part is bounded by `timeout`, logs to $OUT/h200_<part>.log (OUT defaults to ./h200-out), and a failing
# part does not stop the next. Needs torch + triton + click; pytest for `tests` (installed from .devcarry-gpu/whl
# when present, since the GPU machine has no network).
set -uo pipefail
OUT=${OUT:-h200-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(env tests attention batch1 sessions)
synthetic=(python -m specchat bench --synthetic llama-3.1-8b --device cuda)
for part in "${parts[@]}"; do
  log="$OUT/h200_$part.log"
  echo "=== $part $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null)" | tee "$log"
  case $part in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee -a "$log"
      python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$log"
      if [ -d .devcarry-gpu/whl ]; then  # --no-deps: the machine's own numpy etc. stay (the folder has none)
        python -m pip install -q --no-index --no-deps --find-links .devcarry-gpu/whl pytest pytest-timeout iniconfig \
          packaging pluggy pygments gguf pyyaml tqdm requests urllib3 idna certifi charset_normalizer 2>&1 | tail -2 \
          | tee -a "$log"
      fi ;;
    tests)
      timeout ${TESTS_TIMEOUT:-240} python -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graph.py \
        tests/engine/test_kv_cuda.py tests/engine/test_engine_cuda.py ${TESTS_MORE:-} \
        tests/kernels/${TESTS_KERNELS:-} 2>&1 | tail -30 | tee -a "$log" ;;
    matmul)  # MXFP4 matmul vs torch bf16 and int4 tinygemm, every 8B shape, M = 1..512 (docs/benchmarks.md);
      # SWEEP_MS=160,256 also times other launches at those M and prints the best beside choose_config's
      timeout 250 python benchmarks/mxfp4_matmul.py --ms 1,2,4,8,16,32,64,128,160,256,512 --sweep-ms "${SWEEP_MS:-}" \
        2>&1 | tee -a "$log" ;;
    prefill)  # many rows (prefill chunks): the MXFP4 kernel, the decoded weight + cuBLAS and bf16 at M = 128..2048,
      # then the 8B model's prefill with each (benchmarks/prefill_gpu.py)
      timeout 250 python benchmarks/mxfp4_matmul.py --shapes 6144x4096,4096x4096,28672x4096,4096x14336 \
        --ms ${PREFILL_MS:-128,256,384,512,1024,2048} 2>&1 | tee -a "$log"
      timeout 300 python benchmarks/prefill_gpu.py --contexts ${CONTEXTS:-512,2048,8192} 2>&1 | tee -a "$log" ;;
    sweep)  # launch configs around choose_config (what chose it)
      timeout 500 python benchmarks/mxfp4_matmul.py --sweep --ms ${SWEEP_MS:-1,16,64,256} 2>&1 | tee -a "$log" ;;
    floor)  # a bare read of each 8B linear's bytes beside the MXFP4 GEMV, with and without PDL (issue 14's floor)
      timeout 300 python benchmarks/gemv_floor.py 2>&1 | tee -a "$log" ;;
    goals)  # issue 14's end-to-end goals: batch 1, and 32 sessions with k = 4, MXFP4 against bf16
      timeout 240 "${synthetic[@]}" --weights bf16,mxfp4 --batch 1,32 --k 0,4 2>&1 | tee -a "$log" ;;
    attention)
      timeout 150 python benchmarks/attention.py 2>&1 | tee -a "$log" ;;
    attention-sweep)  # launch settings around paged_attention's defaults at every q (CONTEXT, BATCHES pick the case)
      timeout 400 python benchmarks/attention.py --contexts "${CONTEXT:-32768}" --batches "${BATCHES:-1,8}" --q-lens 1,5 \
        --sweep 2>&1 | tee -a "$log" | sed -n '/Best launches/,$p' ;;
    batch1)
      timeout 200 "${synthetic[@]}" --weights bf16,int4,mxfp4 --batch 1 --k 0,4 --steps 128 2>&1 | tee -a "$log"
      timeout 150 "${synthetic[@]}" --weights bf16,mxfp4 --batch 1 --k 0,4 --steps 32 --eager 2>&1 | tee -a "$log" ;;
    sessions)
      timeout 300 "${synthetic[@]}" --weights bf16,mxfp4 --batch 1,8,32 --k 0,4 2>&1 | tee -a "$log" ;;
    profile)
      for w in bf16 mxfp4; do
        timeout 120 python benchmarks/profile_step.py --weights $w --fused 2>&1 | tee -a "$log"
      done
      for p in auto off; do  # the CUDA-graph runner's step: its kernels and wall time, PDL on and off
        timeout 120 python benchmarks/profile_step.py --weights mxfp4 --fused --graph --pdl $p 2>&1 | tee -a "$log"
      done
      timeout 120 python benchmarks/profile_step.py --weights bf16 2>&1 | tee -a "$log" ;;
    small)  # the default model's shape (smollm2-135m, random bf16 weights): a step of ~300 short kernels. Its
      # linears on cuBLAS (SPECCHAT_DENSE_GEMV=0) and through kernels/dense_gemv_triton.py (under PDL: every kernel
      # ours),
      # alternating: the step's kernels and wall time on CUDA graphs, then decode tok/s at 1 and 8 sessions
      timeout 150 python benchmarks/dense_gemv.py --ms 1,4,16 ${SWEEP:+--sweep} 2>&1 | tee -a "$log"
      for dense in 0 1; do
        SPECCHAT_DENSE_GEMV=$dense timeout 100 python benchmarks/profile_step.py --shape smollm2-135m --weights bf16 \
          --fused --graph 2>&1 | head -${ROWS:-30} | sed "s/^/dense=$dense /" | tee -a "$log"
      done
      for dense in 0 1 1 0; do
        SPECCHAT_DENSE_GEMV=$dense timeout 120 python -m specchat bench --synthetic smollm2-135m --device cuda \
          --weights bf16 --batch 1,8 --k 0,4 --steps 128 2>&1 | grep "^| [0-9]" | sed "s/^/dense=$dense /" | tee -a "$log"
      done ;;
    real)  # the default model itself (its GGUF under $SPECCHAT_HOME), its linears through the dense GEMV and on cuBLAS,
      # alternating, each run the bench's 1/8/32 sessions of the session prompts, plain and DRAFTERS with --k auto
      for dense in ${DENSE_ORDER:-1 0 1 0}; do
        SPECCHAT_DENSE_GEMV=$dense timeout ${REAL_TIMEOUT:-200} python -m specchat bench smollm2-135m --device cuda \
          --sessions ${SESSIONS:-1,8,32} --prompts benchmarks/session_prompts.txt --max-tokens 128 --rounds 2 \
          --drafter "${DRAFTERS:-none,ngram+heads}" --k auto 2>&1 | grep -E "^\| [0-9]|Error|error" \
          | sed "s/^/dense=$dense /" | tee -a "$log"
      done ;;
    verify)  # the default model's shape (random bf16 weights) on CUDA graphs: a plain step against a k = 4
      # verification step (5 rows a request) at 1 and 8 requests, each with its kernels (where the extra rows go)
      for b in ${BATCHES:-1 8}; do for r in 1 5; do
        timeout 100 python benchmarks/profile_step.py --shape smollm2-135m --weights bf16 --fused --graph \
          --batch $b --rows $r 2>&1 | head -${ROWS:-24} | tee -a "$log"
      done; done ;;
    fusion)  # the layer fusions (add + norm, KV write in the rotary kernel) against the elementwise ones alone
      timeout 400 python benchmarks/fusion_gpu.py 2>&1 | tee -a "$log" ;;
    kv)  # issue 14's KV goal: 32k context, batch 8, MXFP4 weights, each KV format
      timeout 240 "${synthetic[@]}" --weights mxfp4 --kv bf16,mxfp4,k8v4 --batch 8 --k 0 --context 32768 --steps 32 \
        2>&1 | tee -a "$log" ;;
    pdl)  # programmatic dependent launch on and off, side by side (kernels/pdl.py); CASES picks the cases
      timeout 420 python benchmarks/pdl_gpu.py ${CASES:+--cases "$CASES"} --rounds ${ROUNDS:-3} 2>&1 | tee -a "$log" ;;
    *) echo "unknown part $part" | tee -a "$log" ;;
  esac
done
