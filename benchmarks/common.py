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


def _chunked(pool, workers, fn, *arrays):
    """Run ``fn`` over ``workers`` equal slices of ``arrays`` at once."""
    n = arrays[0].size
    bounds = np.linspace(0, n, workers + 1).astype(int)
    chunks = [[a[lo:hi] for a in arrays]
              for lo, hi in zip(bounds[:-1], bounds[1:])]
    return lambda: list(pool.map(lambda c: fn(*c), chunks))


def stream_bandwidths(megabytes=BANDWIDTH_MB, repeats=7):
    """Bytes per second of three streams over every core, each the best of
    ``repeats``, as ``{kind: bytes/s}``:

    - ``copy``: ``dst[:] = src``, counted as 2 floats an element moved
      (read + write). The destination is not read by the program, but the
      CPU reads each of its cache lines before writing it (write-allocate),
      so the memory moves 3: this undercounts what the machine sustains.
    - ``scale``: ``x *= 1`` in place, 2 floats (read, write back), as an
      optimizer's in-place update of a tensor moves them.
    - ``add``: ``x += y`` in place, 3 floats.

    The in-place streams are the roofline's kind of traffic: an Adam step
    reads each tensor it writes. Their best is the machine's bandwidth for
    such an update, not the copy's (the copy alone gave 27 GB/s on this
    project's 2-core machine, where PyTorch's fused Adam step moved 42 GB/s
    of the bytes it must move, and the in-place streams about 50)."""
    from concurrent.futures import ThreadPoolExecutor

    n = megabytes * (1 << 20) // 4
    x = np.ones(n, np.float32)
    y = np.ones(n, np.float32)
    workers = os.cpu_count() or 1
    kinds = {"copy": (2, lambda a, b: np.copyto(b, a)),
             "scale": (2, lambda a, b: np.multiply(a, 1.0, out=a)),
             "add": (3, lambda a, b: np.add(a, b, out=a))}
    out = {}
    with ThreadPoolExecutor(workers) as pool:
        for kind, (floats, fn) in kinds.items():
            run = _chunked(pool, workers, fn, x, y)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - start)
            out[kind] = floats * 4 * n / best
    return out


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


# glibc's mallopt parameters (malloc.h) and the values ``steady_heap`` sets,
# the mmap threshold first: setting any of them freezes it (at 128 kB, where
# not set), and 32 MiB, the most glibc takes (half a heap), keeps a step's
# temporaries in the arenas. A top pad of a whole heap (64 MiB) keeps glibc
# from unmapping any heap; the trim threshold keeps the main arena's top.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
STEADY_HEAP = ((M_MMAP_THRESHOLD, 32 << 20), (M_TOP_PAD, 64 << 20),
               (M_TRIM_THRESHOLD, 1 << 30))


def glibc():
    """Whether this process runs on glibc."""
    import platform

    try:
        return platform.libc_ver()[0] == "glibc"
    except (OSError, ValueError):
        return False


def steady_heap():
    """Keep the heap memory a step frees for the next step (glibc), instead
    of returning it to the system. Returns how the heap runs: ``"steady"``;
    ``"default"`` where that is not asked for (``KEO_BENCH_DEFAULT_HEAP=1``),
    this is not glibc, or glibc refuses the mmap threshold (nothing else is
    set then); ``"partial"`` where it took the threshold and refused the
    rest.

    XLA's CPU worker threads take a step's temporaries (about 17 MB in the
    fit benchmark's JAX step: the gradients and activations) from glibc's
    per-thread arenas. Where an arena's heap has too little room left for
    them, glibc maps a new 64 MB heap and, once they are freed, unmaps it
    again (the whole heap: only the top pad keeps it), each step: about
    4,150 page faults a batch and a step 35% slower, for a whole ``fit()``.
    Which ``fit()`` falls into it depends on where earlier ones left the
    arenas, not on its optimizer: on this project's 2-core machine, 3 of
    20 fits of ours without an average and with the power warm-up, in turn
    in one process, and none of 24 with this (docs/performance.md, "Fits
    that fault their step's temporaries in")."""
    import ctypes

    if os.environ.get("KEO_BENCH_DEFAULT_HEAP") == "1" or not glibc():
        return "default"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "default"
    first, *rest = STEADY_HEAP
    if not mallopt(*first):
        return "default"
    return "steady" if all([mallopt(*pair) for pair in rest]) else "partial"


def markdown_table(header, rows):
    """A markdown table of ``header`` (cells) and ``rows`` (lists of
    cells, each turned to text)."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |"
              for row in rows]
    return "\n".join(lines)


def summary(doc):
    """The first paragraph of a module's docstring on one line: its
    command's ``--help`` description."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def comma_list(parser, option, value, accepted):
    """The names of a comma-separated ``value`` of ``option``; the parser's
    error (exit 2) names any not in ``accepted``, and what is."""
    names = [n for n in value.split(",") if n]
    unknown = [n for n in names if n not in accepted]
    if unknown:
        parser.error(f"{option}: unknown {', '.join(unknown)}; accepted: "
                     f"{', '.join(accepted)}")
    return names


def emit(result):
    """One JSON line on stdout, for the driver."""
    print("BENCH " + json.dumps(result), flush=True)
