"""Keras 2 configs and OptimizerV2 rules: real configs produced by tf_keras
in the test run become optimizers that step like the tf_keras optimizer they
came from."""

import keras
import numpy as np
import pytest
from conftest import only_on
from conftest import to_numpy

import keras_ema_opt
from keras_ema_opt.compat import LegacyAdagrad
from keras_ema_opt.compat import LegacyNadam
from keras_ema_opt.compat import LegacyRMSprop
from keras_ema_opt.compat import from_legacy_config
from keras_ema_opt.errors import InvalidArgumentError
from keras_ema_opt.errors import LegacyConfigError

tf_keras = pytest.importorskip("tf_keras")
tf = pytest.importorskip("tensorflow")
from tf_keras.src.saving.legacy import serialization as legacy_serialization  # noqa: E402,E501

NEW = {
    "SGD": dict(learning_rate=0.05, momentum=0.9, nesterov=True),
    "Adam": dict(learning_rate=0.01, amsgrad=True, use_ema=True,
                 ema_momentum=0.9),
    "AdamW": dict(learning_rate=0.01, weight_decay=0.05),
    "Adagrad": dict(learning_rate=0.05),
    "Adadelta": dict(learning_rate=1.0, rho=0.9),
    "Adamax": dict(learning_rate=0.01),
    "Nadam": dict(learning_rate=0.01),
    "RMSprop": dict(learning_rate=0.01, centered=True, clipnorm=1.0),
    "Ftrl": dict(learning_rate=0.05, l1_regularization_strength=0.01),
    "Lion": dict(learning_rate=0.001),
    "Adafactor": dict(learning_rate=0.05),
}
LEGACY = {
    "SGD": dict(learning_rate=0.05, momentum=0.9, decay=0.01),
    "Adam": dict(learning_rate=0.01, decay=0.001),
    "Adagrad": dict(learning_rate=0.05, epsilon=0.1),
    "Adadelta": dict(learning_rate=1.0),
    "Adamax": dict(learning_rate=0.01),
    "Nadam": dict(learning_rate=0.01),
    "RMSprop": dict(learning_rate=0.01, epsilon=0.1),
    "RMSprop_momentum": dict(learning_rate=0.01, momentum=0.5),
    "Ftrl": dict(learning_rate=0.05, l2_regularization_strength=0.01),
}
EXPECTED_CLASS = {"Nadam": LegacyNadam, "Adagrad": LegacyAdagrad,
                  "RMSprop": LegacyRMSprop}


def _tf_keras_optimizers():
    """(id, tf_keras optimizer, expected class of ours) for the table."""
    out = []
    for name, kwargs in NEW.items():
        opt = getattr(tf_keras.optimizers, name)(**kwargs, jit_compile=False)
        out.append((f"new-{name}", opt, getattr(keras_ema_opt, name)))
    for key, kwargs in LEGACY.items():
        name = key.split("_")[0]
        opt = getattr(tf_keras.optimizers.legacy, name)(**kwargs)
        expected = EXPECTED_CLASS.get(name, getattr(keras_ema_opt, name))
        if key == "RMSprop_momentum":
            expected = keras_ema_opt.RMSprop
        out.append((f"legacy-{key}", opt, expected))
    return out


TABLE = _tf_keras_optimizers()
FORMS = {
    # tf.keras.optimizers.serialize: {"module", "class_name", ...}
    "serialize": tf_keras.optimizers.serialize,
    # The form SavedModels and .h5 training configs hold ("Custom>Adam",
    # NumPy floats).
    "legacy_h5": legacy_serialization.serialize_keras_object,
}


