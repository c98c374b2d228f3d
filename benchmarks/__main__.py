"""Run the benchmarks on every backend, side by side with the peers, and
write ``benchmarks/results/<device>-results.json``, ``<device>-table.md``
and ``<device>-plot.png``.

    python -m benchmarks [--backends jax,tensorflow,torch] [--out DIR]
                         [--no-step] [--no-fit] [--no-memory]
                         [--step-rounds N]
    keras-ema-opt bench ...          (the same, from a source checkout)

Each backend runs in fresh processes (``KERAS_BACKEND`` is read once per
process). The optimizer step of each configuration runs in a process of
its own, the configurations taking turns for ``--step-rounds`` rounds
(3), and its time is the median over the rounds; memory is measured in
one process per configuration. The table gives medians and their ratios
against the peers of the same run, and checks them against the bounds of
the project's performance issue.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common

ROOT = Path(__file__).resolve().parent.parent
# Rounds of the optimizer-step processes (each configuration once a round).
STEP_ROUNDS = int(os.environ.get("KEO_BENCH_STEP_ROUNDS", 3))
BACKENDS = ("jax", "tensorflow", "torch")

# The configurations whose peak memory is measured, per backend.
MEMORY = {
    "jax": ("keras_ema", "ours:ema", "ours:powerema", "optax_ema"),
    "tensorflow": ("keras_ema", "ours:ema", "ours:powerema", "tf_keras_ema"),
    "torch": ("keras_ema", "ours:ema", "ours:powerema", "torch_adam+lerp"),
}
# The peers ours is held to, with the bound on ours / peer (the first is
# the peer of the tables); the peer of a strategy keeping k averages is
# scaled by the bytes they move. On TensorFlow the peer is tf_keras
# `Adam(use_ema=True, jit_compile=True)` as tf_keras runs it (without a GPU
# it turns its own XLA off), and ours is also held to the same step forced
# under XLA, as ours runs: the comparison under equal compilation.
BOUNDS = {
    "torch": (("torch_adam+lerp", 1.15),),
    "jax": (("optax_ema", 1.10),),
    "tensorflow": (("tf_keras_ema", 0.85), ("tf_keras_ema_xla", 0.85)),
}
# The share of the roofline an Adam + EMA step must reach, per backend.
ROOFLINE_SHARE = {"jax": 0.70, "tensorflow": 0.70}
# A configuration may reach more than the streams measured (they
# undercount), but not by much: past this, a step that returned before its
# work was done, or a stream measured in a slow moment, is suspected.
ROOFLINE_TRUST = 1.3


def _run(module, backend, *args, timeout=1800, **variables):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONHASHSEED="0", **variables)
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{module} on {backend} failed:\n"
                           f"{proc.stderr[-3000:]}")
    return [json.loads(line[6:]) for line in proc.stdout.splitlines()
            if line.startswith("BENCH ")]


def _names(backend):
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.step", "--list"], cwd=ROOT,
        env=dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True, text=True, timeout=600, check=True)
    return out.stdout.split()


def device_kind():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                             text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return "gpu"
    except (OSError, subprocess.SubprocessError):
        pass
    return "cpu"


def step_schedule(names, round_index):
    """The order of the step configurations' processes in one round:
    forward in even rounds, backward in odd ones, so that no configuration
    always runs right after the same neighbour or at the same point of a
    drift of the machine."""
    names = list(names)
    return names if round_index % 2 == 0 else names[::-1]


def merge_step_rounds(records):
    """One step record from a configuration's records of several rounds:
    the median of the rounds' medians (``rounds``, in order). Each process
    measures its best stream anew (``round_bandwidths``, from which
    ``roofline_bandwidth`` takes the run's median); the record keeps the
    bandwidth of its best round."""
    if not records:
        raise ValueError("merge_step_rounds: no records to merge")
    names = {(r["bench"], r["backend"], r["name"]) for r in records}
    if len(names) != 1:
        raise ValueError("merge_step_rounds: records of different "
                         f"configurations: {sorted(names)}")
    merged = dict(records[0])
    merged["rounds"] = [r["seconds"] for r in records]
    merged["round_bandwidths"] = [r["bandwidth"] for r in records]
    merged["seconds"] = statistics.median(merged["rounds"])
    best = max(records, key=lambda r: r["bandwidth"])
    for key in ("bandwidth", "bandwidths", "roofline_seconds"):
        if key in best:
            merged[key] = best[key]
    return merged


def step_bytes(r):
    """The bytes a step record's configuration must move (recorded, or its
    roofline at the bandwidth it was measured with)."""
    return r.get("bytes") or r["roofline_seconds"] * r["bandwidth"]


def _run_steps(results, run):
    return [r for r in results
            if r["bench"] == "step" and r.get("run") == run]


def _measured(steps):
    """(bytes/s, where from): the median over the run's step processes of
    the best stream each measured (``round_bandwidths``, one a process).
    The streams of one machine are bimodal where its cache is shared with
    other tenants (about 52 or 75-95 GB/s for numpy's in-place scale over
    256 MB on this project's 2-core machine, in one run): the roofline is
    what the machine sustains, not its luckiest moment, as a step's time is
    the median of its rounds."""
    values = [b for r in steps
              for b in r.get("round_bandwidths") or [r["bandwidth"]]]
    if not values:
        return 0.0, "none"
    return (statistics.median(values),
            f"measured: median of {len(values)} processes' best stream")


def roofline_bandwidth(results, run=None):
    """(bytes/s, where from) of the roofline of one run (the ``run`` of
    its records; merged files keep theirs apart, as each ran on a machine
    of its own): the streams its step processes measured (``_measured``),
    or what a configuration reached (the bytes it must move over its
    step time) where that is more. A configuration faster than the
    streams' roofline shows that the machine sustains more than the
    streams saw: the roofline must be a bound no step beats, so it takes
    the faster rate (``checks`` flags one past ``ROOFLINE_TRUST`` times the
    streams)."""
    steps = _run_steps(results, run)
    best = _measured(steps)
    for r in steps:
        reached = step_bytes(r) / r["seconds"]
        if reached > best[0]:
            best = (reached, f"reached: {r['backend']} {r['name']}")
    return best


def roofline_seconds(r, results):
    return step_bytes(r) / roofline_bandwidth(results, r.get("run"))[0]


def collect(backends, fit=True, memory=True, say=print,
            step_rounds=STEP_ROUNDS, step=True):
    results = []
    for backend in backends:
        # One fresh process per configuration: no configuration runs in
        # memory, caches or allocator pools another one left behind. The
        # configurations take turns, STEP_ROUNDS times over (see
        # step_schedule): a slow spell of the machine or one slow process
        # falls on one round of one configuration, not on its median.
        names = _names(backend) if step else []
        runs = {name: [] for name in names}
        for r in range(step_rounds):
            for name in step_schedule(names, r):
                say(f"[bench] {backend}: optimizer step, {name} "
                    f"(round {r + 1} of {step_rounds})")
                runs[name] += _run("benchmarks.step", backend, "--names",
                                   name)
        results += [merge_step_rounds(runs[name]) for name in names]
        if fit:
            say(f"[bench] {backend}: fit step")
            results += _run("benchmarks.fit", backend)
        if memory:
            # Each configuration twice: at the problem's size and with
            # tensors twice as large. What does not grow with the state
            # (the runtime, the compiled program, allocator pools) cancels
            # in the difference of the two growths.
            doubled = str(2 * common.SIZE)
            for name in MEMORY[backend]:
                say(f"[bench] {backend}: peak memory of {name}")
                results += _run("benchmarks.step", backend, "--memory", name)
                for r in _run("benchmarks.step", backend, "--memory", name,
                              KEO_BENCH_SIZE=doubled):
                    results.append(dict(r, bench="memory_doubled"))
    return results


def _by(results, bench, backend):
    return {r["name"]: r for r in results
            if r["bench"] == bench and r["backend"] == backend}


def _paired(r, base, compare):
    """``compare(r, base)`` over fit steps: the median over the rounds of
    the two configurations' step times in the same round: of the baseline
    run right beside this one where the record has it (``paired_rounds``),
    else of the round's baseline (the configurations ran one after the
    other, so a slow spell of the machine falls on both), else of the two
    medians."""
    a, b = r.get("rounds"), base.get("rounds")
    if r.get("paired_with") == base["name"] and r.get("paired_rounds"):
        b = r["paired_rounds"]
    if a and b and len(a) == len(b):
        return statistics.median(compare(x, y) for x, y in zip(a, b))
    return compare(r["seconds"], base["seconds"])


def _bytes(averages):
    return common.adam_bytes(1, averages)


def _averages(r, step):
    """The averages a fit record's configuration keeps: its own count, or
    (records written before fit records had it) its step record's."""
    return r.get("averages", step.get(r["name"], {}).get("averages", 1))


