#!/usr/bin/env bash
# The GPU model-step benchmark (issue 42) as one command, run from the repository root:
#
#     OUT=DIR bash benchmarks/gpu_step.sh [gpu_step.py options, e.g. --commit SHA]
#
# For a GPU machine without network where JAX, torch and timm are installed but Keras is not:
# Keras comes from the wheels in .whl/ (git-ignored; see benchmarks/gpu_step.py's docstring for
# the `pip download` that fills it), installed into /tmp/site when `keras` is not importable.
# TensorFlow is not needed. Runs benchmarks/gpu_step.py with a 450 s deadline into $OUT (results,
# case logs) and keeps its whole output in $OUT/gpu_step.log; the exit status is the script's.
# PYTHON (default python3) names the interpreter.
set -euo pipefail
: "${OUT:?set OUT to the folder for the results}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('keras') is None)"; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi -L || echo "nvidia-smi: no GPU listed"
PYTHONUNBUFFERED=1 "$PYTHON" benchmarks/gpu_step.py --out "$OUT" --deadline 450 "$@" 2>&1 \
  | tee "$OUT/gpu_step.log"
