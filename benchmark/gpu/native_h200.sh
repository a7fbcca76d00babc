#!/usr/bin/env bash
# Weights kept as stored (FP8 / MXFP4), KV cache dtype, real-size benchmark models on one H200.
#
#   bash benchmark/gpu/native_h200.sh [--dry-run] [stages]
#
#   tests        compiled tests of the quantised kernels (the MXFP4 decoders included) and the
#                FP8 window attention (NATIVE_TESTS: other test files instead)
#   gemm         bench_quant_gemm.py: bf16 Triton / cuBLAS / previous and current W8A16 /
#                W4A16 at V4-Flash decode shapes, M 1/4/8/16, and the MoE paths (its own 95 s
#                budget for new shapes)
#   moe          bench_quant_gemm.py --only MoE --moe-unsplit: the routed experts alone, M
#                1/4/8/16, the quantised formats with their products split along K (the
#                library) and unsplit, in one process
#   moe_paths    probe_moe_token.py: the rank model's experts (V4.1-Flash dims, shared expert
#                folded) through the sorted and the per-token path, bits compared, then timed
#                ABBA: MXFP4 at M 1/2/3/4/6/8, FP8 at M 1/2/3/4 (where the engine switches paths)
#   moe_token_shapes  probe_moe_token.py --stage-metas: each per-token stage alone at other
#                launch shapes (bits checked against the library's), MXFP4, M 1
#                (MOE_TOKEN_M: other token counts; MOE_TOKEN_STAGES: gate_up and / or down,
#                or sorted: the sorted path's grouped GEMMs at other column tiles and pipeline
#                depths; MOE_TOKEN_FORMAT: fp8 for FP8 stacks; MOE_TOKEN_ONLY: the variants
#                whose label holds it)
#   ab           bench_native.py ab: dsv4_flash_slice loaded --weight-format bf16, then native
#                (one process each), bs 1/8/32
#   rank         bench_native.py decode: dsv41_flash_rank, or $RANK_CONFIG (full depth, 96
#                experts, as stored), CUDA graphs, bs 1/8/32 vs its byte floor
#   rank_engram_host  the rank stage with V4.1's Engram tables in page-locked host memory
#                (--engram-table-location host), its own table beside the rank stage's
#   rank_dspark  the same model with DSpark (simulated acceptance 3.2): full width (which also
#                profiles the SPS table), the static widths, the online width policy (reads
#                that table), one process each
#   rank_ab      the rank model's plain decode (128 tokens) on a base tree and on this
#                tree, ABBA (base, head, head, base), one process each: RANK_AB_BASE (default
#                .ab) holds the base tree's python/ and benchmark/, e.g. `git archive REV python
#                benchmark | tar -x -C .ab`, carried with the call; RANK_AB_SYSTEM another
#                system of bench_native.py (dspark_static: DSpark at its static width), with
#                RANK_AB_ROUND_S seconds a round (default 135), RANK_AB_BS its batch size
#                (default 1), RANK_AB_RUNS the timed generations a round takes the median of
#                (default 3), RANK_AB_BASE_ARGS / RANK_AB_HEAD_ARGS JSON engine arguments of
#                each side (with RANK_AB_BASE=. an A/B of two settings of one tree);
#                RANK_AB_WARM=1 first runs each side once untimed (8 new tokens, within
#                RANK_AB_WARM_S, default 200 s) so a cold Triton cache's compilation does not
#                eat a timed round's limit;
#                abba_summary.py then reads the rounds together (means, speedup, greedy
#                tokens equal or not)
#   rank_profile the rank model at bs 1 under torch.profiler, no speculation and DSpark static
#                (one process each): device kernels per step by time, then host ops
#   rank_profile_serial  the rank model's plain decode at bs 1 (RANK_PROFILE_BS: other batch
#                sizes, e.g. 1,32) under torch.profiler with programmatic launch off: each kernel's
#                own duration (with it on, a kernel's span includes its wait for the one before)
#   v4_kv        dsv4_flash_rank (DeepSeek-V4-Flash dimensions), plain decode at bs 1 and 32
#                with the window KV cache in bf16 and in FP8 (V4.1's is FP8 by definition)
#   sweep        launch shapes of the quantised linear at q_b / o_b / wide, M 1 and 16 (when the
#                gemm stage misses its goals)
#   sweep_v41    the same sweep at V4.1-Flash's narrow dense shapes (x projection, o_b), FP8
#                32 x 32 as released, M 1 and 4
#   sweep_grouped  the same sweep at the grouped output projection (o_a: 8 groups of 1024 x
#                4096, FP8 32 x 32), M 1 / 16 / 32 (32: two row blocks, 1024 programs)
#   w8a8         bench_fp8_gemm.py: the FP8-activation GEMMs (prefill-sized W8A8, the DSpark
#                main projection's split-K) checked, then timed against cuBLAS bf16
#   scale_loads  probe_scale_loads.py: the narrow tiles' scale bytes loaded a step ahead (the
#                library's) against in their step, bits compared, then timed ABBA at
#                V4.1-Flash's dense decode shapes (M 1/4/16) and its per-token experts
#   probe        probe_weight_operand.py: the weight-first orientation, K split over programs
#                (atomics and fixed order) and the inline-PTX MXFP4 decode, against the library
#   probe_regs   probe_fma_gemv.py: V4.1's FP8 decode linears with the weight loaded straight
#                into registers (FMA units; mma.sync with the activation or the weight first),
#                checked, then timed beside the library at M 1/4/16 (PROBE_REGS_SHAPES: some of
#                x_proj,o_b,q_b,wkv; default all)
#   probe_fp4    probe_w_first_fp4.py: the per-token MoE's MXFP4 shapes (one expert's down
#                projection, a token's seven stacked, its seven gate/up projections) as
#                linears on the weight-first register-fed mma.sync kernel, checked, then timed
#                beside the library at M 1/4/16 (PROBE_FP4_SHAPES: some of down_1,down_7,
#                gate_up_7; default all)
#   probe_tma    probe_tma_linear.py: the quantised linear with its weight and activation tiles
#                loaded through tensor descriptors (TMA) at V4.1-Flash's dense shapes (FP8) and
#                its experts' (MXFP4), bits compared with the library, then timed beside it at
#                M 1/4/16 (PROBE_TMA_SHAPES: some of x_proj,o_b,down,q_b,gate_up,wkv)
#   probe_w8a8   probe_w8a8_decode.py: V4.1's FP8 decode linears on FP8 activations (W8A8), the
#                weight's codes fed to the matrix unit as stored (a warpgroup-MMA kernel with
#                64 weight rows a tile and K splits; the register-fed Gluon one), checked
#                against the W8A8 reference, then timed beside the library's W8A16 at M 1/4/16
#                (PROBE_W8A8_SHAPES: some of x_proj,o_b,q_b,wkv; PROBE_W8A8_ONLY: variants)
#   ncu          ncu_targets.py under Nsight Compute: the rank model's heaviest decode kernels
#                at one token (the dense FP8 linears, the per-token MoE stages, the mHC
#                boundary), one launch each, their hardware counters (speed of light, launch
#                shape, occupancy, issue slots, warp stalls, memory, instructions); NCU_TARGETS
#                picks some (ncu_targets.py --targets), NCU_LAUNCHES launches each,
#                NCU_STALLS=1 adds each warp-stall reason's cycles per issued instruction;
#                ncu_summary.py then puts each launch's figures in one table (the summary
#                shows it; the full report stays in results.tgz)
#   attn_splits  probe_attention_splits.py: the decode attention at the rank model's shapes (64
#                heads x 512, window 128 + 512 selected entries, M 1 and 4), the library's split
#                of the key range against forced splits, checked, then timed over 40 layers'
#                inputs
#   attn_shape   probe_attention_shape.py: V4.1's decode attention over gathered keys (64 heads
#                x 512, 640 keys a token) at M 1/8/32 tokens (ATTN_SHAPE_M), the library's
#                launch shape (heads a program, keys a tile, warps) against others, checked,
#                then timed over 40 layers' inputs
#   row_blocks   probe_row_blocks.py: the quantised linear above 16 rows at V4.1-Flash's FP8
#                projections (M 16/32/64: ROW_BLOCKS_M), one row block a program against two
#                (each multiplied by every dequantised weight tile) at other pipeline depths
#                and warps, bits compared with one block a program's, then timed
#   mhc_phases   probe_mhc_phases.py: V4.1's mHC boundary (D 5120, single pass) with each part
#                left out or changed, M 1/4/8/32; then the boundary alone on a base tree and on
#                this tree, ABBA (base, head, head, base), one process each, V4.1's and V4's
#                (D 4096, two pass): MHC_AB_BASE (default .ab) holds the base tree's python/,
#                carried with the call; MHC_AB_M the batch sizes (default 1,4,8,32);
#                MHC_AB_ONLY=1 skips the variants and runs the A/B alone; MHC_VARIANTS the
#                variants whose label holds it (default all)
#
# A device command runs at most ~9.5 minutes (CALL_BUDGET, see stages.sh): one call per line,
# in order of need, with stage budgets set from the first call's timings
# (benchmark/results/sweeps/2026-12-02_native_f66991f.md and
# 2026-12-03_rank_dsv41_flash_8cd19dc.md: a rank engine loads and captures its decode graphs in
# ~70 s and its DSpark graphs in ~110 s; the GEMM stage was cut short at M 1):
#   env,tests,gemm          ~2 minutes  (budgets 200 + 320 s)
#   env,tests,moe           ~4 minutes  (budgets 200 + 300 s)
#   env,moe_paths           ~2 minutes  (200 s)
#   env,moe_token_shapes    ~4 minutes  (300 s)
#   env,ab                  ~6 minutes  (320 s)
#   env,rank                ~3 minutes on a warm Triton cache, ~5 on a cold one (300 s)
#   env,rank_engram_host    as env,rank
#   env,rank_dspark         ~3 minutes on a warm Triton cache, ~9 on a cold one (540 s)
#   env,rank_ab             ~8 minutes (540 s: four engines at bs 1, ~2 minutes each)
#   env,rank_profile        ~4-7 minutes  (400 s)
#   env,rank_profile_serial ~2 minutes at bs 1 on a cold Triton cache (400 s)
#   env,v4_kv               ~6 minutes  (320 s)
#   env,sweep               ~8 minutes  (480 s), only when needed
#   env,sweep_v41           under a minute (240 s)
#   env,sweep_grouped       ~2-3 minutes, not yet timed (240 s)
#   env,w8a8,probe          ~2 minutes  (budgets 120 + 400 s)
#   env,probe_regs          ~1 minute warm (an H200), more on a cold Triton cache (300 s)
#   env,probe_fp4           ~40 s on an H100 (240 s)
#   env,probe_w8a8          not yet timed (420 s)
#   env,scale_loads         under a minute  (240 s)
#   env,mhc_phases          ~3 minutes  (480 s)
#   env,ncu                 ~2 minutes, not yet timed (300 s)
#   env,attn_splits         ~1 minute, not yet timed (180 s)
#   env,attn_shape          not yet timed (240 s)
#   env,row_blocks          not yet timed (240 s)
# A stage left without time is skipped and says so; each benchmark rewrites its table after
# every row, so a stage stopped at its limit keeps its rows. Results: $OUT/summary.md (tables,
# test summaries, what ran) and $OUT/results.tgz (every log and table).
DEFAULT_STAGES=env,tests,gemm
source "$(dirname "$0")/stages.sh"

