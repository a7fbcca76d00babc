#!/usr/bin/env bash
# DeepSeek-V4.1 on one GPU: the V4.1 kernels compiled against their references, tiny-v41 (+
# DSpark) in real CUDA graphs against eager and CPU greedy, the DSpark step's no-sync check, and
# the V4.1-Flash slice in the engine benchmark: no speculation and DSpark (simulated acceptance)
# at full width, static widths and the confidence policy, bs 1/8/32, each engine in its own
# process, against the byte floors of the steps.
#
#   bash benchmark/gpu/v41_h200.sh [--dry-run] [stages]    (env,kernels,graphs,bench by default)
#
# One device call runs at most ~9.5 minutes (CALL_BUDGET, see stages.sh), which holds either
#   env,kernels,graphs   compiled tests, ~4 minutes (limits 90 + 150 s)
#   env,bench            the benchmark, ~8 minutes (stage budget 510 s)
# The default set starts the benchmark with what the tests left of the call (the engines run in
# order of importance: no speculation, full width, static, confidence).
# Results: $OUT/summary.md (tables, test summaries, what ran) and $OUT/results.tgz (every log).
# V41_BENCH_OVERRIDES: extra bench_engine.py arguments, last, so they win (a CPU test runs the
# bench stage on a toy config with them).
DEFAULT_STAGES=env,kernels,graphs,bench
source "$(dirname "$0")/stages.sh"

if has env; then env_stage; fi
if has kernels; then  # compiled: every V4.1 kernel beside its reference
  stage kernels 90
  run 90 v41_kernel_tests.txt python3 -m pytest -q -p no:cacheprovider -n 8 \
    test/registered/kernels/test_quant_store.py test/registered/kernels/test_engram_gather.py \
    test/registered/kernels/test_indexer_v41.py test/registered/kernels/test_mhc.py \
    test/registered/kernels/test_moe_router.py test/registered/kernels/test_moe_token_gemm.py \
    test/registered/kernels/test_moe_grouped_gemm.py
  show "$WORK/v41_kernel_tests.txt" 15
fi
if has graphs; then  # tiny-v41 in real CUDA graphs == eager CUDA == CPU greedy; no host sync
  stage graphs 150
  run 150 v41_graph_tests.txt python3 -m pytest -q -p no:cacheprovider -n 4 \
    test/registered/e2e/test_cuda_graph_runner.py test/registered/e2e/test_dspark_step_no_sync.py \
    test/registered/e2e/test_kernel_backend_e2e.py -k v41
  show "$WORK/v41_graph_tests.txt" 20
fi
if has bench; then
  # The V4.1-Flash slice (21B parameters, built on the device per process): decode and DSpark
  # steps vs their byte floors. One engine per process: graph pools of one engine would hold
  # memory the next needs (benchmark/results/sweeps/2026-12-02_v41_flash_slice_7f843a0.md: bs
  # 32 ran out of memory with two engines in one process). Prefill runs eagerly (the decode
  # steps are measured; prefill graphs add capture time and pool memory). Limits per engine
  # from that call: a process starts, builds the model and captures 8 batch buckets (x the
  # verify widths) before its first row; the full-width engine then profiles the SPS table
  # the confidence policy reads.
  stage bench 510
  if (( ! DRY_RUN )); then rm -rf "$WORK/v41_bench"; fi
  bench=(python3 benchmark/bench_engine.py --config v41_flash_slice --batch-sizes 1,8,32
    --input-len 512 --output-len 64 --gamma 7 --accept-len 3.2 --draft-layers 3
    --draft-experts 32 --draft-top-k 3 --static-cases "" --static-widths 1:4,8:3,32:2
    --confidence-modes async --sps-table "$WORK/v41_bench/sps.json"
    --engine-args '{"cuda_graph_max_prefill_tokens": 0}' --append --out-dir "$WORK/v41_bench")
  # shellcheck disable=SC2206  # word splitting intended: extra arguments
  overrides=(${V41_BENCH_OVERRIDES:-})
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  run 150 v41_bench/graph.log "${bench[@]}" --systems graph "${overrides[@]}"
  run 200 v41_bench/dspark_full.log "${bench[@]}" --systems dspark_full "${overrides[@]}"
  run 150 v41_bench/dspark_static.log "${bench[@]}" --systems dspark_static "${overrides[@]}"
  run 160 v41_bench/dspark_confidence.log "${bench[@]}" --systems dspark_confidence \
    "${overrides[@]}"
  show "$WORK/v41_bench/engine.md"
fi
note "done at +$(($(now) - CALL_START)) s"
