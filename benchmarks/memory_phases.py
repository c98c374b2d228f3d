"""Where the peak memory of one optimizer-step configuration goes, phase
by phase: the resident memory each phase adds over the process's idle
baseline (after the imports), anonymous (heap, arrays) and file-backed
(library pages touched) apart, against the bytes of the state it makes.

The breakdown behind the peak-memory rows of ``python -m benchmarks``
(``benchmarks.step --memory``), for the Keras optimizers (Keras' own and
ours): on a CPU, where the state lives in the process's memory.

    KERAS_BACKEND=jax python -m benchmarks.memory_phases ours:ema

``reads`` instead of a configuration measures a step that only reads
each of the same weights and gradients once (the sum of each), with no
optimizer, made and run as the Keras steps are (TensorFlow: a traced
concrete function; JAX: jitted; PyTorch: eager): what the backend itself
keeps for a compiled step over these tensors, beside which an
optimizer's phases read.
"""

import argparse
import gc
import sys

from benchmarks import common
from benchmarks import step as bench_step

BACKEND = bench_step.BACKEND
MIB = float(1 << 20)


def resident():
    """``(anonymous, file-backed)`` resident bytes of this process
    (Linux's ``/proc/self/status``)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["RssAnon"], fields["RssFile"]


def reads_stepper(variables, grads):
    """(step, sync) of a step that only reads ``variables`` and
    ``grads``: the sum of each, read once, nothing written (TensorFlow: a traced
    concrete function, as ``keras_stepper``'s; JAX: jitted; PyTorch:
    eager)."""
    if BACKEND == "torch":
        import torch

        def step():
            with torch.no_grad():
                torch.stack([v.value.sum() for v in variables]
                            + [g.sum() for g in grads]).sum().item()
        return step, lambda: None
    if BACKEND == "tensorflow":
        import tensorflow as tf

        fn = tf.function(lambda: tf.add_n(
            [tf.reduce_sum(v.value) for v in variables]
            + [tf.reduce_sum(g) for g in grads])).get_concrete_function()
        return fn, lambda: None
    import jax
    import jax.numpy as jnp

    fn = jax.jit(lambda t, g: jnp.stack([jnp.sum(x) for x in t + g]).sum())
    values = [v.value for v in variables]
    out = {}

    def step():
        out["sum"] = fn(values, list(grads))
    return step, lambda: jax.block_until_ready(out["sum"])


def phases(name, steps=10):
    """``[(phase, anonymous bytes, file bytes, state bytes)]``: each
    phase's growth of the resident memory over the one before, and the
    bytes of the state the phase made (parameters and gradients, then
    the slots and averages). ``name`` ``"reads"``: a step that only
    reads the tensors (``reads_stepper``), with no optimizer."""
    configs = bench_step.configurations()
    keras_names = [n for n, c in configs.items()
                   if c[0] is bench_step.keras_step]
    if name not in keras_names + ["reads"]:
        raise SystemExit(f"benchmarks.memory_phases: {name!r} is not a "
                         f"Keras optimizer configuration of {BACKEND}; "
                         f"accepted: {', '.join(keras_names)}, reads")
    kind, averages = (None, 0) if name == "reads" else configs[name][1:]
    n = common.N_TENSORS * common.SIZE * 4
    out = []
    bench_step._import_backend()
    gc.collect()
    last = resident()

    def mark(phase, state_bytes=0):
        nonlocal last
        now = resident()
        out.append((phase, now[0] - last[0], now[1] - last[1], state_bytes))
        last = now

    bench_step._start_runtime()
    mark("runtime started")
    variables, grads = bench_step.keras_inputs()
    mark("weights and gradients", 2 * n)
    if kind is None:
        fn, sync = reads_stepper(variables, grads)
    else:
        opt = bench_step.keras_optimizer(kind)
        opt.build(variables)
        mark("optimizer built", (2 + averages) * n)
        fn, sync = bench_step.keras_stepper(kind, opt, variables, grads)
    mark("step made (TensorFlow: traced)")
    fn()
    sync()
    mark("first step (JAX: compiled)")
    for _ in range(steps - 1):
        fn()
    sync()
    mark(f"{steps - 1} more steps")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=common.summary(__doc__))
    parser.add_argument("name", help="a configuration (benchmarks.step "
                        "--list), a Keras optimizer's, or reads (a step "
                        "that only reads the same tensors)")
    args = parser.parse_args(argv)
    rows = phases(args.name)
    total_anon = sum(r[1] for r in rows)
    total_file = sum(r[2] for r in rows)
    state = sum(r[3] for r in rows)
    for phase, anon, file_bytes, state_bytes in rows:
        common.emit({"bench": "memory_phase", "backend": BACKEND,
                     "name": args.name, "phase": phase,
                     "anonymous_bytes": anon, "file_bytes": file_bytes,
                     "state_bytes": state_bytes})
    print(common.markdown_table(
        ["phase", "anonymous (MiB)", "file-backed (MiB)", "state (MiB)",
         "beyond the state (MiB)"],
        [[p, f"{a / MIB:.1f}", f"{f / MIB:.1f}", f"{s / MIB:.1f}",
          f"{(a + f - s) / MIB:.1f}"] for p, a, f, s in rows]
        + [["total", f"{total_anon / MIB:.1f}", f"{total_file / MIB:.1f}",
            f"{state / MIB:.1f}",
            f"{(total_anon + total_file - state) / MIB:.1f}"]]),
        file=sys.stderr)
    print(f"growth / state: {(total_anon + total_file) / state:.3f} "
          f"(bound 1.1: {1.1 * state / MIB:.1f} MiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
