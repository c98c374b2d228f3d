#!/usr/bin/env bash
# The GPU run of the benchmarks, on a lent device machine (see
# docs/performance.md, "On a GPU").
#
#   bash benchmarks/device.sh fetch          # here: wheels the machine lacks
#   bash benchmarks/device.sh run jax        # there: one backend per call
#   bash benchmarks/device.sh run torch
#   python -m benchmarks --from-json jax-gpu-results.json \
#       torch-gpu-results.json                 # here: gpu-* files
#
# The machine holds PyTorch, JAX, optax and matplotlib for Python 3.12, but
# no Keras, no torch-ema and no TensorFlow (whose GPU wheel is larger than
# what travels there): the GPU run covers JAX and PyTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
case "${1:-}" in
fetch)
    mkdir -p "$WHEELS"
    python3 -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" keras==3.15.1 namex==0.1.0 optree==0.20.0 torch-ema==0.3
    ls "$WHEELS"
    ;;
run)
    backend=${2:?"run needs a backend: jax or torch"}
    python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    out=${OUT:-benchmarks/results/$backend}
    nvidia-smi -L || echo "no nvidia-smi: this run is not on a GPU"
    python3 -m benchmarks --backends "$backend" --out "$out"
    for f in "$out"/*-results.json; do
        mv "$f" "$out/$backend-$(basename "$f")"
    done
    ;;
*)
    echo "usage: bash benchmarks/device.sh fetch | run jax|torch" >&2
    exit 2
    ;;
esac
