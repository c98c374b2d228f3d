"""Keras 2 artifacts of models whose layers were frozen during training or
after it, and of same-named layers in sub-models, saved by real tf_keras,
with tf_keras' own optimizer state (the oracle of
``tests/test_migration_frozen.py``).

Usage: make_frozen_artifacts.py OUT_DIR NAME... ; NAME a key of CASES.
Writes OUT_DIR/<name>/{savedmodel/, model.h5, model.keras,
expected.npz}: ``expected.npz`` holds, for every
variable the optimizer was built on, its Adam moments under
``m:<layer path>/<weight>`` and ``v:...`` (the layer path through the
sub-models, as Keras 3 names the variable), and ``iterations``.
"""

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

L = k2.layers


def _towers():
    """Sub-models ``a`` and ``b``, each with a Dense named ``proj``."""
    a = k2.Sequential([k2.Input((4,)), L.Dense(4, name="proj")], name="a")
    b = k2.Sequential([k2.Input((4,)), L.Dense(4, name="proj")], name="b")
    inputs = k2.Input((4,))
    outputs = L.Dense(2, name="out")(b(a(inputs)))
    return k2.Model(inputs, outputs, name="net"), a


def collide_frozen():
    """``a`` frozen in training and when saved."""
    model, a = _towers()
    a.trainable = False
    return model, None


def collide_unfrozen():
    """``a`` frozen in training, unfrozen before saving: which ``proj``
    the state belongs to is not in the files."""
    model, a = _towers()
    a.trainable = False

    def after():
        a.trainable = True
    return model, after


def frozen_after():
    """``d1`` trained, then frozen before saving."""
    model = k2.Sequential([k2.Input((4,)), L.Dense(3, name="d1"),
                           L.Dense(2, name="d2")], name="seq")

    def after():
        model.get_layer("d1").trainable = False
    return model, after


CASES = {"collide_frozen": collide_frozen,
         "collide_unfrozen": collide_unfrozen,
         "frozen_after": frozen_after}


def _paths(model):
    """id(variable) -> Keras 3's path (``net/b/proj/kernel``)."""
    out = {}

    def visit(layer, prefix):
        for sub in getattr(layer, "layers", None) or []:
            visit(sub, f"{prefix}/{sub.name}")
        for weight in layer.weights:
            short = weight.name.split("/")[-1].split(":")[0]
            out.setdefault(id(weight), f"{prefix}/{short}")
    visit(model, model.name)
    return out


def make(out, name):
    folder = os.path.join(out, name)
    os.makedirs(folder)
    model, after = CASES[name]()
    model.compile(optimizer=k2.optimizers.Adam(0.01), loss="mse")
    rng = np.random.RandomState(0)
    for _ in range(3):
        model.train_on_batch(rng.randn(8, 4).astype("float32"),
                             rng.randn(8, 2).astype("float32"))
    opt = model.optimizer
    paths = _paths(model)
    expected = {"iterations": np.asarray(int(opt.iterations.numpy()))}
    for var in model.weights:
        index = opt._index_dict.get(opt._var_key(var))
        if index is None:  # not in the optimizer's variable list
            continue
        expected[f"m:{paths[id(var)]}"] = opt._momentums[index].numpy()
        expected[f"v:{paths[id(var)]}"] = opt._velocities[index].numpy()
    if after is not None:
        after()
    model.save(os.path.join(folder, "savedmodel"), save_format="tf")
    model.save(os.path.join(folder, "model.keras"))
    # An h5 file of same-named layers keeps them apart by their top-level
    # layer (`a/proj/kernel`), and its config marks the frozen ones.
    model.save(os.path.join(folder, "model.h5"))
    np.savez(os.path.join(folder, "expected.npz"), **expected)


if __name__ == "__main__":
    for case in sys.argv[2:]:
        make(sys.argv[1], case)