def checks(results):
    """Each bound of the performance issue: (what, measured, bound, ok);
    ``bound`` and ``ok`` are None for a value given for reference (a peer's
    memory, the roofline's source)."""
    out = []
    for backend in sorted({r["backend"] for r in results}):
        step = _by(results, "step", backend)
        out += _step_checks(backend, step, results)
        out += _fit_checks(backend, step, _by(results, "fit", backend))
        out += _memory_checks(backend, _by(results, "memory", backend),
                              _by(results, "memory_doubled", backend))
    runs = sorted({r.get("run") for r in results if r["bench"] == "step"},
                  key=str)
    for run in runs:
        bandwidth, source = roofline_bandwidth(results, run)
        measured = _measured(_run_steps(results, run))[0]
        ratio = bandwidth / measured
        label = "" if len(runs) == 1 else f" (run {run})"
        out.append((f"roofline bandwidth{label}, {bandwidth / 1e9:.1f} GB/s"
                    f" ({source}) / the streams'", ratio, ROOFLINE_TRUST,
                    ratio <= ROOFLINE_TRUST))
    return out


def _step_checks(backend, step, results):
    out = []
    for peer_name, bound in BOUNDS[backend]:
        peer = step.get(peer_name)
        for name, r in step.items():
            if not name.startswith("ours:") or peer is None:
                continue
            # A strategy with k averages may move the bytes of k (the
            # peer keeps one).
            scale = _bytes(r["averages"]) / _bytes(peer["averages"])
            ratio = r["seconds"] / (peer["seconds"] * scale)
            out.append((f"{backend} step: {name} / {peer_name}"
                        f"{' (x bytes)' if scale != 1 else ''}",
                        ratio, bound, ratio <= bound))
    if backend == "torch" and "keras_ema" in step and "ours:ema" in step:
        speedup = step["keras_ema"]["seconds"] / step["ours:ema"]["seconds"]
        out.append(("torch step: Keras use_ema / ours:ema (speed-up)",
                    speedup, 2.5, speedup >= 2.5))
    if backend in ROOFLINE_SHARE and "ours:ema" in step:
        r, bound = step["ours:ema"], ROOFLINE_SHARE[backend]
        share = roofline_seconds(r, results) / r["seconds"]
        out.append((f"{backend} step: ours:ema share of the roofline",
                    share, bound, share >= bound))
    return out