def _steps(ours, theirs, steps=10):
    rng = np.random.default_rng(2)
    init = [rng.normal(size=(3, 2)).astype("float32"),
            rng.normal(size=(2,)).astype("float32")]
    ours_v = [keras.Variable(w) for w in init]
    theirs_v = [tf.Variable(w) for w in init]
    for _ in range(steps):
        grads = [rng.normal(size=w.shape).astype("float32") for w in init]
        ours.apply_gradients(
            zip([keras.ops.convert_to_tensor(g) for g in grads], ours_v))
        theirs.apply_gradients(zip([tf.constant(g) for g in grads], theirs_v))
    return [to_numpy(v) for v in ours_v], [v.numpy() for v in theirs_v]


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("case", TABLE, ids=[c[0] for c in TABLE])
def test_every_tf_keras_config_becomes_a_working_optimizer(case, form):
    _, theirs, expected = case
    config = FORMS[form](theirs)
    ours = from_legacy_config(config)
    assert type(ours) is expected
    fresh = type(theirs).from_config(theirs.get_config())
    a, b = _steps(ours, fresh)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=2e-6)


def test_schedule_with_null_name_and_numpy_floats():
    schedule = tf_keras.optimizers.schedules.ExponentialDecay(
        np.float32(0.1), 2, 0.5)
    theirs = tf_keras.optimizers.Adam(learning_rate=schedule,
                                      jit_compile=False)
    config = legacy_serialization.serialize_keras_object(theirs)
    assert config["config"]["learning_rate"]["config"]["name"] is None
    ours = from_legacy_config(config)
    a, b = _steps(ours, tf_keras.optimizers.Adam(
        learning_rate=tf_keras.optimizers.schedules.ExponentialDecay(
            0.1, 2, 0.5), jit_compile=False))
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dynamic", [True, False])
def test_loss_scale_optimizer_wrapper(dynamic):
    inner = tf_keras.optimizers.Adam(learning_rate=0.01, jit_compile=False)
    theirs = tf_keras.mixed_precision.LossScaleOptimizer(
        inner, dynamic=dynamic, **({} if dynamic else {"initial_scale": 8.0}))
    ours = from_legacy_config(tf_keras.optimizers.serialize(theirs))
    if dynamic:
        assert isinstance(ours, keras.optimizers.LossScaleOptimizer)
        assert type(ours.inner_optimizer) is keras_ema_opt.Adam
        assert ours.initial_scale == 32768.0
    else:
        assert type(ours) is keras_ema_opt.Adam
        assert ours.loss_scale_factor == 8.0


def test_legacy_loss_scale_counts_skipped_steps_like_tf_keras(tmp_path):
    # Keras 2's wrapper counted a step skipped for non-finite gradients in
    # `iterations`; Keras 3's does not. Stepped beside tf_keras' on the
    # same gradients (the second not finite), eagerly (on JAX through its
    # stateless step: Keras' own wrapper does not step eagerly there).
    theirs = tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.Adam(0.1, jit_compile=False),
        initial_scale=4.0)
    ours = from_legacy_config(tf_keras.optimizers.serialize(theirs))
    assert type(ours) is keras_ema_opt.compat.LegacyLossScaleOptimizer
    averaged = keras_ema_opt.averaged(
        from_legacy_config(tf_keras.optimizers.serialize(theirs)),
        keras_ema_opt.EMA(0.5))
    # averaged() keeps the counting, and a .keras file keeps both.
    assert isinstance(averaged, keras_ema_opt.compat.LegacyLossScaleOptimizer)
    assert isinstance(averaged, keras_ema_opt.AveragedLossScaleOptimizer)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(
        averaged))
    assert type(again) is type(averaged)
    assert again.averaging.momentum == 0.5
    start = np.array([1.0, -2.0], "float32")
    tf_var = tf.Variable(start)
    variables = [keras.Variable(start) for _ in range(2)]
    for grad in ([4.0, 8.0], [np.inf, 1.0], [-4.0, 2.0], [2.0, 2.0]):
        grad = np.asarray(grad, "float32")
        # tf_keras' apply_gradients takes the gradients unscaled (its
        # `get_unscaled_gradients`); Keras 3's divides by the scale itself.
        theirs.apply_gradients([(tf.constant(
            grad / float(theirs.loss_scale)), tf_var)])
        for opt, var in zip((ours, averaged), variables):
            opt.apply_gradients([(keras.ops.convert_to_tensor(grad), var)])
    for opt, var in zip((ours, averaged), variables):
        assert int(to_numpy(opt.iterations)) == int(theirs.iterations) == 4
        np.testing.assert_allclose(to_numpy(var), tf_var.numpy(),
                                   rtol=1e-6)


