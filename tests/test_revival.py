"""tf.saved_model.load of Keras 2 SavedModels written by tf_keras in the test
run gives keras_ema_opt.compat.RestoredOptimizer, with tf_keras present and
blocked, and to_keras() resumes training like tf_keras does."""

from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import last_json
from conftest import run_python
from conftest import to_numpy

tf_keras = pytest.importorskip("tf_keras")
tf = pytest.importorskip("tensorflow")

import keras_ema_opt  # noqa: E402
from keras_ema_opt import compat  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "revive_saved_models.py"

CASES = {
    "new_adam_ema": lambda: tf_keras.optimizers.Adam(
        0.01, use_ema=True, ema_momentum=0.9, jit_compile=False),
    "new_sgd": lambda: tf_keras.optimizers.SGD(0.05, momentum=0.9,
                                               jit_compile=False),
    "legacy_sgd": lambda: tf_keras.optimizers.legacy.SGD(0.05, momentum=0.9),
    "legacy_adam": lambda: tf_keras.optimizers.legacy.Adam(0.01),
    # Adam's slots and hyperparameters: told by its variables' names
    # (`Adamax/iter`); it came back as an Adam without a word.
    "legacy_adamax": lambda: tf_keras.optimizers.legacy.Adamax(0.01),
    # Variables named after no class: Adam or Adamax, not told.
    "legacy_adam_renamed": lambda: tf_keras.optimizers.legacy.Adam(
        0.01, name="my_opt"),
    # `iterations` read before the first step: `iter:0`, made outside the
    # class's name scope; the other variables tell the class.
    "legacy_adamax_iterations_read": lambda: _iterations_read(
        tf_keras.optimizers.legacy.Adamax(0.01)),
    # Named after a class it is not: its slots tell it.
    "legacy_sgd_named_adamax": lambda: tf_keras.optimizers.legacy.SGD(
        0.05, momentum=0.9, name="adamax"),
    # Told from their state alone: Nadam by its momentum_cache (which is
    # state to restore, not an argument), centered RMSprop by its `mg`
    # slots, Ftrl's regularization strengths from its variables.
    "legacy_nadam": lambda: tf_keras.optimizers.legacy.Nadam(0.01),
    "legacy_rmsprop_centered": lambda: tf_keras.optimizers.legacy.RMSprop(
        0.01, momentum=0.5, centered=True),
    "legacy_ftrl": lambda: tf_keras.optimizers.legacy.Ftrl(
        0.05, l1_regularization_strength=0.01,
        l2_regularization_strength=0.02, beta=0.1),
}
def _iterations_read(optimizer):
    optimizer.iterations  # as tf.summary.experimental.set_step(...) does
    return optimizer


# New optimizers keep only lr in their variables; legacy Adam and Adamax
# share slot names, told apart by the names of their variables only:
# these need the config (keras_metadata.pb).
CONFIG_NEEDED = {"new_adam_ema", "new_sgd", "legacy_adam_renamed"}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 2)).astype("float32")
    return x, y


