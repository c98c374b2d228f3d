"""`include_non_trainable=True`: BatchNorm statistics averaged with the
weights, in `fit()` on every backend (JAX's stateless step included), in
custom loops, through `.keras` files, under gradient accumulation.

Oracle: the raw statistics of an identical run without averaging, recorded
after every optimizer step, averaged in float64 numpy by the EMA formula
(a_0 = s_0, a_t = m a_{t-1} + (1 - m) s_t)."""

import re
import warnings

import keras
import numpy as np
import pytest

import keras_ema_opt
from keras_ema_opt import backend
from keras_ema_opt.errors import InvalidArgumentError
from conftest import BACKEND
from conftest import only_on
from conftest import to_numpy

M = 0.8


def _model():
    return keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(4),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(1),
    ])


def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(48, 3).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]])).astype("float32")


class _Record(keras.callbacks.Callback):
    """Records the BatchNorm statistics after each batch."""

    def __init__(self, every=1):
        super().__init__()
        self.every = every
        self.stats = []

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.every:
            return
        backend.sync_training_state(self.model)
        bn = self.model.layers[1]
        self.stats.append([to_numpy(bn.moving_mean).astype("float64"),
                           to_numpy(bn.moving_variance).astype("float64")])


def _reference(initial, stats, m=M):
    averages = [a.astype("float64") for a in initial]
    for step in stats:
        averages = [m * a + (1 - m) * s for a, s in zip(averages, step)]
    return averages


def _bn_stats(weights):
    """Moving mean and variance in ``_model().get_weights()`` (Dense kernel,
    bias, then BN gamma, beta, mean, variance)."""
    return [weights[4], weights[5]]


def _assert_stat_averages(optimizer, bn, initial, stats):
    expected = _reference(initial, stats)
    for var, want in zip([bn.moving_mean, bn.moving_variance], expected):
        np.testing.assert_allclose(to_numpy(optimizer.average_of(var)),
                                   want, rtol=1e-5, atol=1e-6)


def _fit(optimizer, weights, callbacks=(), epochs=1, run_eagerly=False):
    model = _model()
    model.set_weights(weights)
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=run_eagerly)
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return model


@pytest.mark.parametrize("epochs", [1, 2])
def test_fit_averages_batchnorm_statistics(epochs):
    weights = _model().get_weights()
    record = _Record()
    raw = _fit(keras_ema_opt.SGD(0.05), weights, [record], epochs=epochs)
    averaging = keras_ema_opt.EMA(M, include_non_trainable=True,
                                  finalize=False)
    model = _fit(keras_ema_opt.SGD(0.05, averaging=averaging), weights,
                 epochs=epochs)
    bn = model.layers[1]
    # The averaging does not change the training trajectory...
    np.testing.assert_array_equal(to_numpy(bn.moving_mean),
                                  to_numpy(raw.layers[1].moving_mean))
    # ...and the statistics' averages follow the formula over every step.
    _assert_stat_averages(model.optimizer, bn, _bn_stats(weights),
                          record.stats)
    assert len(record.stats) == 6 * epochs


def test_an_eager_fit_averages_statistics_from_before_its_first_step():
    # JAX's and PyTorch's trainers build the optimizer before the first
    # step. Keras' TensorFlow trainer builds it in the first train step:
    # under run_eagerly=True after the step's forward pass, so that the
    # statistics' averages start from the statistics after it (3e-3 off
    # the formula here): a warning says so, and the remedy it names
    # (track the model, build first) starts them before it.
    weights = _model().get_weights()
    record = _Record()
    _fit(keras_ema_opt.SGD(0.05), weights, [record], run_eagerly=True)

    def averaging():
        return keras_ema_opt.EMA(M, include_non_trainable=True,
                                 finalize=False)

    if BACKEND == "tensorflow":
        with pytest.warns(UserWarning, match=re.escape(
                "TensorFlow's `fit(run_eagerly=True)` builds it in its "
                "first step")):
            _fit(keras_ema_opt.SGD(0.05, averaging=averaging()), weights,
                 run_eagerly=True)
        model = _model()
        model.set_weights(weights)
        model.optimizer = keras_ema_opt.SGD(0.05, averaging=averaging())
        model.optimizer.track_non_trainable(model)
        model.optimizer.build(model.trainable_variables)
        model.compile(optimizer=model.optimizer, loss="mse",
                      run_eagerly=True)
        x, y = _data()
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    else:
        model = _fit(keras_ema_opt.SGD(0.05, averaging=averaging()),
                     weights, run_eagerly=True)
    _assert_stat_averages(model.optimizer, model.layers[1],
                          _bn_stats(weights), record.stats)


