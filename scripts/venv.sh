#!/usr/bin/env bash
# Prints the path of this checkout's virtual environment, creating what is missing.
#
# Two layers, so that no checkout ever imports another one's code:
# - the dependencies (PyTorch, gRPC, the test tools: gigabytes, minutes to install) live once outside
#   the clone, keyed by the dependency list in pyproject.toml, and hold no wafl at all; every checkout
#   and CI reuses them, a dependency change gives a fresh one;
# - the checkout's own environment, <clone>/.venv (ignored by git, a few kilobytes), sees those
#   dependencies through a .pth file and holds the editable install of this checkout alone, with the
#   dependencies' console scripts (pytest, mypy, lint-imports, mkdocs, ...) re-pointed at its own
#   interpreter. Two clones at different commits, or a frozen worktree running a long sweep beside a
#   clone being edited, each run their own code (tests/test_checkouts.py).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
key=$(python3 - "$root/pyproject.toml" <<'PY'
import hashlib, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = sorted(p["dependencies"]) + sorted(p.get("optional-dependencies", {}).get("test", []))
# "deps-only": the layout in which the shared environment holds no wafl (a new key, so that no earlier
# environment whose site-packages still points at some checkout's code is ever reused)
print(hashlib.sha256("\n".join(["deps-only", *deps]).encode()).hexdigest()[:16])
PY
)
base=${WAFL_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/wafl}
deps="$base/deps-$key"
if [ ! -x "$deps/bin/python" ] || [ ! -f "$deps/.complete" ]; then
  mkdir -p "$base"
  # One creator at a time (others wait for it); an environment is built where it will live (its scripts
  # name their interpreter's path) and marked complete only once everything installed.
  exec 9>"$deps.lock"
  flock 9
  if [ ! -x "$deps/bin/python" ] || [ ! -f "$deps/.complete" ]; then
    echo "creating $deps (first run installs torch, a few minutes)" >&2
    rm -rf "$deps"
    python3 -m venv "$deps"
    "$deps/bin/pip" install --quiet --upgrade pip >&2
    (cd "$root" && "$deps/bin/pip" install --quiet -r <(python3 - pyproject.toml <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(p["dependencies"] + p.get("optional-dependencies", {}).get("test", [])))
PY
)) >&2
    touch "$deps/.complete"
  fi
  flock -u 9
fi

venv="$root/.venv"
site="lib/python3.$(python3 -c 'import sys; print(sys.version_info[1])')/site-packages"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.deps" 2>/dev/null)" != "$deps" ]; then
  rm -rf "$venv"
  python3 -m venv --without-pip "$venv"
  # addsitedir (not a bare path line) so that the dependencies' own .pth files are read too
  echo "import site; site.addsitedir('$deps/$site')" > "$venv/$site/_wafl_deps.pth"
  # the dependencies' console scripts, run by this checkout's interpreter; binaries (ruff) as links
  for script in "$deps"/bin/*; do
    name=$(basename "$script")
    case "$name" in python | python3 | python3.* | pip | pip3 | pip3.* | activate* | Activate.ps1 | wafl) continue ;; esac
    if head -c 64 "$script" | head -1 | grep -q "^#!$deps/bin/python"; then
      { echo "#!$venv/bin/python"; tail -n +2 "$script"; } > "$venv/bin/$name"
      chmod +x "$venv/bin/$name"
    else
      ln -s "$script" "$venv/bin/$name"
    fi
  done
  echo "$deps" > "$venv/.deps"
fi
# The project itself: an editable install into this checkout's environment only, cheap, always refreshed.
"$deps/bin/pip" --python "$venv/bin/python" install --quiet --no-deps --no-build-isolation -e "$root" >&2
echo "$venv"
