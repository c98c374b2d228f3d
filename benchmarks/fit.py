"""A ``model.fit`` step: a 60-layer ``Dense(256)`` MLP, batch 32, Adam, with
and without averaging, ours beside Keras' own ``use_ema``.

    python -m benchmarks.fit [--names ...]
    python -m benchmarks.fit --interleave [--names ours,ours:ema,...]

Each configuration trains one epoch of ``STEPS`` batches; the time of a
step is the median gap between consecutive ``on_train_batch_end`` calls
after the first ``WARMUP`` (compilation and warm-up excluded). The
configurations take turns, ``ROUNDS`` times over, each turn with a new
model and optimizer (Keras 3.15's ``use_ema=True`` cannot run a second
``fit()`` on JAX, defect L3); the result is the median over the turns,
so that a slow spell of the machine does not fall on one configuration
only.

The process keeps the heap memory its steps free (``common.steady_heap``;
``KEO_BENCH_DEFAULT_HEAP=1`` leaves glibc's defaults): with glibc's
defaults, XLA's worker threads map and unmap a new heap for each JAX
step's temporaries in some fits and not in others, whatever their
optimizer, and those fits run 35% slower. Each record keeps the minor
page faults a batch of each of its fits.

An averaged configuration runs right beside a run of its baseline (ours
without an average; Keras without ``use_ema``), the baseline first in
even rounds and second in odd ones (an even ``ROUNDS`` balances the two
orders): its overhead is the median over the rounds of those adjacent
pairs' ratios. Runs far apart in a round do not share
the machine's state as neighbours do: ``ours`` run first and sixth in a
round of six measured 8% apart on JAX (the median over four rounds), as
much as an average adds.

With ``--interleave`` (JAX and TensorFlow), the configurations train side
by side in this process instead, a step each in turn: one model each,
built and compiled by a short ``fit()``, then ``INTERLEAVED_STEPS`` steps
of each through Keras' own compiled train function (its ``fit()`` step
without the loop around it: callbacks, and on JAX the storing of the new
state on the model), each timed until its loss is on the host, the order
reversed every other turn. An average's cost is the median over the
turns of its step's time over the first configuration's in the same turn
(``--names``' first, the baseline): a slow spell of the machine falls on
both steps of a turn, not on one run of many steps. It measures another
step than ``fit()``'s: each step waits for its loss (``fit()`` lets the
next step's host work overlap this one's kernels), and the models take
turns in the machine's caches; their steps run slower than in ``fit()``.
"""

import argparse
import gc
import itertools
import os
import statistics
import sys
import time

import numpy as np

from benchmarks import common
from benchmarks.step import configurations
from benchmarks.step import keras_optimizer

BACKEND = os.environ.get("KERAS_BACKEND", "jax")
LAYERS = int(os.environ.get("KEO_BENCH_LAYERS", 60))
WIDTH = int(os.environ.get("KEO_BENCH_WIDTH", 256))
BATCH = 32
STEPS = int(os.environ.get("KEO_BENCH_STEPS", 120))
WARMUP = min(20, STEPS // 3)
ROUNDS = int(os.environ.get("KEO_BENCH_ROUNDS", 6))
INTERLEAVED_STEPS = int(os.environ.get("KEO_BENCH_INTERLEAVED_STEPS", 300))


def _clock():
    """A callback noting when each batch ends and the process's minor page
    faults by then (Keras imported late: the backend is chosen by the
    environment first)."""
    import resource

    import keras

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []
            self.faults = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())
            self.faults.append(
                resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

        def median_step(self):
            return statistics.median(np.diff(self.times[WARMUP:]))

        def mean_faults(self):
            """Minor page faults a batch after the first ``WARMUP``: their
            mean, not their median (they come in bursts, when malloc
            hands memory back and takes it again)."""
            return float(np.mean(np.diff(self.faults[WARMUP:])))

    return Clock()


def model():
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((WIDTH,))]
    layers += [keras.layers.Dense(WIDTH, activation="relu")
               for _ in range(LAYERS - 1)]
    layers.append(keras.layers.Dense(WIDTH))
    return keras.Sequential(layers)


NAMES = ("keras", "keras_ema", "ours", "ours:ema", "ours:ema_power",
         "ours:swa", "ours:powerema")


# Each averaged configuration and the baseline it is measured against.
BASELINES = {"keras_ema": "keras", "ours:ema": "ours",
             "ours:ema_power": "ours", "ours:swa": "ours",
             "ours:powerema": "ours"}
# ``--interleave``'s default: ours' baseline and its averages.
INTERLEAVED_NAMES = ("ours", *(n for n in NAMES if BASELINES.get(n) == "ours"))


def _turns(names, round_index):
    """The turns of one round, in order: ``(name, None, (name,))`` for a
    configuration that runs alone (without its baseline among ``names``,
    or a baseline nothing is paired with), first; then ``(name, baseline,
    runs)`` for each averaged configuration, ``runs`` the pair in its
    order, the baseline first in even rounds and second in odd ones."""
    paired = [name for name in names if BASELINES.get(name) in names]
    bases = {BASELINES[name] for name in paired}
    turns = [(name, None, (name,)) for name in names
             if name not in paired and name not in bases]
    for name in paired:
        pair = (BASELINES[name], name)
        turns.append((name, BASELINES[name],
                      pair if round_index % 2 == 0 else pair[::-1]))
    return turns


def schedule(names, round_index):
    """The configurations one round runs, in order (see ``_turns``)."""
    return [run for _, _, runs in _turns(names, round_index) for run in runs]