def test_finalize_writes_averaged_statistics_and_swap_restores_them():
    weights = _model().get_weights()
    averaging = keras_ema_opt.EMA(M, include_non_trainable=True)
    model = _fit(keras_ema_opt.SGD(0.05, averaging=averaging), weights)
    bn = model.layers[1]
    averaged = to_numpy(model.optimizer.average_of(bn.moving_mean))
    # fit() ended: finalize_variable_values wrote the averages, statistics
    # included (the default `finalize=True`, Keras 2 semantics).
    np.testing.assert_array_equal(to_numpy(bn.moving_mean), averaged)
    bn.moving_mean.assign(np.full((4,), 7.0, "float32"))
    with model.optimizer.swap_average(model):
        np.testing.assert_array_equal(to_numpy(bn.moving_mean), averaged)
    np.testing.assert_array_equal(to_numpy(bn.moving_mean),
                                  np.full((4,), 7.0, "float32"))


@pytest.mark.parametrize("second", ["keras", "ours"])
def test_recompiled_model_trains_with_its_new_optimizer(second):
    # JAX wraps the model's train_step for the statistics' averages: a model
    # compiled again with another optimizer trains with Keras' own step.
    averaging = keras_ema_opt.EMA(M, include_non_trainable=True)
    model = _fit(keras_ema_opt.SGD(0.05, averaging=averaging),
                 _model().get_weights())
    middle = model.get_weights()
    make = {"keras": lambda: keras.optimizers.SGD(0.05),
            "ours": lambda: keras_ema_opt.SGD(0.05, use_ema=True)}[second]
    model.compile(optimizer=make(), loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    fresh = _fit(make(), middle)
    for got, want in zip(model.get_weights(), fresh.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_without_the_option_statistics_are_not_averaged():
    model = _fit(keras_ema_opt.SGD(0.05, use_ema=True), _model().get_weights())
    with pytest.raises(KeyError, match="moving_mean"):
        model.optimizer.average_of(model.layers[1].moving_mean)


def test_gradient_accumulation_averages_statistics_on_real_steps():
    weights = _model().get_weights()
    record = _Record(every=2)
    _fit(keras_ema_opt.SGD(0.05, gradient_accumulation_steps=2), weights,
         [record])
    averaging = keras_ema_opt.EMA(M, include_non_trainable=True,
                                  finalize=False)
    model = _fit(keras_ema_opt.SGD(0.05, gradient_accumulation_steps=2,
                                   averaging=averaging), weights)
    assert len(record.stats) == 3
    _assert_stat_averages(model.optimizer, model.layers[1],
                          _bn_stats(weights), record.stats)


def test_custom_loop_with_track_non_trainable():
    model = _model()
    initial = [to_numpy(v) for v in model.layers[1].non_trainable_variables]
    optimizer = keras_ema_opt.SGD(
        0.05, averaging=keras_ema_opt.EMA(M, include_non_trainable=True))
    optimizer.track_non_trainable(model)
    # Averages start as copies of the variables when the optimizer is built.
    optimizer.build(model.trainable_variables)
    stats = _custom_loop(optimizer, optimizer, model)
    # compute_gradients ran the forward pass once: one statistics update per
    # step, which the average sees.
    _assert_stat_averages(optimizer, model.layers[1], initial, stats)


def test_a_custom_loop_that_builds_at_its_first_step_is_warned():
    # Built by its first apply_gradients, after that step's forward pass,
    # the statistics' averages start from the statistics after it (one
    # step late against the formula from their values before it, which
    # the loop above and fit() follow): said, with the remedy.
    model = _model()
    optimizer = keras_ema_opt.SGD(
        0.05, averaging=keras_ema_opt.EMA(M, include_non_trainable=True))
    optimizer.track_non_trainable(model)
    x, _ = _data()
    grads_and_vars = optimizer.compute_gradients(
        lambda: keras.ops.mean(model(x[:8], training=True)),
        model.trainable_variables)
    after = [to_numpy(v) for v in model.layers[1].non_trainable_variables]
    with pytest.warns(UserWarning, match=re.escape(
            "Build it before the first forward pass: "
            "`optimizer.build(model.trainable_variables)`")):
        optimizer.apply_gradients(grads_and_vars)
    _assert_stat_averages(optimizer, model.layers[1], after, [after])
    # `minimize` with a callable var_list builds after its forward pass too.
    model = _model()
    optimizer = keras_ema_opt.SGD(
        0.05, averaging=keras_ema_opt.EMA(M, include_non_trainable=True))
    optimizer.track_non_trainable(model)
    with pytest.warns(UserWarning, match="Build it before"):
        optimizer.minimize(
            lambda: keras.ops.mean(model(x[:8], training=True)),
            lambda: model.trainable_variables)
    # Built first (as the loop above), nothing is said.
    model = _model()
    optimizer = keras_ema_opt.SGD(
        0.05, averaging=keras_ema_opt.EMA(M, include_non_trainable=True))
    optimizer.track_non_trainable(model)
    optimizer.build(model.trainable_variables)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _custom_loop(optimizer, optimizer, model, steps=1)
    assert not [w for w in caught if "Build it before" in str(w.message)]


def test_no_warning_where_the_build_reads_the_values_before_the_step():
    # A model whose only non-trainable floats are a frozen layer's weights
    # (no forward pass moves them), and a step traced in a tf.function
    # (its build, under tf.init_scope, reads the values before the step):
    # the averages start right, and nothing is said.
    # An adapted Normalization's statistics: no forward pass moves them.
    norm = keras.layers.Normalization()
    norm.adapt(np.arange(6, dtype="float32").reshape(2, 3))
    for first in (keras.layers.Dense(2, trainable=False), norm):
        model = keras.Sequential([keras.Input((3,)), first,
                                  keras.layers.Dense(1)])
        optimizer = keras_ema_opt.SGD(0.1, averaging=keras_ema_opt.EMA(
            0.5, include_non_trainable=True))
        optimizer.track_non_trainable(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.apply_gradients([(np.ones(v.shape, "float32"), v)
                                       for v in model.trainable_variables])
        assert not [w for w in caught
                    if "Build it before" in str(w.message)]
    if BACKEND != "tensorflow":
        return
    import tensorflow as tf

    model = _model()
    optimizer = keras_ema_opt.SGD(
        0.05, averaging=keras_ema_opt.EMA(M, include_non_trainable=True))
    optimizer.track_non_trainable(model)
    before = [to_numpy(v) for v in model.layers[1].non_trainable_variables]
    x, _ = _data()

    @tf.function
    def step(batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(batch, training=True) ** 2)
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables),
                                      variables))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(tf.constant(x[:8]))
    assert not [w for w in caught if "Build it before" in str(w.message)]
    after = [to_numpy(v).astype("float64")
             for v in model.layers[1].non_trainable_variables]
    _assert_stat_averages(optimizer, model.layers[1], before, [after])


