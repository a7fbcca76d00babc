#!/usr/bin/env bash
# A/B of the engine benchmark in one device call: the same `bench_engine.py` command on a base
# tree and on this tree, alternating (base, head, base, head, ...), each run in its own process
# with its checkpoints deleted afterwards. Results land in $OUT/<side>_<round>/engine.md and
# engine.json; the environment in $OUT/env.txt.
#
#   bash benchmark/gpu/ab_engine.sh BASE_DIR ROUNDS [bench_engine.py args...]
#
# BASE_DIR holds the base tree's python/ and benchmark/ (e.g. `git archive <rev> python benchmark`
# unpacked into an ignored folder that the device call carries). Carry .whl for transformers.
set -u
OUT=${OUT:-/tmp/out}
BASE=$1
ROUNDS=$2
shift 2
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=""
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && SITE=/tmp/site
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "head: $(git log --oneline -1 2>/dev/null) ($(git status --short -- python benchmark | wc -l) changed files)"
  echo "base: $BASE"
  echo "args: $*"
} | tee "$OUT/env.txt"
for round in $(seq 1 "$ROUNDS"); do
  for side in base head; do
    root=$PWD
    [ "$side" = base ] && root=$(cd "$BASE" && pwd)
    dir="$OUT/${side}_${round}"
    mkdir -p "$dir"
    tmp=$(mktemp -d /tmp/ab_engine.XXXX)
    echo "== $side round $round"
    (cd "$root" && TMPDIR=$tmp PYTHONPATH=$root/python:$root${SITE:+:$SITE} \
      timeout 600 python3 benchmark/bench_engine.py "$@" --out-dir "$dir" 2>&1 \
      | grep -v '"ids"' | tail -5)
    rm -rf "$tmp"
  done
done
