#!/usr/bin/env bash
# Run SGLang's own clients (bench_serving, few_shot_gsm8k), lm-eval and the openai client
# against the tiny server: test/clients/test_sglang_clients.py. No GPU, nothing downloaded at
# test time.
#
#   bash test/clients/run_client_tests.sh [pytest args...]
#
# The clients live in the SGLang plugin's virtualenv (sglang 0.5.23 pins torch 2.14.1, which
# conflicts with ours): plugins/sglang/run_contract_tests.sh's recipe builds it, then the pinned
# client packages of requirements-clients.txt are added (constrained to the plugin's pins). The
# server and pytest run from this repository's .venv (`make install`).
#
# DSPARK_SGLANG_VENV: where that venv lives (default: ~/.cache/sglang-dspark/venv-sglang-0.5.23).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
plugin="$repo/plugins/sglang"
venv="${DSPARK_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/sglang-dspark/venv-sglang-0.5.23}"
py="$venv/bin/python"
sglang_version="0.5.23"

want="$(cat "$plugin/requirements-sglang-cpu.txt" | sha256sum | cut -c1-16)-$sglang_version"
if [ ! -f "$venv/.installed" ] || [ "$(cat "$venv/.installed")" != "$want" ]; then
  echo "== building $venv (pinned packages, sglang $sglang_version)"
  test -x "$py" || python3 -m venv "$venv"
  "$py" -m pip install --quiet -r "$plugin/requirements-sglang-cpu.txt"
  "$py" -m pip install --quiet --no-deps "sglang==$sglang_version"
  echo "$want" > "$venv/.installed"
fi
clients="$(cat "$here/requirements-clients.txt" | sha256sum | cut -c1-16)"
if [ ! -f "$venv/.clients" ] || [ "$(cat "$venv/.clients")" != "$clients" ]; then
  echo "== adding the pinned clients to $venv"
  "$py" -m pip install --quiet -r "$here/requirements-clients.txt" \
    -c "$plugin/requirements-sglang-cpu.txt"
  echo "$clients" > "$venv/.clients"
fi
"$py" -c "import sglang, lm_eval, datasets, openai; assert sglang.__version__ == '$sglang_version'"

cd "$repo"
test -x .venv/bin/python || make install
export DSPARK_CLIENTS_PYTHON="$py"
exec .venv/bin/python -m pytest -p no:cacheprovider -n 0 test/clients "$@"
