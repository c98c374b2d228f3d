"""Make Keras 2 artifacts with real tf_keras, and the oracle continuation.

For each case (optimizer x model), trains a tf_keras model 3 steps with
``train_on_batch``, saves it as a SavedModel, a full ``.h5``, a
``tf.train.Checkpoint`` and a ``save_weights`` TF checkpoint, then continues
5 more steps in tf_keras and records the weights and EMA averages after
them (the oracle). Also writes the batches used.

Usage: make_legacy_artifacts.py OUT_DIR CASE... ; CASE = opt:model where opt
is a key of OPTIMIZERS and model one of mlp, conv, embed, nested
(a Sequential and a functional model inside a functional model), rnn (Bidirectional GRU), custom
(a custom layer class). Writes
OUT_DIR/<case>/{savedmodel/, model.h5, ckpt/, weights/, model.keras,
expected.npz} and
OUT_DIR/<case>/info.json. Without tf_keras it uses tf.keras (Keras 2 in
TensorFlow <= 2.15).
"""

import functools
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

try:
    import tf_keras as k2  # noqa: E402
except ImportError:  # tf.keras 2.12: Keras 2 is tf.keras itself
    k2 = tf.keras

STEPS_BEFORE = 3
STEPS_AFTER = 5


def _new(name, **kw):
    return lambda: getattr(k2.optimizers, name)(**kw)


def _legacy(name, **kw):
    return lambda: getattr(k2.optimizers.legacy, name)(**kw)


OPTIMIZERS = {
    "sgd": _new("SGD", learning_rate=0.05, momentum=0.9),
    "sgd_ema": _new("SGD", learning_rate=0.05, use_ema=True,
                    ema_momentum=0.9),
    "adam": _new("Adam", learning_rate=0.01),
    "adam_ema": _new("Adam", learning_rate=0.01, use_ema=True,
                     ema_momentum=0.9, amsgrad=True),
    "adamw": _new("AdamW", learning_rate=0.01, weight_decay=0.01),
    "adagrad": _new("Adagrad", learning_rate=0.05),
    "adadelta": _new("Adadelta", learning_rate=0.5),
    "adamax": _new("Adamax", learning_rate=0.01),
    "nadam": _new("Nadam", learning_rate=0.01),
    "rmsprop_ema": _new("RMSprop", learning_rate=0.01, momentum=0.5,
                        use_ema=True, ema_momentum=0.8,
                        ema_overwrite_frequency=None),
    "ftrl": _new("Ftrl", learning_rate=0.05),
    "lion": _new("Lion", learning_rate=0.001),
    "adafactor": _new("Adafactor", learning_rate=0.05),
    "L_sgd": _legacy("SGD", learning_rate=0.05, momentum=0.9, decay=0.01),
    "L_adam": _legacy("Adam", learning_rate=0.01),
    "L_adagrad": _legacy("Adagrad", learning_rate=0.05),
    "L_adadelta": _legacy("Adadelta", learning_rate=0.5),
    "L_adamax": _legacy("Adamax", learning_rate=0.01),
    "L_nadam": _legacy("Nadam", learning_rate=0.01),
    "L_rmsprop": _legacy("RMSprop", learning_rate=0.01),
    "L_rmsprop_m": _legacy("RMSprop", learning_rate=0.01, momentum=0.5,
                           centered=True),
    "L_ftrl": _legacy("Ftrl", learning_rate=0.05,
                      l1_regularization_strength=0.01,
                      l2_regularization_strength=0.02, beta=0.1),
}


def _model(kind):
    layers = k2.layers
    if kind == "mlp":
        return k2.Sequential([
            layers.InputLayer(input_shape=(6,)),
            layers.Dense(5, activation="relu", name="d1"),
            layers.Dense(2, name="d2"),
        ], name="mlp")
    if kind == "conv":
        inputs = k2.Input((6, 6, 1))
        x = layers.Conv2D(3, 3, use_bias=False, name="c1")(inputs)
        # Non-fused: the fused kernel applies Bessel's correction to the
        # moving variance, which Keras 3 does not (docs/migration.md).
        x = layers.BatchNormalization(fused=False, name="bn")(x)
        x = layers.Flatten()(x)
        outputs = layers.Dense(2, name="out")(x)
        return k2.Model(inputs, outputs, name="conv")
    if kind == "embed":
        inputs = k2.Input((4,), dtype="int32")
        x = layers.Embedding(10, 3, name="emb")(inputs)
        x = layers.LSTM(4, name="lstm")(x)
        outputs = layers.Dense(2, name="out")(x)
        return k2.Model(inputs, outputs, name="embed")
    if kind == "nested":
        inner = k2.Sequential([
            layers.Dense(5, activation="relu", name="d1"),
            layers.Dense(4, activation="tanh", name="d2"),
        ], name="inner")
        sub_inputs = k2.Input((4,))
        sub = k2.Model(sub_inputs, layers.Dense(3, name="d3")(sub_inputs),
                       name="sub")
        inputs = k2.Input((6,))
        outputs = layers.Dense(2, name="out")(sub(inner(inputs)))
        return k2.Model(inputs, outputs, name="nested")
    if kind == "rnn":
        inputs = k2.Input((4,), dtype="int32")
        x = layers.Embedding(10, 3, name="emb")(inputs)
        x = layers.Bidirectional(layers.GRU(4, name="gru"), name="bi")(x)
        outputs = layers.Dense(2, name="out")(x)
        return k2.Model(inputs, outputs, name="rnn")
    if kind == "custom":
        inputs = k2.Input((6,))
        x = layers.Dense(5, name="d1")(inputs)
        x = _scale_class()(init=0.5, name="scale")(x)
        outputs = layers.Dense(2, name="out")(x)
        return k2.Model(inputs, outputs, name="custom")
    raise ValueError(kind)