native=(python3 benchmark/bench_native.py)
# RANK_CONFIG picks the rank model of the rank stages (dsv4_flash_rank: V4-Flash dimensions;
# dsv41_flash_rank_ep8: one EP8 rank's experts, which fits an 80 GB H100);
# RANK_DSPARK_SYSTEMS the DSpark systems of rank_dspark (dspark_online needs dspark_full's SPS
# table from the same call).
RANK_CONFIG=${RANK_CONFIG:-dsv41_flash_rank}
RANK_DSPARK_SYSTEMS=${RANK_DSPARK_SYSTEMS:-dspark_full,dspark_static,dspark_online}
rank=(--config "$RANK_CONFIG" --input-len 256 --output-len 32)
if has env; then env_stage; fi
if has tests; then
  stage tests 200
  # NATIVE_TESTS (test files, space-separated) replaces the list, e.g. to rerun a failure.
  # shellcheck disable=SC2086
  run 200 native_tests.txt python3 -m pytest -v -p no:cacheprovider -n 12 ${NATIVE_TESTS:-\
    test/registered/kernels/test_quantized_gemm.py \
    test/registered/kernels/test_window_sparse_attention.py \
    test/registered/kernels/test_moe_token_gemm.py \
    test/registered/kernels/test_moe_mixed_experts.py \
    test/registered/kernels/test_csa2_pair_pool.py \
    test/registered/kernels/test_rmsnorm.py \
    test/registered/kernels/test_rope_q_kv.py \
    test/registered/kernels/test_quant_load.py \
    test/registered/kernels/test_picked_entry_rows.py \
    test/registered/kernels/test_small_m_linear.py \
    test/registered/kernels/test_fp4_nibble_decode.py \
    test/registered/kernels/test_engram_gather.py \
    test/registered/kernels/test_indexer_v41.py \
    test/registered/e2e/test_engram_host_tables.py}
  show "$WORK/native_tests.txt" 15
