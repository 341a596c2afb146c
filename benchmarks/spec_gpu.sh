#!/usr/bin/env bash
# Speculation on the GPU, in one device call (issue 13; results in docs/benchmarks.md):
#   bash benchmarks/spec_gpu.sh [PART ...]    PART: tests sessions auto long cost rates ahead hostgap profile chain kernels gate
#                                             joins trace
#                                             (default: tests sessions auto cost)
# Needs the default model's GGUF in $SPECCHAT_HOME/models/smollm2-135m/ and the `gguf` package (see docs/gpu.md).
# DRAFTERS=a,b,... picks the drafters of `sessions` and `auto`; EAGLE=DIR benchmarks another EAGLE-3 head directory
# beside the shipped one; SESSIONS and REQUESTS set `gate`'s load (default 8,32 and 32), SESSIONS and ROUNDS `long`'s
# (8,32 and 3); COMMIT names the tree
# measured (the device's .git may be stale). Each part is bounded by `timeout` and logs to $OUT/spec_<part>.log (OUT
# defaults to ./gpu-out). `auto` and `long` report each configuration's
# run of median throughput over its warm rounds (`bench --rounds 3`: the slower of the second and third).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests sessions auto cost)
drafters="${DRAFTERS:-none,ngram,heads,eagle}${EAGLE:+,eagle:$EAGLE}"
bench=(python -m specchat bench smollm2-135m --device cuda --sessions 1,8,32 --prompts benchmarks/session_prompts.txt
  --max-tokens 128)