def _fit_checks(backend, step, fit):
    out = []
    if "ours" not in fit:
        return out
    for name, r in fit.items():
        if name.startswith("ours:"):
            # 10% per average kept (PowerEMA keeps two: their traffic is
            # allowed, no more).
            k = _averages(r, step)
            ratio = _paired(r, fit["ours"], lambda a, b: a / b) - 1
            out.append((f"{backend} fit: {name} added to the step"
                        f"{f' ({k} averages)' if k != 1 else ''}",
                        ratio, 0.10 * k, ratio <= 0.10 * k))
    return out


def _memory_checks(backend, memory, doubled):
    """The bound holds ours; the peers' and Keras' values are given beside
    it for reference."""
    out = []
    for name, r in memory.items():
        ours = name.startswith("ours")
        suffix = "" if ours else " (reference)"
        bound = 1.10 if ours else None
        out.append((f"{backend} memory: {name} growth / state bytes{suffix}",
                    r["ratio"], bound, r["ratio"] <= 1.10 if ours else None))
        if r.get("runtime_bytes"):
            # The same growth counted from a process whose runtime has
            # started (JAX's CPU client), for reference: the bound is the
            # row above.
            started = (r["growth_bytes"] - r["runtime_bytes"]) / r[
                "needed_bytes"]
            out.append((f"{backend} memory: {name} growth over the started "
                        f"runtime / state bytes (reference)", started, None,
                        None))
        d = doubled.get(name)
        if d and d["needed_bytes"] > r["needed_bytes"]:
            marginal = ((d["growth_bytes"] - r["growth_bytes"])
                        / (d["needed_bytes"] - r["needed_bytes"]))
            out.append((f"{backend} memory: {name} growth per state byte "
                        f"(tensors x2; fixed costs cancel){suffix}",
                        marginal, bound, marginal <= 1.10 if ours else None))
    return out


