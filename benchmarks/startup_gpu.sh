#!/usr/bin/env bash
# Start-up on the GPU (issue 18): two `specchat generate --device cuda` runs of the default model one after the
# other, a 64-token answer each. The first fills the Triton cache under $SPECCHAT_HOME; the second is what a user
# meets every later time: its wall time to exit and the decode tok/s its timing line reports.
#   bash benchmarks/startup_gpu.sh        (logs to $OUT/startup.log; OUT defaults to ./gpu-out)
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
log="$OUT/startup.log"
echo "=== startup $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null)" | tee "$log"
prompt="Write a short Python function that returns the squares of a list of numbers."
for run in first second; do
  start=$(date +%s%N)
  timeout 180 python -m specchat generate smollm2-135m --device cuda -p "$prompt" --max-tokens 64 --stats \
    > "$OUT/startup_$run.txt" 2> "$OUT/startup_$run.err"
  rc=$?
  wall_ms=$(( ($(date +%s%N) - start) / 1000000 ))
  echo "$run run: rc $rc, wall ${wall_ms} ms; $(grep -i 'tok/s' "$OUT/startup_$run.err" | tail -1)" \
    | tee -a "$log"
done
