#!/usr/bin/env bash
# The type check: mypy over wafl.common, wafl.server, wafl.client and wafl.cli with pyproject.toml's [tool.mypy].
# The repository keeps the package's folders at the top level (common/, server/, ...), which the installed package
# maps to wafl.common, wafl.server, ...; mypy reads source files by module name, so this lays out
# build/api-src/wafl/ as links to those folders (the same layout docs/hooks.py makes for the API reference).
# Usage: scripts/typecheck.sh [PYTHON]   (PYTHON defaults to python3; extra mypy arguments after it)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${1:-python3}"
shift || true
PACKAGE="$ROOT/build/api-src/wafl"
mkdir -p "$PACKAGE"
[ -f "$PACKAGE/__init__.py" ] || echo '"""wafl: wait-free federated learning over gRPC."""' > "$PACKAGE/__init__.py"
for name in common server client cli; do
    [ -L "$PACKAGE/$name" ] || ln -s "$ROOT/$name" "$PACKAGE/$name"
done
cd "$ROOT/build/api-src"
exec "$PYTHON" -m mypy --config-file "$ROOT/pyproject.toml" \
    -p wafl.common -p wafl.server -p wafl.client -p wafl.cli "$@"