# The distributions whose versions a run records, per backend.
PACKAGES = {"jax": ("jax", "jaxlib", "optax"),
            "tensorflow": ("tensorflow", "tf_keras"),
            "torch": ("torch", "torch-ema")}


def versions(backends):
    """{distribution: version} of Keras, numpy and the backends' own
    (read from their metadata, nothing imported); absent ones left out."""
    from importlib import metadata

    out = {}
    for name in ("keras", "numpy") + tuple(
            p for b in backends for p in PACKAGES.get(b, ())):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def machine_meta(device, results):
    """What the run of ``results`` was made on, stored with them."""
    backends = sorted({r["backend"] for r in results})
    return {"device": device, "machine": platform.machine(),
            "processor": platform.processor(), "cores": os.cpu_count(),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "backends": backends, "versions": versions(backends)}


def _describe(meta):
    runs = meta.get("merged_from") or [meta]
    return "; ".join(
        f"{', '.join(m.get('backends', [])) or 'run'}: "
        f"{m.get('device', '?')}, "
        f"{m.get('processor') or m.get('machine', '?')}, "
        f"{m.get('cores', '?')} cores, Python {m.get('python', '?')}, "
        + "".join(f"{k} {v}, " for k, v in m.get("versions", {}).items())
        + f"{m.get('date', '?')}" for m in runs)


