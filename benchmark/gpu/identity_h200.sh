#!/usr/bin/env bash
# Greedy identity of DSpark on one GPU, on the shipped demo pair, in one device call: where greedy
# DSpark parts from greedy decoding by default, and whether `--enable-deterministic-inference`
# (batch-invariant kernels) closes it, module by module (`greedy_identity_probe.py`, eager),
# then through `benchmark.acceptance` with CUDA graphs at 1 / 8 / 32 requests in flight and on
# every question at 32 (each stage's acceptance.json lands in $OUT as soon as it finishes).
#   bash benchmark/gpu/identity_h200.sh GSM8K_TEST_JSONL [QUESTIONS_IN_THE_LAST_STAGE]
# The last stage gets what is left of 570 s (a device command may run 600 s).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/identity
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD
DATA=$1
LAST_LIMIT=()
[ -n "${2:-}" ] && LAST_LIMIT=(--limit "$2")
DET='{"enable_deterministic_inference": true}'
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log --oneline -1; } \
  > "$OUT/env.txt" 2>&1
probe() {  # name, time limit (s), probe arguments
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" python3 benchmark/gpu/greedy_identity_probe.py --prompts "$DATA" --limit 6 \
    --max-new-tokens 160 --out "/tmp/identity/$name" "$@" > "/tmp/identity/$name.log" 2>&1
  echo "probe $name: rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
  cat "/tmp/identity/$name/identity_probe.md" >> "$OUT/probe.md" 2>/dev/null
}
stage() {  # name, time limit (s), benchmark.acceptance arguments
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" python3 -m benchmark.acceptance --model-path demo --data "$DATA" \
    --max-new-tokens 256 --policies full --temperatures 0 --random-draft none \
    --out "/tmp/identity/$name" "$@" > "/tmp/identity/$name.log" 2>&1
  echo "stage $name: rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
  cp "/tmp/identity/$name/acceptance.json" "$OUT/$name.json" 2>/dev/null
}
probe deterministic 150 --engine-args "$DET"
probe default 120
stage det_bs1 45 --limit 6 --batch-size 1 --engine-args "$DET"
stage det_bs8 45 --limit 48 --batch-size 8 --engine-args "$DET"
stage det_bs32 60 --limit 128 --batch-size 32 --engine-args "$DET"
stage det_all $((570 - SECONDS)) --batch-size 32 "${LAST_LIMIT[@]}" --engine-args "$DET"
tar czf "$OUT/logs.tgz" -C /tmp/identity --exclude='runs' --exclude='tables' . 2>/dev/null
ls -la "$OUT"
