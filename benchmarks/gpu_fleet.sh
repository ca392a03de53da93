#!/usr/bin/env bash
# GPU fleet: 100 logical clients training ResNet-18 on generated CIFAR-10-sized data, in 4 worker
# processes (4 training slots each) on this machine's GPU, 3 rounds. Prints and saves the round time,
# rounds per hour, the GPU's peak memory and mean utilization, and how many clients' tensors were
# on the GPU at once (benchmarks/results/gpu/gpu_fleet.json and .md). Exits 0 when the run finished
# its rounds, 1 when it did not, 2 without CUDA (nothing measured), 124 past its limit: the Python
# part is stopped after 290 s, so the whole check takes under 5 minutes.
#
#   bash benchmarks/gpu_fleet.sh                          # cuda (device 0)
#   bash benchmarks/gpu_fleet.sh --workers 2 --slots 8    # any flag of benchmarks/gpu_fleet.py
#   WAFL_PYTHON=/path/to/python bash benchmarks/gpu_fleet.sh   # a Python that already has wafl
#
# Without WAFL_PYTHON it uses the environment of scripts/venv.sh (created on first use, which
# needs the package index; an existing one is reused, then only the editable install is refreshed).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${WAFL_PYTHON:-}" ]; then
  py=$WAFL_PYTHON
else
  venv=$(bash "$root/scripts/venv.sh")
  py="$venv/bin/python"
fi
cd "$root"
set +e
PYTHONUNBUFFERED=1 timeout --kill-after=10 290 "$py" benchmarks/gpu_fleet.py "$@"
rc=$?
set -e
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "gpu_fleet: stopped after 290 s (limit); see the lines above for how far it got" >&2
fi
exit "$rc"