fi
if has gemm; then
  stage gemm 320
  run 320 quant_gemm.log python3 benchmark/kernels/bench_quant_gemm.py --out "$WORK/quant_gemm.md"
  show "$WORK/quant_gemm.md"
fi
if has moe; then
  stage moe 300
  run 300 moe_gemm.log python3 benchmark/kernels/bench_quant_gemm.py --only MoE --m 1,4,8,16 \
    --moe-unsplit --budget-s 280 --out "$WORK/moe_gemm.md"
  show "$WORK/moe_gemm.md"
fi
if has moe_paths; then
  stage moe_paths 200
  run 100 moe_paths.log python3 benchmark/kernels/probe_moe_token.py --format mxfp4 \
    --shapes dsv41_flash_ep4 --m 1,2,3,4,6,8 --out "$WORK/moe_paths.md"
  show "$WORK/moe_paths.md"
  run 100 moe_paths_fp8.log python3 benchmark/kernels/probe_moe_token.py --format fp8 \
    --shapes dsv41_flash_ep4 --m 1,2,3,4 --out "$WORK/moe_paths_fp8.md"
  show "$WORK/moe_paths_fp8.md"
fi
if has moe_token_shapes; then
  stage moe_token_shapes 300
  run 300 moe_token_shapes.log python3 benchmark/kernels/probe_moe_token.py \
    --format "${MOE_TOKEN_FORMAT:-mxfp4}" \
    --shapes dsv41_flash_ep4 --m "${MOE_TOKEN_M:-1}" --stage-metas \
    --stages "${MOE_TOKEN_STAGES:-gate_up,down}" ${MOE_TOKEN_ONLY:+--only "$MOE_TOKEN_ONLY"} \
    --out "$WORK/moe_token_shapes.md"
  show "$WORK/moe_token_shapes.md"
