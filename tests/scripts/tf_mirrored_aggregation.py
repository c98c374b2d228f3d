"""apply_gradients / aggregate_gradients under a two-replica MirroredStrategy
(two logical CPUs), with tf_keras under the same strategy as the oracle.

Prints one JSON line with the results.
"""

import json
import os

os.environ["KERAS_BACKEND"] = "tensorflow"
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tf_keras  # noqa: E402

import keras_ema_opt  # noqa: E402
from keras2_idioms import keras2_momentum_sgd  # noqa: E402

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def replica_gradient():
    # Replica 0 sees 1, replica 1 sees 2: the sum is 3, the mean 1.5.
    ctx = tf.distribute.get_replica_context()
    return tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32) * tf.ones(2)


def run(optimizer, variable, skip, caller_mean):
    @tf.function
    def step():
        def replica_fn():
            g = replica_gradient()
            if caller_mean:
                g = tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.MEAN, g
                )
            optimizer.apply_gradients(
                [(g, variable)], skip_gradients_aggregation=skip
            )

        strategy.run(replica_fn)

    step()
    tf_variable = (
        variable.value if isinstance(variable, keras.Variable) else variable
    )
    return [np.asarray(v).tolist()
            for v in strategy.experimental_local_results(tf_variable)]


def aggregated(optimizer, variable):
    @tf.function
    def fn():
        return strategy.run(
            lambda: optimizer.aggregate_gradients(
                [(replica_gradient(), variable)]
            )[0][0]
        )

    return [np.asarray(v).tolist()
            for v in strategy.experimental_local_results(fn())]


results = {}
for label, skip, mean in [("default", False, False), ("skip_mean", True, True)]:
    with strategy.scope():
        ours_v = keras.Variable(np.zeros(2, "float32"))
        ours = keras_ema_opt.SGD(learning_rate=1.0)
        ours.build([ours_v])
        theirs_v = tf.Variable(np.zeros(2, "float32"))
        theirs = tf_keras.optimizers.SGD(learning_rate=1.0)
        theirs.build([theirs_v])
    results[label] = {
        "ours": run(ours, ours_v, skip, mean),
        "tf_keras": run(theirs, theirs_v, skip, mean),
    }
with strategy.scope():
    v = keras.Variable(np.zeros(2, "float32"))
    opt = keras_ema_opt.SGD()
    opt.build([v])
results["aggregate"] = aggregated(opt, v.value)


def built_in_the_step(make_optimizer, make, averages=False):
    """A custom loop's first ``apply_gradients`` in ``strategy.run`` inside
    a ``tf.function`` builds the optimizer there (three steps; each
    replica's copy of the weight, and of its average with ``use_ema``)."""
    with strategy.scope():
        w = make(np.array([1.0, 2.0, 3.0], "float32"))
        opt = make_optimizer()

    def replica_fn(x):
        with tf.GradientTape() as tape:
            # Each replica its own loss: replica_gradient()[0] is 1 or 2.
            loss = tf.reduce_sum(w * w * x) * replica_gradient()[0]
        opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))

    @tf.function
    def step(x):
        strategy.run(replica_fn, args=(x,))

    for i in range(3):
        step(tf.constant(1.0 + i))
    held = [w] + (opt._model_variables_moving_average if averages else [])
    return [[np.asarray(c).tolist()
             for c in strategy.experimental_local_results(
                 v.value if isinstance(v, keras.Variable) else v)]
            for v in held] + [int(opt.iterations.numpy())]


EMA = dict(use_ema=True, ema_momentum=0.5, clipnorm=0.5,
           ema_overwrite_frequency=2)
for label, kwargs in [("built_in_step", {}), ("built_in_step_ema", EMA)]:
    results[label] = {
        "ours": built_in_the_step(
            lambda: keras_ema_opt.Adam(0.1, **kwargs), keras.Variable,
            averages=bool(kwargs)),
        "tf_keras": built_in_the_step(
            lambda: tf_keras.optimizers.Adam(0.1, **kwargs), tf.Variable,
            averages=bool(kwargs)),
    }
# A Keras 2 subclass's own slots, made in its `build` after
# `super().build()`, were made in the trace: the step failed as above.
results["subclass_built_in_step"] = {
    "ours": built_in_the_step(
        lambda: keras2_momentum_sgd(keras_ema_opt.Optimizer, tf)(0.1),
        keras.Variable),
    "tf_keras": built_in_the_step(
        lambda: keras2_momentum_sgd(tf_keras.optimizers.Optimizer, tf)(
            0.1, jit_compile=False), tf.Variable),
}
print(json.dumps(results))
