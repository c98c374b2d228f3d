"""Keras 2 training state migrated into Keras 3 resumes exactly.

Artifacts are made by real tf_keras during the test run
(``tests/scripts/make_legacy_artifacts.py``, in a subprocess, cached per
session under ``.pytest-fixtures/``): each case trains 3 steps, saves a
SavedModel, a full ``.h5``, a ``tf.train.Checkpoint`` and a ``save_weights``
checkpoint, then continues 5 steps in tf_keras (the oracle). Here each
artifact is migrated under the active backend, trained the same 5 steps,
and the weights and EMA averages compared within 1e-6 (absolute plus
relative).
"""

import hashlib
import json
import os
import subprocess
import sys

import h5py
import keras
import numpy as np
import pytest

import keras_ema_opt
from keras_ema_opt.compat import from_legacy_config
from keras_ema_opt.savedmodel import load_legacy
from keras_ema_opt.savedmodel import model_from_config
from tests.conftest import to_numpy

pytest.importorskip("tf_keras")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "make_legacy_artifacts.py")

NEW = ["sgd", "sgd_ema", "adam", "adam_ema", "adamw", "adagrad", "adadelta",
       "adamax", "nadam", "rmsprop_ema", "ftrl", "lion", "adafactor"]
LEGACY = ["L_sgd", "L_adam", "L_adagrad", "L_adadelta", "L_adamax",
          "L_nadam", "L_rmsprop", "L_rmsprop_m", "L_ftrl"]
FORMATS = {"savedmodel": "savedmodel", "h5": "model.h5",
           "checkpoint": "ckpt/ckpt", "save_weights": "weights/w"}
# Every optimizer on the MLP in every format; the conv net with
# BatchNormalization and the Embedding+LSTM model with a spread of
# optimizers (EMA on and off, new and OptimizerV2), in every format.
CASES = [f"{o}:mlp" for o in NEW + LEGACY] + [
    f"{o}:{m}" for m in ("conv", "embed")
    for o in ("sgd_ema", "adam_ema", "nadam", "rmsprop_ema", "adafactor",
              "L_sgd", "L_nadam", "L_rmsprop", "L_adagrad")]


def _digest():
    with open(SCRIPT, "rb") as f:
        text = f.read()
    import tf_keras

    return hashlib.sha1(
        text + tf_keras.__version__.encode() + " ".join(CASES).encode()
    ).hexdigest()[:12]


@pytest.fixture(scope="session")
def artifacts():
    """Made once per machine and script version (CI runs the backends in
    turn over the same clone)."""
    folder = os.path.join(ROOT, ".pytest-fixtures", "legacy-" + _digest())
    done = os.path.join(folder, "DONE")
    if not os.path.exists(done):
        os.makedirs(folder, exist_ok=True)
        env = dict(os.environ, KERAS_BACKEND="tensorflow",
                   CUDA_VISIBLE_DEVICES="")
        subprocess.run([sys.executable, SCRIPT, folder] + CASES, check=True,
                       env=env, timeout=900, capture_output=True)
        open(done, "w").close()
    return folder


def _user_model(folder):
    """What a user does for a bare checkpoint: build the model and compile
    it with the optimizer it was trained with."""
    with h5py.File(os.path.join(folder, "model.h5"), "r") as f:
        config = f.attrs["model_config"]
        training = json.loads(f.attrs["training_config"])

    def build():
        model = model_from_config(config)
        model.compile(optimizer=from_legacy_config(
            training["optimizer_config"]), loss="mse")
        return model

    return build


def _find(model, name):
    name = name.split(":")[0]
    found = [w for w in model.weights
             if w.path == name or w.path.endswith("/" + name)]
    assert len(found) == 1, (name, [w.path for w in model.weights])
    return found[0]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", CASES)
def test_migrated_training_continues_like_tf_keras(artifacts, case, fmt):
    folder = os.path.join(artifacts, case.replace(":", "-"))
    expected = np.load(os.path.join(folder, "expected.npz"))
    with open(os.path.join(folder, "info.json")) as f:
        info = json.load(f)
    bare = fmt in ("checkpoint", "save_weights")
    model = load_legacy(os.path.join(folder, FORMATS[fmt]),
                        model=_user_model(folder) if bare else None)
    weights = [_find(model, n) for n in info["weights"]]
    trainable = [_find(model, n) for n in info["trainable"]]
    for i, var in enumerate(weights):
        np.testing.assert_array_equal(to_numpy(var), expected[f"before{i}"],
                                      err_msg=var.path)
    assert int(to_numpy(model.optimizer.iterations)) == info["iterations"] - 5
    for i in range(5):
        model.train_on_batch(expected[f"x{i}"], expected[f"y{i}"])
    for i, var in enumerate(weights):
        np.testing.assert_allclose(to_numpy(var), expected[f"after{i}"],
                                   rtol=1e-6, atol=1e-6, err_msg=var.path)
    averages = [k for k in expected.files if k.startswith("average")]
    assert bool(averages) == ("ema" in case)
    for i, var in enumerate(trainable):
        if f"average{i}" in expected.files:
            np.testing.assert_allclose(
                to_numpy(model.optimizer.average_of(var)),
                expected[f"average{i}"], rtol=1e-6, atol=1e-6,
                err_msg=f"average of {var.path}")
