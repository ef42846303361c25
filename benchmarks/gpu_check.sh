#!/usr/bin/env bash
# The segflow GPU check, one command (installs nothing; needs torch, onnx, onnxruntime):
#   correctness of every built-in model on CUDA vs onnxruntime, then ResNet-50 b1/b32,
#   BERT-base b1 and the MLP chain in nobulk/stream, bulk/stream, bulk/event and
#   bulk/event+graphs against onnxruntime (CUDA, with and without CUDA graphs) and
#   PyTorch eager. Prints one table; writes $OUT/gpu_check.json when $OUT is set.
# Usage: benchmarks/gpu_check.sh [--dry-run] [gpu_check.py options]
# The whole check stays under 8 minutes: rows stop starting after --budget-s (450 s)
# and a hard timeout ends it at 475 s (partial JSON is written after each workload).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec timeout 475 python benchmarks/gpu_check.py "$@"