def data():
    """The ``(x, y)`` of one epoch of ``STEPS`` batches."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * STEPS, WIDTH), dtype=np.float32)
    y = rng.standard_normal((BATCH * STEPS, WIDTH), dtype=np.float32)
    return x, y


def fit_with(optimizer, x, y):
    """One epoch of a new ``model()`` trained by ``optimizer``: its clock
    (``_clock``) and its number of parameters."""
    m = model()
    m.compile(optimizer=optimizer, loss="mse")
    clock = _clock()
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
          callbacks=[clock])
    parameters = int(sum(np.prod(v.shape) for v in m.trainable_weights))
    del m
    gc.collect()
    return clock, parameters


def _fit_once(name, x, y):
    # The optimizers of the step benchmark (their `jit_compile` concerns
    # eager steps: in fit() the step's own compilation, or the lack of it,
    # applies).
    clock, parameters = fit_with(keras_optimizer(name), x, y)
    return clock.median_step(), parameters, clock.mean_faults()


def run(names=NAMES, rounds=ROUNDS, heap="default"):
    """Each configuration's fits (module docstring); emit a record each.
    ``heap``: how this process's heap runs (``common.steady_heap``),
    recorded with the minor page faults of each fit's batches."""
    x, y = data()
    names = list(dict.fromkeys(names))  # each configuration once
    times = {name: [] for name in names}  # per round, one run or several
    faults = {name: [] for name in names}
    beside = {name: [] for name in names}  # the adjacent baseline's run
    parameters = {}
    for r in range(rounds):
        for name in names:
            times[name].append([])
        for name, base, runs in _turns(names, r):
            for run_name in runs:
                seconds, parameters[run_name], batch_faults = _fit_once(
                    run_name, x, y)
                times[run_name][-1].append(seconds)
                faults[run_name].append(batch_faults)
            if base is not None:  # the baseline's run of this turn
                beside[name].append(times[base][-1][-1])
    configs = configurations()
    for name in names:
        runs = [t for round_times in times[name] for t in round_times]
        record = {"bench": "fit", "backend": BACKEND, "name": name,
                  "averages": configs[name][2],
                  "seconds": statistics.median(runs),
                  "rounds": [statistics.median(t) for t in times[name]],
                  "parameters": parameters[name], "heap": heap,
                  # each fit's minor page faults a batch, in run order
                  "faults": faults[name]}
        if beside[name]:
            record["paired_with"] = BASELINES[name]
            record["paired_rounds"] = beside[name]
        common.emit(record)


def _stepper(name, x, y):
    """A function running one step of a new ``model()`` trained by
    ``name`` with Keras' compiled train function, returning its loss (on
    the host), after a short ``fit()`` that builds and compiles it."""
    m = model()
    m.compile(optimizer=keras_optimizer(name), loss="mse")
    m.fit(x[:BATCH * 4], y[:BATCH * 4], batch_size=BATCH, epochs=1,
          shuffle=False, verbose=0)
    train = m.train_function
    if BACKEND == "tensorflow":
        import tensorflow as tf

        batches = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(
            BATCH).repeat())

        def step():
            return float(train(batches)["loss"])
        return step
    batches = itertools.cycle([(x[i:i + BATCH], y[i:i + BATCH])
                               for i in range(0, len(x), BATCH)])
    state = m._get_jax_state(
        trainable_variables=True, non_trainable_variables=True,
        optimizer_variables=True, metrics_variables=True)

    def step():
        nonlocal state
        logs, state = train(state, batches)
        return float(logs["loss"])
    return step


def run_interleaved(names, steps=INTERLEAVED_STEPS, heap="default"):
    """The configurations' steps in turn (module docstring); emit a record
    each; the first of ``names`` is the baseline."""
    if BACKEND not in ("jax", "tensorflow"):
        raise ValueError(
            "benchmarks.fit --interleave steps Keras' train function of JAX "
            "or TensorFlow alone: run it with KERAS_BACKEND=jax or "
            f"tensorflow. Received: KERAS_BACKEND={BACKEND!r}.")
    names = list(dict.fromkeys(names))
    if len(names) < 2 or steps < 1:
        raise ValueError(
            "benchmarks.fit --interleave needs a baseline and at least one "
            "configuration to compare with it, and at least one step. "
            f"Received: names={names}, steps={steps}.")
    x, y = data()
    steppers = {name: _stepper(name, x, y) for name in names}
    for stepper in steppers.values():  # warm: each compiled, caches filled
        for _ in range(WARMUP):
            stepper()
    times = {name: [] for name in names}
    for turn in range(steps):
        for name in names if turn % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            steppers[name]()
            times[name].append(time.perf_counter() - start)
    base = times[names[0]]
    configs = configurations()
    for name in names:
        common.emit({
            "bench": "fit_interleaved", "backend": BACKEND, "name": name,
            "averages": configs[name][2], "steps": steps,
            "seconds": statistics.median(times[name]),
            "paired_with": names[0], "heap": heap,
            "added": statistics.median(
                t / b for t, b in zip(times[name], base)) - 1})


def main(argv=None):
    parser = argparse.ArgumentParser(description=common.summary(__doc__))
    parser.add_argument("--names", default=None)
    parser.add_argument("--interleave", action="store_true",
                        help="the configurations' steps in turn in this "
                        "process (JAX, TensorFlow); the first of --names is "
                        "the baseline")
    args = parser.parse_args(argv)
    heap = common.steady_heap()
    if args.interleave:
        names = (args.names.split(",") if args.names else
                 INTERLEAVED_NAMES)
        try:
            run_interleaved(names, heap=heap)
        except ValueError as error:
            parser.error(str(error))
        return 0
    run(args.names.split(",") if args.names else NAMES, heap=heap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
