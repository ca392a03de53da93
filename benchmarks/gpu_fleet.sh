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
# Without WAFL_PYTHON it uses the environment of scripts/venv.sh (see _limited.sh).
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/_limited.sh" gpu_fleet 290 benchmarks/gpu_fleet.py "$@"