def _keras2_loop(optimizer, variable, batches, traced):
    """Keras 2's custom mixed-precision loop (the TensorFlow guide's):
    the scaled loss's gradients, unscaled, applied."""
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.matmul(x, variable) ** 2)
            scaled = optimizer.get_scaled_loss(loss)
        grads = tape.gradient(scaled, [variable])
        grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, [variable]))

    step = tf.function(step) if traced else step
    for x in batches:
        step(tf.constant(x))
    return (np.asarray(variable.numpy()), int(optimizer.iterations),
            float(optimizer.loss_scale), int(optimizer.dynamic_counter))


@only_on("tensorflow")
@pytest.mark.parametrize("inner", ["ours", "keras"])
@pytest.mark.parametrize("traced", [False, True])
def test_legacy_loss_scale_runs_keras2_custom_loop(inner, traced):
    """get_scaled_loss / get_unscaled_gradients / apply_gradients of
    unscaled gradients, beside tf_keras' wrapper: Keras 3's had neither
    method, and divides what it is given by the scale. Traced before the
    first step (the scale variable is read, not the initial value), with
    an overflowing step (skipped, counted) and the scale growing."""
    rng = np.random.RandomState(0)
    start = rng.randn(3, 2).astype("float32")
    batches = rng.randn(6, 4, 3).astype("float32")
    batches[2] *= 1e36  # the loss overflows float32
    theirs = _keras2_loop(tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.Adam(0.1), dynamic_growth_steps=2),
        tf.Variable(start), batches, traced)
    adam = (keras_ema_opt.Adam if inner == "ours" else keras.optimizers.Adam)
    ours = _keras2_loop(keras_ema_opt.compat.LegacyLossScaleOptimizer(
        adam(0.1), dynamic_growth_steps=2), keras.Variable(start), batches,
        traced)
    assert ours[1:] == theirs[1:] == (6, 65536.0, 1)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-6)


def test_legacy_loss_scale_minimize_equals_tf_keras():
    """Keras 2's minimize on the wrapper scales and unscales itself (on
    JAX too, where Keras 3's wrapper raised UnexpectedTracerError on an
    eager step: its stateful step is a `cond` that assigns)."""
    start = np.array([1.0, -2.0, 3.0], "float32")
    ours_v, tf_var = keras.Variable(start), tf.Variable(start)
    ours = keras_ema_opt.compat.LegacyLossScaleOptimizer(
        keras_ema_opt.Adam(0.1), dynamic_growth_steps=2)
    theirs = tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.Adam(0.1), dynamic_growth_steps=2)
    for i in range(1, 5):
        ours.minimize(lambda: keras.ops.sum(ours_v * ours_v * i), [ours_v])
        theirs.minimize(lambda: tf.reduce_sum(tf_var * tf_var * i), [tf_var])
    np.testing.assert_allclose(to_numpy(ours_v), tf_var.numpy(), rtol=1e-6)
    assert int(to_numpy(ours.iterations)) == 4
    assert float(to_numpy(ours.loss_scale)) == float(theirs.loss_scale) == (
        2.0**17)
    if keras.backend.backend() == "tensorflow":  # a tensor loss and a tape
        with tf.GradientTape() as tape:
            loss = keras.ops.sum(ours_v * ours_v)
        ours.minimize(loss, [ours_v], tape=tape)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf_var * tf_var)
        theirs.minimize(loss, [tf_var], tape=tape)
        np.testing.assert_allclose(to_numpy(ours_v), tf_var.numpy(),
                                   rtol=1e-6)


