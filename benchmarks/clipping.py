"""Gradient clipping: Keras' own ``_clip_gradients`` against ours, alone and
in an Adam + EMA step, for each of Keras' rules (``clipnorm``,
``global_clipnorm``, ``clipvalue``), on the step benchmark's problem (200
float32 tensors of 50,000 elements).

    KERAS_BACKEND=torch python -m benchmarks.clipping [--rules ...] [--fit
        [--accumulate N] [--loss-scale]]

On PyTorch ours clips with torch's multi-tensor kernels (one
``_foreach_norm`` and one ``_foreach_mul`` for all the gradients) where
Keras runs its ops gradient by gradient; on JAX and TensorFlow both run
Keras' rule (ours inside the compiled step). Each measurement is the
median of ``KEO_BENCH_REPEATS`` calls after warm-up, Keras' and ours
taking turns call by call in one process (``interleaved``); the printed
ratios are Keras / ours.

With ``--fit``, each rule is timed in ``model.fit`` instead: the fit
benchmark's 60-layer ``Dense(256)`` MLP, batch 32, Keras' optimizer and
ours, each with the rule and without it, taking turns over
``KEO_BENCH_ROUNDS`` rounds (a fresh model each). Each run gives the
median gap between batches after the first ``WARMUP`` and the mean of
the process's minor page faults a batch (``getrusage``) after them: on PyTorch
``fit()`` hands the optimizer the variables' own ``.grad`` tensors, which
ours clips in place, where new clipped tensors would be faulted in again
at each step under glibc's default malloc. With ``--accumulate N`` both
optimizers take ``gradient_accumulation_steps=N``: the update step clips
the average Keras' step makes (``(g + acc) / N``), which ours also clips
in place. With ``--loss-scale`` both run inside Keras'
``LossScaleOptimizer`` (its dynamic scale): the optimizer clips the
unscaled gradients the loss scaler makes, which ours also clips in
place.
"""

import argparse
import contextlib
import os
import sys

from benchmarks import common
from benchmarks.step import LR
from benchmarks.step import MOMENTUM
from benchmarks.step import _sync_torch
from benchmarks.step import tensors

BACKEND = os.environ.get("KERAS_BACKEND", "jax")
RULES = {"clipnorm": 1.0, "global_clipnorm": 1.0, "clipvalue": 1e-3}


def _sync():
    if BACKEND == "torch":
        _sync_torch()
    elif BACKEND == "jax":
        import jax

        jax.effects_barrier()


def _block(values):
    """Wait for ``values`` (JAX dispatches asynchronously)."""
    if BACKEND == "jax":
        import jax

        jax.block_until_ready(values)


def optimizer(kind, rule, accumulate=None, loss_scale=False):
    import keras

    import keras_ema_opt

    options = {} if rule is None else {rule: RULES[rule]}
    if accumulate:
        options["gradient_accumulation_steps"] = accumulate
    if kind == "keras":
        made = keras.optimizers.Adam(LR, use_ema=True,
                                     ema_momentum=MOMENTUM, **options)
    else:
        made = keras_ema_opt.Adam(LR, averaging=keras_ema_opt.EMA(MOMENTUM),
                                  **options)
    if loss_scale:
        return keras.optimizers.LossScaleOptimizer(made)
    return made


def interleaved(fns, sync, warmup=common.WARMUP, repeats=common.REPEATS):
    """{key: median seconds} of each of ``fns`` ({key: function}), their
    calls taking turns, in reversed order every other repeat: a slow
    spell of the machine, or the allocator's state one of them leaves,
    falls on all of them alike."""
    import statistics
    import time

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times = {key: [] for key in fns}
    order = list(fns)
    for i in range(repeats):
        for key in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fns[key]()
            sync()
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def measure(rule):
    """{(what, kind): seconds} for one rule."""
    import keras

    variables, grads = [], []
    for w, g in tensors():
        variables.append(keras.Variable(w))
        # Large enough that every rule clips.
        grads.append(keras.ops.convert_to_tensor(g * 100))
    if BACKEND == "torch":
        import torch

        no_grad = torch.no_grad
    else:
        no_grad = contextlib.nullcontext
    fns = {}
    for kind in ("keras", "ours"):
        opt = optimizer(kind, rule)
        opt.build(variables)

        def clip(opt=opt):
            _block(opt._clip_gradients(grads))

        def step(opt=opt):
            with no_grad():
                opt.apply(grads, variables)
            _block([v.value for v in variables])

        fns["clip", kind] = clip
        fns["step", kind] = step
    out = {}
    for what in ("clip", "step"):
        out.update(interleaved({key: fn for key, fn in fns.items()
                                if key[0] == what}, _sync))
    return out


FIT_KINDS = ("keras", "keras, no clipping", "ours", "ours, no clipping")


