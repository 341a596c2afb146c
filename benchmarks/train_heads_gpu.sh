#!/usr/bin/env bash
# Train the shipped draft heads of the default model on one GPU, in one device call:
#   bash benchmarks/train_heads_gpu.sh          (OUT defaults to ./gpu-out)
# The GGUF must already be in $SPECCHAT_HOME/models/smollm2-135m/ (the GPU machine has no network: carry it in,
# see docs/gpu.md) and the `gguf` package installed (pip install --no-index --find-links .devcarry-gpu/whl gguf).
# Both heads learn from the same answers (generated once, bf16, all submitted at once, or ANSWERS=FILE... made
# elsewhere): the EAGLE-3 head (--arch eagle, a directory) and the MLP heads. Each stage is bounded by `timeout`
# and logs to $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
SAMPLES=${SAMPLES:-4}
EPOCHS=${EPOCHS:-30}
work="$HOME/eagle.work"
mkdir -p "$work"
# ANSWERS=FILE...: answers generated elsewhere (train_heads.generate_answers records), used instead of generating
[ -n "${ANSWERS:-}" ] && cat $ANSWERS > "$work/answers.jsonl"
# 64 running requests: the largest batch the CUDA graphs are captured for
common=(--device cuda --dtype bfloat16 --samples "$SAMPLES" --max-running 64)
echo "=== eagle $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null)" | tee "$OUT/train_eagle.log"
timeout 420 python -m specchat train-heads --arch eagle "${common[@]}" --epochs "$EPOCHS" --batch-tokens 4096 --lr 2e-3 \
  --out "$HOME/eagle-out" --work "$work" 2>&1 | tee -a "$OUT/train_eagle.log"
# Files over 16 MiB do not come back from a device call: the head comes back in parts (cat them together).
mkdir -p "$OUT/eagle-smollm2-135m"
cp "$HOME/eagle-out/config.json" "$OUT/eagle-smollm2-135m/" 2>/dev/null
split -b 10m "$HOME/eagle-out/model.safetensors" "$OUT/eagle-smollm2-135m/model.safetensors.part_" 2>/dev/null
mkdir -p "$HOME/heads.work"
cp "$work/answers.jsonl" "$HOME/heads.work/" 2>/dev/null
echo "=== heads $(date -u +%FT%TZ)" | tee "$OUT/train_heads.log"
timeout 150 python -m specchat train-heads --arch heads --heads 5 "${common[@]}" --epochs "${HEADS_EPOCHS:-10}" \
  --draft-vocab 8192 --out "$OUT/heads-smollm2-135m.safetensors" --work "$HOME/heads.work" 2>&1 \
  | tee -a "$OUT/train_heads.log"
ls -la "$OUT" "$OUT/eagle-smollm2-135m" 2>&1 | tee -a "$OUT/train_eagle.log"
