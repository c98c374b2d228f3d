"""What a Keras 2 model was compiled with migrates too: loss objects and
custom losses, metrics, a model with no optimizer state, a loss scale, a
checkpoint laid out as TensorFlow's guide writes it; and the destination
is checked before anything is read.

Artifacts are made by real tf_keras during the test run
(``tests/scripts/make_compile_artifacts.py``); the oracle is tf_keras' own
``train_on_batch`` right after saving: the migrated model's (after writing
and reloading the ``.keras`` file) must give the same loss and metrics,
and the same weights after the step.
"""

import json
import os
import warnings

import keras
import numpy as np
import pytest

import keras_ema_opt
from keras_ema_opt.errors import InvalidArgumentError
from keras_ema_opt.savedmodel import migrate
from conftest import ROOT
from conftest import made_by_script
from conftest import to_numpy
from legacy_custom_objects import my_loss

pytest.importorskip("tf_keras")

SCRIPT = os.path.join(ROOT, "tests", "scripts", "make_compile_artifacts.py")
CASES = ["loss_objects", "metric_objects", "custom_loss", "metric_names",
         "multi_output", "multi_output_dict", "huber", "cosine_axis",
         "one_loss_weighted", "one_loss_weighted_dict", "fresh", "mixed",
         "mixed_v2", "renorm"]
CUSTOM = {"my_loss": my_loss}


@pytest.fixture(scope="module")
def artifacts():
    return made_by_script(SCRIPT, CASES)


def _expected(folder):
    with open(os.path.join(folder, "expected.json")) as f:
        return json.load(f)


def _migrated(folder, name, tmp_path, **kwargs):
    dst = str(tmp_path / "new.keras")
    migrate(os.path.join(folder, name), dst, custom_objects=CUSTOM,
            **kwargs)
    return keras.saving.load_model(dst, custom_objects=CUSTOM)


def _continues_like_tf_keras(model, expected, weights_after=True):
    x = np.asarray(expected["x"], "float32")
    y = ([np.asarray(a) for a in expected["y"]] if expected.get("outputs")
         else np.asarray(expected["y"]))
    logs = model.train_on_batch(x, y, return_dict=True)
    assert sorted(logs) == sorted(expected["logs"])
    for key, want in expected["logs"].items():
        assert float(logs[key]) == pytest.approx(want, rel=1e-5, abs=1e-6), (
            key)
    if not weights_after:
        return
    for got, want in zip(model.weights, expected["after"]):
        np.testing.assert_allclose(to_numpy(got), np.asarray(want),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["model.h5", "savedmodel"])
@pytest.mark.parametrize("case", ["loss_objects", "metric_objects",
                                  "custom_loss", "metric_names",
                                  "multi_output", "multi_output_dict",
                                  "huber", "cosine_axis", "one_loss_weighted",
                                  "one_loss_weighted_dict", "renorm"])
def test_loss_and_metrics_continue_like_tf_keras(artifacts, tmp_path, case,
                                                 fmt):
    # Keras 2 loss objects carry `reduction="auto"` and `fn`, which Keras 3
    # refuses; a custom loss is stored by name and comes in through
    # custom_objects; metrics are stored resolved ("accuracy" as a
    # MeanMetricWrapper of sparse_categorical_accuracy); a model of several
    # outputs named its metrics after them ("reg_mae"): the logs' keys are
    # tf_keras' (they were "reg_reg_mae"). Keras 3.15's Huber and
    # CosineSimilarity leave `delta` and `axis` out of their configs (the
    # file would train with the defaults); one loss with a weight per
    # output is applied to each, as Keras 2 did (Keras 3 refused it at
    # the first step); batch renormalization, refused while Keras 3 had
    # none, keeps its arguments (its weights are the statistics' moving
    # renorm_mean and renorm_stddev beside the moving mean and variance).
    folder = os.path.join(artifacts, case)
    model = _migrated(folder, fmt, tmp_path)
    if case == "renorm":
        bn = model.get_layer("bn")
        assert bn.renorm and bn.renorm_momentum == pytest.approx(0.9)
        assert bn.renorm_clipping == {"rmax": 1.5, "rmin": 0.7, "dmax": 0.5}
    _continues_like_tf_keras(model, _expected(folder))


@pytest.mark.parametrize("case", ["loss_objects", "metric_objects",
                                  "custom_loss", "metric_names", "huber",
                                  "one_loss_weighted"])
