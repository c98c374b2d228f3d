"""What the host pays per state array in a JAX or TensorFlow ``fit()``
step, whatever the arrays hold: the averages' share of a step bound by
its host, not by its kernels (a small model, or a GPU running the fit
benchmark's MLP).

    KERAS_BACKEND=jax python -m benchmarks.host [--arrays 360] [--extra 120]
    KERAS_BACKEND=tensorflow python -m benchmarks.host [...]

Keras' JAX ``fit()`` passes the model's and the optimizer's state through
one donating ``jax.jit`` call a step, and after it stores the new state on
the model (``model._jax_state = {...}``), which Keras' attribute tracking
walks array by array. An average adds one array per averaged variable to
both. Each is timed here with tiny arrays, ``--arrays`` of them and then
``--extra`` more (the fit benchmark's MLP: about 360 arrays of state
without an average, 120 averaged variables), the median of
``KEO_BENCH_REPEATS`` calls; the per-array cost is the difference over
``--extra``:

- ``jit_dispatch``: the call of a donating ``jax.jit`` that adds one to
  each array, until it returns (JAX dispatches asynchronously: the
  host's part);
- ``jit_round_trip``: the same call and waiting for its results;
- ``state_tracking``: Keras' assignment of a state dict of that many
  arrays to a model.

Keras' TensorFlow ``fit()`` runs a ``tf.function`` a step that captures
each variable it uses (the optimizer's step takes the handles of the
weights, the moments and the averages), and each call passes every
captured handle in:

- ``function_captures``: the call of a ``tf.function`` that captures
  that many variables of four floats and does nothing with them (one
  ``NoOp`` after their handles), until it returns.

The fit step itself at a size where the host bounds it is the fit
benchmark with narrow layers (``KEO_BENCH_WIDTH=4 python -m
benchmarks.fit``).
"""

import argparse
import os
import sys

from benchmarks import common

BACKEND = os.environ.get("KERAS_BACKEND", "jax")


def jit_seconds(n, repeats=common.REPEATS):
    """(dispatch, round trip) seconds of a donating ``jax.jit`` call over
    ``n`` arrays of four floats."""
    import jax
    import jax.numpy as jnp

    step = jax.jit(lambda xs: [x + 1 for x in xs], donate_argnums=0)
    state = [jnp.zeros(4, "float32") + i for i in range(n)]

    def dispatch():
        nonlocal state
        state = step(state)

    def wait():
        jax.block_until_ready(state)

    return (common.median_time(dispatch, _nothing, repeats=repeats),
            common.median_time(dispatch, wait, repeats=repeats))


def _nothing():
    pass


def tracking_seconds(n, repeats=common.REPEATS):
    """Seconds of Keras' ``model._jax_state = {...}`` (as its JAX ``fit()``
    does after each step) with ``n`` arrays of state."""
    import jax.numpy as jnp

    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    arrays = [jnp.zeros(4, "float32") for _ in range(n)]
    half = n // 2

    def assign():
        model._jax_state = {
            "trainable_variables": arrays[:half],
            "non_trainable_variables": [],
            "optimizer_variables": arrays[half:],
            "metrics_variables": [],
        }

    seconds = common.median_time(assign, _nothing, repeats=repeats)
    model._jax_state = None
    return seconds


def capture_seconds(n, repeats=common.REPEATS):
    """Seconds of a call of a ``tf.function`` capturing ``n`` variables of
    four floats (a ``NoOp`` after their handles)."""
    import tensorflow as tf

    variables = [tf.Variable(tf.zeros(4) + i) for i in range(n)]

    @tf.function
    def call():
        tf.group(*[v.handle for v in variables])

    call()  # traced once
    return common.median_time(call, _nothing, repeats=repeats)


def run(arrays=360, extra=120, repeats=common.REPEATS):
    """Emit each measurement at ``arrays`` and ``arrays + extra`` arrays,
    and its cost per added array; return the records."""
    if BACKEND not in ("jax", "tensorflow"):
        raise ValueError(
            "benchmarks.host measures JAX's and TensorFlow's fit() step: "
            "run it with KERAS_BACKEND=jax or tensorflow. Received: "
            f"KERAS_BACKEND={BACKEND!r}.")
    if arrays < 1 or extra < 1:
        raise ValueError("benchmarks.host: --arrays and --extra must be at "
                         f"least 1. Received: arrays={arrays}, "
                         f"extra={extra}.")
    if BACKEND == "tensorflow":
        import tensorflow as tf

        platform = "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
        timings = {"function_captures": [capture_seconds(n, repeats)
                                         for n in (arrays, arrays + extra)]}
    else:
        import jax

        platform = jax.devices()[0].platform
        timings = {"jit_dispatch": [], "jit_round_trip": [],
                   "state_tracking": []}
        for n in (arrays, arrays + extra):
            dispatched, round_trip = jit_seconds(n, repeats)
            timings["jit_dispatch"].append(dispatched)
            timings["jit_round_trip"].append(round_trip)
            timings["state_tracking"].append(tracking_seconds(n, repeats))
    records = []
    for what, (base, more) in timings.items():
        record = {"bench": "host", "backend": BACKEND, "platform": platform,
                  "what": what, "arrays": arrays, "extra": extra,
                  "seconds": base, "seconds_extra": more,
                  "per_array": (more - base) / extra}
        common.emit(record)
        records.append(record)
    return records


def table(records):
    return common.markdown_table(
        ["measurement", "platform", "arrays", "ms", "with more arrays",
         "ms", "per added array (us)"],
        [[r["what"], r["platform"], r["arrays"], f"{r['seconds'] * 1e3:.3f}",
          r["arrays"] + r["extra"], f"{r['seconds_extra'] * 1e3:.3f}",
          f"{r['per_array'] * 1e6:.2f}"] for r in records])


def main(argv=None):
    parser = argparse.ArgumentParser(description=common.summary(__doc__))
    parser.add_argument("--arrays", type=int, default=360)
    parser.add_argument("--extra", type=int, default=120)
    args = parser.parse_args(argv)
    try:
        records = run(args.arrays, args.extra)
    except ValueError as error:
        parser.error(str(error))
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
