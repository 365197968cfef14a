#!/usr/bin/env bash
# The GPU check as it runs on a lent GPU machine, from the repository root:
#
#   bash bench/gpu_check.sh [--only SECTION,...]
#
# That machine's python3 has torch 2.11 (CUDA 13), transformers 5.x, safetensors, rich, tensorboard, numpy and
# pytest: nothing needs to be brought along or installed, and plait is imported from src/ by path. The check
# takes about five minutes (each section has its own limit in bench/gpu_check.py); the outer limit leaves room
# for a slow start. The JSON lands in $OUT/gpu_check.json ($OUT is the device tool's folder that comes back;
# bench/results/ when it is unset); copy it to bench/results/gpu_check-<date>-<gpu>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# torchao for the fp8 section (--only fp8): that machine has no package index, so a wheel carried in bench/wheels/
if compgen -G "bench/wheels/torchao-*.whl" > /dev/null; then
  python3 -m pip install -q --no-deps --target /tmp/plait-wheels bench/wheels/torchao-*.whl
  export PYTHONPATH=/tmp/plait-wheels${PYTHONPATH:+:$PYTHONPATH}
fi
timeout 570 python3 bench/gpu_check.py --device cuda --out "$OUT" "$@"
