#!/usr/bin/env bash
# GPU check: one short wait-free round of SCD with ResNet-18 on synthetic CIFAR-shaped data, on
# this machine's GPU. Prints GM and PM step times (ms), the PM steps completed, the stream the PM
# ran on, whether the PM overlapped the upload, and whether moving the client's tensors to host
# memory and back (as a worker does for an idle client) freed device memory and let the PM train
# on; exits 0 when every check passed, 1 when one
# failed, 2 without CUDA, 124 when it ran past its limit. Takes well under 5 minutes: the Python
# part is stopped after 280 s.
#
#   bash benchmarks/gpu_check.sh                    # cuda (device 0)
#   bash benchmarks/gpu_check.sh --device cuda:1    # any flag of benchmarks/gpu_check.py
#   bash benchmarks/gpu_check.sh --json /tmp/gpu_check.json    # also keep the measurements
#   WAFL_PYTHON=/path/to/python bash benchmarks/gpu_check.sh   # a Python that already has wafl
#
# Without WAFL_PYTHON it uses the environment of scripts/venv.sh (see _limited.sh).
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/_limited.sh" gpu_check 280 benchmarks/gpu_check.py --device cuda "$@"
