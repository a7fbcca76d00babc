#!/usr/bin/env bash
# Paired serving A/Bs of the shipped demo pair (`--model-path demo`) on one GPU: fresh server
# launches in ABBA order through `benchmark.ab`, tok/s per user on GSM8K test questions
# (zero-shot, 256 new tokens) at 1, 8 and 32 requests in flight.
#
#   GSM8K=PATH/test.jsonl bash benchmark/gpu/serving_h200.sh [--dry-run] [stages]
#
#   dspark         no speculation (baseline) vs DSpark with the trained draft (candidate): real
#                  acceptance, the acceptance length of every launch in the report
#   deterministic  DSpark with the default kernels (baseline) vs DSpark with
#                  --enable-deterministic-inference (candidate): what the batch-invariant
#                  kernels cost
#
# One device call per stage (4 replicates x 2 arms, one server launch each; 380 s on a fresh
# machine, whose first launch compiles every kernel in ~2 minutes):
#   env,dspark          ~7 minutes  (budget 540 s)
#   env,deterministic   ~7 minutes  (budget 540 s)
# Results: $OUT/summary.md (the reports) and $OUT/results.tgz (results.json, logs).
DEFAULT_STAGES=env,dspark
source "$(dirname "$0")/stages.sh"

GSM8K=${GSM8K:-.demo/gsm8k_test.jsonl}
REPLICATES=${REPLICATES:-4}
server="python3 -m sgl_dspark.launch_server --model-path demo --port {port}"
dspark="$server --speculative-algorithm DSpark"
workloads=()
for conc_n in 1:16 8:64 32:128; do  # at least four waves: a run of ~2-4 s
  workloads+=(--workload "gsm8k:path=$GSM8K,out=256,conc=${conc_n%:*},n=${conc_n#*:},name=gsm8k-c${conc_n%:*}")
done
ab=(python3 -m benchmark.ab --metric tok_per_s_per_user --replicates "$REPLICATES"
  --runs-per-launch 2 --warmup-runs 1 "${workloads[@]}" --no-plot)

if has env; then env_stage; fi
if has dspark; then
  stage dspark 540
  run 540 dspark/ab.log "${ab[@]}" --baseline-cmd "$server" --candidate-cmd "$dspark" \
    --output-dir "$WORK/dspark"
  show "$WORK/dspark/report.md"
fi
if has deterministic; then
  stage deterministic 540
  run 540 deterministic/ab.log "${ab[@]}" --baseline-cmd "$dspark" \
    --candidate-cmd "$dspark --enable-deterministic-inference" --output-dir "$WORK/deterministic"
  show "$WORK/deterministic/report.md"
fi