fi
if has ab; then  # the same random model, bf16 then native, each engine in its own process
  stage ab 320
  for fmt in bf16 native; do
    run 170 "ab/weights_$fmt.log" "${native[@]}" ab --config dsv4_flash_slice --formats "$fmt" \
      --batch-sizes 1,8,32 --input-len 256 --output-len 32 --append --out-dir "$WORK/ab"
  done
  show "$WORK/ab/native_ab_dsv4_flash_slice.md"
fi
if has rank; then
  stage rank 300
  run 300 rank/plain.log "${native[@]}" decode "${rank[@]}" --systems plain --append \
    --batch-sizes 1,8,32 --out-dir "$WORK/rank"
  show "$WORK/rank/native_decode_$RANK_CONFIG.md"
fi
if has rank_engram_host; then
  stage rank_engram_host 300
  run 300 rank_host/plain.log "${native[@]}" decode "${rank[@]}" --systems plain --append \
    --batch-sizes 1,8,32 --engine-args '{"engram_table_location": "host"}' \
    --out-dir "$WORK/rank_host"
  show "$WORK/rank_host/native_decode_$RANK_CONFIG.md"
fi
if has rank_dspark; then  # full width first: after its rows it profiles the SPS table online reads
  stage rank_dspark 540
  for system in dspark_full:320 dspark_static:110 dspark_online:110; do
    [[ ",$RANK_DSPARK_SYSTEMS," == *",${system%:*},"* ]] || continue
    run "${system#*:}" "rank/${system%:*}.log" "${native[@]}" decode "${rank[@]}" \
      --systems "${system%:*}" --append --batch-sizes 1,8,32 --sps-table "$WORK/rank/sps.json" \
      --out-dir "$WORK/rank"
  done
  show "$WORK/rank/native_decode_$RANK_CONFIG.md"
