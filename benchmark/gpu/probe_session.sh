# This session's device calls: A = compiled tests of the changed kernels + the graph/DSpark
# equality tests + the #5 kernel table; B = the engine benchmark; C = the kernel table + the
# changed kernels' compiled tests again (A's were cut by their time limits).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/python:$PWD:/tmp/site
mkdir -p $OUT/r
finish() { cd $OUT && tar czf all.tgz r && rm -rf r; }
trap finish EXIT
if [ "$1" = A ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 test/registered/kernels/test_rmsnorm.py \
    test/registered/kernels/test_moe_reduce.py test/registered/kernels/test_activation.py \
    test/registered/kernels/test_draft_attention.py test/registered/unit/test_norm_family.py \
    test/registered/e2e/test_moe_backend.py test/registered/unit/test_draft_attention_backend.py 2>&1 | tail -4 | tee $OUT/r/kernel_tests.txt
  timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 test/registered/e2e/test_cuda_graph_runner.py \
    test/registered/e2e/test_dspark_plain_decode.py test/registered/e2e/test_overlap_schedule.py 2>&1 | tail -4 | tee $OUT/r/graph_tests.txt
  timeout 200 python3 benchmark/kernels/run_all.py --only "rmsnorm,K4 moe_reduce,K6 silu_mul_clamp shared,router_topk from x,k7_mhc_post_combine_norm_bf16_hc4" --out $OUT/r/kernels.md 2>&1 | tail -3
fi
if [ "$1" = B ]; then
  timeout 560 python3 benchmark/bench_engine.py --config mid_910m --batch-sizes 1,8,32 --attention-backend triton \
    --static-cases 1:4,1:3,32:3 --out-dir $OUT/r 2>&1 | grep -v '"ids"' | tail -30
fi
if [ "$1" = C ]; then
  timeout 230 python3 benchmark/kernels/run_all.py --only "rmsnorm_hidden,rmsnorm_q_lora,K4 moe_reduce,K6 silu_mul_clamp shared,router_topk from x" --out $OUT/r/kernels.md > $OUT/r/run_all.log 2>&1
  timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 test/registered/kernels/test_rmsnorm.py \
    test/registered/kernels/test_moe_reduce.py test/registered/kernels/test_activation.py 2>&1 | tail -3 | tee $OUT/r/kernel_tests.txt
fi
