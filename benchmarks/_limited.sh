#!/usr/bin/env bash
# Runs one of this folder's Python scripts with wafl's environment, stopped after a time limit
# (shared by gpu_check.sh and gpu_fleet.sh):
#
#   bash benchmarks/_limited.sh NAME LIMIT_S SCRIPT [ARGS...]
#
# WAFL_PYTHON: a Python that already has wafl; without it, the environment of scripts/venv.sh
# (created on first use, which needs the package index; an existing one is reused, then only the
# editable install is refreshed). Exits with the script's code, 124 when it ran past LIMIT_S.
set -euo pipefail
name=$1 limit=$2 script=$3
shift 3
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${WAFL_PYTHON:-}" ]; then
  py=$WAFL_PYTHON
else
  venv=$(bash "$root/scripts/venv.sh")
  py="$venv/bin/python"
fi
cd "$root"
set +e
PYTHONUNBUFFERED=1 timeout --kill-after=10 "$limit" "$py" "$script" "$@"
rc=$?
set -e
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "$name: stopped after $limit s (limit); see the lines above for how far it got" >&2
fi
exit "$rc"
