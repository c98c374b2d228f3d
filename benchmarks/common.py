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


# glibc's mallopt parameters (malloc.h) and the values ``steady_heap`` sets.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
STEADY_HEAP = {M_TOP_PAD: 64 << 20, M_TRIM_THRESHOLD: 1 << 30,
               M_MMAP_THRESHOLD: 32 << 20}


def steady_heap():
    """Keep freed heap memory in this process (glibc): what ``fit()``'s
    steps free, the next step takes again without faulting it in. Returns
    how the heap runs: ``"steady"``, or ``"default"`` where that is not
    asked for (``KEO_BENCH_DEFAULT_HEAP=1``) or this is not glibc.

    XLA's CPU worker threads take a step's temporaries (about 17 MB in
    the fit benchmark's JAX step: the gradients and activations) from
    glibc's per-thread arenas. Where an arena's heap has too little room
    left, glibc maps a new 64 MB heap for them and, once they are freed,
    unmaps it again (the whole heap: no trim threshold applies), each
    step: 4,150 page faults a batch and a step 35% slower, for a whole
    ``fit()``. Which ``fit()`` falls into it depends on where earlier ones
    left the arenas, not on its optimizer: on this project's 2-core
    machine, 2 or 3 in 12 of ours without an average and as many with
    one. A large top pad keeps a heap glibc would unmap, a large trim
    threshold the free memory at a heap's top, and a fixed mmap threshold
    keeps glibc from moving it (it moves with the sizes freed)."""
    import ctypes
    import ctypes.util

    if os.environ.get("KEO_BENCH_DEFAULT_HEAP") == "1":
        return "default"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return "default"
    ok = [mallopt(param, value) for param, value in STEADY_HEAP.items()]
    return "steady" if all(ok) else "default"


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