def test_legacy_loss_scale_keras2_methods_and_variables():
    ours = keras_ema_opt.compat.LegacyLossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=None,
        dynamic_growth_steps=None)  # Keras 2's None: the defaults
    assert ours.dynamic and ours.initial_scale == 2.0**15
    assert ours.dynamic_growth_steps == 2000
    # Exists before the first step (Keras 2's did; Keras 3 makes it then),
    # a value: a later step does not change it.
    before = ours.loss_scale
    assert float(to_numpy(before)) == 2.0**15
    assert int(to_numpy(ours.dynamic_counter)) == 0
    loss = keras.ops.convert_to_tensor(np.float32(1.5))
    assert float(to_numpy(ours.get_scaled_loss(loss))) == 1.5 * 2.0**15
    assert float(to_numpy(ours.get_scaled_loss(lambda: loss)())) == (
        1.5 * 2.0**15)
    grads = ours.get_unscaled_gradients(
        [keras.ops.convert_to_tensor(np.float32([2.0**16])), None])
    assert grads[1] is None and float(to_numpy(grads[0])[0]) == 2.0
    ours.apply_gradients([(keras.ops.convert_to_tensor(
        np.float32([np.inf])), keras.Variable(np.ones(1, "float32")))])
    assert float(to_numpy(ours.loss_scale)) == 2.0**14
    assert float(to_numpy(before)) == 2.0**15
    # The same variables, in the same order, as Keras 3's wrapper after a
    # build: files written by either load into the other.
    w = keras.Variable(np.ones(2, "float32"), name="w")
    keras_own = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(
        0.1, momentum=0.5))
    ours = keras_ema_opt.compat.LegacyLossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.5))
    for opt in (keras_own, ours):
        opt.build([w])
    assert [v.path.split("/", 1)[1] for v in ours.variables] == [
        v.path.split("/", 1)[1] for v in keras_own.variables]
    with pytest.raises(InvalidArgumentError,
                       match="second is `initial_scale`.*initial_scale=True"):
        keras_ema_opt.compat.LegacyLossScaleOptimizer(
            keras.optimizers.SGD(), True)
    with pytest.raises(ValueError, match="dynamic=False"):
        keras_ema_opt.compat.LegacyLossScaleOptimizer(
            keras.optimizers.SGD(), dynamic=False, initial_scale=8.0)


def test_unscaled_gradients_not_applied_leave_fit_scaled():
    """get_unscaled_gradients marks the next step's gradients as unscaled;
    fit() scales its loss (scale_loss) in each step, which clears the
    mark: gradients unscaled only to be looked at, never applied, made
    every step of a later fit() 32768 times too large."""
    def fit(cls, look_first):
        keras.utils.set_random_seed(0)
        keras.config.set_dtype_policy("mixed_float16")
        try:
            model = keras.Sequential([keras.Input((3,)),
                                      keras.layers.Dense(1)])
            optimizer = cls(keras.optimizers.SGD(0.01))
            model.compile(optimizer=optimizer, loss="mse")
            if look_first:
                optimizer.get_unscaled_gradients([keras.ops.ones((3, 1))])
            model.fit(np.ones((8, 3), "float32"), np.zeros((8, 1), "float32"),
                      epochs=2, batch_size=8, verbose=0)
            return to_numpy(model.trainable_variables[0])
        finally:
            keras.config.set_dtype_policy("float32")

    want = fit(keras.optimizers.LossScaleOptimizer, False)
    got = fit(keras_ema_opt.compat.LegacyLossScaleOptimizer, True)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_legacy_loss_scale_reaches_the_averages_of_its_inner_optimizer():
    """A migrated mixed-precision model with use_ema: model.optimizer is
    the wrapper, which had no averaging API (AttributeError)."""
    w = keras.Variable(np.array([1.0, 2.0], "float32"))
    ours = keras_ema_opt.compat.LegacyLossScaleOptimizer(
        keras_ema_opt.SGD(0.1, use_ema=True, ema_momentum=0.5),
        initial_scale=4.0)
    ours.apply_gradients([(keras.ops.convert_to_tensor(
        np.float32([4.0, 4.0])), w)])
    # SGD: w = [0.9, 1.9]; the average starts at the weights: 0.5 w0 + 0.5 w
    np.testing.assert_allclose(to_numpy(ours.average_of(w)), [0.95, 1.95],
                               rtol=1e-6)
    assert ours.averaging is ours.inner_optimizer.averaging
    ours.assign_averages([w])
    np.testing.assert_allclose(to_numpy(w), [0.95, 1.95], rtol=1e-6)
    plain = keras_ema_opt.compat.LegacyLossScaleOptimizer(
        keras.optimizers.SGD(0.1))
    assert plain.averaging is None
    with pytest.raises(InvalidArgumentError, match="average_of\\(\\) needs "
                       "averages, and the inner optimizer .* keeps none"):
        plain.average_of(w)


