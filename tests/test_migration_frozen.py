"""Migration of models with frozen layers and same-named sub-model layers,
against tf_keras' own optimizer state (artifacts and oracle made by real
tf_keras in ``tests/scripts/make_frozen_artifacts.py``), and of ``.keras``
files.

A Keras 2 optimizer stores one list per slot whose element *i* belongs to
the *i*-th variable it was built on, a list it does not store: where
same-named layers were partly frozen, the state must land on the layer it
belongs to, or the migration must say it cannot tell (never guess)."""

import os

import numpy as np
import pytest

pytest.importorskip("tf_keras")

import keras  # noqa: E402

from keras_ema_opt import savedmodel  # noqa: E402
from keras_ema_opt.errors import LegacyFormatError  # noqa: E402
from keras_ema_opt.errors import LegacyStateError  # noqa: E402
from conftest import ROOT  # noqa: E402
from conftest import made_by_script  # noqa: E402
from conftest import to_numpy  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "scripts", "make_frozen_artifacts.py")
CASES = ["collide_frozen", "collide_unfrozen", "frozen_after"]


@pytest.fixture(scope="module")
def artifacts():
    return made_by_script(SCRIPT, CASES)


def _variable(model, path):
    """``net/b/proj/kernel`` -> that variable of the Keras 3 model."""
    *layers, weight = path.split("/")[1:]
    layer = model
    for name in layers:
        layer = layer.get_layer(name)
    return getattr(layer, weight)


def _moments(model, variable):
    opt = model.optimizer
    index = opt._get_variable_index(variable)
    return (to_numpy(opt._momentums[index]),
            to_numpy(opt._velocities[index]))


def _check_state(model, expected):
    assert int(to_numpy(model.optimizer.iterations)) == int(
        expected["iterations"])
    keys = [k[2:] for k in expected.files if k.startswith("m:")]
    assert keys
    for path in keys:
        variable = _variable(model, path)
        if not variable.trainable:
            continue
        m, v = _moments(model, variable)
        np.testing.assert_array_equal(m, expected[f"m:{path}"], err_msg=path)
        np.testing.assert_array_equal(v, expected[f"v:{path}"], err_msg=path)


@pytest.mark.parametrize("fmt", ["savedmodel", "model.h5"])
def test_same_named_layer_frozen_in_training_gets_no_other_layers_state(
        artifacts, tmp_path, fmt):
    # Sub-models `a` and `b` both hold a Dense `proj`; `a` was frozen in
    # training and when saved: the moments of the one `proj` trained are
    # b's (the first `proj` in model order is a's). A SavedModel lists its
    # trainable variables; an h5 file's model config marks `a` frozen.
    folder = os.path.join(artifacts, "collide_frozen")
    expected = np.load(os.path.join(folder, "expected.npz"))
    record = savedmodel.inspect(os.path.join(folder, fmt))
    owners = {s.weight for s in record.optimizer.slots}
    # (a is the model's first layer with weights, b its second; an h5
    # file keys them by the layer's name)
    first = "layer_with_weights-0/" if fmt == "savedmodel" else "a/"
    assert not any(w.startswith(first) for w in owners), owners
    out = tmp_path / "new.keras"
    savedmodel.migrate(os.path.join(folder, fmt), str(out))
    model = keras.saving.load_model(str(out))
    _check_state(model, expected)
    b = _variable(model, "net/b/proj/kernel")
    assert np.any(_moments(model, b)[0])


@pytest.mark.parametrize("fmt", ["savedmodel", "model.h5"])
def test_same_named_layer_unfrozen_after_training_is_refused(artifacts,
                                                             tmp_path, fmt):
    # `a` was frozen in training and unfrozen before saving: the files do
    # not say which `proj` the one set of moments belongs to (the h5 file
    # is read: a LegacyStateError, not a LegacyFormatError).
    folder = os.path.join(artifacts, "collide_unfrozen")
    out = tmp_path / "new.keras"
    with pytest.raises(LegacyStateError, match="proj/kernel") as info:
        savedmodel.migrate(os.path.join(folder, fmt), str(out))
    assert not isinstance(info.value, LegacyFormatError)
    assert "frozen" in str(info.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", ["savedmodel", "model.h5"])
def test_layer_frozen_after_training_migrates_with_a_warning(artifacts,
                                                             tmp_path, fmt):
    folder = os.path.join(artifacts, "frozen_after")
    expected = np.load(os.path.join(folder, "expected.npz"))
    out = tmp_path / "new.keras"
    with pytest.warns(UserWarning, match=r"d1/kernel.*not migrated"):
        savedmodel.migrate(os.path.join(folder, fmt), str(out))
    model = keras.saving.load_model(str(out))
    assert not _variable(model, "seq/d1/kernel").trainable
    _check_state(model, expected)  # d2's moments, exactly


def test_tf_keras_keras_file_migrates_with_a_built_optimizer(artifacts,
                                                              tmp_path):
    folder = os.path.join(artifacts, "frozen_after")
    out = tmp_path / "new.keras"
    with pytest.warns(UserWarning, match="not migrated from a tf_keras"):
        savedmodel.migrate(os.path.join(folder, "model.keras"), str(out))
    model = keras.saving.load_model(str(out))
    assert model.optimizer.built
    assert int(to_numpy(model.optimizer.iterations)) == 0


def test_keras3_file_is_named_as_such(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    src = tmp_path / "k3.keras"
    model.save(str(src))
    with pytest.raises(LegacyFormatError,
                       match=r"written by Keras 3.*needs no migration"):
        savedmodel.migrate(str(src), str(tmp_path / "out.keras"))
    assert sorted(os.listdir(tmp_path)) == ["k3.keras"]
