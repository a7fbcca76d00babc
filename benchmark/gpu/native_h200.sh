#!/usr/bin/env bash
# Weights kept as stored (FP8 / MXFP4), KV cache dtype, real-size benchmark models: one device
# call on one H200, about 9 minutes. Results: $OUT/*.md (+ .json, logs).
#
#   bash benchmark/gpu/native_h200.sh [stages]     (default: env,tests,gemm,ab,rank,v41)
#
#   tests  compiled tests of the quantised kernels and the FP8 window attention
#   gemm   bench_quant_gemm.py: bf16 Triton / cuBLAS / previous and current W8A16 / W4A16 at
#          V4-Flash decode shapes, M 1/4/8/16, and the MoE paths (its own 95 s budget)
#   ab     bench_native.py ab: dsv4_flash_slice loaded --weight-format bf16 vs native, bs 1/8/32
#   rank   bench_native.py decode: dsv4_flash_rank (full depth, 96 experts, as stored), CUDA
#          graphs, bs 1/8/32 vs its byte floor; DSpark (simulated acceptance 3.2) at full width,
#          static widths and the online width policy; then the FP8 window KV cache (plain rows)
#   v41    bench_native.py decode: dsv41_flash_rank loaded natively, bs 1 on the kernels V4.1
#          runs today (torch mHC / indexer / MoE and attention, so eager)
#   sweep  (not in the default set; a second call) launch shapes of the quantised linear at
#          q_b / o_b / wide, M 1 and 16, when the gemm stage misses its goals
# Every stage has its own time limit; each benchmark rewrites its markdown after every row.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
STAGES=${1:-env,tests,gemm,ab,rank,v41}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
START=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - START ))s" | tee -a "$OUT/stages.txt"; }
if has env; then
  stamp env
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    echo "commit $(git log --oneline -1 2>/dev/null) ($(git status --short -- python benchmark test | wc -l) changed files)"
  } 2>&1 | tee "$OUT/env.txt"
fi
if has tests; then
  stamp tests
  timeout 80 python3 -m pytest -q -p no:cacheprovider -n 8 \
    test/registered/kernels/test_quantized_gemm.py \
    test/registered/kernels/test_window_sparse_attention.py \
    test/registered/kernels/test_moe_token_gemm.py \
    test/registered/kernels/test_small_m_linear.py 2>&1 | tee "$OUT/native_tests.txt" | tail -15
fi
if has gemm; then
  stamp gemm
  timeout 110 python3 benchmark/kernels/bench_quant_gemm.py --out "$OUT/quant_gemm.md" \
    > "$OUT/quant_gemm.log" 2>&1
  tail -70 "$OUT/quant_gemm.md"
fi
if has ab; then
  stamp ab
  timeout 90 python3 benchmark/bench_native.py ab --config dsv4_flash_slice --batch-sizes 1,8,32 \
    --input-len 256 --output-len 32 --out-dir "$OUT" > "$OUT/native_ab.log" 2>&1
  cat "$OUT/native_ab_dsv4_flash_slice.md"
fi
if has rank; then
  stamp rank
  timeout 170 python3 benchmark/bench_native.py decode --config dsv4_flash_rank --dspark \
    --batch-sizes 1,8,32 --input-len 256 --output-len 32 --out-dir "$OUT" \
    > "$OUT/native_rank.log" 2>&1
  cat "$OUT/native_decode_dsv4_flash_rank.md"
  stamp rank_fp8_kv
  mkdir -p "$OUT/fp8_kv"
  timeout 45 python3 benchmark/bench_native.py decode --config dsv4_flash_rank \
    --kv-cache-dtype fp8_e4m3 --batch-sizes 1,32 --input-len 256 --output-len 32 \
    --out-dir "$OUT/fp8_kv" > "$OUT/fp8_kv/native_rank_fp8_kv.log" 2>&1
  head -8 "$OUT/fp8_kv/native_decode_dsv4_flash_rank.md"
fi
if has v41; then
  stamp v41
  timeout 45 python3 benchmark/bench_native.py decode --config dsv41_flash_rank --batch-sizes 1 \
    --input-len 64 --output-len 8 --out-dir "$OUT" > "$OUT/native_v41.log" 2>&1
  cat "$OUT/native_decode_dsv41_flash_rank.md" 2>/dev/null || tail -20 "$OUT/native_v41.log"
fi
if has sweep; then
  stamp sweep
  for shape in q_b o_b wide; do
    timeout 150 python3 benchmark/kernels/bench_quant_gemm.py --sweep --m 1,16 --only "$shape" \
      --out "$OUT/quant_sweep_$shape.md" > "$OUT/quant_sweep_$shape.log" 2>&1
    cat "$OUT/quant_sweep_$shape.md"
  done
fi
stamp done
