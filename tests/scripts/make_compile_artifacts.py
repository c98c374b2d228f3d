"""Keras 2 artifacts of what a model is compiled with, and of models with
no optimizer state, saved by real tf_keras, with tf_keras' own results of
the next training step (the oracle of ``tests/test_migration_compile.py``).

Usage: make_compile_artifacts.py OUT_DIR NAME... ; NAME a key of CASES.
Writes OUT_DIR/<name>/{model.h5, savedmodel/, model.keras, ckpt/,
expected.json}:
``expected.json`` holds tf_keras' ``train_on_batch`` logs (loss and
metrics) of the batch in it, taken right after saving, and the weights
after that step.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

try:
    import tf_keras as k2  # noqa: E402
except ImportError:  # tf.keras 2.12
    k2 = tf.keras


def my_loss(y_true, y_pred):
    """A custom loss, stored in the files by its name only."""
    return tf.reduce_mean(tf.abs(y_true - y_pred), axis=-1) * 2.0


def _classifier():
    model = k2.Sequential([k2.Input((4,)), k2.layers.Dense(3, name="d")])
    model.compile(
        optimizer=k2.optimizers.Adam(0.01),
        loss=k2.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy", k2.metrics.SparseTopKCategoricalAccuracy(k=2)])
    rng = np.random.RandomState(0)
    return model, [(rng.randn(8, 4).astype("float32"),
                    rng.randint(0, 3, 8).astype("int32")) for _ in range(3)]


def _metric_names():
    # As users spell them: a name Keras 3's compile resolves by the
    # outputs ("acc") and a metric function, kept so in .keras files.
    # Six classes: the function's default k is 5 (torch's topk needs k
    # classes at least).
    model = k2.Sequential([k2.Input((4,)), k2.layers.Dense(6, name="d")])
    rng = np.random.RandomState(3)
    batches = [(rng.randn(8, 4).astype("float32"),
                rng.randint(0, 6, 8).astype("int32")) for _ in range(3)]
    model.compile(
        optimizer=k2.optimizers.Adam(0.01),
        loss=k2.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["acc", k2.metrics.sparse_top_k_categorical_accuracy])
    return model, batches


def _regression(loss, metrics, optimizer=None):
    def make():
        model = k2.Sequential([k2.Input((4,)), k2.layers.Dense(2, name="d")])
        model.compile(optimizer=optimizer() if optimizer else
                      k2.optimizers.SGD(0.05, momentum=0.9),
                      loss=loss(), metrics=metrics())
        rng = np.random.RandomState(1)
        return model, [(rng.randn(8, 4).astype("float32"),
                        rng.randn(8, 2).astype("float32")) for _ in range(3)]
    return make


def _two_outputs(**units):
    """A model of two Dense outputs on one hidden layer: ``units`` by
    output name, in order."""
    inputs = k2.Input((4,))
    hidden = k2.layers.Dense(5, name="h")(inputs)
    return k2.Model(inputs, [k2.layers.Dense(n, name=name)(hidden)
                             for name, n in units.items()])


def _multi_output(as_dict):
    # Keras 2 named each output's metric objects after the output
    # (`reg_mae`), where Keras 3 adds the output's name itself.
    def make():
        model = _two_outputs(reg=2, cls=3)
        losses = ["mse", k2.losses.SparseCategoricalCrossentropy(
            from_logits=True)]
        metrics = [["mae"], ["accuracy"]]
        if as_dict:
            losses = dict(zip(["reg", "cls"], losses))
            metrics = dict(zip(["reg", "cls"], metrics))
        model.compile(optimizer=k2.optimizers.Adam(0.01), loss=losses,
                      metrics=metrics, loss_weights=[1.0, 0.5])
        rng = np.random.RandomState(4)
        return model, [(rng.randn(8, 4).astype("float32"),
                        [rng.randn(8, 2).astype("float32"),
                         rng.randint(0, 3, 8).astype("int32")])
                       for _ in range(3)]
    return make


def _one_loss_weighted(as_dict):
    # One loss for two outputs, with a weight for each: Keras 2 applied
    # the loss to every output (Keras 3 takes a loss per weight).
    def make():
        model = _two_outputs(a=2, b=2)
        weights = [1.0, 0.3]
        if as_dict:
            weights = dict(zip(["a", "b"], weights))
        model.compile(optimizer=k2.optimizers.Adam(0.01), loss="mse",
                      loss_weights=weights)
        rng = np.random.RandomState(5)
        return model, [(rng.randn(8, 4).astype("float32"),
                        [rng.randn(8, 2).astype("float32"),
                         rng.randn(8, 2).astype("float32")])
                       for _ in range(3)]
    return make


def _renorm():
    # Batch renormalization, which Keras 3.15 took back (its weights and
    # rule are tf_keras'): migrated with its arguments, not refused.
    model = k2.Sequential([
        k2.Input((4,)), k2.layers.Dense(3, name="h"),
        k2.layers.BatchNormalization(
            name="bn", momentum=0.8, renorm=True, renorm_momentum=0.9,
            renorm_clipping={"rmax": 1.5, "rmin": 0.7, "dmax": 0.5}),
        k2.layers.Dense(2, name="d")])
    model.compile(optimizer=k2.optimizers.SGD(0.05, momentum=0.9),
                  loss="mse")
    rng = np.random.RandomState(6)
    return model, [(rng.randn(16, 4).astype("float32"),
                    rng.randn(16, 2).astype("float32")) for _ in range(3)]


def _mixed(optimizer):
    # Targets far beyond float16: the first steps overflow and halve the
    # dynamic loss scale (32768 -> 4096), state an .h5 does not keep.
    def make():
        model = k2.Sequential([k2.Input((4,)),
                               k2.layers.Dense(2, name="d")])
        model.compile(optimizer=optimizer(), loss="mse")
        rng = np.random.RandomState(2)
        return model, [(rng.randn(8, 4).astype("float32"),
                        np.full((8, 2), 3e4, "float32"))
                       for _ in range(3)] + [
            (rng.randn(8, 4).astype("float32"),
             rng.randn(8, 2).astype("float32"))]
    return make


CASES = {
    # Loss objects carry Keras 2's `reduction="auto"` and `fn`.
    "loss_objects": _classifier,
    "metric_objects": _regression(
        lambda: k2.losses.MeanSquaredError(),
        lambda: [k2.metrics.MeanAbsoluteError(), "mse"]),
    "custom_loss": _regression(lambda: my_loss, lambda: ["mae"]),
    "metric_names": _metric_names,
    "multi_output": _multi_output(as_dict=False),
    "multi_output_dict": _multi_output(as_dict=True),
    # Arguments Keras 3.15's classes leave out of their configs.
    "huber": _regression(lambda: k2.losses.Huber(delta=0.5), lambda: None),
    "cosine_axis": _regression(
        lambda: k2.losses.CosineSimilarity(axis=0), lambda: None),
    "one_loss_weighted": _one_loss_weighted(as_dict=False),
    "one_loss_weighted_dict": _one_loss_weighted(as_dict=True),
    # Compiled, saved before the first step: no optimizer state anywhere.
    "fresh": _regression(lambda: "mse", lambda: None,
                         lambda: k2.optimizers.legacy.SGD(0.05,
                                                          momentum=0.9)),
    "renorm": _renorm,
    "mixed": _mixed(lambda: k2.optimizers.Adam(0.01)),
    # OptimizerV2's wrapper: its bare checkpoint names no class.
    "mixed_v2": _mixed(lambda: k2.optimizers.legacy.Adam(0.01)),
}
STEPS_BEFORE = {"fresh": 0, "mixed": 3, "mixed_v2": 3}


def make(out, name):
    tf.random.set_seed(0)
    k2.utils.set_random_seed(0)
    k2.mixed_precision.set_global_policy(
        "mixed_float16" if name.startswith("mixed") else "float32")
    model, batches = CASES[name]()
    for x, y in batches[:STEPS_BEFORE.get(name, 2)]:
        model.train_on_batch(x, y)
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    model.save(os.path.join(folder, "savedmodel"), save_format="tf")
    model.save(os.path.join(folder, "model.h5"), save_format="h5")
    if name == "fresh":
        model.save(os.path.join(folder, "no_optimizer.h5"),
                   include_optimizer=False)
        model.save(os.path.join(folder, "no_optimizer"), save_format="tf",
                   include_optimizer=False)
        k2.models.clone_model(model).save(
            os.path.join(folder, "uncompiled.keras"))
    else:
        if not name.startswith("mixed"):
            model.save(os.path.join(folder, "model.keras"))
        # As TensorFlow's checkpoint guide writes them: the model under
        # a key of the user's choosing.
        tf.train.Checkpoint(step=tf.Variable(7), optimizer=model.optimizer,
                            net=model).write(
                                os.path.join(folder, "ckpt", "ckpt"))
    scale = getattr(model.optimizer, "loss_scale", None)
    scale = None if scale is None else float(scale)
    x, y = batches[STEPS_BEFORE.get(name, 2)]
    logs = model.train_on_batch(x, y, return_dict=True)
    more = {}
    if name.startswith("mixed"):
        # Two more steps: one that overflows again (skipped: Keras 2
        # counted it in `iterations`, Keras 3's wrapper does not), then
        # one applied, whose Adam step reads that count.
        rng = np.random.RandomState(3)
        more_batches = [(rng.randn(8, 4).astype("float32"),
                         np.full((8, 2), 3e4, "float32")),
                        (rng.randn(8, 4).astype("float32"),
                         rng.randn(8, 2).astype("float32"))]
        for bx, by in more_batches:
            model.train_on_batch(bx, by)
        more = {"more": {
            "batches": [[bx.tolist(), by.tolist()] for bx, by in more_batches],
            "after": [w.numpy().tolist() for w in model.weights],
            "iterations": int(model.optimizer.iterations.numpy()),
            "loss_scale": float(model.optimizer.loss_scale)}}
    with open(os.path.join(folder, "expected.json"), "w") as f:
        json.dump({**more, "x": x.tolist(),
                   # several outputs: a list of their targets
                   "y": [a.tolist() for a in y] if isinstance(y, list)
                   else y.tolist(), "outputs": isinstance(y, list),
                   "logs": {k: float(v) for k, v in logs.items()},
                   "after": [w.numpy().tolist() for w in model.weights],
                   "iterations": int(model.optimizer.iterations.numpy()),
                   "loss_scale": scale},
                  f)


if __name__ == "__main__":
    for case in sys.argv[2:]:
        make(sys.argv[1], case)
    print("ok")
