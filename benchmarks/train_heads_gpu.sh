#!/usr/bin/env bash
# Train the shipped draft heads of the default model on one GPU, in device calls of at most 10 minutes:
#   bash benchmarks/train_heads_gpu.sh [PART ...]    PART: heads eagle (default: both, in that order)
# The GGUF must already be in $SPECCHAT_HOME/models/smollm2-135m/ (the GPU machine has no network: carry it in,
# see docs/gpu.md) and the `gguf` package installed (pip install --no-index --find-links .devcarry-gpu/whl gguf).
# `heads` generates the answers (bf16, 64 requests at once, SAMPLES sampled ones per train prompt besides the
# greedy one, and SYNTH prompts the model writes itself, answered greedily; or ANSWERS=FILE... made elsewhere)
# and trains the MLP heads; `eagle` trains the EAGLE-3 head (a
# directory) on the same answers, so run it on the same machine after `heads`. The answers come back gzipped in
# $OUT, to train other variants later without generating again. Each stage is bounded by `timeout` and logs to $OUT.
# Answers, features and 8 epochs of the heads take ~9 minutes on an H200: if `heads` stops at its timeout, run it
# again in the next call on the same machine (within 30 s): train-heads resumes from its work directory.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
SAMPLES=${SAMPLES:-3}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(heads eagle)
# 64 running requests: the largest batch the CUDA graphs are captured for
common=(--device cuda --dtype bfloat16 --samples "$SAMPLES" --synth-prompts "${SYNTH:-0}" --max-running 64)
for part in "${parts[@]}"; do
  echo "=== $part $(date -u +%FT%TZ) tree ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" | tee "$OUT/train_$part.log"
  case $part in
    heads)
      mkdir -p "$HOME/heads.work"
      # ANSWERS=FILE...: answers generated elsewhere (train_heads.generate_answers records), used instead of generating
      [ -n "${ANSWERS:-}" ] && zcat -f $ANSWERS > "$HOME/heads.work/answers.jsonl"
      timeout ${HEADS_TIMEOUT:-540} python -m specchat train-heads --arch heads --heads 5 "${common[@]}" \
        --epochs "${HEADS_EPOCHS:-8}" --batch-size "${HEADS_BATCH:-1024}" --draft-vocab 8192 --labels "${LABELS:-soft}" \
        --out "$OUT/heads-smollm2-135m.safetensors" --work "$HOME/heads.work" 2>&1 | tee -a "$OUT/train_heads.log"
      gzip -c "$HOME/heads.work/answers.jsonl" > "$OUT/answers.jsonl.gz" ;;
    estimate)  # the trained heads against the shipped ones on the same greedy answers of the eval split: exact
      # greedy runs at k = 4, the heads alone and after the n-grams (benchmarks/datastore_estimate.py)
      PYTHONPATH=$PYTHONPATH:benchmarks timeout 300 python benchmarks/datastore_estimate.py --device cuda --no-store \
        --heads shipped=specchat/data/heads/smollm2-135m.safetensors --heads new="$OUT/heads-smollm2-135m.safetensors" \
        2>&1 | tail -12 | tee -a "$OUT/train_$part.log" ;;
    eagle)
      mkdir -p "$HOME/eagle.work"
      cp "$HOME/heads.work/answers.jsonl" "$HOME/eagle.work/" 2>/dev/null
      timeout ${EAGLE_TIMEOUT:-420} python -m specchat train-heads --arch eagle "${common[@]}" \
        --epochs "${EAGLE_EPOCHS:-6}" --batch-tokens 4096 --lr 2e-3 --out "$HOME/eagle-out" --work "$HOME/eagle.work" \
        2>&1 | tee -a "$OUT/train_eagle.log"
      # Files over 16 MiB do not come back from a device call: the head comes back in parts (cat them together).
      mkdir -p "$OUT/eagle-smollm2-135m"
      cp "$HOME/eagle-out/config.json" "$OUT/eagle-smollm2-135m/" 2>/dev/null
      split -b 10m "$HOME/eagle-out/model.safetensors" "$OUT/eagle-smollm2-135m/model.safetensors.part_" 2>/dev/null ;;
    *) echo "unknown part $part" | tee -a "$OUT/train_$part.log" ;;
  esac
done
ls -la "$OUT" 2>&1 | tail -12