def _custom_loop(optimizer, differentiating, model, steps=3):
    """``steps`` of ``compute_gradients`` (by ``differentiating``) and
    ``apply_gradients``; the statistics after each, in float64."""
    x, _ = _data()
    stats = []
    for i in range(steps):
        batch = x[8 * i: 8 * i + 8]
        grads_and_vars = differentiating.compute_gradients(
            lambda: keras.ops.mean(model(batch, training=True)),
            model.trainable_variables)
        optimizer.apply_gradients(grads_and_vars)
        stats.append([to_numpy(v).astype("float64")
                      for v in model.layers[1].non_trainable_variables])
    return stats


@pytest.mark.parametrize("how", ["compute_gradients", "minimize"])
def test_forward_pass_state_changes_in_a_custom_loop(how):
    # The forward pass of compute_gradients / minimize updates BatchNorm's
    # moving statistics (and the dropout seed) on every backend: on JAX its
    # stateless evaluation dropped those updates, so the statistics (and
    # their averages) never moved and every step drew the same mask.
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(3)
    norm = keras.layers.BatchNormalization(momentum=0.9)
    model = keras.Sequential([keras.Input((3,)), dense, norm,
                              keras.layers.Dropout(0.5)])
    optimizer = keras_ema_opt.SGD(0.0, averaging=keras_ema_opt.EMA(
        0.5, include_non_trainable=True))
    optimizer.track_non_trainable(model)
    optimizer.build(model.trainable_variables)
    x, _ = _data()
    kernel = to_numpy(dense.kernel).astype("float64")
    bias = to_numpy(dense.bias).astype("float64")
    mean = np.zeros(3)  # float64 reference: m <- 0.9 m + 0.1 batch mean
    average = mean.copy()
    masks = []
    for i in range(3):
        batch = x[8 * i: 8 * i + 8]

        def loss():
            return keras.ops.sum(model(batch, training=True))

        if how == "minimize":
            optimizer.minimize(loss, model.trainable_variables)
        else:
            grads = optimizer.compute_gradients(loss,
                                                model.trainable_variables)
            masks.append(to_numpy(grads[0][0]))
            optimizer.apply_gradients(grads)
        mean = 0.9 * mean + 0.1 * (batch.astype("float64") @ kernel
                                   + bias).mean(axis=0)
        average = 0.5 * average + 0.5 * mean
        np.testing.assert_allclose(to_numpy(norm.moving_mean), mean,
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            to_numpy(optimizer.average_of(norm.moving_mean)), average,
            rtol=1e-5, atol=1e-6)
    if masks:  # a new dropout mask at each step (seed state carried)
        assert not np.allclose(masks[0], masks[1])