@functools.lru_cache(maxsize=None)  # registered once per process
def _scale_class():
    """A custom layer with weights of its own (``keo_test>Scale``); its
    Keras 3 twin is ``tests/legacy_custom_objects.py``."""

    @k2.utils.register_keras_serializable(package="keo_test")
    class Scale(k2.layers.Layer):
        def __init__(self, init=1.0, **kwargs):
            super().__init__(**kwargs)
            self.init = init

        def build(self, input_shape):
            self.w = self.add_weight(
                name="w", shape=(input_shape[-1],),
                initializer=k2.initializers.Constant(self.init))
            self.b = self.add_weight(name="b", shape=(input_shape[-1],),
                                     initializer="zeros")

        def call(self, x):
            return x * self.w + self.b

        def get_config(self):
            return {**super().get_config(), "init": self.init}

    return Scale


def _batches(kind, n):
    rng = np.random.RandomState(7)
    out = []
    for _ in range(n):
        if kind in ("mlp", "nested", "custom"):
            x = rng.randn(8, 6).astype("float32")
        elif kind == "conv":
            x = rng.randn(8, 6, 6, 1).astype("float32")
        else:
            # Every token in every batch: OptimizerV2 applies an
            # Embedding's sparse gradient lazily (rows absent from a batch
            # are not moved), Keras 3 densely; with all rows present both
            # rules agree, and the comparison tests the migration.
            tokens = np.concatenate([np.arange(10), rng.randint(0, 10, 22)])
            x = rng.permutation(tokens).reshape(8, 4).astype("int32")
        out.append((x, rng.randn(8, 2).astype("float32")))
    return out


def _averages(opt):
    averages = getattr(opt, "_model_variables_moving_average", None) or []
    return [a.numpy() for a in averages]


def make(out, case):
    opt_key, kind = case.split(":")
    tf.random.set_seed(0)
    k2.utils.set_random_seed(0)
    model = _model(kind)
    # Eager steps: tf_keras' Nadam `_u_product` is wrong under tf.function
    # (reference legacy-formats §4.3); the eager run is the right oracle.
    model.compile(optimizer=OPTIMIZERS[opt_key](), loss="mse",
                  run_eagerly=opt_key == "nadam")
    batches = _batches(kind, STEPS_BEFORE + STEPS_AFTER)
    for x, y in batches[:STEPS_BEFORE]:
        model.train_on_batch(x, y)
    folder = os.path.join(out, case.replace(":", "-"))
    os.makedirs(folder, exist_ok=True)
    model.save(os.path.join(folder, "savedmodel"), save_format="tf")
    model.save(os.path.join(folder, "model.h5"), save_format="h5")
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        os.path.join(folder, "ckpt", "ckpt"))
    model.save_weights(os.path.join(folder, "weights", "w"), save_format="tf")
    if hasattr(k2.saving, "save_model"):  # the .keras zip, Keras 2.13 on
        model.save(os.path.join(folder, "model.keras"))
    before = [w.numpy() for w in model.weights]
    for x, y in batches[STEPS_BEFORE:]:
        model.train_on_batch(x, y)
    arrays = {f"x{i}": x for i, (x, _) in enumerate(batches[STEPS_BEFORE:])}
    arrays.update(
        {f"y{i}": y for i, (_, y) in enumerate(batches[STEPS_BEFORE:])})
    arrays.update({f"before{i}": w for i, w in enumerate(before)})
    arrays.update({f"after{i}": w.numpy() for i, w in enumerate(
        model.weights)})
    arrays.update({f"average{i}": a for i, a in enumerate(
        _averages(model.optimizer))})
    np.savez(os.path.join(folder, "expected.npz"), **arrays)
    with open(os.path.join(folder, "info.json"), "w") as f:
        json.dump({
            "case": case,
            "weights": [w.name for w in model.weights],
            "trainable": [w.name for w in model.trainable_weights],
            "iterations": int(model.optimizer.iterations.numpy()),
            "tensorflow": tf.__version__,
        }, f)


if __name__ == "__main__":
    for case in sys.argv[2:]:
        make(sys.argv[1], case)
    print("ok")
