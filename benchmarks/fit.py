"""A ``model.fit`` step: a 60-layer ``Dense(256)`` MLP, batch 32, Adam, with
and without averaging, ours beside Keras' own ``use_ema``.

    python -m benchmarks.fit [--names ...]

Each configuration trains one epoch of ``STEPS`` batches; the time of a
step is the median gap between consecutive ``on_train_batch_end`` calls
after the first ``WARMUP`` (compilation and warm-up excluded). The
configurations take turns, ``ROUNDS`` times over, each turn with a new
model and optimizer (Keras 3.15's ``use_ema=True`` cannot run a second
``fit()`` on JAX, defect L3); the result is the median over the turns,
so that a slow spell of the machine does not fall on one configuration
only.
"""

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np

from benchmarks import common
from benchmarks.step import keras_optimizer

BACKEND = os.environ.get("KERAS_BACKEND", "jax")
LAYERS = int(os.environ.get("KEO_BENCH_LAYERS", 60))
WIDTH = int(os.environ.get("KEO_BENCH_WIDTH", 256))
BATCH = 32
STEPS = int(os.environ.get("KEO_BENCH_STEPS", 120))
WARMUP = min(20, STEPS // 3)
ROUNDS = int(os.environ.get("KEO_BENCH_ROUNDS", 5))


def _clock():
    """A callback noting when each batch ends (Keras imported late: the
    backend is chosen by the environment first)."""
    import keras

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

        def median_step(self):
            return statistics.median(np.diff(self.times[WARMUP:]))

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


def run(names=NAMES, rounds=ROUNDS):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * STEPS, WIDTH), dtype=np.float32)
    y = rng.standard_normal((BATCH * STEPS, WIDTH), dtype=np.float32)
    times = {name: [] for name in names}
    parameters = {}
    for _ in range(rounds):
        for name in names:
            m = model()
            # The optimizers of the step benchmark (their `jit_compile`
            # concerns eager steps: in fit() the step's own compilation,
            # or the lack of it, applies).
            m.compile(optimizer=keras_optimizer(name), loss="mse")
            clock = _clock()
            m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0, callbacks=[clock])
            times[name].append(clock.median_step())
            parameters[name] = int(sum(np.prod(v.shape)
                                       for v in m.trainable_weights))
            del m
            gc.collect()
    for name in names:
        common.emit({"bench": "fit", "backend": BACKEND, "name": name,
                     "seconds": statistics.median(times[name]),
                     "rounds": times[name],
                     "parameters": parameters[name]})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", default=None)
    args = parser.parse_args(argv)
    run(args.names.split(",") if args.names else NAMES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
