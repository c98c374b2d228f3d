"""Timing, problem sizes and the measured machine bandwidth, shared by the
per-backend benchmark modules (no framework imports here)."""

import json
import os
import statistics
import time

import numpy as np

# The problem of the performance issue; the environment can shrink it
# (the smoke test of the benchmarks does).
N_TENSORS = int(os.environ.get("KEO_BENCH_TENSORS", 200))
SIZE = int(os.environ.get("KEO_BENCH_SIZE", 50_000))
WARMUP = 5
REPEATS = int(os.environ.get("KEO_BENCH_REPEATS", 50))


def median_time(step, sync, warmup=WARMUP, repeats=REPEATS):
    """Median seconds of ``step()`` over ``repeats`` calls after
    ``warmup`` (``sync()`` waits for the device after each)."""
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


BANDWIDTH_MB = int(os.environ.get("KEO_BENCH_BANDWIDTH_MB", 256))


def copy_bandwidth(megabytes=BANDWIDTH_MB, repeats=7):
    """Bytes per second (read + write) of a large copy split over every
    core, the best of ``repeats``: the machine's memory bandwidth, the
    roofline of an update that streams its tensors."""
    from concurrent.futures import ThreadPoolExecutor

    n = megabytes * (1 << 20) // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    workers = os.cpu_count() or 1
    bounds = np.linspace(0, n, workers + 1).astype(int)
    chunks = [(dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    best = float("inf")
    with ThreadPoolExecutor(workers) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(lambda c: np.copyto(*c), chunks))
            best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def adam_bytes(n_elements, averages=1, itemsize=4):
    """Bytes an Adam step with ``averages`` averages must move: the update
    reads g, m, v, w and writes m, v, w; each average reads itself (the new
    weight can stay in registers when fused) and writes itself."""
    return n_elements * itemsize * (7 + 2 * averages)


def peak_rss_bytes():
    """Peak resident memory of this process so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def emit(result):
    """One JSON line on stdout, for the driver."""
    print("BENCH " + json.dumps(result), flush=True)