fi
rank_ab_args() {  # SIDE: that side's engine arguments (JSON)
  if [ "$1" = base ]; then echo "${RANK_AB_BASE_ARGS:-{\}}"; else echo "${RANK_AB_HEAD_ARGS:-{\}}"; fi
}
rank_ab_decode() {  # LIMIT_S DIR SIDE ROOT NEW_TOKENS RUNS: one engine of ROOT's tree
  run "$1" "$2.log" env PYTHONPATH="$4/python:$4:$PYTHONPATH" \
    python3 "$4/benchmark/bench_native.py" decode --config "$RANK_CONFIG" \
    --input-len 256 --output-len "$5" --systems "${RANK_AB_SYSTEM:-plain}" \
    --batch-sizes "${RANK_AB_BS:-1}" --timed-runs "$6" \
    --engine-args "$(rank_ab_args "$3")" --out-dir "$WORK/$2"
}
rank_ab_round() {  # ROUND SIDE ROOT: the rank model's decode at RANK_AB_BS on ROOT's tree
  rank_ab_decode "${RANK_AB_ROUND_S:-135}" "rank_ab/${1}_$2" "$2" "$3" 128 "${RANK_AB_RUNS:-3}"
  show "$WORK/rank_ab/${1}_$2/native_decode_$RANK_CONFIG.md"
}
rank_ab_warm() {  # ROUND SIDE ROOT: an untimed short run (compiles the side's kernels)
  [ "$1" -le 2 ] || return 0  # each side once: the first base and head rounds
  rank_ab_decode "${RANK_AB_WARM_S:-200}" "rank_ab_warm/$2" "$2" "$3" 8 1
}
if has rank_ab; then  # each side's rows in a table of its own; read them in ABBA order
  stage rank_ab 540
  if [ "${RANK_AB_WARM:-0}" = 1 ]; then abba rank_ab "${RANK_AB_BASE:-.ab}" rank_ab_warm; fi
  abba rank_ab "${RANK_AB_BASE:-.ab}" rank_ab_round
  run 30 rank_ab/summary.log python3 benchmark/gpu/abba_summary.py "$WORK/rank_ab" \
    --out "$WORK/rank_ab_summary.md"
  show "$WORK/rank_ab_summary.md"
fi
if has rank_profile; then  # the kernel list heads each profile's table in the summary
  stage rank_profile 400
  for system in plain:180 dspark_static:220; do
    run "${system#*:}" "rank_profile/${system%:*}.log" "${native[@]}" decode "${rank[@]}" \
      --systems "${system%:*}" --batch-sizes 1 --profile --out-dir "$WORK/rank_profile"
  done
  if (( ! DRY_RUN )); then
    for f in "$WORK"/rank_profile/profile_*_bs1.txt; do
      [ -f "$f" ] || continue
      grep -A 45 "device kernels per step" "$f" > "${f%.txt}_kernels.md"
      show "${f%.txt}_kernels.md"
    done
  fi