def test_keras_file_of_tf_keras_compiles_the_same_loss_and_metrics(
        artifacts, case):
    # A tf_keras .keras file keeps its compile config in Keras 2's newer
    # serialization; its optimizer state is not migrated (a warning says
    # so), so only the step's loss and metrics, computed before the update
    # from the exact weights, are tf_keras'.
    folder = os.path.join(artifacts, case)
    with pytest.warns(UserWarning, match="optimizer state is not migrated"):
        model = keras_ema_opt.load_legacy(
            os.path.join(folder, "model.keras"), custom_objects=CUSTOM)
    _continues_like_tf_keras(model, _expected(folder), weights_after=False)


def test_custom_loss_needs_its_function(artifacts, tmp_path):
    src = os.path.join(artifacts, "custom_loss", "model.h5")
    with pytest.raises(keras_ema_opt.errors.LegacyConfigError,
                       match="'my_loss'.*custom_objects"):
        migrate(src, str(tmp_path / "new.keras"))
    assert os.listdir(tmp_path) == []


def test_checkpoint_with_the_model_under_a_key_of_its_own(artifacts):
    # tf.train.Checkpoint(step=..., optimizer=..., net=model), as in
    # TensorFlow's checkpoint guide: the model is found under `net`.
    folder = os.path.join(artifacts, "loss_objects")

    def build():
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(3, name="d")])
        model.compile(
            optimizer=keras_ema_opt.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy",
                     keras.metrics.SparseTopKCategoricalAccuracy(k=2)])
        return model

    model = keras_ema_opt.load_legacy(os.path.join(folder, "ckpt", "ckpt"),
                                      model=build)
    assert int(to_numpy(model.optimizer.iterations)) == 2
    _continues_like_tf_keras(model, _expected(folder))


@pytest.mark.parametrize("fmt", ["model.h5", "savedmodel"])
def test_optimizer_without_state_starts_fresh_from_its_config(
        artifacts, tmp_path, fmt):
    # An OptimizerV2 saved before its first step has no variables: the
    # optimizer comes from the training config (SGD 0.05, momentum 0.9,
    # not Keras' default RMSprop), built, with a warning.
    folder = os.path.join(artifacts, "fresh")
    with pytest.warns(UserWarning, match="holds no optimizer state"):
        model = _migrated(folder, fmt, tmp_path)
    config = model.optimizer.get_config()
    assert type(model.optimizer).__name__ == "SGD"
    assert config["learning_rate"] == pytest.approx(0.05)
    assert config["momentum"] == pytest.approx(0.9)
    assert int(to_numpy(model.optimizer.iterations)) == 0
    _continues_like_tf_keras(model, _expected(folder))


@pytest.mark.parametrize("fmt", ["no_optimizer.h5", "no_optimizer"])
def test_model_saved_without_optimizer_is_written_uncompiled(
        artifacts, tmp_path, fmt):
    folder = os.path.join(artifacts, "fresh")
    with pytest.warns(UserWarning, match="not compiled"):
        model = _migrated(folder, fmt, tmp_path)
    assert not model.compiled
    reference = keras_ema_opt.load_legacy(os.path.join(folder, "model.h5"))
    for got, want in zip(model.weights, reference.weights):
        np.testing.assert_array_equal(to_numpy(got), to_numpy(want))


def test_uncompiled_tf_keras_keras_file_is_not_compiled(artifacts):
    path = os.path.join(artifacts, "fresh", "uncompiled.keras")
    with pytest.warns(UserWarning, match="not compiled"):
        model = keras_ema_opt.load_legacy(path)
    assert not model.compiled


def _resumes_through_more_steps(model, expected):
    """tf_keras' next steps after the save: one applied, one skipped
    (overflowing again), one applied. Keras 2's wrapper counted the skipped
    step in `iterations`, and so does the migrated one
    (compat.LegacyLossScaleOptimizer): Keras 3's did not, and the last Adam
    step then read another step count."""
    more = expected["more"]
    model.train_on_batch(np.asarray(expected["x"], "float32"),
                         np.asarray(expected["y"], "float32"))
    for x, y in more["batches"]:
        model.train_on_batch(np.asarray(x, "float32"),
                             np.asarray(y, "float32"))
    assert int(to_numpy(model.optimizer.iterations)) == more["iterations"]
    assert float(to_numpy(model.optimizer.dynamic_scale)) == (
        more["loss_scale"])
    for got, want in zip(model.weights, more["after"]):
        np.testing.assert_allclose(to_numpy(got), want, rtol=1e-5,
                                   atol=1e-6)


@pytest.fixture
def mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    yield
    keras.config.set_dtype_policy("float32")


