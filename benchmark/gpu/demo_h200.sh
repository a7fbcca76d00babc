#!/usr/bin/env bash
# The shipped demo pair (`--model-path demo`) on one GPU in one device call: GSM8K (zero-shot)
# acceptance, accuracy and greedy identity through `benchmark.acceptance`, stage by stage in
# priority order (each stage's acceptance.json lands in $OUT as soon as it finishes).
#   bash benchmark/gpu/demo_h200.sh GSM8K_TEST_JSONL
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/acc
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD
DATA=$1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/env.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/env.txt"
stage() {  # name, time limit (s), benchmark.acceptance arguments
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" python3 -m benchmark.acceptance --model-path demo --data "$DATA" \
    --max-new-tokens 256 --out "/tmp/acc/$name" "$@" > "/tmp/acc/$name.log" 2>&1
  echo "stage $name: rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
  cp "/tmp/acc/$name/acceptance.json" "$OUT/$name.json" 2>/dev/null
  grep -v '^INFO\|Loading\|it/s\]' "/tmp/acc/$name.log" | tail -5
}
# every question, greedy: no-spec vs DSpark (full verify, the draft's block size)
stage all_greedy 210 --policies full --temperatures 0 --batch-size 32 --random-draft none
# tok/s per user at 1 / 8 / 32 requests in flight (wall time of each run)
stage bs1 35 --limit 6 --batch-size 1 --policies full --temperatures 0 --random-draft none
stage bs8 35 --limit 48 --batch-size 8 --policies full --temperatures 0 --random-draft none
stage bs32 40 --limit 128 --batch-size 32 --policies full --temperatures 0 --random-draft none
# greedy identity with fp32 serving
stage fp32 70 --limit 200 --dtype float32 --policies full --temperatures 0 --batch-size 32 \
  --random-draft none
# the other verify policies, temperature 1 and the random-draft control on a subset
stage policies 150 --limit 300 --policies full,static:4,confidence --temperatures 0,1 \
  --batch-size 32 --random-draft auto
tar czf "$OUT/logs.tar.gz" -C /tmp/acc --exclude='runs' --exclude='random_draft' . 2>/dev/null
ls -la "$OUT"