for part in "${parts[@]}"; do
  log="$OUT/spec_$part.log"
  echo "=== $part $(date -u +%FT%TZ) tree ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" | tee "$log"
  case $part in
    tests)
      timeout 300 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_cuda.py tests/engine/test_cuda_graph.py \
        tests/engine/test_step_ahead.py tests/engine/test_adaptive.py tests/kernels/test_draft_heads.py \
        2>&1 | tail -15 | tee -a "$log" ;;
    sessions)
      timeout 420 "${bench[@]}" --drafter "$drafters" --k 4 2>&1 | tee -a "$log" ;;
    auto)
      timeout 300 "${bench[@]}" --drafter "${DRAFTERS:-ngram,heads,eagle}${EAGLE:+,eagle:$EAGLE}" --k auto --rounds 3 2>&1 \
        | tee -a "$log" ;;
    long)  # --k auto at 8 and 32 sessions over 128 requests (slots refilled: no batch that ends on its slowest
      # request, and runs ~4x longer than `auto`'s at 32 sessions, whose plain decoding varied 23-30k tok/s)
      # (SESSIONS and ROUNDS override 8,32 and 3: over 3+ rounds the bench prints each round's paired ratios)
      timeout 300 python -m specchat bench smollm2-135m --device cuda --sessions "${SESSIONS:-8,32}" --requests 128 \
        --rounds "${ROUNDS:-3}" \
        --prompts benchmarks/session_prompts.txt --max-tokens 128 --drafter "${DRAFTERS:-none,heads,ngram+heads}" \
        --k auto 2>&1 | tee -a "$log" ;;
    trace)  # what the draft gate saw and chose at one session, step by step (benchmarks/gate_trace.py: the trace
      # comes back as $OUT/gate_trace.json), beside fixed k = 4; DRAFTERS' first drafter (default: heads)
      first=${DRAFTERS:-heads}
      timeout 240 python benchmarks/gate_trace.py --device cuda --drafter "${first%%,*}" --sessions 1 --requests 32 \
        --rounds 2 --out "$OUT/gate_trace.json" 2>&1 | grep -v '^\s*$' | tail -12 | tee -a "$log" ;;
    cost)  # each case in a process of its own (one process measuring MXFP4 at batch 1 then 8 once failed the second
      # runner's capture on the H200; docs/benchmarks.md, forty-sixth session)
      for weights in bf16 mxfp4; do
        for batch in 1 8; do
          timeout 150 python benchmarks/eagle_cost.py --shape llama-3.1-8b --batch $batch --weights $weights 2>&1 \
            | tee -a "$log"
        done
      done ;;
    rates)  # synthetic 8B MXFP4 at k = 4 with the heads' per-position acceptance (RATES: benchmarks/tree_estimate.py
      # --prompts eval, the chain acceptance by depth of the shipped heads); the head's own cost is `cost`'s
      timeout 240 python -m specchat bench --synthetic llama-3.1-8b --device cuda --weights mxfp4 --batch 1,8 --k 0,4 \
        --acceptance "${RATES:-0.533,0.515,0.542,0.571}" 2>&1 | grep -v "^done:" | tee -a "$log" ;;
    ahead)  # plain steps launched ahead of the host, on and off, alternating (docs/gpu.md)
      timeout 200 python benchmarks/step_ahead_gpu.py --sessions 1,8,32 --reps 3 --max-tokens 64 2>&1 | tee -a "$log" ;;
    chain)  # the heads' fused greedy chain (kernels/draft_heads_triton.py) against the plain one, each beside plain
      # decoding
      for fused in 1 0; do
        echo "--- SPECCHAT_FUSED_HEADS=$fused" | tee -a "$log"
        SPECCHAT_FUSED_HEADS=$fused timeout 200 "${bench[@]}" --drafter none,heads --k 4 2>&1 | tee -a "$log"
      done ;;
    kernels)  # where a step's device time goes, plain and heads, by kernel (torch profiler)
      timeout 300 python benchmarks/profile_spec.py --sessions 1,8,32 --configs none,heads:4 --kernels 25 \
        2>&1 | grep -v USDT | tee -a "$log" ;;
    hostgap)  # what the host does more per step for the heads held at cap 0 than for plain decoding, 32 sessions:
      # torch ops per step and the host functions by own time (the gates learnt in the first pair; the second timed)
      # (HOSTGAP_FLAGS: other flags, e.g. --gc-freeze; default --host-ops 40 --cprofile)
      timeout 400 python benchmarks/profile_spec.py --sessions 32 --requests 128 \
        --configs "${CONFIGS:-none,heads:auto,none,heads:auto}" ${HOSTGAP_FLAGS---host-ops 40 --cprofile} 2>&1 \
        | grep -v USDT | tee -a "$log" ;;
    profile)
      timeout 200 python benchmarks/profile_spec.py --sessions 1,8,32 --configs none,ngram:4,ngram:auto --cprofile \
        2>&1 | tee -a "$log" ;;
    gate)  # what the draft gates priced each cap at (ms per token) against what each kind of step took, --k auto
      configs=$(echo "${DRAFTERS:-ngram+heads}" | tr , '\n' | grep -v '^none$' | sed 's/$/:auto/' | paste -sd,)
      timeout 250 python benchmarks/profile_spec.py --sessions "${SESSIONS:-8,32}" --requests "${REQUESTS:-32}" --configs "none,$configs" 2>&1 \
        | grep -E "^ +[0-9]+ |by kind|by the cap|draft gates|steps of the timed" | tee -a "$log" ;;
    joins)  # prompts joining drafting steps ahead (SpecStep.joins_drafting), on then off, 128 requests of repeated
      # prompts at 8 sessions: the load under which it ended the process with an illegal memory access
      # (twenty-ninth session); each run's exit status is printed
      for k in 4 auto; do
        for on in 1 0; do
          echo "--- SPECCHAT_JOINS_DRAFTING=$on --k $k" | tee -a "$log"
          SPECCHAT_JOINS_DRAFTING=$on timeout 120 python -m specchat bench smollm2-135m --device cuda --sessions 8 \
            --requests 128 --rounds 3 --prompts benchmarks/session_prompts.txt --max-tokens 128 \
            --drafter "${DRAFTERS:-none,heads,ngram+heads}" --k $k 2>&1 | grep -E "^\| [0-9]|illegal|Error" \
            | tee -a "$log"
          echo "exit ${PIPESTATUS[0]}" | tee -a "$log"
        done
      done ;;
    *) echo "unknown part $part" | tee -a "$log" ;;
  esac
done