def _dense_model():
    return keras.Sequential([keras.Input((4,)),
                             keras.layers.Dense(2, name="d")])


# "mixed": Keras 2.11+'s Adam in its LossScaleOptimizer; "mixed_v2":
# OptimizerV2's.
@pytest.mark.parametrize("case", ["mixed", "mixed_v2"])
def test_loss_scale_is_kept_from_a_savedmodel_and_named_when_lost(
        artifacts, tmp_path, mixed_float16, case):
    folder = os.path.join(artifacts, case)
    scale = _expected(folder)["loss_scale"]
    assert scale < 32768  # the overflowing steps halved it in tf_keras
    model = _migrated(folder, "savedmodel", tmp_path)
    assert float(to_numpy(model.optimizer.dynamic_scale)) == scale
    assert isinstance(model.optimizer,
                      keras_ema_opt.compat.LegacyLossScaleOptimizer)
    _resumes_through_more_steps(model, _expected(folder))
    with pytest.warns(UserWarning, match="does not store the loss scale"):
        model = keras_ema_opt.load_legacy(os.path.join(folder, "model.h5"))
    assert float(to_numpy(model.optimizer.dynamic_scale)) == 32768


def test_bare_checkpoint_of_a_loss_scale_optimizer_keeps_its_scale(
        artifacts, mixed_float16):
    """An OptimizerV2 checkpoint stores no config: the optimizer rebuilt
    from its variables is wrapped as it was, with the scale it reached."""
    folder = os.path.join(artifacts, "mixed_v2")
    model = _dense_model()
    with pytest.warns(UserWarning, match="rebuilt .* in the LossScale"):
        optimizer = keras_ema_opt.savedmodel.restore_checkpoint(
            model, os.path.join(folder, "ckpt"))
    assert isinstance(optimizer,
                      keras_ema_opt.compat.LegacyLossScaleOptimizer)
    assert float(to_numpy(optimizer.dynamic_scale)) == (
        _expected(folder)["loss_scale"])
    model.compile(optimizer=optimizer, loss="mse")
    _resumes_through_more_steps(model, _expected(folder))


@pytest.mark.parametrize("case", ["mixed", "mixed_v2"])
def test_loss_scale_given_no_place_or_keras_wrapper_is_named(
        artifacts, case):
    """A model compiled with an optimizer of its own: a loss scale it has
    no place for, or Keras 3's wrapper (which counts skipped steps
    otherwise), is named, not passed over."""
    folder = os.path.join(artifacts, case)
    scale = _expected(folder)["loss_scale"]

    def plain():
        model = _dense_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    with pytest.warns(UserWarning, match=f"loss scale of {scale:g} after 0 "
                      "good steps; the Adam given is no loss-scale"):
        keras_ema_opt.load_legacy(os.path.join(folder, "ckpt"), model=plain)

    def keras_wrapper():
        model = _dense_model()
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(0.01)), loss="mse")
        return model

    with pytest.warns(UserWarning, match="migrated into Keras 3's "
                      "LossScaleOptimizer, which does not count"):
        model = keras_ema_opt.load_legacy(os.path.join(folder, "ckpt"),
                                          model=keras_wrapper)
    assert float(to_numpy(model.optimizer.dynamic_scale)) == scale

    def ours():
        model = _dense_model()
        model.compile(optimizer=keras_ema_opt.compat.LegacyLossScaleOptimizer(
            keras.optimizers.Adam(0.01)), loss="mse")
        return model

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = keras_ema_opt.load_legacy(os.path.join(folder, "ckpt"),
                                          model=ours)
    assert float(to_numpy(model.optimizer.dynamic_scale)) == scale


def test_destination_is_checked_before_the_source_is_read(tmp_path):
    # The source does not exist: only the destination's error can come.
    src = str(tmp_path / "missing.h5")
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        migrate(src, str(tmp_path / "no" / "such" / "new.keras"))
    (tmp_path / "taken.keras").mkdir()
    with pytest.raises(InvalidArgumentError, match="is a directory"):
        migrate(src, str(tmp_path / "taken.keras"))
    assert sorted(os.listdir(tmp_path)) == ["taken.keras"]
    assert os.listdir(tmp_path / "taken.keras") == []


def test_model_builder_must_give_a_model(artifacts, tmp_path):
    src = os.path.join(artifacts, "fresh", "model.h5")
    with pytest.raises(InvalidArgumentError,
                       match="a function returning one.*gave str"):
        migrate(src, str(tmp_path / "new.keras"), model=lambda: "model")
    assert os.listdir(tmp_path) == []