fi
if has rank_profile_serial; then
  stage rank_profile_serial 400
  run 400 rank_profile_serial/plain.log "${native[@]}" decode "${rank[@]}" --systems plain \
    --batch-sizes "${RANK_PROFILE_BS:-1}" --profile \
    --engine-args '{"programmatic_launch_max_bs": 0}' --out-dir "$WORK/rank_profile_serial"
  if (( ! DRY_RUN )); then
    for f in "$WORK"/rank_profile_serial/profile_plain_bs*.txt; do
      [ -f "$f" ] || continue
      grep -A 45 "device kernels per step" "$f" > "${f%.txt}_kernels.md"
      show "${f%.txt}_kernels.md"
    done
  fi
fi
if has v4_kv; then  # one table per KV dtype (bench_native names its table by config only)
  stage v4_kv 320
  for kv in auto fp8_e4m3; do
    run 160 "v4_kv/$kv.log" "${native[@]}" decode --config dsv4_flash_rank --input-len 256 \
      --output-len 32 --systems plain --kv-cache-dtype "$kv" --batch-sizes 1,32 \
      --out-dir "$WORK/v4_kv/$kv"
    show "$WORK/v4_kv/$kv/native_decode_dsv4_flash_rank.md"
  done
fi
if has sweep; then
  stage sweep 480
  for shape in q_b o_b wide; do
    run 160 "sweep_$shape.log" python3 benchmark/kernels/bench_quant_gemm.py --sweep \
      --m 1,16 --only "$shape" --out "$WORK/quant_sweep_$shape.md"
    show "$WORK/quant_sweep_$shape.md"
  done
fi
if has sweep_v41; then
  stage sweep_v41 240
  run 240 sweep_v41.log python3 benchmark/kernels/bench_quant_gemm.py --sweep --m 1,4 \
    --only v41 --sweep-formats fp8/32 --out "$WORK/quant_sweep_v41.md"
  show "$WORK/quant_sweep_v41.md"
fi
if has sweep_grouped; then
  stage sweep_grouped 240
  run 240 sweep_grouped.log python3 benchmark/kernels/bench_quant_gemm.py --sweep --m 1,16,32 \
    --only grouped --sweep-formats fp8/32 --out "$WORK/quant_sweep_grouped.md"
  show "$WORK/quant_sweep_grouped.md"
fi
if has attn_splits; then
  stage attn_splits 180
  run 180 attn_splits.log python3 benchmark/kernels/probe_attention_splits.py --m 1,4 \
    --out "$WORK/attn_splits.md"
  show "$WORK/attn_splits.md"
fi
if has attn_shape; then
  stage attn_shape 240
  run 240 attn_shape.log python3 benchmark/kernels/probe_attention_shape.py \
    --m "${ATTN_SHAPE_M:-1,8,32}" --out "$WORK/attn_shape.md"
  show "$WORK/attn_shape.md"
fi
if has row_blocks; then
  stage row_blocks 240
  run 240 row_blocks.log python3 benchmark/kernels/probe_row_blocks.py \
    --m "${ROW_BLOCKS_M:-16,32,64}" --out "$WORK/row_blocks.md"
  show "$WORK/row_blocks.md"
fi
if has w8a8; then
  stage w8a8 120
  run 120 fp8_gemm.log python3 benchmark/kernels/bench_fp8_gemm.py --out "$WORK/fp8_gemm.md"
  show "$WORK/fp8_gemm.md"
fi
if has scale_loads; then  # the probe keeps to its own budget, under the stage's limit
  stage scale_loads 240
  run 240 scale_loads.log python3 benchmark/kernels/probe_scale_loads.py --budget-s 200 \
    --out "$WORK/scale_loads.md"
  show "$WORK/scale_loads.md"
