#!/usr/bin/env bash
# Build (or reuse) the plugin's own virtualenv -- sglang 0.5.23 with its torch pin, this
# repository's sglang-dspark and the plugin, all from this checkout -- and run the plugin's
# contract tests in it. No GPU needed. The first build takes a few minutes.
#
#   bash plugins/sglang/run_contract_tests.sh [pytest args...]
#
# DSPARK_SGLANG_VENV: where the venv lives (default: ~/.cache/sglang-dspark/venv-sglang-0.5.23).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${DSPARK_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/sglang-dspark/venv-sglang-0.5.23}"
py="$venv/bin/python"
sglang_version="0.5.23"

want="$(cat "$here/requirements-sglang-cpu.txt" | sha256sum | cut -c1-16)-$sglang_version"
if [ ! -f "$venv/.installed" ] || [ "$(cat "$venv/.installed")" != "$want" ]; then
  echo "== building $venv (pinned packages, sglang $sglang_version)"
  test -x "$py" || python3 -m venv "$venv"
  "$py" -m pip install --quiet -r "$here/requirements-sglang-cpu.txt"
  # --no-deps: sglang's own list pulls GPU kernel packages the CPU contract does not import.
  "$py" -m pip install --quiet --no-deps "sglang==$sglang_version"
  echo "$want" > "$venv/.installed"
fi
# Always from this checkout (a venv built for another clone is repointed here).
echo "== installing sglang-dspark and the plugin from $repo"
"$py" -m pip install --quiet --no-deps -e "$repo"
"$py" -m pip install --quiet --no-deps -e "$here"

"$py" -c "import sglang, sgl_dspark, sgl_dspark_plugin; assert sglang.__version__ == '$sglang_version'"
cd "$here"
exec "$py" -m pytest -p no:cacheprovider -W ignore::DeprecationWarning tests "$@"
