#!/usr/bin/env bash
# Train the demo pair on one GPU, in time-limited device calls that each return what they made.
#   bash benchmark/gpu/train_demo_h200.sh target CORPUS MINUTES   # the V4.1 target from scratch
#   bash benchmark/gpu/train_demo_h200.sh draft CORPUS TARGET_DIR STEPS  # its DSpark draft
# CORPUS: `python -m sgl_dspark.tools.build_demo_corpus` output (corpus.jsonl[.gz], tokenizer,
# prompts.jsonl). Work lands in /tmp/demo (kept while the machine stays warm); the served files
# come back through $OUT: weight shards (each under 16 MiB) in $OUT/model or $OUT/draft, logs and
# reports in $OUT/run.tar.gz.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/demo
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/env.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/env.txt"
stage=$1
if [[ $stage == target ]]; then
  corpus=$2 minutes=$3
  python3 -m sgl_dspark.tools.train_target --corpus "$corpus" --output /tmp/demo/target \
    --total-minutes "$minutes" --eval-every 250 2>&1 | tr '\r' '\n' | grep -v '^training:' \
    | tee "$OUT/train.log" | tail -40
  mkdir -p "$OUT/model"
  cp /tmp/demo/target/model/*.safetensors "$OUT/model/"
  (cd /tmp/demo/target && tar czf "$OUT/run.tar.gz" training_report.md training_log.jsonl \
    loss.png model/config.json model/model.safetensors.index.json)
elif [[ $stage == draft ]]; then
  corpus=$2 target=$3 steps=$4
  shift 4
  python3 -m sgl_dspark.tools.train_dspark_draft --target-path "$target" \
    --data "$corpus/prompts.jsonl" --output /tmp/demo/draft --no-progress \
    --steps "$steps" "$@" 2>&1 | tee "$OUT/draft.log" | tail -40
  mkdir -p "$OUT/draft"
  cp /tmp/demo/draft/*.safetensors /tmp/demo/draft/config.json "$OUT/draft/" 2>/dev/null
  (cd /tmp/demo/draft && tar czf "$OUT/run.tar.gz" --exclude='*.pt' --exclude='*.safetensors' \
    --exclude=continuations.json .)
fi
ls -la "$OUT" "$OUT"/*/ 2>/dev/null