def table(results, device, meta=None):
    meta = meta or machine_meta(device, results)
    lines = [f"Device: {_describe(meta)}. Medians "
             "(ms); roofline = bytes an Adam step with its averages must "
             "move / the run's bandwidth: the median of its step "
             "processes' best streams, or what a configuration reached "
             "where more (in the Bounds, with where it came from).", ""]
    for backend in sorted({r["backend"] for r in results}):
        step = _by(results, "step", backend)
        fit = _by(results, "fit", backend)
        mem = _by(results, "memory", backend)
        peer_name = BOUNDS[backend][0][0]
        peer = step.get(peer_name)
        lines += [f"### {backend}", "",
                  "| configuration | step (ms) | / " + peer_name +
                  " | roofline (ms) | fit step (ms) | peak memory / state |",
                  "|---|---|---|---|---|---|"]
        for name in sorted(set(step) | set(fit)):
            s, f = step.get(name), fit.get(name)
            ratio = (f"{s['seconds'] / peer['seconds']:.2f}"
                     if s and peer else "")
            m = mem.get(name)
            lines.append(
                f"| {name} | {s['seconds'] * 1e3:.2f} |" if s else
                f"| {name} | |")
            lines[-1] += (
                f" {ratio} | "
                f"{roofline_seconds(s, results) * 1e3:.2f} |" if s else
                " | |")
            lines[-1] += (f" {f['seconds'] * 1e3:.2f} |" if f else " |")
            lines[-1] += (f" {m['ratio']:.2f} |" if m else " |")
        lines.append("")
    lines += _fit_traffic_lines(results)
    lines += _fit_heap_lines(results)
    lines += ["### Bounds", "", "| check | measured | bound | |",
              "|---|---|---|---|"]
    for what, value, bound, ok in checks(results):
        verdict = "reference" if ok is None else "ok" if ok else "MISSED"
        bound = "-" if bound is None else f"{bound:.2f}"
        lines.append(f"| {what} | {value:.2f} | {bound} | {verdict} |")
    return "\n".join(lines) + "\n"


def fit_traffic(results):
    """Per backend and averaged fit configuration: (backend, name, added
    seconds, base step seconds, seconds of its memory traffic unfused,
    folded). What the average adds to a fit step against what its bytes
    alone cost at the roofline's bandwidth of the same run: unfused, a
    separate loop reads the new weight back and reads and writes each
    average (3 floats an element per average); folded into the update,
    the new weight is still in registers (2)."""
    out = []
    for backend in sorted({r["backend"] for r in results}):
        step = _by(results, "step", backend)
        fit = _by(results, "fit", backend)
        base = fit.get("ours")
        if base is None or not step:
            continue
        for name, r in sorted(fit.items()):
            if not name.startswith("ours:") or "parameters" not in r:
                continue
            # The roofline of the run that measured this configuration's
            # step (a merged file may hold its fit steps from another run
            # of the same machine), else of the backend's first step run.
            run = step.get(name, next(iter(step.values()))).get("run")
            bandwidth = roofline_bandwidth(results, run)[0]
            if not bandwidth:
                continue
            k = _averages(r, step)
            n = r["parameters"]
            # The roofline's bytes of k averages, and the new weight read
            # back (one float more per two) where they are not folded.
            folded = (common.adam_bytes(n, k) - common.adam_bytes(n, 0)) / (
                bandwidth)
            out.append((backend, name,
                        _paired(r, base, lambda a, b: a - b),
                        base["seconds"], folded * 3 / 2, folded))
    return out


def _fit_traffic_lines(results):
    rows = fit_traffic(results)
    if not rows:
        return []
    lines = ["### Fit: the average's cost against its memory traffic", "",
             "Added = fit step with the average - without. Traffic = the "
             "average's bytes / the roofline's bandwidth: unfused (the new "
             "weight read back, the average read and written: 3 floats an "
             "element"
             " per average), folded into the update (2). Shares are of the "
             "step without an average.", "",
             "| backend | configuration | added (ms) | traffic unfused (ms)"
             " | share | traffic folded (ms) | share | added / unfused |",
             "|---|---|---|---|---|---|---|---|"]
    for backend, name, added, base, unfused, folded in rows:
        lines.append(
            f"| {backend} | {name} | {added * 1e3:.2f} | "
            f"{unfused * 1e3:.2f} | {unfused / base:.2f} | "
            f"{folded * 1e3:.2f} | {folded / base:.2f} | "
            f"{added / unfused:.2f} |")
    return lines + [""]