def test_keras_file_carries_statistics_averages(tmp_path):
    averaging = keras_ema_opt.EMA(M, include_non_trainable=True,
                                  finalize=False)
    model = _fit(keras_ema_opt.SGD(0.05, averaging=averaging),
                 _model().get_weights())
    bn = model.layers[1]
    saved = to_numpy(model.optimizer.average_of(bn.moving_variance))
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    got = loaded.optimizer.average_of(loaded.layers[1].moving_variance)
    np.testing.assert_array_equal(to_numpy(got), saved)
    x, y = _data()
    loaded.fit(x, y, batch_size=8, verbose=0)  # and it keeps training


class _Counting(keras.layers.Layer):
    """A layer with an integer non-trainable variable (a step counter)."""

    def build(self, input_shape):
        self.counter = self.add_weight(
            shape=(), dtype="int32", initializer="zeros", trainable=False,
            name="counter")

    def call(self, x):
        self.counter.assign_add(1)
        return x


def test_integer_non_trainable_variables_are_never_averaged():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2),
                              keras.layers.BatchNormalization(), _Counting()])
    optimizer = keras_ema_opt.SGD(
        averaging=keras_ema_opt.SWA(include_non_trainable=True))
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    with pytest.raises(KeyError, match="counter"):
        optimizer.average_of(model.layers[2].counter)
    assert optimizer.average_of(model.layers[1].moving_mean) is not None


def test_errors_name_what_was_received():
    optimizer = keras_ema_opt.SGD(
        averaging=keras_ema_opt.EMA(include_non_trainable=True))
    model = _model()
    with pytest.raises(InvalidArgumentError, match="track_non_trainable"):
        optimizer.build(model.trainable_variables)
    with pytest.raises(InvalidArgumentError, match="keras.Model"):
        optimizer.track_non_trainable([1, 2])
    built = keras_ema_opt.SGD(use_ema=True)
    built.build(model.trainable_variables)
    with pytest.raises(InvalidArgumentError, match="before the optimizer"):
        built.track_non_trainable(model)