def _tf_keras_model(optimizer):
    model = tf_keras.Sequential([
        tf_keras.Input((4,)), tf_keras.layers.Dense(3, name="d1"),
        tf_keras.layers.Dense(2, name="d2")], name="seq")
    model.compile(optimizer=optimizer, loss="mse")
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each case: the SavedModel, its tf_keras model, and its state."""
    folder = tmp_path_factory.mktemp("savedmodels")
    x, y = _data()
    out = {}
    for key, make in CASES.items():
        tf_keras.utils.set_random_seed(0)
        model = _tf_keras_model(make())
        model.fit(x[:24], y[:24], batch_size=8, epochs=1, verbose=0)
        path = str(folder / key)
        model.save(path, save_format="tf")
        config = tf_keras.optimizers.serialize(model.optimizer)
        out[key] = (path, model, config)
    return out


def _truth(model):
    """{(slot, 'd1/kernel'): value} from the live tf_keras optimizer."""
    opt = model.optimizer
    truth = {}
    if hasattr(opt, "get_slot_names"):
        for var in model.trainable_variables:
            for slot in opt.get_slot_names():
                truth[(slot, var.name[:-2])] = opt.get_slot(var, slot).numpy()
    else:
        for var in opt.variables():
            parts = var.name[:-2].split("/")
            if len(parts) > 2 and parts[1] != "average":
                truth[(parts[1], "/".join(parts[2:]))] = var.numpy()
    return truth


def test_in_process_revival_gives_our_restored_optimizer(saved):
    for key, (path, model, _) in saved.items():
        restored = tf.saved_model.load(path).optimizer
        assert type(restored) is compat.RestoredOptimizer, key
        assert restored.iterations == 3
        assert restored.legacy is key.startswith("legacy")
        assert restored.learning_rate == pytest.approx(
            float(model.optimizer.learning_rate.numpy()))
        truth = _truth(model)
        assert set(restored.slots) == set(truth), key
        for k, v in truth.items():
            np.testing.assert_array_equal(restored.slots[k], v)
        if key == "new_adam_ema":
            averages = {v.name[:-2].split("/", 2)[2]: v.numpy() for v in
                        model.optimizer._model_variables_moving_average}
            assert set(restored.averages) == set(averages)
            for k, v in averages.items():
                np.testing.assert_array_equal(restored.averages[k], v)


def test_revival_without_tf_keras(saved):
    paths = [saved[k][0] for k in CASES]
    result = last_json(run_python(SCRIPT, "block", *paths))
    assert result["tf_keras_loaded"] is False
    for key in CASES:
        path, model, _ = saved[key]
        entry = result[path]
        assert entry["type"] == "RestoredOptimizer"
        assert entry["iterations"] == 3
        truth = _truth(model)
        assert len(entry["slots"]) == len(truth)
        for (slot, name), value in truth.items():
            np.testing.assert_array_equal(entry["slots"][f"{slot}|{name}"],
                                          value)


def test_get_config_points_to_to_keras(saved):
    restored = tf.saved_model.load(saved["legacy_sgd"][0]).optimizer
    with pytest.raises(NotImplementedError, match="to_keras"):
        restored.get_config()


@pytest.mark.parametrize("key", sorted(CASES))
def test_to_keras_resumes_like_tf_keras(saved, key):
    path, model, config = saved[key]
    restored = tf.saved_model.load(path).optimizer
    ours = keras.Sequential([keras.Input((4,)),
                             keras.layers.Dense(3, name="d1"),
                             keras.layers.Dense(2, name="d2")], name="seq")
    ours.set_weights(model.get_weights())
    optimizer = restored.to_keras(
        ours, config=config if key in CONFIG_NEEDED else None)
    assert int(to_numpy(optimizer.iterations)) == 3
    ours.compile(optimizer=optimizer, loss="mse")
    x, y = _data()
    for i in range(3, 8):
        batch = (x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
        ours.train_on_batch(*batch)
        model.train_on_batch(*batch)
    for a, b in zip(ours.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if key == "new_adam_ema":
        for var, theirs in zip(ours.trainable_variables,
                               model.optimizer._model_variables_moving_average):
            np.testing.assert_allclose(to_numpy(optimizer.average_of(var)),
                                       theirs.numpy(), rtol=1e-5, atol=1e-6)
    assert isinstance(optimizer, keras_ema_opt.Optimizer)
    if key.startswith("legacy_adamax"):
        assert type(optimizer) is keras_ema_opt.Adamax
    if key == "legacy_sgd_named_adamax":
        assert type(optimizer) is keras_ema_opt.SGD


def test_to_keras_refuses_to_guess(saved):
    from keras_ema_opt.errors import LegacyConfigError

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.Dense(2)])
    restored = tf.saved_model.load(saved["new_sgd"][0]).optimizer
    with pytest.raises(LegacyConfigError, match="keras_metadata.pb"):
        restored.to_keras(model)
    restored = tf.saved_model.load(saved["legacy_adam_renamed"][0]).optimizer
    with pytest.raises(LegacyConfigError, match="Adam's or Adamax's.*named "
                       "after my_opt, not one"):
        restored.to_keras(model)
    # A config that does not match the state: named, not silently dropped.
    restored = tf.saved_model.load(saved["legacy_sgd"][0]).optimizer
    with pytest.raises(LegacyConfigError, match="no place for the Keras 2"):
        restored.to_keras(model, config={"class_name": "SGD", "config": {
            "learning_rate": 0.1, "momentum": 0.0, "decay": 0.0}})


@pytest.mark.parametrize("source,target", [
    ("legacy_sgd", "tf_keras_optimizer"),
    ("new_adam_ema", "tf_keras_experimentalOptimizer"),
])
def test_renamed_identifiers_revive_too(saved, tmp_path, source, target):
    """TF 2.12 with two Keras 2 copies wrote tf_keras_* identifiers."""
    import shutil

    from tensorflow.core.protobuf import saved_model_pb2

    path = tmp_path / target
    shutil.copytree(saved[source][0], path)
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((path / "saved_model.pb").read_bytes())
    nodes = proto.meta_graphs[0].object_graph_def.nodes
    renamed = 0
    for node in nodes:
        if node.WhichOneof("kind") == "user_object" and \
                node.user_object.identifier in ("optimizer",
                                                "experimentalOptimizer"):
            node.user_object.identifier = target
            renamed += 1
    assert renamed == 1
    (path / "saved_model.pb").write_bytes(proto.SerializeToString())
    restored = tf.saved_model.load(str(path)).optimizer
    assert type(restored) is compat.RestoredOptimizer
    assert restored.iterations == 3
    assert restored.slots


def test_revival_registers_when_compat_is_imported_before_tensorflow(saved):
    code = (
        "import keras_ema_opt.compat\n"
        "import tensorflow as tf\n"
        f"o = tf.saved_model.load({saved['new_adam_ema'][0]!r}).optimizer\n"
        "print(type(o).__module__, o.iterations)\n"
    )
    proc = run_python("-c", code, backend="jax")
    assert proc.stdout.split()[-2:] == ["keras_ema_opt.compat.revival", "3"]