fi
if has ncu; then  # hardware counters of the heaviest decode kernels, one launch each
  stage ncu 300
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
  ncu_sections=()
  for section in SpeedOfLight LaunchStats Occupancy SchedulerStats WarpStateStats \
    MemoryWorkloadAnalysis InstructionStats; do
    ncu_sections+=(--section "$section")
  done
  if [ "${NCU_STALLS:-0}" = 1 ]; then  # why a warp did not issue, per issued instruction
    ncu_sections+=(--metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio")
  fi
  # shellcheck disable=SC2086
  run 300 ncu.txt "${ncu_bin:-ncu}" --clock-control none --profile-from-start off \
    "${ncu_sections[@]}" python3 benchmark/kernels/ncu_targets.py \
    --launches "${NCU_LAUNCHES:-1}" ${NCU_TARGETS:+--targets $NCU_TARGETS}
  show "$WORK/ncu.txt" 4  # the report's last lines: how ncu ended
  run 30 ncu_summary.log python3 benchmark/gpu/ncu_summary.py "$WORK/ncu.txt" \
    --out "$WORK/ncu_summary.md"
  show "$WORK/ncu_summary.md"
fi
if has probe; then  # the probe keeps to its own budget, under the stage's limit
  stage probe 400
  run 400 probe.log python3 benchmark/kernels/probe_weight_operand.py --budget-s 360 \
    --out "$WORK/probe_weight_operand.md"
  show "$WORK/probe_weight_operand.md"
fi
if has probe_regs; then  # the probe keeps to its own budget, under the stage's limit
  stage probe_regs 300
  run 300 probe_regs.log python3 benchmark/kernels/probe_fma_gemv.py --budget-s 270 \
    --shapes "${PROBE_REGS_SHAPES:-x_proj,o_b,q_b,wkv}" --out "$WORK/probe_regs.md"
  show "$WORK/probe_regs.md"
fi
if has probe_fp4; then  # the probe keeps to its own budget, under the stage's limit
  stage probe_fp4 240
  run 240 probe_fp4.log python3 benchmark/kernels/probe_w_first_fp4.py --budget-s 210 \
    --shapes "${PROBE_FP4_SHAPES:-down_1,down_7,gate_up_7}" --out "$WORK/probe_fp4.md"
  show "$WORK/probe_fp4.md"
fi
if has probe_tma; then  # the probe keeps to its own budget, under the stage's limit
  stage probe_tma 300
  run 300 probe_tma.log python3 benchmark/kernels/probe_tma_linear.py --budget-s 270 \
    --shapes "${PROBE_TMA_SHAPES:-x_proj,o_b,down,q_b,gate_up,wkv}" --out "$WORK/probe_tma.md"
  show "$WORK/probe_tma.md"
fi
if has probe_w8a8; then  # the probe keeps to its own budget, under the stage's limit
  stage probe_w8a8 420
  run 420 probe_w8a8.log python3 benchmark/kernels/probe_w8a8_decode.py --budget-s 390 \
    --shapes "${PROBE_W8A8_SHAPES:-x_proj,o_b,q_b,wkv}" --only "${PROBE_W8A8_ONLY:-}" \
    --out "$WORK/probe_w8a8.md"
  show "$WORK/probe_w8a8.md"
fi
mhc_ab_round() {  # ROUND SIDE ROOT: the boundary alone, V4.1's and V4's, on ROOT's library
  local model limit name extra
  for model in v41 v4; do
    limit=45 name="${1}_$2" extra=()
    [ "$model" = v4 ] && limit=40 name="${1}_${2}_v4" extra=(--two-pass --hidden 4096)
    run "$limit" "mhc_ab/$name.log" env PYTHONPATH="$3/python:$PWD" \
      python3 benchmark/kernels/probe_mhc_phases.py --library-only --m "${MHC_AB_M:-1,4,8,32}" \
      "${extra[@]}" --out "$WORK/mhc_ab/$name.md"
    show "$WORK/mhc_ab/$name.md"
  done
}
if has mhc_phases; then  # the A/B rounds print one table each; read them in ABBA order
  stage mhc_phases 480
  if [ "${MHC_AB_ONLY:-0}" != 1 ]; then
    run 140 mhc_phases.log python3 benchmark/kernels/probe_mhc_phases.py \
      --m "${MHC_AB_M:-1,4,8,32}" --only "${MHC_VARIANTS:-}" --out "$WORK/mhc_phases.md"
    show "$WORK/mhc_phases.md"
  fi
  abba mhc_phases "${MHC_AB_BASE:-.ab}" mhc_ab_round
fi
note "done at +$(($(now) - CALL_START)) s"