@only_on("tensorflow")
def test_legacy_loss_scale_unscales_sparse_gradients():
    ours = keras_ema_opt.compat.LegacyLossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=4.0)
    grad = tf.IndexedSlices(tf.constant([[8.0, 4.0]]), tf.constant([1]),
                            tf.constant([3, 2]))
    (unscaled,) = ours.get_unscaled_gradients([grad])
    assert isinstance(unscaled, tf.IndexedSlices)
    np.testing.assert_array_equal(unscaled.values.numpy(), [[2.0, 1.0]])
    np.testing.assert_array_equal(unscaled.indices.numpy(), [1])


def test_string_identifiers_and_old_lr_key():
    assert type(from_legacy_config("adam")) is keras_ema_opt.Adam
    assert type(from_legacy_config("RMSprop")) is keras_ema_opt.RMSprop
    opt = from_legacy_config({"class_name": "SGD", "config": {
        "lr": 0.3, "decay": 0.0, "momentum": 0.0, "nesterov": False}})
    assert float(to_numpy(opt.learning_rate)) == pytest.approx(0.3)


def test_unknown_class_is_named():
    with pytest.raises(LegacyConfigError, match="'Custom>MyOpt'"):
        from_legacy_config({"class_name": "Custom>MyOpt", "config": {}})
    with pytest.raises(LegacyConfigError, match="Received: 3"):
        from_legacy_config(3)
    custom = from_legacy_config(
        {"class_name": "Custom>MyOpt", "config": {"learning_rate": 0.2}},
        custom_objects={"MyOpt": keras_ema_opt.SGD})
    assert type(custom) is keras_ema_opt.SGD


@pytest.mark.parametrize("name,cls,kwargs", [
    ("Adagrad", LegacyAdagrad, dict(learning_rate=0.1, epsilon=0.1,
                                    decay=0.01)),
    ("RMSprop", LegacyRMSprop, dict(learning_rate=0.01, epsilon=0.1)),
    ("RMSprop", LegacyRMSprop, dict(learning_rate=0.01, epsilon=0.1,
                                    centered=True)),
    ("Nadam", LegacyNadam, dict(learning_rate=0.01, schedule_decay=0.004)),
])
def test_legacy_rules_equal_tf_keras_legacy_for_ten_steps(name, cls, kwargs):
    a, b = _steps(cls(**kwargs),
                  getattr(tf_keras.optimizers.legacy, name)(**kwargs))
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    # ... and differ from Keras 3's rule (why they exist).
    plain = {k: v for k, v in kwargs.items() if k != "schedule_decay"}
    c, _ = _steps(getattr(keras_ema_opt, name)(**plain),
                  getattr(tf_keras.optimizers.legacy, name)(**kwargs))
    assert not all(np.allclose(x, y, rtol=1e-6) for x, y in zip(a, c))


def test_legacy_rule_errors():
    with pytest.raises(ValueError, match="momentum=0.5"):
        LegacyRMSprop(momentum=0.5)
    with pytest.raises(ValueError, match="does not support"):
        LegacyNadam(learning_rate=keras.optimizers.schedules.ExponentialDecay(
            0.1, 1, 0.9))
    with pytest.raises(ValueError, match="must be non-negative"):
        LegacyAdagrad(initial_accumulator_value=-1.0)


def test_legacy_rules_round_trip_through_keras_files(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=LegacyNadam(learning_rate=0.01), loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is LegacyNadam
    np.testing.assert_array_equal(
        to_numpy(loaded.optimizer._momentum_cache),
        to_numpy(model.optimizer._momentum_cache))
