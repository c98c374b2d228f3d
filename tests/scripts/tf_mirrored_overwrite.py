"""``fit()`` with ``use_ema=True, ema_overwrite_frequency=2`` under a
two-replica MirroredStrategy (two logical CPUs), and the same training on
one device with the same global batches.

Also two eager ``apply_gradients`` of SGD(0.1) with an EMA of 0.5 on a
variable made in the strategy's scope, called outside it (a cross-replica
custom step): every replica's copy of the weight and of its average.

Prints one JSON line: ``{"mirrored": {...}, "single": {...},
"cross_replica": {...}}``, the first two the weights, their averages and
the step count after training.
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

import keras_ema_opt  # noqa: E402


def train(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(3, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras_ema_opt.Adam(
            0.05, use_ema=True, ema_momentum=0.5,
            ema_overwrite_frequency=2), loss="mse")
    rng = np.random.RandomState(1)
    x = rng.randn(24, 4).astype("float32")
    y = rng.randn(24, 1).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    # finalize would write the averages over the weights at the end: the
    # overwrites of the steps are what is compared.
    model.optimizer.averaging.finalize = False
    model.fit(data, epochs=2, verbose=0)
    opt = model.optimizer
    return {
        "iterations": int(opt.iterations.numpy()),
        "weights": [np.asarray(v.value).tolist()
                    for v in model.trainable_variables],
        "averages": [np.asarray(opt.average_of(v)).tolist()
                     for v in model.trainable_variables],
    }


def cross_replica(strategy):
    with strategy.scope():
        w = keras.Variable(np.array([1.0, 2.0], "float32"), name="w")
        opt = keras_ema_opt.SGD(0.1, use_ema=True, ema_momentum=0.5)
        opt.build([w])
    for _ in range(2):
        opt.apply_gradients([(tf.constant([1.0, 1.0]), w)])
    average = opt._model_variables_moving_average[0]  # the variable
    copies = (lambda v: [c.numpy().tolist() for c in v.value.values])
    return {"weights": copies(w), "averages": copies(average)}


mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
print(json.dumps({
    "mirrored": train(mirrored),
    "single": train(tf.distribute.get_strategy()),
    "cross_replica": cross_replica(mirrored),
}))