def _fit_heap_lines(results):
    """How the fit processes' heap ran (``benchmarks.common.steady_heap``)
    and the most minor page faults a batch of any of their fits, per
    backend; nothing where no fit record notes its heap (runs before fit
    records did), and ``default (not recorded)`` for such records merged
    beside ones that do."""
    fits = [r for r in results if r["bench"] == "fit"]
    if not any("heap" in r for r in fits):
        return []
    heaps = sorted({r.get("heap", "default (not recorded)") for r in fits})
    worst = {}
    for r in fits:
        if r.get("faults"):
            worst[r["backend"]] = max([worst.get(r["backend"], 0.0)]
                                      + r["faults"])
    return [f"Fit processes' heap: {', '.join(heaps)} (`steady`: "
            "`benchmarks.common.steady_heap`, the memory a step frees kept "
            "for the next). The most minor page faults a batch in any fit: "
            + ", ".join(f"{b} {f:.1f}" for b, f in sorted(worst.items()))
            + ".", ""]


def summary(results):
    """The README's table: per backend, ours against Keras' own and the
    peer, step and fit."""
    lines = ["| backend | Adam step: Keras `use_ema` | ours, EMA | peer, EMA "
             "| ours / peer | fit step: Keras `use_ema` | ours, no avg | "
             "ours, EMA |", "|---|---|---|---|---|---|---|---|"]
    for backend in sorted({r["backend"] for r in results}):
        step = _by(results, "step", backend)
        fit = _by(results, "fit", backend)
        peer = BOUNDS[backend][0][0]

        def ms(table, name):
            r = table.get(name)
            return f"{r['seconds'] * 1e3:.1f} ms" if r else "-"

        ratio = (f"{step['ours:ema']['seconds'] / step[peer]['seconds']:.2f}"
                 if "ours:ema" in step and peer in step else "-")
        lines.append(
            f"| {backend} | {ms(step, 'keras_ema')} | {ms(step, 'ours:ema')}"
            f" | {ms(step, peer)} ({peer}) | {ratio} | "
            f"{ms(fit, 'keras_ema')} | {ms(fit, 'ours')} | "
            f"{ms(fit, 'ours:ema')} |")
    return "\n".join(lines) + "\n"


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = sorted({r["backend"] for r in results})
    fig, axes = plt.subplots(1, len(backends),
                             figsize=(5 * len(backends), 4.5), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        step = _by(results, "step", backend)
        names = sorted(step)
        values = [step[n]["seconds"] * 1e3 for n in names]
        colors = ["tab:green" if n.startswith("ours") else
                  "tab:gray" if n.startswith("keras") else "tab:blue"
                  for n in names]
        ax.barh(names, values, color=colors)
        roof = [roofline_seconds(step[n], results) * 1e3 for n in names]
        ax.scatter(roof, names, marker="|", color="black", s=200,
                   label="roofline")
        ax.set_title(f"{backend}: Adam step, 200 x 50k float32")
        ax.set_xlabel("ms (median)")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def write(results, out, device, meta=None):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = meta or machine_meta(device, results)
    payload = {"meta": meta, "results": results,
               "checks": [dict(zip(("check", "measured", "bound", "ok"), c))
                          for c in checks(results)]}
    paths = {"json": out / f"{device}-results.json",
             "table": out / f"{device}-table.md",
             "summary": out / f"{device}-summary.md",
             "plot": out / f"{device}-plot.png"}
    # All four made first, then renamed: a failure leaves the earlier set
    # whole, not a part of a new one beside it.
    tmps = {kind: path.with_suffix(path.suffix + ".tmp")
            for kind, path in paths.items()}
    try:
        tmps["json"].write_text(json.dumps(payload, indent=1))
        tmps["table"].write_text(table(results, device, meta))
        tmps["summary"].write_text(summary(results))
        plot(results, tmps["plot"])
        for kind, path in paths.items():
            os.replace(tmps[kind], path)
    finally:
        for tmp in tmps.values():
            if tmp.exists():
                tmp.unlink()
    return paths


def merge_files(files):
    """(device, meta, results) of results files of one kind of device (the
    GPU run comes back one backend a call). The merged metadata keeps each
    file's own (machine, Python, date: ``merged_from``); a configuration
    measured in two files, or files of two kinds of device, is refused."""
    payloads = []
    for f in files:
        try:
            payload = json.loads(Path(f).read_text())
            _check_payload(payload)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--from-json: {f} is not a results file of "
                             f"`python -m benchmarks` ({e})") from e
        payloads.append((f, payload))
    devices = {p["meta"]["device"] for _, p in payloads}
    if len(devices) != 1:
        raise ValueError("--from-json: the files are of different devices: "
                         f"{sorted(devices)}; merge the files of one device")
    seen, results, merged_from = {}, [], []
    for f, p in payloads:
        # A merged file keeps the runs it was merged from; each record
        # names its run (its roofline is its run's).
        runs = p["meta"].get("merged_from") or [dict(
            p["meta"], backends=p["meta"].get("backends") or sorted(
                {r["backend"] for r in p["results"]}))]
        for r in p["results"]:
            key = (r["bench"], r["backend"], r["name"])
            if key in seen:
                where = (f"twice in {f}" if seen[key] == f else
                         f"in both {seen[key]} and {f}")
                raise ValueError(f"--from-json: {' '.join(key)} is {where}; "
                                 "give one run of each configuration")
            seen[key] = f
            results.append(dict(r, run=len(merged_from) + r.get("run", 0)))
        merged_from += runs
    device = devices.pop()
    return device, {"device": device, "merged_from": merged_from}, results


