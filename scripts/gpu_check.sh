#!/usr/bin/env bash
# One short check of VCGA's nccl plugin on a machine with an NVIDIA GPU: probe, capability table,
# topology, Accelerator, ProcessGroupNCCL, the `vcga` group and a mixed CUDA + simulated world.
# Prints a PASS/FAIL/SKIP table; steps that need a GPU (or a feature not in this checkout) SKIP.
# Exit status: 1 if any step failed, else 0. See docs/gpu-check.md.
#
#   scripts/gpu_check.sh [--json results.json]
#   PYTHON=/path/to/python scripts/gpu_check.sh      # a Python with CUDA torch and vcga installed
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec timeout --kill-after=10 900 "$PYTHON" scripts/gpu_check.py "$@"
