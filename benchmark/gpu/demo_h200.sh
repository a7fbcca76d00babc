#!/usr/bin/env bash
# The shipped demo pair (`--model-path demo`) on one GPU in one device call: GSM8K (zero-shot)
# acceptance, accuracy and greedy identity through `benchmark.acceptance`, stage by stage
# (each stage's acceptance.json is copied to $OUT when it ends, also when cut at its limit).
#   bash benchmark/gpu/demo_h200.sh GSM8K_TEST_JSONL [STAGES]
#   (all | random | policies | async | speed,blocks | fp32: one device call each; served tok/s
#   and what --enable-deterministic-inference costs: serving_h200.sh)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/acc
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD
DATA=$1
STAGES=${2:-all}
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
  # the SPS table the confidence policy's runs read (profiled at the start of the stage)
  cp "/tmp/acc/$name/tables/sps.json" "$OUT/${name}_sps.json" 2>/dev/null
  grep -v '^INFO\|Loading\|it/s\]' "/tmp/acc/$name.log" | tail -5
}
DET='{"enable_deterministic_inference": true}'
has() { [[ ",$STAGES," == *",$1,"* ]]; }
# every question with the batch-invariant kernels (greedy DSpark = greedy decoding on a GPU):
# no-spec, DSpark with each verify policy, greedy and T=1; the n-gram control from the greedy
# no-spec outputs (acceptance.json is rewritten after each run). About 520 s on a fresh machine.
if has all; then
  stage all $((575 - SECONDS)) --policies full,static:4,confidence --temperatures 0,1 \
    --batch-size 32 --random-draft none --engine-args "$DET"
fi
# the static and confidence policies on every question (the SPS table profiled first), and the
# confidence policy's async mode alone (each about 330 s on a warm machine)
if has policies; then
  stage policies 330 --policies static:4,confidence --temperatures 0,1 --batch-size 32 \
    --random-draft none --engine-args "$DET"
fi
if has async; then
  stage async 300 --policies confidence:async --temperatures 0,1 --batch-size 32 \
    --random-draft none --engine-args "$DET"
fi
# the random-draft control on every question (no-spec first: the greedy check's baseline)
if has random; then
  stage random $((575 - SECONDS)) --policies "" --temperatures 0,1 --batch-size 32 \
    --random-draft auto --engine-args "$DET"
fi
# tok/s per user at 1 / 8 / 32 requests in flight (wall time of each run)
if has speed; then
  stage bs1 35 --limit 6 --batch-size 1 --policies full --temperatures 0 --random-draft none
  stage bs8 35 --limit 48 --batch-size 8 --policies full --temperatures 0 --random-draft none
  stage bs32 40 --limit 128 --batch-size 32 --policies full --temperatures 0 --random-draft none
fi
# the draft's block size against shorter blocks, greedy, full verify
if has blocks; then
  stage blocks 150 --limit 320 --block-sizes 2,4,8 --policies full --temperatures 0 \
    --batch-size 32 --random-draft none --engine-args "$DET"
fi
# greedy identity with fp32 serving: a call of its own (on a fresh machine compiling the fp32
# kernels and capturing no-spec's graphs took 97 s, DSpark's more than the 45 s left of 170)
if has fp32; then
  stage fp32 400 --limit 128 --dtype float32 --policies full --temperatures 0 --batch-size 32 \
    --random-draft none
fi
tar czf "$OUT/logs.tar.gz" -C /tmp/acc --exclude='runs' --exclude='random_draft' . 2>/dev/null
ls -la "$OUT"
