#!/usr/bin/env bash
# Prints the path of a virtual environment with wafl's dependencies, creating it when missing.
# The environment lives outside the clone, keyed by the dependency list in pyproject.toml, so
# repeated runs (CI, developers) reuse it; a dependency change gives a fresh one.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
key=$(python3 - "$root/pyproject.toml" <<'PY'
import hashlib, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = sorted(p["dependencies"]) + sorted(p.get("optional-dependencies", {}).get("test", []))
print(hashlib.sha256("\n".join(deps).encode()).hexdigest()[:16])
PY
)
base=${WAFL_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/wafl}
venv="$base/venv-$key"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  mkdir -p "$base"
  # One creator at a time (others wait for it); a venv is built where it will live (its scripts name
  # their interpreter's path) and marked complete only once everything installed.
  exec 9>"$venv.lock"
  flock 9
  if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
    echo "creating $venv (first run installs torch, a few minutes)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip >&2
    (cd "$root" && "$venv/bin/pip" install --quiet -r <(python3 - pyproject.toml <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(p["dependencies"] + p.get("optional-dependencies", {}).get("test", [])))
PY
)) >&2
    touch "$venv/.complete"
  fi
  flock -u 9
fi
# The project itself: an editable install, cheap, always refreshed so the clone in use is the one imported.
"$venv/bin/pip" install --quiet --no-deps --no-build-isolation -e "$root" >&2
echo "$venv"
