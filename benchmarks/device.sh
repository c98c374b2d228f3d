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
#   bash benchmarks/device.sh all [SECONDS]  # there: both backends in one
#                                            # call, section by section
#
#   bash benchmarks/device.sh followup [SECONDS]  # there: what the first
#                                            # run left open (below)
#
# `all` is for a lease too short for two full runs (15 minutes of device
# time, the machine's start included). It runs, in this order, what is
# lost first at the deadline last: the optimizer steps of JAX, then of
# PyTorch (one round: each configuration in its own process, the median
# of KEO_BENCH_REPEATS steps); the fit steps of PyTorch, then of JAX
# (KEO_BENCH_ROUNDS=2 rounds, the averaged configurations beside their
# baselines in both orders); the peak memory of PyTorch, then of JAX;
# the host's cost per state array in JAX's fit step (benchmarks.host,
# to $OUT/jax-host.txt); the kernels of JAX's compiled fit step
# (benchmarks.kernels, to $OUT/jax-kernels.txt), then of its optimizer
# step alone with the bytes they move (benchmarks.kernels --step, to
# $OUT/jax-step-kernels.txt).
# Each section is a `python -m benchmarks` of its own whose results file
# is copied to $OUT as soon as it is written
# (<backend>-<section>-gpu-results.json). A section starts only with
# MIN_SECTION seconds (default 90) left of SECONDS (default 540), and is
# killed at that deadline: what finished comes back. Merge them here with
# --from-json.
#
# `followup` asks what the first GPU run left open, under the same
# deadline, each section's BENCH lines to $OUT/<section>.txt: JAX's step
# of optax + EMA, ours:ema and ours:swa (three rounds of a process each,
# in turn), their compiled steps' kernels and bytes, the host's cost per
# state array, JAX's fit over four rounds (ours, ours:ema, ours:swa,
# ours:ema_power), PyTorch's over four (ours, ours:ema_power, ours:ema).
# KEO_DEVICE_INSTALL=0 skips installing the carried wheels (a trial of the
# script here, with small KEO_BENCH_* sizes).
#
# The machine holds PyTorch, JAX, optax and matplotlib for Python 3.12, but
# no Keras, no torch-ema and no TensorFlow (whose GPU wheel is larger than
# what travels there): the GPU run covers JAX and PyTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl

setup() {  # there: the carried wheels, and what every run needs
    if [[ ${KEO_DEVICE_INSTALL:-1} != 0 ]]; then
        python3 -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
    fi
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    nvidia-smi -L || echo "no nvidia-smi: this run is not on a GPU"
}

# The sections of `all` and `followup`: each starts only with MIN_SECTION
# seconds left before $deadline and is killed at it; results go to $out.
starts() {  # name: whether a section may start; sets $left
    left=$(( deadline - $(date +%s) ))
    if (( left < ${MIN_SECTION:-90} )); then
        echo "[device] $1: not started, ${left} s left"
        return 1
    fi
    echo "[device] $1: started, ${left} s left"
}
section() {  # name, then the driver's arguments
    local name=$1
    shift
    starts "$name" || return 0
    rm -rf "/tmp/bench-$name"
    if timeout "$left" python3 -m benchmarks --out "/tmp/bench-$name" \
            "$@"; then
        for f in "/tmp/bench-$name"/*-results.json; do
            cp "$f" "$out/$name-$(basename "$f")"
        done
    else
        echo "[device] $name: failed or out of time (status $?)"
    fi
}
lines() {  # name, backend, then a benchmark module and its arguments:
    # its output appended to $out/<name>.txt
    local name=$1 backend=$2
    shift 2
    starts "$name" || return 0
    KERAS_BACKEND=$backend timeout "$left" python3 -m "$@" \
        >> "$out/$name.txt" ||
        echo "[device] $name: failed or out of time (status $?)"
}

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
    setup
    out=${OUT:-benchmarks/results/$backend}
    python3 -m benchmarks --backends "$backend" --out "$out"
    for f in "$out"/*-results.json; do
        mv "$f" "$out/$backend-$(basename "$f")"
    done
    ;;
all)
    deadline=$(( $(date +%s) + ${2:-540} ))
    setup
    out=${OUT:-benchmarks/results/device}
    mkdir -p "$out"
    for backend in jax torch; do
        section "$backend-step" --backends "$backend" --no-fit \
            --no-memory --step-rounds 1
    done
    for backend in torch jax; do
        KEO_BENCH_ROUNDS=2 section "$backend-fit" --backends "$backend" \
            --no-step --no-memory
    done
    for backend in torch jax; do
        section "$backend-memory" --backends "$backend" --no-step --no-fit
    done
    # What the host pays per state array in JAX's fit step (no kernel
    # at its size).
    KEO_BENCH_REPEATS=300 lines jax-host jax benchmarks.host
    # Last: the kernels of JAX's compiled fit step (no timing), then those
    # of the optimizer step alone with the bytes they move, SWA first (its
    # step was 1.32 of optax on the H200).
    lines jax-kernels jax benchmarks.kernels \
        --names keras,keras_ema,ours,ours:ema,ours:swa
    lines jax-step-kernels jax benchmarks.kernels --step \
        --names ours:swa,ours:ema,optax_ema,ours:ema_power,ours
    ls -l "$out"
    ;;
followup)
    # The questions the first GPU run left open, in order: why JAX's SWA
    # step took 1.32 of optax (three rounds of a process each for SWA, the
    # EMA and optax, in turn, then the kernels and bytes of their compiled
    # steps); what the host pays per state array; JAX's fit overhead over
    # four rounds (two did not resolve 10%), then PyTorch's power warm-up.
    deadline=$(( $(date +%s) + ${2:-540} ))
    setup
    out=${OUT:-benchmarks/results/device}
    mkdir -p "$out"
    for round in 1 2 3; do
        for name in optax_ema ours:ema ours:swa; do
            lines jax-swa-step jax benchmarks.step --names "$name"
        done
    done
    lines jax-swa-step-kernels jax benchmarks.kernels --step \
        --names ours:swa,ours:ema,optax_ema
    KEO_BENCH_REPEATS=300 lines jax-host jax benchmarks.host
    KEO_BENCH_ROUNDS=4 lines jax-fit-4-rounds jax benchmarks.fit \
        --names ours,ours:ema,ours:swa,ours:ema_power
    KEO_BENCH_ROUNDS=4 lines torch-fit-4-rounds torch benchmarks.fit \
        --names ours,ours:ema_power,ours:ema
    ls -l "$out"
    ;;
*)
    echo "usage: bash benchmarks/device.sh fetch | run jax|torch |" \
        "all [SECONDS] | followup [SECONDS]" >&2
    exit 2
    ;;
esac
