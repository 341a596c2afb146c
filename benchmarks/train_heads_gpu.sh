#!/usr/bin/env bash
# Train the shipped draft heads of the default model on one GPU, in one device call:
#   bash benchmarks/train_heads_gpu.sh          (OUT defaults to ./gpu-out)
# The GGUF must already be in $SPECCHAT_HOME/models/smollm2-135m/ (the GPU machine has no network: carry it in,
# see docs/gpu.md) and the `gguf` package installed (pip install --no-index --find-links .devcarry-gpu/whl gguf).
# Both heads learn from the same answers (generated once, bf16, all submitted at once): the EAGLE-3 head
# (--arch eagle, a directory) and the MLP heads. Each stage is bounded by `timeout` and logs to $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
SAMPLES=${SAMPLES:-4}
EPOCHS=${EPOCHS:-10}
work="$HOME/eagle.work"
common=(--device cuda --dtype bfloat16 --samples "$SAMPLES" --max-running 256)
echo "=== eagle $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null)" | tee "$OUT/train_eagle.log"
timeout 420 python -m specchat train-heads --arch eagle "${common[@]}" --epochs "$EPOCHS" --batch-tokens 16384 \
  --out "$OUT/eagle-smollm2-135m" --work "$work" 2>&1 | tee -a "$OUT/train_eagle.log"
mkdir -p "$HOME/heads.work"
cp "$work/answers.jsonl" "$HOME/heads.work/" 2>/dev/null
echo "=== heads $(date -u +%FT%TZ)" | tee "$OUT/train_heads.log"
timeout 150 python -m specchat train-heads --arch heads --heads 5 "${common[@]}" --epochs "$EPOCHS" \
  --draft-vocab 8192 --out "$OUT/heads-smollm2-135m.safetensors" --work "$HOME/heads.work" 2>&1 \
  | tee -a "$OUT/train_heads.log"
cp "$work/answers.jsonl" "$OUT/answers.jsonl" 2>/dev/null
ls -la "$OUT" "$OUT/eagle-smollm2-135m" 2>&1 | tee -a "$OUT/train_eagle.log"