def test_loss_scale_optimizer_averages_statistics():
    weights = _model().get_weights()
    record = _Record()
    _fit(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)),
         weights, [record])
    averaging = keras_ema_opt.EMA(M, include_non_trainable=True,
                                  finalize=False)
    optimizer = keras_ema_opt.averaged(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)),
        averaging)
    model = _fit(optimizer, weights)
    _assert_stat_averages(optimizer, model.layers[1], _bn_stats(weights),
                          record.stats)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_skipped_step_moves_no_average_of_statistics(legacy):
    # A step a loss-scale optimizer skips (gradients not finite) leaves
    # every average, the statistics' too. On JAX fit() tells it by the
    # scale (halved only then): it went by `iterations`, which
    # compat.LegacyLossScaleOptimizer counts on a skipped step too, and
    # the statistics' averages moved there.
    wrapper = (keras_ema_opt.compat.LegacyLossScaleOptimizer if legacy
               else keras.optimizers.LossScaleOptimizer)
    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization(momentum=0.5)(
        keras.layers.Dense(3)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    inner = keras_ema_opt.Adam(0.01, averaging=keras_ema_opt.EMA(
        0.5, include_non_trainable=True, finalize=False))
    model.compile(optimizer=wrapper(inner), loss="mse")
    x = np.random.RandomState(1).randn(8, 4).astype("float32")
    model.train_on_batch(x, np.ones((8, 1), "float32"))
    watched = model.non_trainable_variables + model.trainable_variables
    before = [to_numpy(inner.average_of(v)) for v in watched]
    # Other statistics in the skipped batch, and a loss that overflows.
    model.train_on_batch(x * 10 + 3, np.full((8, 1), 3e38, "float32"))
    assert int(to_numpy(inner.iterations)) == (2 if legacy else 1)
    for var, was in zip(watched, before):
        np.testing.assert_array_equal(to_numpy(inner.average_of(var)), was,
                                      err_msg=var.path)


@pytest.mark.parametrize("wrapper", ["averaged", "legacy"])
def test_loss_scale_optimizer_in_a_custom_loop_tracks_the_model(wrapper):
    # averaged(LossScaleOptimizer(...)) had no track_non_trainable, which
    # its build error asks for. On JAX an eager step of a loss-scale
    # wrapper runs as its stateless step, which left these averages to
    # fit()'s step: they stayed where they started.
    model = _model()
    initial = [to_numpy(v) for v in model.layers[1].non_trainable_variables]
    averaging = keras_ema_opt.EMA(M, include_non_trainable=True)
    if wrapper == "averaged":
        optimizer = keras_ema_opt.averaged(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)),
            averaging)
    else:
        optimizer = keras_ema_opt.compat.LegacyLossScaleOptimizer(
            keras_ema_opt.SGD(0.05, averaging=averaging))
    inner = optimizer.inner_optimizer
    inner.track_non_trainable(model)
    optimizer.build(model.trainable_variables)
    stats = _custom_loop(optimizer, inner, model)
    _assert_stat_averages(inner, model.layers[1], initial, stats)


def test_overwrite_writes_statistics_averages_in_an_eager_step():
    """ema_overwrite_frequency=2 writes the statistics' averages into them
    every second step of a custom loop (on JAX the compiled eager step
    read the statistics and returned nothing for them: never written)."""
    model = _model()
    bn = model.layers[1]
    averages = [to_numpy(v).astype("float64")
                for v in bn.non_trainable_variables]
    optimizer = keras_ema_opt.SGD(
        0.05, averaging=keras_ema_opt.EMA(M, include_non_trainable=True),
        ema_overwrite_frequency=2)
    optimizer.track_non_trainable(model)
    optimizer.build(model.trainable_variables)
    x, _ = _data()
    for i in range(4):
        grads_and_vars = optimizer.compute_gradients(
            lambda: keras.ops.mean(model(x[8 * i: 8 * i + 8],
                                         training=True)),
            model.trainable_variables)
        seen = [to_numpy(v).astype("float64")
                for v in bn.non_trainable_variables]
        averages = [M * a + (1 - M) * s for a, s in zip(averages, seen)]
        optimizer.apply_gradients(grads_and_vars)
        written = [to_numpy(v) for v in bn.non_trainable_variables]
        for got, stat, average in zip(written, seen, averages):
            want = average if i % 2 else stat
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@only_on("jax")
def test_stateless_step_without_statistics_warns():
    model = _model()
    optimizer = keras_ema_opt.SGD(
        averaging=keras_ema_opt.EMA(include_non_trainable=True))
    optimizer.track_non_trainable(model)
    optimizer.build(model.trainable_variables)
    grads = [keras.ops.ones_like(v.value) for v in model.trainable_variables]
    with pytest.warns(UserWarning, match="non-trainable"):
        optimizer.stateless_apply(
            [v.value for v in optimizer.variables], grads,
            [v.value for v in model.trainable_variables])
