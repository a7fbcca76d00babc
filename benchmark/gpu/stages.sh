# Stages, time limits and results of the one-call GPU scripts (sourced by them after they set
# DEFAULT_STAGES): `bash SCRIPT [--dry-run] [stage,stage,...]`.
#
# * Results: every command writes under $WORK (logs, tables; outside $OUT); after each command
#   $WORK is packed into $OUT/results.tgz and a line (exit status, seconds) is added to
#   $OUT/summary.md, which the stages also append their tables and test summaries to. The device
#   tool returns only a few files from $OUT: these two are all the scripts write there.
# * Time: the call has CALL_BUDGET seconds (default 570, under the 600 s a device command may
#   run); a stage gets its own budget, clipped to what the call has left; a command gets its own
#   limit, clipped to what its stage has left, and is skipped (a summary line says so) when less
#   than MIN_COMMAND_S remain. A command past its limit gets SIGINT (pytest prints the summary of
#   the tests run so far, Python unwinds) and SIGKILL 20 s later; what it wrote stays.
# * --dry-run: print each command with its limit and log, run nothing, write nothing.
# * LIMIT_SCALE (default 1) multiplies every budget and limit (a CPU run of a toy config).
set -u
OUT=${OUT:-/tmp/out}
LIMIT_SCALE=${LIMIT_SCALE:-1}
CALL_BUDGET=$((${CALL_BUDGET:-570} * LIMIT_SCALE))
MIN_COMMAND_S=${MIN_COMMAND_S:-30}
DRY_RUN=0
STAGES=""
for arg in "$@"; do
  case $arg in
    --dry-run) DRY_RUN=1 ;;
    -*) echo "unknown option $arg (usage: $0 [--dry-run] [stages])" >&2; exit 2 ;;
    *) STAGES=$arg ;;
  esac
done
STAGES=${STAGES:-$DEFAULT_STAGES}
WORK_ROOT=${WORK_ROOT:-/tmp/gpu_run}
WORK=$WORK_ROOT/work
CALL_START=$(date +%s)
STAGE_END=$((CALL_START + CALL_BUDGET))
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python:$PWD
if (( ! DRY_RUN )); then
  rm -rf "$WORK"
  mkdir -p "$WORK" "$OUT"
  : > "$OUT/summary.md"
  if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
fi

has() { [[ ",$STAGES," == *",$1,"* ]]; }
now() { date +%s; }

note() {  # a line of the summary (and of stdout)
  if (( DRY_RUN )); then echo "# $*"; else echo "$*" | tee -a "$OUT/summary.md"; fi
}

pack() {  # the work directory into $OUT/results.tgz, replaced only once complete
  (( DRY_RUN )) && return 0
  tar -czf "$WORK_ROOT/results.tgz" -C "$WORK_ROOT" work 2>/dev/null \
    && mv "$WORK_ROOT/results.tgz" "$OUT/results.tgz"
}

stage() {  # stage NAME BUDGET_S: starts a stage of at most BUDGET_S (and what the call has left)
  local call_end=$((CALL_START + CALL_BUDGET)) budget=$(($2 * LIMIT_SCALE)) t
  t=$(now)
  STAGE_END=$((t + budget))
  (( STAGE_END > call_end )) && STAGE_END=$call_end
  if (( DRY_RUN )); then
    echo "## stage $1: budget $budget s"
  else
    note "## $1 (at +$((t - CALL_START)) s, budget $((STAGE_END - t)) s)"
  fi
}

run() {  # run LIMIT_S LOG CMD...: CMD with stdout and stderr to $WORK/LOG, within LIMIT_S
  local limit=$(($1 * LIMIT_SCALE)) log=$2 t left rc
  shift 2
  if (( DRY_RUN )); then
    local arg line="timeout $limit"
    for arg in "$@"; do
      if [[ $arg =~ ^[A-Za-z0-9_./:,=@%+-]+$ ]]; then
        line+=" $arg"
      elif [[ $arg != *"'"* ]]; then
        line+=" '$arg'"
      else
        line+=" $(printf '%q' "$arg")"
      fi
    done
    echo "$line > $WORK/$log"
    return 0
  fi
  t=$(now)
  left=$((STAGE_END - t))
  (( left < limit )) && limit=$left
  if (( limit < MIN_COMMAND_S )); then
    note "- $log: skipped, $left s left in the stage"
    return 0
  fi
  mkdir -p "$(dirname "$WORK/$log")"
  timeout -s INT -k 20 "$limit" "$@" > "$WORK/$log" 2>&1
  rc=$?
  local why=""
  (( rc == 124 || rc == 137 )) && why=" (stopped at its ${limit} s limit)"
  note "- $log: exit $rc after $(($(now) - t)) s$why"
  pack
  return 0
}

show() {  # show FILE [TAIL_LINES]: a file (or its tail) into the summary and stdout
  (( DRY_RUN )) && return 0
  if [ -f "$1" ]; then
    { echo; echo '```'; if [ $# -gt 1 ]; then tail -n "$2" "$1"; else cat "$1"; fi; echo '```'; } \
      | tee -a "$OUT/summary.md"
  else
    note "- (no $(basename "$1"))"
  fi
}

abba() {  # abba STAGE BASE_DIR ROUND_FN: ROUND_FN ROUND SIDE ROOT for the sides base, head,
  # head, base (ROOT: BASE_DIR's absolute path for base, the working tree for head); a missing
  # BASE_DIR is noted and runs nothing
  local base_tree root round=0 side
  base_tree=$(cd "$2" 2>/dev/null && pwd)
  if [ -z "$base_tree" ]; then
    note "- $1: no base tree at $2"
    return 0
  fi
  for side in base head head base; do
    round=$((round + 1))
    root=$PWD
    [ "$side" = base ] && root=$base_tree
    "$3" "$round" "$side" "$root"
  done
}

env_stage() {  # device, versions and tree
  stage env 30
  (( DRY_RUN )) && { echo "nvidia-smi; python3 -c 'import torch, triton'; git log -1"; return 0; }
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    echo "commit $(git log --oneline -1 2>/dev/null) ($(git status --short -- python benchmark test 2>/dev/null | wc -l) changed files)"
  } > "$WORK/env.txt" 2>&1
  show "$WORK/env.txt"
  pack
}
