#!/usr/bin/env bash
# A prepared check of echorl on one GPU: no internet, models built on the spot, under 5 minutes.
# torch CUDA sampling vs the learner's CPU log-probs, the vLLM engine if importable (sampling,
# in-place update, agreement), the apply latency, and a learner + 2 nodes demo on the device.
# Prints one summary JSON line; the exit status is 1 if a step failed.
#
#   scripts/gpu-check.sh                          # cuda
#   scripts/gpu-check.sh --device cpu --small     # every step but vLLM, on the CPU (tests the script)
#   scripts/gpu-check.sh --out summary.json --steps 30
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
exec timeout "${GPU_CHECK_TIMEOUT:-290}" "$PY" scripts/gpu_check.py "$@"