def measure_fit(rule, rounds=None, accumulate=None, loss_scale=False):
    """{kind: (median step seconds, minor faults a step)}: the medians over
    the rounds of each run's median step and mean faults
    (``benchmarks.fit``'s clock), ``kind`` from ``FIT_KINDS``."""
    import statistics

    from benchmarks import fit

    rounds = fit.ROUNDS if rounds is None else rounds
    x, y = fit.data()
    runs = {kind: [] for kind in FIT_KINDS}
    for r in range(rounds):
        for kind in FIT_KINDS if r % 2 == 0 else FIT_KINDS[::-1]:
            clock, _ = fit.fit_with(optimizer(
                kind.split(",")[0], None if "no clipping" in kind else rule,
                accumulate, loss_scale), x, y)
            runs[kind].append((clock.median_step(), clock.mean_faults()))
    return {kind: (statistics.median(s for s, _ in r),
                   statistics.median(f for _, f in r))
            for kind, r in runs.items()}


def run_fit(rules=tuple(RULES), rounds=None, accumulate=None,
            loss_scale=False):
    records = []
    for rule in rules:
        m = measure_fit(rule, rounds, accumulate, loss_scale)
        records.append({
            "bench": "clipping_fit", "backend": BACKEND, "name": rule,
            "accumulate": accumulate, "loss_scale": loss_scale,
            "keras_seconds": m["keras"][0], "seconds": m["ours"][0],
            "keras_unclipped_seconds": m["keras, no clipping"][0],
            "unclipped_seconds": m["ours, no clipping"][0],
            "keras_faults": m["keras"][1], "faults": m["ours"][1],
            "unclipped_faults": m["ours, no clipping"][1],
            "speedup": m["keras"][0] / m["ours"][0]})
        common.emit(records[-1])
    return records


def fit_table(records):
    return common.markdown_table(
        [f"{BACKEND} fit step", "Keras (ms)", "Keras, no clipping (ms)",
         "Keras faults a step", "ours (ms)", "ours, no clipping (ms)",
         "ours faults a step", "ours, no clipping, faults a step",
         "Keras / ours"],
        [[r["name"] + (f", accumulating {r['accumulate']}"
                       if r.get("accumulate") else "")
          + (", loss-scaled" if r.get("loss_scale") else ""),
          f"{r['keras_seconds'] * 1e3:.2f}",
          f"{r['keras_unclipped_seconds'] * 1e3:.2f}",
          f"{r['keras_faults']:.0f}", f"{r['seconds'] * 1e3:.2f}",
          f"{r['unclipped_seconds'] * 1e3:.2f}", f"{r['faults']:.0f}",
          f"{r['unclipped_faults']:.0f}", f"{r['speedup']:.2f}"]
         for r in records])


def run(rules=tuple(RULES)):
    records = []
    for rule in rules:
        times = measure(rule)
        for what in ("clip", "step"):
            records.append({
                "bench": f"clipping_{what}", "backend": BACKEND,
                "name": rule, "keras_seconds": times[what, "keras"],
                "seconds": times[what, "ours"],
                "speedup": times[what, "keras"] / times[what, "ours"]})
            common.emit(records[-1])
    return records


def table(records):
    return common.markdown_table(
        [BACKEND, "Keras (ms)", "ours (ms)", "Keras / ours"],
        [[f"{r['name']}, " + ("clipping alone" if r["bench"] ==
                              "clipping_clip" else "Adam + EMA step"),
          f"{r['keras_seconds'] * 1e3:.2f}", f"{r['seconds'] * 1e3:.2f}",
          f"{r['speedup']:.2f}"] for r in records])


def main(argv=None):
    parser = argparse.ArgumentParser(description=common.summary(__doc__))
    parser.add_argument("--rules", default=",".join(RULES),
                        help="comma-separated: " + ", ".join(RULES))
    parser.add_argument("--fit", action="store_true",
                        help="time each rule in model.fit (see above)")
    parser.add_argument("--accumulate", type=int, default=None,
                        help="with --fit: gradient_accumulation_steps")
    parser.add_argument("--loss-scale", action="store_true",
                        help="with --fit: inside Keras' LossScaleOptimizer")
    args = parser.parse_args(argv)
    rules = common.comma_list(parser, "--rules", args.rules, RULES)
    if args.accumulate is not None and (not args.fit
                                        or args.accumulate < 2):
        parser.error("--accumulate takes an integer of at least 2, with "
                     f"--fit; received {args.accumulate}"
                     + ("" if args.fit else " without --fit"))
    if args.loss_scale and not args.fit:
        parser.error("--loss-scale times model.fit: it goes with --fit")
    if args.fit:
        print(fit_table(run_fit(rules, accumulate=args.accumulate,
                                loss_scale=args.loss_scale)))
    else:
        print(table(run(rules)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