def _check_payload(payload):
    """Raise KeyError/TypeError/ValueError naming what a results payload
    lacks."""
    if not isinstance(payload.get("meta"), dict) or not isinstance(
            payload["meta"].get("device"), str):
        raise ValueError("no meta.device")
    if not isinstance(payload.get("results"), list) or not payload[
            "results"]:
        raise ValueError("no results")
    for r in payload["results"]:
        needed = ("bench", "backend", "name") + (
            ("seconds", "roofline_seconds", "bandwidth")
            if r.get("bench") == "step" else ())
        missing = [k for k in needed if k not in r]
        if missing:
            raise ValueError(f"a record lacks {', '.join(missing)}: {r}")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=common.summary(__doc__))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" /
                                             "results"))
    parser.add_argument("--no-step", action="store_true",
                        help="skip the optimizer-step benchmark (a run of "
                        "the fit or memory sections alone, merged later "
                        "with --from-json)")
    parser.add_argument("--no-fit", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--step-rounds", type=int, default=STEP_ROUNDS,
                        help="rounds of the optimizer-step processes, each "
                        "configuration once a round (default: "
                        "%(default)s; KEO_BENCH_STEP_ROUNDS)")
    parser.add_argument("--from-json", metavar="FILE", nargs="+",
                        help="rebuild the table and plot of results files "
                        "(several: runs of some backends each, on one kind "
                        "of device, merged)")
    args = parser.parse_args(argv)
    if args.no_step and args.no_fit and args.no_memory:
        parser.error("--no-step, --no-fit and --no-memory together leave "
                     "nothing to run: keep at least one section")
    if args.step_rounds < 1:
        parser.error("--step-rounds: at least 1 round is needed. Received: "
                     f"{args.step_rounds}")
    backends = common.comma_list(parser, "--backends", args.backends,
                                 BACKENDS)
    if not backends and not args.from_json:
        parser.error(f"--backends: at least one of {', '.join(BACKENDS)} "
                     f"is needed. Received: {args.backends!r}")
    if args.from_json:
        try:
            device, meta, results = merge_files(args.from_json)
        except ValueError as e:
            parser.error(str(e))
    else:
        device = device_kind()
        results = collect(backends, fit=not args.no_fit, memory=not args.no_memory,
                          step_rounds=args.step_rounds,
                          step=not args.no_step)
        meta = machine_meta(device, results)
    paths = write(results, args.out, device, meta)
    print(table(results, device, meta))
    for path in paths.values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
