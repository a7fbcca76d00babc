#!/usr/bin/env bash
# One device call: environment, compiled kernel tests, DSpark eager check, engine micro-bench,
# kernel benchmark. Usage (device tool, carry .whl): bash benchmark/gpu/run_h200.sh [stages]
# The test stages stop pytest with SIGINT at their limit (`timeout -s INT`), so a cut run still
# prints its summary, and `-rfE` names every failure and error in it (a cold machine compiles
# every kernel first: the kernels stage took over 330 s at 12 workers). KERNELS_LIMIT /
# KERNELS_WORKERS and GRAPHS_LIMIT override the kernels and graphs stages' limits and workers.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
STAGES=${1:-env,kernels,dspark,bench,kbench}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
if has env; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
  python3 -c "import torch, triton, numpy; print(torch.__version__, triton.__version__, numpy.__version__)" | tee -a "$OUT/env.txt"
  git log --oneline -1 2>/dev/null | tee -a "$OUT/env.txt"
fi
if has kernels; then
  timeout -s INT -k 20 ${KERNELS_LIMIT:-420} python3 -m pytest -q -rfE -p no:cacheprovider -n ${KERNELS_WORKERS:-12} test/registered/kernels \
    test/registered/unit/test_kernel_dispatch.py test/registered/e2e/test_moe_backend.py \
    test/registered/unit/test_triton_attention_backend.py test/registered/unit/test_indexer_family.py \
    test/registered/unit/test_norm_family.py 2>&1 | tee "$OUT/kernel_tests.txt" | tail -25
fi
if has dspark; then
  python3 benchmark/gpu/dspark_eager_check.py --out "$OUT/dspark_eager.json" 2>&1 | tail -60
fi
if has dspark_triton; then
  python3 benchmark/gpu/dspark_eager_check.py --kernel-backend triton \
    --out "$OUT/dspark_eager_triton.json" 2>&1 | tail -8
fi
if has nosync; then
  python3 -m pytest -q -p no:cacheprovider test/registered/e2e/test_dspark_step_no_sync.py \
    test/registered/e2e/test_dspark_oracle_draft.py 2>&1 | tee "$OUT/nosync.txt" | tail -15
fi
if has e2e; then
  python3 benchmark/gpu/kernel_backend_e2e.py --out "$OUT/kernel_backend_e2e.json" 2>&1 | tail -60
fi
if has bench; then
  python3 benchmark/bench_one_batch.py --config mid_910m --device cuda --batch-sizes 1,8 \
    --input-len 512 --output-len 32 --out "$OUT/bench_one_batch.json" 2>&1 | tail -5
fi
if has graphs; then
  timeout -s INT -k 20 ${GRAPHS_LIMIT:-300} python3 -m pytest -q -rfE -p no:cacheprovider -n 4 test/registered/e2e/test_cuda_graph_runner.py \
    test/registered/e2e/test_dspark_step_no_sync.py test/registered/e2e/test_dspark_sampled_graphs.py \
    test/registered/e2e/test_dspark_capped_graphs.py \
    test/registered/e2e/test_overlap_schedule.py \
    test/registered/e2e/test_dspark_plain_decode.py \
    test/registered/e2e/test_kernel_backend_e2e.py test/registered/e2e/test_prefill_graphs.py \
    2>&1 | tee "$OUT/graph_tests.txt" | tail -30
fi
if has engine; then
  timeout 420 python3 benchmark/bench_engine.py --config mid_910m --batch-sizes 1,8,32 --attention-backend triton --no-overlap-row \
    --out-dir "$OUT" 2>&1 | grep -v '"ids"' | tail -40
  cat "$OUT/engine.md" 2>/dev/null
fi
if has sweeps; then  # launch-shape sweeps (each candidate checked bit-identical first)
  timeout 240 python3 benchmark/kernels/sweep_launch.py --out "$OUT/sweep_launch.md" 2>&1 | tail -3
  timeout 240 python3 benchmark/kernels/sweep_router.py --out "$OUT/sweep_router.md" 2>&1 | tail -3
fi
if has prefill; then  # host vs device time of a prefill and of a decode step
  python3 benchmark/gpu/profile_prefill.py --out-dir "$OUT" 2>&1 | tail -3
fi
if has kbench; then
  python3 benchmark/kernels/run_all.py --out "$OUT/kernels.md" ${KBENCH_ONLY:+--only "$KBENCH_ONLY"} \
    2>&1 | tail -80
fi
