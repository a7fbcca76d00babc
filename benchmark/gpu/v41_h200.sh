#!/usr/bin/env bash
# DeepSeek-V4.1 on one GPU in one device call (about 8 minutes on an H200): the V4.1 kernels
# compiled against their references, tiny-v41 (+ DSpark) in real CUDA graphs against eager and
# CPU greedy, the DSpark step's no-sync check, then the V4.1-Flash slice in the engine benchmark
# at bs 1/8/32 (no speculation and DSpark with simulated acceptance, CUDA graphs) with the byte
# floors of both steps. Everything lands in $OUT.
#   bash benchmark/gpu/v41_h200.sh [stages]   (stages: env,kernels,graphs,bench; default all)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD
STAGES=${1:-env,kernels,graphs,bench}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
if has env; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/env.txt"
  git log --oneline -1 2>/dev/null | tee -a "$OUT/env.txt"
fi
if has kernels; then  # compiled: every V4.1 kernel beside its reference
  timeout 90 python3 -m pytest -q -p no:cacheprovider -n 8 \
    test/registered/kernels/test_quant_store.py test/registered/kernels/test_engram_gather.py \
    test/registered/kernels/test_indexer_v41.py test/registered/kernels/test_mhc.py \
    test/registered/kernels/test_moe_router.py test/registered/kernels/test_moe_token_gemm.py \
    test/registered/kernels/test_moe_grouped_gemm.py 2>&1 | tee "$OUT/v41_kernel_tests.txt" | tail -15
fi
if has graphs; then  # tiny-v41 in real CUDA graphs == eager CUDA == CPU greedy; no host sync
  timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 \
    test/registered/e2e/test_cuda_graph_runner.py test/registered/e2e/test_dspark_step_no_sync.py \
    test/registered/e2e/test_kernel_backend_e2e.py -k "v41" 2>&1 | tee "$OUT/v41_graph_tests.txt" | tail -20
fi
if has bench; then  # the V4.1-Flash slice: decode step and DSpark step vs their byte floors
  timeout 240 python3 benchmark/bench_engine.py --config v41_flash_slice --batch-sizes 1,8,32 \
    --skip-eager --static-cases "" --input-len 512 --output-len 64 --gamma 7 --accept-len 3.2 \
    --draft-layers 3 --draft-experts 32 --draft-top-k 3 --out-dir "$OUT/v41_bench" 2>&1 \
    | grep -v '"ids"' | tail -25
  cat "$OUT/v41_bench/engine.md" 2>/dev/null
fi
