"""The averaging engine in use: swaps, callbacks, finalize, dtypes,
accumulation, averaged() on any optimizer, state in .keras files, and the
Keras 3.15 defects L1-L6 (../shared/reference/averaging-anchors.md)."""

import os
import re

import keras
import numpy as np
import pytest
from conftest import BACKEND
from conftest import only_on
from conftest import to_numpy

import keras_ema_opt
from keras_ema_opt import backend
from keras_ema_opt.callbacks import AveragedCheckpoint
from keras_ema_opt.callbacks import SwapAverage
from keras_ema_opt.errors import InvalidArgumentError


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32"))
    return x, y.astype("float32")


def _model(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(1),
    ])


def _weights(model):
    return [to_numpy(v).copy() for v in model.trainable_variables]


def _averages(model):
    opt = model.optimizer
    return [to_numpy(opt.average_of(v)).copy()
            for v in model.trainable_variables]


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _fit_model(averaging=None, epochs=2, **fit_kwargs):
    x, y = _data()
    model = _model()
    opt = keras_ema_opt.Adam(
        learning_rate=0.05,
        **({"use_ema": True, "ema_momentum": 0.8} if averaging is None
           else {"averaging": averaging}),
    )
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, **fit_kwargs)
    return model, x, y


# ---------------------------------------------------------------------------
# Swaps
# ---------------------------------------------------------------------------


def test_swap_average_is_bit_exact():
    model, x, _ = _fit_model(keras_ema_opt.EMA(0.9, finalize=False))
    # Magnitudes where an add/subtract swap would lose bits.
    big = model.trainable_variables[0]
    big.assign(to_numpy(big) * 1e30)
    raw = _weights(model)
    averages = _averages(model)
    with model.optimizer.swap_average(model):
        for v, a in zip(model.trainable_variables, averages):
            assert _bits_equal(to_numpy(v), a)
    for v, r in zip(model.trainable_variables, raw):
        assert _bits_equal(to_numpy(v), r)


def test_swap_restores_after_an_exception():
    model, _, _ = _fit_model(keras_ema_opt.EMA(0.9, finalize=False))
    raw = _weights(model)
    with pytest.raises(RuntimeError, match="boom"):
        with model.optimizer.swap_average(model):
            raise RuntimeError("boom")
    for v, r in zip(model.trainable_variables, raw):
        assert _bits_equal(to_numpy(v), r)


def test_swap_callback_after_a_fit_that_raised_restores_on_evaluate():
    # A fit() interrupted in its second epoch never calls on_train_end: a
    # later evaluate() with the same callback is not inside that fit, and
    # must end on the raw weights (it left the averages in the model).
    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 1 and batch == 2:
                raise KeyboardInterrupt("stop")

    x, y = _data()
    model = _model()
    model.compile(optimizer=keras_ema_opt.Adam(
        0.1, averaging=keras_ema_opt.EMA(0.9, finalize=False)), loss="mse")
    callback = SwapAverage(swap_on_epoch=True)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                  callbacks=[callback, Interrupt()])
    keras_ema_opt.backend.sync_training_state(model)
    raw = _weights(model)
    assert not np.array_equal(raw[0], to_numpy(
        model.optimizer.average_of(model.trainable_variables[0])))
    model.evaluate(x, y, verbose=0, callbacks=[callback])
    assert not callback.averages_in_model
    for v, r in zip(model.trainable_variables, raw):
        assert _bits_equal(to_numpy(v), r)


def test_average_of_and_assign_averages():
    model, _, _ = _fit_model(keras_ema_opt.SWA(finalize=False))
    opt = model.optimizer
    first = model.trainable_variables[0]
    expected = to_numpy(opt.average_of(first))
    opt.assign_averages([first])
    assert _bits_equal(to_numpy(first), expected)
    with pytest.raises(KeyError, match="No average is kept"):
        opt.average_of(keras.Variable(np.zeros(2, "float32")))


def test_averaging_api_needs_averaging():
    opt = keras_ema_opt.Adam()
    with pytest.raises(InvalidArgumentError,
                       match=r"swap_average\(\) needs averaging"):
        opt.swap_average()
    opt = keras_ema_opt.Adam(use_ema=True)
    with pytest.raises(InvalidArgumentError,
                       match="needs the optimizer built"):
        opt.average_of(keras.Variable(1.0))


# ---------------------------------------------------------------------------
# Keras 3.15 defects
# ---------------------------------------------------------------------------


def test_l1_predict_with_swap_callback_restores_raw_weights():
    model, x, _ = _fit_model(keras_ema_opt.EMA(0.8, finalize=False))
    raw = _weights(model)
    callback = SwapAverage()
    averaged_out = model.predict(x, verbose=0, callbacks=[callback])
    for v, r in zip(model.trainable_variables, raw):
        assert _bits_equal(to_numpy(v), r)
    assert not callback.averages_in_model
    with model.optimizer.swap_average(model):
        expected = model.predict(x, verbose=0)
    np.testing.assert_array_equal(averaged_out, expected)
    assert not np.allclose(model.predict(x, verbose=0), expected)


def test_l2_early_stop_with_swap_on_epoch_ends_on_averages():
    class StopAfterSecondEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.model.stop_training = True

    x, y = _data()
    model = _model()
    model.compile(optimizer=keras_ema_opt.Adam(0.05, use_ema=True,
                                               ema_momentum=0.8),
                  loss="mse")
    model.fit(x, y, batch_size=8, epochs=5, verbose=0,
              callbacks=[SwapAverage(swap_on_epoch=True),
                         StopAfterSecondEpoch()])
    assert int(to_numpy(model.optimizer.iterations)) == 8
    for v, a in zip(_weights(model), _averages(model)):
        assert _bits_equal(v, a)


def test_l4_gradient_accumulation_averages_once_per_real_step():
    w0 = np.array([1.0, -1.0], "float32")
    w = keras.Variable(w0)
    opt = keras_ema_opt.SGD(learning_rate=1.0, gradient_accumulation_steps=2,
                            averaging=keras_ema_opt.EMA(0.5))
    grads = [np.array(g, "float32") for g in
             ([1.0, 2.0], [3.0, 0.0], [-1.0, 1.0], [0.5, 0.5])]
    for g in grads:
        opt.apply_gradients([(keras.ops.convert_to_tensor(g), w)])
    w1 = w0 - (grads[0] + grads[1]) / 2
    w2 = w1 - (grads[2] + grads[3]) / 2
    expected = 0.5 * (0.5 * w0 + 0.5 * w1) + 0.5 * w2
    np.testing.assert_allclose(to_numpy(w), w2, rtol=1e-6)
    np.testing.assert_allclose(to_numpy(opt.average_of(w)), expected,
                               rtol=1e-6)
    assert int(to_numpy(opt._averager.count)) == 2


@pytest.mark.parametrize("frequency", [None, 1])
def test_l5_overwrite_with_gradient_variables_are_skipped(frequency):
    scale = keras.Variable(np.ones(2, "float32"))
    scale.overwrite_with_gradient = True
    w = keras.Variable(np.array([2.0, 4.0], "float32"))
    opt = keras_ema_opt.SGD(learning_rate=0.5, use_ema=True, ema_momentum=0.5,
                            ema_overwrite_frequency=frequency)
    g = keras.ops.convert_to_tensor(np.array([1.0, 1.0], "float32"))
    opt.apply_gradients([(g * 3.0, scale), (g, w)])
    np.testing.assert_allclose(to_numpy(scale), [3.0, 3.0])
    assert opt.average_of(scale) is None
    with opt.swap_average([scale, w]):
        np.testing.assert_allclose(to_numpy(scale), [3.0, 3.0])
    opt.finalize_variable_values([scale, w])
    np.testing.assert_allclose(to_numpy(scale), [3.0, 3.0])


def test_l6_finalize_false_keeps_raw_weights_after_fit():
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras_ema_opt.Adam(
        0.05, averaging=keras_ema_opt.EMA(0.8, finalize=False)), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    raw = _weights(model)
    averages = _averages(model)
    assert not all(np.allclose(r, a) for r, a in zip(raw, averages))
    # The default (Keras 2) finalize writes the averages, on a second model.
    again = _model()
    again.compile(optimizer=keras_ema_opt.Adam(
        0.05, averaging=keras_ema_opt.EMA(0.8)), loss="mse")
    again.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for v, a in zip(_weights(again), averages):
        np.testing.assert_allclose(v, a, rtol=1e-6, atol=1e-7)
    # A second fit() on the model whose raw weights stayed runs (smoke).
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)


# ---------------------------------------------------------------------------
# Callbacks
# ---------------------------------------------------------------------------


def test_swap_average_callback_evaluates_on_averages_during_fit():
    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.val = []

        def on_epoch_end(self, epoch, logs=None):
            self.val.append(logs["val_loss"])

    x, y = _data()
    model = _model()
    model.compile(optimizer=keras_ema_opt.Adam(
        0.05, averaging=keras_ema_opt.EMA(0.8, finalize=False)), loss="mse")
    record = Record()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              validation_data=(x, y), callbacks=[SwapAverage(), record])
    with model.optimizer.swap_average(model):
        expected = model.evaluate(x, y, verbose=0)
    assert record.val[0] == pytest.approx(expected, rel=1e-5)
    raw = model.evaluate(x, y, verbose=0)
    assert raw != pytest.approx(expected, rel=1e-3)



def test_swap_average_callback_under_a_mixed_precision_policy():
    # Keras wraps the compiled optimizer in a LossScaleOptimizer: the
    # callbacks reach the averages through it.
    class Record(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            inner = self.model.optimizer.inner_optimizer
            self.seen = [(to_numpy(v), to_numpy(inner.average_of(v)))
                         for v in self.model.trainable_variables]

    x, y = _data()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = _model()
        model.compile(optimizer=keras_ema_opt.Adam(
            0.05, averaging=keras_ema_opt.EMA(0.8, finalize=False)),
            loss="mse")
        record = Record()
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  validation_data=(x, y), callbacks=[SwapAverage(), record])
    finally:
        keras.config.set_dtype_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    for weight, average in record.seen:
        np.testing.assert_array_equal(weight, average)
    inner = model.optimizer.inner_optimizer
    assert any(not np.array_equal(to_numpy(v), to_numpy(inner.average_of(v)))
               for v in model.trainable_variables)  # restored afterwards
    # Keras' LossScaleOptimizer has no averaging API; its inner optimizer
    # has it all (README).
    assert not hasattr(model.optimizer, "swap_average")
    with inner.swap_average(model):
        for v in model.trainable_variables:
            np.testing.assert_array_equal(to_numpy(v),
                                          to_numpy(inner.average_of(v)))

class _Interrupt(keras.callbacks.Callback):
    """Raises during validation, as a Ctrl-C or a failing metric would."""

    def on_test_batch_end(self, batch, logs=None):
        raise KeyboardInterrupt("during validation")


def test_validation_ended_by_an_exception_loses_no_training():
    # Keras calls no on_test_end then: the swap SwapAverage opened stays
    # open, the model holding the averages. A later fit() must neither
    # restore that swap's older raw weights at its end (it dropped three
    # epochs of training) nor, with the same callback, train on averages.
    x, y = _data()
    for again in (False, True):
        model = _model()
        opt = keras_ema_opt.Adam(
            0.05, averaging=keras_ema_opt.EMA(0.9, finalize=False))
        model.compile(optimizer=opt, loss="mse")
        swap = SwapAverage()

        class Raw(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                self.raw = [to_numpy(v).copy() for v in self.model.weights]

            def on_train_begin(self, logs=None):
                self.start = [to_numpy(v).copy()
                              for v in self.model.weights]

        raw = Raw()
        with pytest.raises(KeyboardInterrupt):
            model.fit(x, y, validation_data=(x, y), verbose=0,
                      callbacks=[raw, swap, _Interrupt()])
        before = raw.raw
        if again:
            # The same callback closes its swap as the next fit() begins.
            second = Raw()
            model.fit(x, y, epochs=3, verbose=0, callbacks=[swap, second])
            for a, b in zip(second.start, before):
                np.testing.assert_array_equal(a, b)
        elif opt._averager.swaps:  # left open (JAX's evaluate closes it)
            with pytest.warns(UserWarning,
                              match="was closed at step .* without restoring"):
                model.fit(x, y, epochs=3, verbose=0)
        else:
            model.fit(x, y, epochs=3, verbose=0)
        assert not opt._averager.swaps
        after = [to_numpy(v) for v in model.weights]
        assert not all(np.array_equal(a, b) for a, b in zip(after, before))


def test_averaged_checkpoint_names_a_filepath_it_cannot_format(tmp_path):
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras_ema_opt.Adam(0.05, use_ema=True),
                  loss="mse")
    callback = AveragedCheckpoint(str(tmp_path / "avg-{epoch}-{val_loss:.3f}"
                                      ".keras"))
    with pytest.raises(InvalidArgumentError,
                       match=r"cannot format.*'val_loss'.*\['loss'\]"):
        model.fit(x, y, validation_data=(x, y), validation_freq=2, epochs=2,
                  verbose=0, callbacks=[callback])
    assert os.listdir(tmp_path) == []


def test_swap_on_epoch_lets_model_checkpoint_save_averages(tmp_path):
    path = tmp_path / "best.weights.h5"
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras_ema_opt.Adam(
        0.05, averaging=keras_ema_opt.EMA(0.8, finalize=False)), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
        SwapAverage(swap_on_epoch=True),
        keras.callbacks.ModelCheckpoint(str(path), save_weights_only=True),
    ])
    averages = _averages(model)
    saved = _model()
    saved.load_weights(str(path))
    for v, a in zip(_weights(saved), averages):
        assert _bits_equal(v, a)


def test_averaged_checkpoint_writes_the_averaged_model(tmp_path):
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras_ema_opt.SGD(
        0.05, averaging=keras_ema_opt.SWA(finalize=False)), loss="mse")
    callback = AveragedCheckpoint(tmp_path / "avg-{epoch}.keras")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[callback])
    assert sorted(os.listdir(tmp_path)) == ["avg-1.keras", "avg-2.keras"]
    loaded = keras.saving.load_model(tmp_path / "avg-2.keras")
    for v, a in zip(_weights(loaded), _averages(model)):
        assert _bits_equal(v, a)
    # The raw weights are back in the live model.
    assert not all(np.allclose(v, a) for v, a in
                   zip(_weights(model), _averages(model)))


def test_callback_errors_name_what_was_received():
    with pytest.raises(InvalidArgumentError, match="must end in '.keras'"):
        AveragedCheckpoint("model.h5")
    for path in (None, 3):  # was os.fspath's bare TypeError
        with pytest.raises(InvalidArgumentError, match="`filepath` must be "
                           f"a path.*Received: filepath={path!r} of type"):
            AveragedCheckpoint(path)
    with pytest.raises(InvalidArgumentError, match="save_freq=0"):
        AveragedCheckpoint("m.keras", save_freq=0)
    # At construction, as SwapAverage's (it was read after an epoch).
    for slot in ("a", -1, 1.5):
        with pytest.raises(InvalidArgumentError,
                           match=re.escape(f"slot={slot!r}")):
            AveragedCheckpoint("m.keras", slot=slot)
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    with pytest.raises(InvalidArgumentError, match="needs a model compiled"):
        model.predict(x, verbose=0, callbacks=[SwapAverage()])


# ---------------------------------------------------------------------------
# What is averaged, and how it is stored
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float32_averages_of_low_precision_weights(dtype):
    w = keras.Variable(np.ones((4,), "float32"), dtype=dtype)
    opt = keras_ema_opt.SGD(learning_rate=0.05, averaging=keras_ema_opt.EMA(
        0.999, average_dtype="float32"))
    trajectory = [to_numpy(w).astype(np.float64)]
    for _ in range(20):
        opt.apply_gradients([(keras.ops.ones((4,), dtype=dtype), w)])
        trajectory.append(to_numpy(w).astype(np.float64))
    average = opt.average_of(w)
    assert keras.backend.standardize_dtype(average.dtype) == "float32"
    assert keras.backend.standardize_dtype(w.dtype) == dtype
    expected = trajectory[0]
    for t in trajectory[1:]:
        expected = 0.999 * expected + 0.001 * t
    # The weights as stored, within float32 round-off: XLA, allowed
    # excess precision, had dropped a compiled step's rounding of the new
    # weights to their dtype, and the JAX average mixed the unrounded ones
    # (2e-4 off here; `backend.widen` keeps the rounding).
    np.testing.assert_allclose(to_numpy(average), expected, rtol=1e-6,
                               atol=1e-7)
    # Each increment (~1e-3 * 0.05 t) is below the low-precision spacing
    # near 1: an average kept in the weights' own dtype would stay at 1.
    assert np.all(to_numpy(average) < 0.995)
    # Swap and finalize write float32 averages into low-precision weights.
    raw = to_numpy(w).copy()
    with opt.swap_average([w]):
        np.testing.assert_allclose(to_numpy(w).astype(np.float64),
                                   to_numpy(average), atol=1e-2)
    assert _bits_equal(to_numpy(w), raw)
    opt.finalize_variable_values([w])
    assert keras.backend.standardize_dtype(w.dtype) == dtype



@only_on("tensorflow")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float32_averages_of_low_precision_weights_under_xla(dtype):
    # The step in a function XLA compiles (a GPU's fit()): XLA, allowed
    # excess precision, dropped the rounding of the new weights to their
    # dtype, and the average mixed the unrounded ones (8e-5 off here).
    import tensorflow as tf

    w = keras.Variable(np.linspace(-1, 1, 64).astype("float32"), dtype=dtype)
    opt = keras_ema_opt.SGD(learning_rate=0.01, averaging=keras_ema_opt.EMA(
        0.9, average_dtype="float32"))
    opt.build([w])
    grad = keras.ops.cast(np.cos(np.arange(64)), dtype)
    step = tf.function(lambda: opt.apply_gradients([(grad, w)]),
                       jit_compile=True)
    expected = to_numpy(w).astype(np.float64)
    for _ in range(10):
        step()
        expected = 0.9 * expected + 0.1 * to_numpy(w).astype(np.float64)
    np.testing.assert_allclose(to_numpy(opt.average_of(w)), expected,
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("xla", [False, True])
def test_float16_subnormal_weights_are_averaged_as_stored(xla):
    # Weights below float16's smallest normal (6.1e-5): XLA's
    # reduce_precision, with which `backend.widen` keeps a compiled step's
    # rounding, flushes them to zero. On JAX, and under XLA on TensorFlow,
    # the SWA average of weights that never moved was 0, and an EMA of
    # weights moving among subnormals mixed zeros.
    if xla and BACKEND != "tensorflow":
        pytest.skip("JAX compiles every step; PyTorch has no XLA step")
    values = np.array([3e-5, -2e-5, 1e-6, 6e-8, -6.1e-5, 5e-5, 1e-3],
                      "float16")
    moves = np.array([1e-5, -3e-6, 4e-6, 1e-7, -2e-5, 3e-5, 1e-4],
                     "float16")
    for averaging, grads in [
            (keras_ema_opt.SWA(average_dtype="float32"), 0 * moves),
            (keras_ema_opt.EMA(0.5, average_dtype="float32"), moves)]:
        name = type(averaging).__name__
        w = keras.Variable(values, dtype="float16")
        opt = keras_ema_opt.SGD(0.3, averaging=averaging)
        opt.build([w])
        g = keras.ops.convert_to_tensor(grads)

        def step():
            opt.apply_gradients([(g, w)])
        if xla:
            import tensorflow as tf

            step = tf.function(step, jit_compile=True)
        expected = to_numpy(w).astype(np.float64)
        for _ in range(4):
            step()
            stored = to_numpy(w).astype(np.float64)
            expected = stored if name == "SWA" else (
                0.5 * expected + 0.5 * stored)
        assert np.all(stored[:6] != 0) and np.all(
            np.abs(stored[:6]) < 6.2e-5), stored
        average = to_numpy(opt.average_of(w))
        if name == "SWA":  # weights that never moved: exactly them
            np.testing.assert_array_equal(average, values.astype("float32"))
        np.testing.assert_allclose(average, expected, rtol=1e-6, atol=1e-12,
                                   err_msg=name)


@pytest.mark.parametrize("dtype,momentum", [("bfloat16", 0.999),
                                            ("float16", 0.9999)])
def test_low_precision_averages_in_their_own_dtype_move(dtype, momentum):
    # A decay close to 1 rounds to 1.0 in bfloat16 / float16: the average
    # is mixed with `1 - d` taken in float32, on every backend (the JAX
    # step once kept it at its start for ever).
    w = keras.Variable(np.zeros((4,), "float32"), dtype=dtype)
    opt = keras_ema_opt.SGD(learning_rate=1.0,
                            averaging=keras_ema_opt.EMA(momentum))
    step = keras.ops.cast(-0.5 * np.ones((4,)), dtype)
    trajectory = []
    for _ in range(40):
        opt.apply_gradients([(step, w)])
        trajectory.append(to_numpy(w).astype(np.float64))
    average = to_numpy(opt.average_of(w)).astype(np.float64)
    assert keras.backend.standardize_dtype(opt.average_of(w).dtype) == dtype
    expected = np.zeros(4)
    for t in trajectory:
        expected = momentum * expected + (1 - momentum) * t
    # Rounded to the storage dtype at each of the 40 steps: within a few
    # of its units (bfloat16 has 8 bits of mantissa, float16 11).
    np.testing.assert_allclose(average, expected, rtol=2 ** -6)
    assert np.all(average > 0)


@pytest.mark.parametrize("xla", [False, True])
@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
@pytest.mark.parametrize("dtype,momentum", [
    ("bfloat16", 0.9), ("bfloat16", 0.999), ("float16", 0.9),
    ("float16", 0.99)])
def test_low_precision_averages_mix_with_the_float32_weight(
        dtype, momentum, optimizer, xla):
    # An average held in its weight's bfloat16 / float16 is mixed in
    # float32 with the float32 `1 - d` and rounded once, on every path:
    # PyTorch's `_foreach_lerp_` (the engine's update and the fused Adam
    # step's) took the weight rounded to the average's dtype (0.1 in
    # bfloat16 is 0.10009765625, 0.01 in float16 0.0099945), and so did
    # TensorFlow's eager kernel, which computed in the dtype throughout.
    if xla and BACKEND != "tensorflow":
        pytest.skip("JAX compiles every step; PyTorch has no XLA step")
    import ml_dtypes

    storage = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1000, 1000, 2048).astype(storage).astype("float32")
    w = keras.Variable(np.zeros(2048, "float32"), dtype=dtype)
    opt = getattr(keras_ema_opt, optimizer)(
        0.1, averaging=keras_ema_opt.EMA(momentum))
    opt.build([w])  # the average starts as a copy: zeros
    w.assign(keras.ops.cast(x, dtype))
    zero = keras.ops.zeros((2048,), dtype)  # the step leaves `w` at x

    def step():
        opt.apply_gradients([(zero, w)])
    if xla:
        import tensorflow as tf

        step = tf.function(step, jit_compile=True)
    step()
    np.testing.assert_array_equal(to_numpy(w).astype("float32"), x)
    weight = np.float32(1) - np.float32(momentum)  # 1 - d in float32
    expected = (weight * x).astype(storage).astype("float32")
    average = to_numpy(opt.average_of(w)).astype("float32")
    rounded = (np.float32(weight.astype(storage)) * x).astype(storage)
    assert np.any(rounded.astype("float32") != expected)  # tells them apart
    np.testing.assert_array_equal(average, expected)

def test_average_of_returns_an_array_of_its_own():
    w = keras.Variable(np.ones(3, "float32"))
    opt = keras_ema_opt.SGD(0.1, use_ema=True, ema_momentum=0.5)
    opt.apply_gradients([(keras.ops.ones((3,)), w)])
    before = opt.average_of(w)
    opt.apply_gradients([(keras.ops.ones((3,)), w)])  # donates on JAX
    np.testing.assert_allclose(to_numpy(before), [0.95] * 3, rtol=1e-6)


def test_debias_reads_the_weights_before_the_first_update():
    w = keras.Variable(np.array([2.0, -1.0], "float32"))
    opt = keras_ema_opt.SGD(0.1, averaging=keras_ema_opt.EMA(
        0.9, debias=True, every=3))
    opt.apply_gradients([(keras.ops.ones((2,)), w)])
    np.testing.assert_allclose(to_numpy(opt.average_of(w)), to_numpy(w))
    assert not np.any(np.isnan(to_numpy(opt.average_of(w))))
    # A value, as without `debias`: on PyTorch the weight it read had tied
    # it to the parameter's gradient (`np.asarray` refused it).
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(opt.average_of(w)),
                                      to_numpy(opt.average_of(w)))
        assert not getattr(opt.average_of(w), "requires_grad", False)
        opt.apply_gradients([(keras.ops.ones((2,)), w)])


def test_numpy_integer_overwrite_frequency():
    opt = keras_ema_opt.SGD(use_ema=True, ema_overwrite_frequency=np.int64(3))
    assert opt.ema_overwrite_frequency == 3


def test_flags_and_average_dtypes_are_checked():
    # `bool("False")` is True: a string flag silently meant the opposite.
    for make, text in [
            (lambda: keras_ema_opt.EMA(debias="no"), "debias='no'"),
            (lambda: keras_ema_opt.EMA(finalize="False"), "finalize='False'"),
            (lambda: keras_ema_opt.SWA(include_non_trainable="false"),
             "include_non_trainable='false'"),
            (lambda: SwapAverage(swap_on_epoch="False"),
             "swap_on_epoch='False'"),
            (lambda: SwapAverage(slot="x"), "slot='x'"),
            (lambda: SwapAverage(slot=-1), "slot=-1")]:
        with pytest.raises(InvalidArgumentError, match=re.escape(text)):
            make()
    # An integer or bool average truncates every update.
    for dtype in ("int32", "uint8", "bool", "not-a-dtype"):
        with pytest.raises(InvalidArgumentError,
                           match=re.escape(f"average_dtype={dtype!r}")):
            keras_ema_opt.EMA(average_dtype=dtype)
    assert keras_ema_opt.EMA(average_dtype=np.float16).average_dtype == (
        "float16")
    assert keras_ema_opt.EMA(debias=np.bool_(True)).debias is True


def test_swap_and_assign_refuse_variables_the_optimizer_does_not_know():
    model, _, _ = _fit_model(keras_ema_opt.EMA(0.9, finalize=False))
    clone = _model(seed=5)
    raw = _weights(clone)
    with pytest.raises(KeyError, match="None of the .* variables given"):
        with model.optimizer.swap_average(clone):
            pass
    with pytest.raises(KeyError, match="None of the .* variables given"):
        model.optimizer.assign_averages(clone.trainable_variables)
    for v, r in zip(clone.trainable_variables, raw):
        assert _bits_equal(to_numpy(v), r)
    # The model's own variables, integer and non-averaged ones included,
    # still swap.
    with model.optimizer.swap_average(model):
        pass


def test_strategy_errors_name_the_value():
    with pytest.raises(InvalidArgumentError, match=r"momentum=1\.5"):
        keras_ema_opt.EMA(1.5)
    with pytest.raises(InvalidArgumentError, match="warmup='linear'"):
        keras_ema_opt.EMA(warmup="linear")
    with pytest.raises(InvalidArgumentError, match="every=0"):
        keras_ema_opt.SWA(every=0)
    with pytest.raises(InvalidArgumentError, match="start_step=-1"):
        keras_ema_opt.SWA(start_step=-1)
    with pytest.raises(InvalidArgumentError, match="Received: averaging=0.9"):
        keras_ema_opt.Adam(averaging=0.9)
    for kwargs, text in [(dict(inv_gamma="a"), "inv_gamma='a'"),
                         (dict(inv_gamma=None), "inv_gamma=None"),
                         (dict(power=-1.0), "power=-1.0"),
                         # inv_gamma=inf made every decay 0: no averaging.
                         (dict(inv_gamma=float("inf")),
                          "finite.*inv_gamma=inf"),
                         (dict(power=float("inf")), "power=inf"),
                         (dict(power="x"), "power='x'"),
                         (dict(momentum=0.1, min_momentum=0.5),
                          "min_momentum=0.5, momentum=0.1")]:
        with pytest.raises(InvalidArgumentError, match=text):
            keras_ema_opt.EMA(warmup="power", **kwargs)
    with pytest.raises(InvalidArgumentError, match="start_step=100"):
        keras_ema_opt.PowerEMA(start_step=100)
    # An argument no strategy takes: typed (a TypeError too, as Python's),
    # with the ones accepted (it was Averaging.__init__'s TypeError).
    for cls, kwargs, accepted in [
            (keras_ema_opt.EMA, dict(bogus=1), "momentum, power"),
            (keras_ema_opt.SWA, dict(decay=0.9), "average_dtype, every"),
            (keras_ema_opt.PowerEMA, dict(sigma_rel=0.1), "sigma_rels")]:
        with pytest.raises(keras_ema_opt.errors.UnknownArgumentError,
                           match=rf"{cls.__name__} does not accept the "
                           rf"argument\(s\) {{'{next(iter(kwargs))}'.*"
                           rf"Accepted arguments: .*{accepted}"):
            cls(**kwargs)


def test_average_dtype_the_backend_does_not_hold_is_refused():
    # JAX without its 64-bit mode holds a float64 variable's value in
    # float32: the averages were float32 while the config said float64.
    v = keras.Variable(np.ones((3,), "float32"))
    opt = keras_ema_opt.SGD(0.1, averaging=keras_ema_opt.EMA(
        0.9, average_dtype="float64"))
    if BACKEND == "jax" and not __import__("jax").config.jax_enable_x64:
        with pytest.raises(InvalidArgumentError,
                           match=r"average_dtype='float64'.* in float32, "
                           r"not float64 .*jax_enable_x64"):
            opt.build([v])
        return
    opt.build([v])
    assert keras.backend.standardize_dtype(
        opt.average_of(v).dtype) == "float64"


@pytest.mark.parametrize("explicit", [False, True])
def test_ema_momentum_set_after_construction(explicit):
    # Keras 2 reads `ema_momentum` at every update: set between steps it
    # applies from the next one (also through JAX's compiled eager step).
    # An `averaging=` strategy passed in is left as given.
    kwargs = dict(averaging=keras_ema_opt.EMA(0.9)) if explicit else dict(
        use_ema=True, ema_momentum=0.9)
    opt = keras_ema_opt.SGD(learning_rate=1.0, **kwargs)
    w = keras.Variable(np.zeros((1,), "float32"))
    momenta = [0.9, 0.5, 0.5]
    expected = 0.0  # the average starts as the weights (Keras 2)
    for step, momentum in enumerate(momenta, 1):
        opt.ema_momentum = momentum
        opt.apply_gradients([(keras.ops.convert_to_tensor([-1.0]), w)])
        m = 0.9 if explicit else momentum
        expected = m * expected + (1 - m) * step
    np.testing.assert_allclose(to_numpy(opt.average_of(w)), [expected],
                               rtol=1e-6)
    if not explicit:
        with pytest.raises(InvalidArgumentError, match="ema_momentum=1.5"):
            opt.ema_momentum = 1.5
        # A refused value leaves the optimizer as it was.
        assert opt.ema_momentum == 0.5
        assert opt.get_config()["ema_momentum"] == 0.5


def test_averaging_api_errors_name_what_was_received():
    w = keras.Variable(np.ones((2,), "float32"))
    opt = keras_ema_opt.SGD(averaging=keras_ema_opt.PowerEMA())
    opt.build([w])
    assert opt.average_of(w, 1) is not None
    for call in (lambda: opt.average_of(w, 2),
                 lambda: opt.swap_average([w], slot=-1),
                 lambda: opt.assign_averages(slot="1")):
        with pytest.raises(InvalidArgumentError,
                           match=r"`slot` must be an integer in \[0, 2\)"):
            call()
    with pytest.raises(InvalidArgumentError, match="Received: model='x'"):
        opt.swap_average("x")
    with pytest.raises(InvalidArgumentError,
                       match=r"\(gradient, variable\) pairs"):
        opt.apply_gradients([keras.ops.ones((2,))])


def test_overwrite_frequency_writes_debiased_averages():
    w = keras.Variable(np.array([4.0], "float32"))
    opt = keras_ema_opt.SGD(1.0, averaging=keras_ema_opt.EMA(0.5, debias=True),
                            ema_overwrite_frequency=2)
    opt.apply_gradients([(keras.ops.ones((1,)), w)])  # w 3; a 1.5, c 0.5
    opt.apply_gradients([(keras.ops.ones((1,)), w)])  # w 2; a 1.75, c 0.75
    # (0.5 * 1.5 + 0.5 * 2) / 0.75, written into w at step 2 (held as
    # b = 3, then 3 + (0.5 / 0.75)(2 - 3): the same 7/3)
    np.testing.assert_allclose(to_numpy(w), [1.75 / 0.75], rtol=1e-6)


STRATEGIES = {
    "ema_power": keras_ema_opt.EMA(0.99, warmup="power", start_step=2),
    "ema_debias": keras_ema_opt.EMA(0.9, debias=True),
    "swa": keras_ema_opt.SWA(start_step=1, every=2),
}


@pytest.mark.parametrize("key", sorted(STRATEGIES))
def test_keras_file_carries_averaging_state(key, tmp_path):
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras_ema_opt.AdamW(
        0.05, averaging=STRATEGIES[key]), loss="mse")
    for i in range(3):
        model.train_on_batch(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.averaging == STRATEGIES[key]
    for i in range(3, 7):
        batch = (x[(i % 4) * 8:(i % 4 + 1) * 8], y[(i % 4) * 8:(i % 4 + 1) * 8])
        model.train_on_batch(*batch)
        loaded.train_on_batch(*batch)
    for a, b in zip(_averages(model), _averages(loaded)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert int(to_numpy(loaded.optimizer._averager.count)) == int(
        to_numpy(model.optimizer._averager.count))


# ---------------------------------------------------------------------------
# averaged(): any Keras 3 optimizer
# ---------------------------------------------------------------------------


class PlainSGD(keras.optimizers.Optimizer):
    """A user's own Keras 3 optimizer."""

    def update_step(self, gradient, variable, learning_rate):
        lr = keras.ops.cast(learning_rate, variable.dtype)
        self.assign_sub(variable, keras.ops.multiply(gradient, lr))


def _keras_optimizers():
    return {
        "Lion": lambda: keras.optimizers.Lion(learning_rate=0.01),
        "Muon": lambda: keras.optimizers.Muon(learning_rate=0.01),
        "user": lambda: PlainSGD(learning_rate=0.1),
        "ours": lambda: keras_ema_opt.Adam(0.01),
        "LossScale": lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(0.01)),
    }


@pytest.mark.parametrize("kind", sorted(_keras_optimizers()))
def test_averaged_adds_averaging_to_any_optimizer(kind):
    x, y = _data()
    model = _model()
    base = _keras_optimizers()[kind]()
    opt = keras_ema_opt.averaged(base, keras_ema_opt.EMA(0.5, finalize=False))
    config = {k: v for k, v in opt.get_config().items() if k != "averaging"}
    base_config = base.get_config()
    assert {k: config.get(k) for k in base_config if k not in
            ("use_ema", "inner_optimizer")} == {
        k: v for k, v in base_config.items() if k not in
        ("use_ema", "inner_optimizer")}
    model.compile(optimizer=opt, loss="mse")
    trajectory = [_weights(model)]
    for i in range(3):
        model.train_on_batch(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
        trajectory.append(_weights(model))
    averages = _averages(model)
    for j, a in enumerate(averages):
        expected = np.asarray(trajectory[0][j], np.float64)
        for step in trajectory[1:]:
            expected = 0.5 * expected + 0.5 * step[j]
        np.testing.assert_allclose(a, expected, rtol=1e-5, atol=1e-6)


def test_averaged_loss_scale_optimizer_steps_eagerly_on_every_backend():
    """apply_gradients of averaged(LossScaleOptimizer(...)), an overflowing
    step among them, against float64 (on JAX Keras' wrapper raised
    UnexpectedTracerError: its step is a `cond` whose branches assign)."""
    w0 = np.array([1.0, -2.0], np.float64)
    var = keras.Variable(w0.astype("float32"))
    opt = keras_ema_opt.averaged(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=4.0),
        keras_ema_opt.EMA(0.5))
    grads = [np.array([4.0, 8.0]), np.array([np.inf, 1.0]),
             np.array([-4.0, 2.0])]
    w, a, scale = w0, w0, 4.0
    for g in grads:
        opt.apply_gradients([(keras.ops.convert_to_tensor(
            (g * scale).astype("float32")), var)])
        if np.isfinite(g).all():
            w = w - 0.1 * g
            a = 0.5 * a + 0.5 * w
        else:
            scale /= 2
    np.testing.assert_allclose(to_numpy(var), w, rtol=1e-6)
    np.testing.assert_allclose(to_numpy(opt.average_of(var)), a, rtol=1e-6)
    assert float(to_numpy(opt.dynamic_scale)) == scale == 2.0
    assert int(to_numpy(opt.iterations)) == 2  # Keras 3 counts no skip


def test_loss_scale_optimizer_eager_steps_take_pairs_in_any_order():
    """Pairs in another order than the build's, a subset, an unknown
    variable: as Keras' own step takes them (on JAX the eager step runs
    as the stateless one, which took the gradients by position: each
    variable stepped with the other's momentum)."""
    a = keras.Variable(np.ones(2, "float32"))
    b = keras.Variable(np.full(2, 10.0, "float32"))
    opt = keras_ema_opt.compat.LegacyLossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), initial_scale=4.0)
    opt.build([a, b])

    def g(value):
        return keras.ops.convert_to_tensor(np.full(2, 4.0 * value, "float32"))

    opt.apply_gradients([(g(1.0), a), (g(2.0), b)])
    opt.apply_gradients([(g(2.0), b), (g(1.0), a)])
    opt.apply_gradients([(g(2.0), b)])
    # float64: m <- 0.9 m - 0.1 g; w <- w + m
    np.testing.assert_allclose(to_numpy(a), [0.71, 0.71], rtol=1e-6)
    np.testing.assert_allclose(to_numpy(b), [8.878, 8.878], rtol=1e-6)
    with pytest.raises(ValueError, match="(?i)unknown variable|cannot "
                       "recognize variable"):
        opt.apply_gradients([(g(1.0), keras.Variable(np.zeros(2,
                                                              "float32")))])


class _Halving(keras.optimizers.schedules.LearningRateSchedule):
    """A user's schedule, registered nowhere."""

    def __call__(self, step):
        return 0.1 * keras.ops.power(0.5, keras.ops.cast(step, "float32"))


@pytest.mark.parametrize("rate", ["schedule", "callable"])
def test_averaged_keeps_what_the_config_cannot_carry(rate):
    # averaged() rebuilds the optimizer from its config: a user's schedule
    # or a callable learning rate, and `exclude_from_weight_decay`, are
    # carried over as they are. Oracle: Keras' own AdamW, same settings.
    def make():
        lr = _Halving() if rate == "schedule" else (lambda: 0.05)
        optimizer = keras.optimizers.AdamW(learning_rate=lr,
                                           weight_decay=0.5)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer

    def train(optimizer):
        kernel = keras.Variable(np.ones((2, 2), "float32"), name="kernel")
        bias = keras.Variable(np.ones((2,), "float32"), name="bias")
        for g in (1.0, -2.0, 0.5):
            optimizer.apply_gradients([
                (keras.ops.full((2, 2), g), kernel),
                (keras.ops.full((2,), g), bias)])
        return to_numpy(kernel), to_numpy(bias)

    ours = train(keras_ema_opt.averaged(make(), keras_ema_opt.EMA(0.9)))
    theirs = train(make())
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class ScaledAdam(keras.optimizers.Adam):
    """A user's subclass of Keras' Adam that passes Keras' arguments on."""

    def __init__(self, scale=1.0, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate * self.scale)

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}


class ScaledAdamKw(ScaledAdam):
    """The same, its `**kwargs` named otherwise."""

    def __init__(self, scale=1.0, **kw):
        super().__init__(scale=scale, **kw)


@pytest.mark.parametrize("cls", [ScaledAdam, ScaledAdamKw])
def test_averaged_takes_a_subclass_passing_keras_arguments_on(cls):
    # Adam's own arguments (beta_1) reach Adam through the subclass's
    # `**kwargs`, whatever its name; they were refused as unknown. Oracle:
    # the subclass itself, same gradients.
    def train(optimizer):
        w = keras.Variable(np.ones((2, 2), "float32"))
        for g in (1.0, -2.0, 0.5):
            optimizer.apply_gradients([(keras.ops.full((2, 2), g), w)])
        return to_numpy(w)

    def make():
        return cls(scale=0.5, learning_rate=0.1, beta_1=0.5, epsilon=1e-3)

    ours = keras_ema_opt.averaged(make(), keras_ema_opt.EMA(0.9))
    assert ours.scale == 0.5 and ours.beta_1 == 0.5 and ours.epsilon == 1e-3
    np.testing.assert_allclose(train(ours), train(make()), rtol=1e-6)
    with pytest.raises(keras_ema_opt.errors.UnknownArgumentError,
                       match=r"\{'bogus': 1\}"):
        keras_ema_opt.contract_class(cls)(bogus=1)


def test_averaged_names_an_argument_a_subclass_sets_itself():
    # Its config carries what its __init__ sets itself (and so does not
    # round-trip in Keras either): a typed error naming the argument, not
    # Python's "multiple values".
    class FixedBeta(keras.optimizers.Adam):
        def __init__(self, **kwargs):
            super().__init__(beta_1=0.5, **kwargs)

    with pytest.raises(keras_ema_opt.errors.UnknownArgumentError,
                       match=r"FixedBeta does not accept the argument\(s\) "
                       r"\{'beta_1': 0.5\}: its __init__ sets it itself"):
        keras_ema_opt.averaged(FixedBeta(), keras_ema_opt.EMA(0.9))


def _multi_optimizer():
    multi = getattr(keras.optimizers, "MultiOptimizer", None)
    if multi is None:
        pytest.skip("this Keras has no MultiOptimizer")
    return multi(keras.optimizers.OptimizerMap(keras.optimizers.SGD()))


@pytest.mark.parametrize("case", [
    "no averaging", "MultiOptimizer", "Keras' use_ema", "ours averaging",
    "loss scale of use_ema", "use_ema, PowerEMA given"])
def test_averaged_refuses_what_it_cannot_average(case):
    O = keras.optimizers
    optimizer, averaging, match = {
        "no averaging": (lambda: O.Adam(), None,
                         r"takes an averaging strategy.*averaging=None"),
        "MultiOptimizer": (_multi_optimizer, keras_ema_opt.EMA(),
                           r"MultiOptimizer routes variables to several"),
        "Keras' use_ema": (lambda: O.SGD(use_ema=True, ema_momentum=0.5),
                           keras_ema_opt.EMA(0.9),
                           r"sgd.* already averages \(use_ema=True, "
                           r"ema_momentum=0.5\): pass the optimizer "
                           r"without its averaging\. For several averages "
                           r"at once, give one strategy"),
        # The message's advice is no way around the refusal.
        "use_ema, PowerEMA given": (
            lambda: O.Adam(use_ema=True), keras_ema_opt.PowerEMA(),
            r"already averages \(use_ema=True.*without its averaging"),
        "ours averaging": (lambda: keras_ema_opt.averaged(
            O.Adam(), keras_ema_opt.EMA()), keras_ema_opt.SWA(),
            r"already averages \(averaging=EMA\(momentum=0.999"),
        "loss scale of use_ema": (lambda: O.LossScaleOptimizer(
            O.Adam(use_ema=True)), keras_ema_opt.EMA(),
            r"already averages \(use_ema=True"),
    }[case]
    with pytest.raises(InvalidArgumentError, match=match):
        keras_ema_opt.averaged(optimizer(), averaging)


def test_ema_momentum_beside_another_averaging_warns():
    with pytest.warns(UserWarning, match=r"Adam: ema_momentum=0.5 is not "
                      r"used: the averages follow averaging=EMA\(momentum"
                      r"=0.9"):
        opt = keras_ema_opt.Adam(use_ema=True, ema_momentum=0.5,
                                 averaging=keras_ema_opt.EMA(0.9))
    assert opt.averaging == keras_ema_opt.EMA(0.9)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The same EMA, and the default momentum (a config's): no warning.
        keras_ema_opt.Adam(ema_momentum=0.9, averaging=keras_ema_opt.EMA(0.9))
        swa = keras_ema_opt.Adam(averaging=keras_ema_opt.SWA())
        keras_ema_opt.Adam.from_config(swa.get_config())
        # A momentum without `use_ema=True`, which averaged nothing.
        keras_ema_opt.averaged(keras.optimizers.Adam(ema_momentum=0.5),
                               keras_ema_opt.EMA(0.9))
    assert not [w for w in caught if "is not used" in str(w.message)]


def test_averaged_refuses_a_built_optimizer():
    opt = keras.optimizers.Adam()
    opt.build([keras.Variable(np.zeros(2, "float32"))])
    with pytest.raises(InvalidArgumentError, match="already holds state"):
        keras_ema_opt.averaged(opt, keras_ema_opt.EMA())


def test_averaged_user_optimizer_round_trips_through_keras_file(tmp_path):
    model = _model()
    model.compile(optimizer=keras_ema_opt.averaged(
        PlainSGD(learning_rate=0.1), keras_ema_opt.SWA()), loss="mse")
    x, y = _data()
    model.train_on_batch(x[:8], y[:8])
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer).__name__ == "PlainSGD"
    assert loaded.optimizer.averaging == keras_ema_opt.SWA()



@pytest.mark.parametrize("make", [
    lambda: keras_ema_opt.Adam(0.05, averaging=keras_ema_opt.EMA(0.99)),
    lambda: keras_ema_opt.averaged(keras.optimizers.SGD(0.05),
                                   keras_ema_opt.EMA(0.99)),
    lambda: keras_ema_opt.Adam(0.05, use_ema=True),
], ids=["averaging", "averaged", "use_ema"])
def test_reload_averages_by_the_rule_it_was_made_with(make, tmp_path):
    """A strategy passed as `averaging=` averages every variable the
    optimizer was built with at every step; `use_ema=True` the variables
    of the step (Keras 2). `EMA(0.99)`, equal to the EMA of Keras'
    default `ema_momentum`, was left out of the config and reloaded under
    `use_ema`'s rule. A step giving the first layer alone a gradient: the
    second layer's average moves toward its weight (float64 formula), or
    stays under `use_ema`, in the saved optimizer and the reloaded one."""
    model = _model()
    model.compile(optimizer=make(), loss="mse")
    x, y = _data()
    model.train_on_batch(x[:8], y[:8])
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    every_variable = not getattr(make(), "_ema_follows_momentum")
    for m in (model, loaded):
        first = m.layers[0].trainable_variables
        last = m.layers[-1].kernel
        before = to_numpy(m.optimizer.average_of(last)).astype("float64")
        weight = to_numpy(last).astype("float64")
        m.optimizer.apply_gradients(
            [(keras.ops.ones(v.shape), v) for v in first])
        after = to_numpy(m.optimizer.average_of(last))
        want = before + 0.01 * (weight - before) if every_variable else before
        np.testing.assert_allclose(after, want, rtol=1e-6, atol=1e-7)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()

# ---------------------------------------------------------------------------
# The weight of one update late in a long run, against the float64 formula
# ---------------------------------------------------------------------------


def _weight_of_update(averaging, step, updates_before, slot=0,
                      optimizer=keras_ema_opt.SGD):
    """The weight ``w`` of the update made at optimizer step ``step``, the
    ``updates_before + 1``-th: the average is 0 and the weight 1 before
    it, so it leaves ``w`` in the average (Adam's fused PyTorch path
    folds it into its update)."""
    var = keras.Variable(np.ones((4,), "float32"))
    opt = optimizer(learning_rate=0.0, averaging=averaging)
    opt.build([var])
    opt.iterations.assign(step - 1)
    averager = opt._averager
    averager.count.assign(updates_before)
    for average in averager.slots[0]:
        average.assign(np.zeros((4,), "float32"))
    opt.apply_gradients([(keras.ops.zeros((4,)), var)])
    return to_numpy(averager.slots[0][slot])


@pytest.mark.parametrize("step", [10**3, 10**6, 5 * 10**6, 2 * 10**7])
@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_power_ema_weight_late_in_a_long_run(step, optimizer):
    # EDM2: 1 - beta = 1 - (1 - 1/t) ** (gamma + 1). Formed in float32 it
    # was 1.5% off at t = 1e6 and 19% at 2e7.
    averaging = keras_ema_opt.PowerEMA(sigma_rels=(0.05, 0.10))
    for slot, gamma in enumerate(averaging.gammas):
        expected = -np.expm1((gamma + 1) * np.log1p(-1.0 / step))
        got = _weight_of_update(averaging, step, step - 1, slot,
                                getattr(keras_ema_opt, optimizer))
        np.testing.assert_allclose(got, expected, rtol=2e-6)


@pytest.mark.parametrize("updates", [10**4, 10**6, 4 * 10**6])
def test_swa_weights_stay_uniform_in_a_long_run(updates):
    # torch AveragedModel: a + (w - a) / (n + 1); (n - 1) / n formed in
    # float32 made the models' weights 0.89-1.12 of 1/T after 4e6 updates.
    got = _weight_of_update(keras_ema_opt.SWA(), updates, updates - 1)
    np.testing.assert_allclose(got, 1.0 / updates, rtol=2e-6)


@pytest.mark.parametrize("path", ["backend", "engine"])
def test_ema_of_a_high_decay_does_not_drift_from_its_mean(path,
                                                          monkeypatch):
    # In float32, d a + (1 - d) x with the rounded d and 1 - d (which need
    # not sum to 1) drifts from the mean it tracks, by up to
    # (d + (1 - d) - 1) / (1 - d) of it: 4e-5 of it on average after 2,000
    # updates of d = 0.9999, where a + (1 - d) (x - a) stays within 1e-8
    # (torch's lerp, TF's moving averages). Both the backend's fast path
    # and the engine's own keras.ops update (JAX's, and any other
    # backend's for what its fast path leaves).
    from keras_ema_opt import backend

    if path == "engine":
        monkeypatch.setattr(backend, "lerp_averages",
                            lambda pairs, weight, gated=False: pairs)
    rng = np.random.default_rng(0)
    values = (1 + 0.01 * rng.standard_normal((2000, 256))).astype("float32")
    var = keras.Variable(values[0])
    opt = keras_ema_opt.SGD(learning_rate=0.0,
                            averaging=keras_ema_opt.EMA(0.9999))
    opt.build([var])
    zero = keras.ops.zeros((256,))
    expected = values[0].astype(np.float64)
    for value in values[1:]:
        var.assign(value)
        opt.apply([zero], [var])
        expected += 1e-4 * (value.astype(np.float64) - expected)
    error = (to_numpy(opt.average_of(var)).astype(np.float64) - expected
             ) / expected
    assert abs(error.mean()) < 1e-7, error.mean()
    np.testing.assert_allclose(to_numpy(opt.average_of(var)), expected,
                               rtol=2e-5)


@pytest.mark.parametrize("momentum", [0.0, 1.0])
def test_engine_update_copies_and_keeps_non_finite_values(momentum,
                                                          monkeypatch):
    # EMA(0) copies the weights and EMA(1) keeps the average, exactly,
    # infinite or huge values included (the engine's keras.ops update:
    # 0 (x - a) would be NaN where x - a is infinite).
    from keras_ema_opt import backend

    monkeypatch.setattr(backend, "lerp_averages",
                        lambda pairs, weight, gated=False: pairs)
    start = np.array([0.0, 1.0, -1.0, -3e38, np.inf], "float32")
    var = keras.Variable(start)
    opt = keras_ema_opt.SGD(learning_rate=0.0,
                            averaging=keras_ema_opt.EMA(momentum))
    opt.build([var])
    new = np.array([np.inf, -np.inf, np.inf, 3e38, 2.0], "float32")
    var.assign(new)
    opt.apply([keras.ops.zeros((5,))], [var])
    np.testing.assert_array_equal(to_numpy(opt.average_of(var)),
                                  new if momentum == 0.0 else start)


@pytest.mark.parametrize("momentum", [1.0, 1])
def test_debias_at_momentum_one_is_refused(momentum):
    # The correction a / (1 - d^n) is 0 / 0 at d = 1: optax.ema(1.0,
    # debias=True) gives NaN; ours was accepted and held the last weights,
    # where d = 1 - 1e-8 gives their mean (its weight 1 - d is taken in
    # float64: test_debiased_average_of_extreme_weights).
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    ema = optax.ema(1.0, debias=True)
    state = ema.init(jnp.zeros(2))
    for x in ([1.0, 2.0], [3.0, 4.0]):
        out, state = ema.update(jnp.asarray(x), state)
    assert np.isnan(np.asarray(out)).all()
    with pytest.raises(InvalidArgumentError, match=re.escape(
            f"Received: momentum={momentum!r}")):
        keras_ema_opt.EMA(momentum, debias=True)
    # With a warm-up the decay stays below 1, and without debias the
    # average is the first weights: both are taken.
    keras_ema_opt.EMA(momentum, debias=True, warmup="power")
    keras_ema_opt.EMA(momentum)


def test_debias_correction_keeps_moving_near_one():
    # The correction c = 1 - prod(d) kept as c stopped moving once
    # w (1 - c) fell below half its float32 spacing: at 1 - 3e-8 / w
    # (1 - 3e-6 for d = 0.99, 1 - 3e-4 for 0.9999), so that the debiased
    # average stayed that far off. Here the average holds 1, as the
    # weights do (it does not move), and the correction starts at
    # 1 - 4e-6: after 150 updates of d = 0.99 the debiased average is
    # 1 / (1 - 4e-6 0.99^150), against the float64 formula.
    var = keras.Variable(np.ones((4,), "float32"))
    opt = keras_ema_opt.SGD(learning_rate=0.0, averaging=keras_ema_opt.EMA(
        0.99, debias=True))
    opt.build([var])
    averager = opt._averager
    averager.slots[0][0].assign(np.ones((4,), "float32"))
    start = np.float32(1 - 4e-6)
    averager.debias.assign(start)  # c itself, as a state written before
    averager.count.assign(1200)  # after the updates that made it
    np.testing.assert_allclose(to_numpy(opt.average_of(var)),
                               np.full(4, 1 / float(start)), rtol=1e-7)
    rest = 1.0 - float(start)
    weight = float(np.float32(0.01))
    for _ in range(150):
        opt.apply([keras.ops.zeros((4,))], [var])
        rest *= 1.0 - weight
    np.testing.assert_allclose(to_numpy(opt.average_of(var)),
                               np.full(4, 1 / (1 - rest)), rtol=2e-7)


def test_debiased_average_holds_weights_that_never_move():
    # The zero-started average a <- a + w (x - a) stalls short of a constant
    # x in float32 once w (x - a) is below half its spacing (about 3e-8 / w
    # of x), and a / c stays that far off however exact c is. The debiased
    # average held itself starts as a copy (w / c = 1) and stays exact.
    x = (1 + np.random.default_rng(0).random(64)).astype("float32")
    var = keras.Variable(x)
    opt = keras_ema_opt.SGD(learning_rate=0.0, averaging=keras_ema_opt.EMA(
        0.9, debias=True))
    for _ in range(300):
        opt.apply([keras.ops.zeros((64,))], [var])
    np.testing.assert_array_equal(to_numpy(opt.average_of(var)), x)


def test_debiased_average_of_moving_weights_equals_its_formula():
    # b <- b + (w / c) (x - b), c = 1 - d^t after the update, against the
    # float64 formula a / (1 - d^t) of the zero-started average (optax's
    # debiased ema; tests/test_averaging_peers.py runs optax beside it):
    # float32 round-off per element, and no bias over them (a / c read
    # from the zero-started a was 6e-8 low on average here).
    rng = np.random.default_rng(1)
    d = 0.99
    var = keras.Variable(np.zeros((1000,), "float32"))
    opt = keras_ema_opt.SGD(learning_rate=0.0, averaging=keras_ema_opt.EMA(
        d, debias=True))
    a = np.zeros((1000,))
    for _ in range(400):
        x = (1 + 0.01 * rng.standard_normal(1000)).astype("float32")
        var.assign(x)
        opt.apply([keras.ops.zeros((1000,))], [var])
        a = d * a + (1 - d) * x.astype("float64")
    error = to_numpy(opt.average_of(var)).astype("float64") / (
        a / (1 - d ** 400)) - 1
    assert np.abs(error).max() < 1.5e-6
    assert abs(error.mean()) < 2e-8


@pytest.mark.parametrize("case", ["tiny_weight", "float16_average"])
def test_debiased_average_of_extreme_weights(case):
    # A first weight of 1e-24 (a correction far below 2**-64) still marks
    # the held form of the state (read as an old state, it was b / c:
    # 1e5 here); a correction below float16's range is still one above
    # zero for a float16 average (it read the weights: 3, not 2.5).
    var = keras.Variable(np.array([2.0, 2.0], "float32"))
    if case == "tiny_weight":
        strategy = keras_ema_opt.EMA(1.0, warmup="power", inv_gamma=1e-6,
                                     power=4.0, debias=True)
        step, means = 0.0, [2.0, 2.0, 2.0]
    else:
        strategy = keras_ema_opt.EMA(1 - 1e-8, debias=True,
                                     average_dtype="float16")
        step, means = -1.0, [3.0, 3.5, 4.0]
    opt = keras_ema_opt.SGD(learning_rate=1.0, averaging=strategy)
    for mean in means:
        opt.apply([keras.ops.full((2,), step)], [var])
        np.testing.assert_allclose(to_numpy(opt.average_of(var)), [mean] * 2,
                                   rtol=1e-3)


def test_debias_correction_reaches_one_exactly():
    # prod(d) below 2^-30 (here 0.5^200, below float32's range) reads as
    # a correction of exactly 1, not 0 (which would mean no update yet).
    var = keras.Variable(np.full((4,), 3.0, "float32"))
    opt = keras_ema_opt.SGD(learning_rate=0.0, averaging=keras_ema_opt.EMA(
        0.5, debias=True))
    for _ in range(200):
        opt.apply_gradients([(keras.ops.zeros((4,)), var)])
    averager = opt._averager
    state, old = averager._debias_terms(averager.debias.value)
    assert not bool(to_numpy(old))  # the held form (_debias_step)
    assert float(to_numpy(averager._correction(state))) == 1.0
    var.assign(np.full((4,), 5.0, "float32"))  # not averaged in yet
    np.testing.assert_array_equal(to_numpy(opt.average_of(var)),
                                  np.full((4,), 3.0, "float32"))


@pytest.mark.parametrize("warmup", [None, "num_updates", "power"])
@pytest.mark.parametrize("every", [1, 10])
def test_ema_every_k_steps_keeps_the_per_step_warm_up(warmup, every):
    # The n-th update every k steps is k updates of the per-step rule at
    # step n k: w = 1 - d(n k) ** k (d of the warm-up counted in steps).
    n = 50
    averaging = keras_ema_opt.EMA(0.999, warmup=warmup, every=every)
    m = float(n * every)
    d = {None: 0.999,
         "num_updates": min(0.999, (1 + m) / (10 + m)),
         "power": min(0.999, max(0.0, 1 - (1 + m) ** (-2.0 / 3.0)))}[warmup]
    got = _weight_of_update(averaging, n * every, n - 1)
    np.testing.assert_allclose(got, -np.expm1(every * np.log(d)),
                               rtol=1e-5)


class _InterruptAtStep3(keras.callbacks.Callback):
    """Raises after the third step, noting the raw kernel there."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            backend.sync_training_state(self.model)
            self.raw = to_numpy(self.model.layers[0].kernel).copy()
            raise KeyboardInterrupt


def test_fit_ending_in_an_exception_keeps_the_raw_weights():
    """Keras' JAX fit() calls finalize_variable_values in a `finally`; a fit
    that fails keeps its raw weights there too, as on the other backends."""
    x, y = _data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras_ema_opt.SGD(0.5, averaging=keras_ema_opt.EMA(0.9))
    model.compile(optimizer=optimizer, loss="mse")
    interrupt = _InterruptAtStep3()
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                  callbacks=[interrupt])
    kernel = model.layers[0].kernel
    np.testing.assert_array_equal(to_numpy(kernel), interrupt.raw)
    assert not np.array_equal(to_numpy(optimizer.average_of(kernel)),
                              interrupt.raw)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # and it goes on
    np.testing.assert_array_equal(to_numpy(kernel),
                                  to_numpy(optimizer.average_of(kernel)))


@pytest.mark.parametrize("make", [
    lambda: keras_ema_opt.Adam(averaging=keras_ema_opt.EMA(0.9)),
    lambda: keras_ema_opt.Adam(use_ema=True),
    lambda: keras_ema_opt.averaged(keras.optimizers.Adam(),
                                   keras_ema_opt.SWA()),
], ids=["averaging", "use_ema", "averaged"])
def test_an_error_in_the_first_step_of_a_fit_is_not_replaced(make):
    x, y = _data()
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(4, name="d1"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=make(), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    wider = np.random.RandomState(2).rand(len(x), 5).astype("float32")
    # Keras' own error (TensorFlow's kernel says "size-incompatible"), not
    # JAX's "'NoneType' object is not callable" from a read in `finally`
    with pytest.raises(Exception, match="incompatible") as caught:
        model.fit(wider, y, batch_size=8, epochs=1, verbose=0)
    assert not isinstance(caught.value, TypeError)


def test_fit_inside_swap_average_trains_from_the_averages_and_says_so():
    x, y = _data()
    model = _model()
    optimizer = keras_ema_opt.Adam(
        0.1, averaging=keras_ema_opt.EMA(0.9, finalize=False))
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=8, verbose=0)
    with pytest.warns(UserWarning, match=(
            r"A swap of averaged weights open since optimizer step 4 was "
            r"closed at step 8 without restoring the raw weights of that "
            r"step: the model was trained from the averages it held, and "
            r"restoring would undo that training\. \(A fit\(\) inside `with "
            r"optimizer.swap_average\(model\):` trains from the averages")):
        with optimizer.swap_average(model):
            averages = [to_numpy(v).copy() for v in model.trainable_variables]
            model.fit(x, y, batch_size=8, verbose=0)
            trained = [to_numpy(v).copy() for v in model.trainable_variables]
    for v, value, average in zip(model.trainable_variables, trained,
                                 averages):
        np.testing.assert_array_equal(to_numpy(v), value)  # kept
        assert not np.array_equal(value, average)


def test_swap_on_epoch_listed_before_backup_and_restore_is_refused(tmp_path):
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras_ema_opt.Adam(use_ema=True), loss="mse")
    before = [to_numpy(v).copy() for v in model.weights]
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(InvalidArgumentError, match=(
            r"SwapAverage\(swap_on_epoch=True\) is listed before "
            r"BackupAndRestore, which would back up the averages .* List "
            r"BackupAndRestore before SwapAverage\. Received the callbacks "
            r"\['SwapAverage', 'BackupAndRestore'")):
        model.fit(x, y, verbose=0,
                  callbacks=[SwapAverage(swap_on_epoch=True), backup])
    for v, value in zip(model.weights, before):
        np.testing.assert_array_equal(to_numpy(v), value)
    model.fit(x, y, verbose=0,  # the other way round
              callbacks=[backup, SwapAverage(swap_on_epoch=True)])
    by_batches = keras.callbacks.BackupAndRestore(  # saves after batches
        str(tmp_path / "by_batches"), save_freq=2)
    model.fit(x, y, verbose=0,
              callbacks=[SwapAverage(swap_on_epoch=True), by_batches])


@pytest.mark.parametrize("order, warned", [
    ("SwapAverage(), EarlyStopping", True),
    ("EarlyStopping, SwapAverage(swap_on_epoch=True)", True),
    ("SwapAverage(swap_on_epoch=True), EarlyStopping", False),
    ("SwapAverage(), ModelCheckpoint(save_best_only)", True),
    ("SwapAverage(), EarlyStopping on loss", False),
])
def test_best_epoch_callbacks_keeping_raw_weights_are_warned_of(
        tmp_path, order, warned):
    import warnings

    x, y = _data()
    model = _model()
    model.compile(optimizer=keras_ema_opt.Adam(use_ema=True), loss="mse")
    make = {
        "SwapAverage()": lambda: SwapAverage(),
        "SwapAverage(swap_on_epoch=True)": lambda: SwapAverage(
            swap_on_epoch=True),
        "EarlyStopping": lambda: keras.callbacks.EarlyStopping(
            monitor="val_loss", restore_best_weights=True),
        "EarlyStopping on loss": lambda: keras.callbacks.EarlyStopping(
            monitor="loss", restore_best_weights=True),
        "ModelCheckpoint(save_best_only)": lambda: (
            keras.callbacks.ModelCheckpoint(
                str(tmp_path / "best.keras"), save_best_only=True)),
    }
    callbacks = [make[name]() for name in order.split(", ")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, validation_data=(x, y), verbose=0,
                  callbacks=callbacks)
    messages = [str(w.message) for w in caught
                if "choose the best epoch" in str(w.message)]
    assert bool(messages) == warned
    if warned:
        assert re.search(
            r"\['(EarlyStopping|ModelCheckpoint)'\] choose the best epoch by "
            r"\['val_loss'\], measured on the averaged weights "
            r"\(SwapAverage\), but would keep that epoch's raw weights\. Use "
            r"SwapAverage\(swap_on_epoch=True\) listed before them",
            messages[0])


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_swa_keeps_its_average_between_samples_whatever_the_weights(
        optimizer):
    # SWA(every=3) samples at steps 3, 6, ...: a NaN weight at step 2 (a
    # step that diverged) does not reach the average before the next
    # sample, on every backend (the PyTorch fast path had mixed in
    # 0 * NaN); the sample of step 3 takes it, as the rule says.
    w = keras.Variable(np.array([1.0, 2.0], "float32"))
    opt = getattr(keras_ema_opt, optimizer)(
        0.01, averaging=keras_ema_opt.SWA(every=3))
    averages = []
    for grad in ([0.5, 0.5], [0.5, np.nan], [0.5, 0.5]):
        opt.apply_gradients([(keras.ops.convert_to_tensor(
            np.array(grad, "float32")), w)])
        averages.append(to_numpy(opt.average_of(w)).copy())
    assert np.isnan(to_numpy(w)[1])
    np.testing.assert_array_equal(averages[1], averages[0])
    assert not np.isnan(averages[1]).any()
    assert np.isnan(averages[2][1]) and not np.isnan(averages[2][0])


@pytest.mark.parametrize("every", [1, 2])
def test_debiased_average_starts_after_start_step(every):
    # EMA(debias=True, start_step=s): the average copies the weights up to
    # step s, then is the debiased average of the weights of the steps
    # that average (a / c, a started at 0, c = 1 - d^k after k updates),
    # whose first update is a copy. The copies had set the correction to
    # 1, and debias then did nothing: the plain EMA from the copy of step
    # s (3.5 for 4.0 at the first update here). Between s and the first
    # update (every=2) it reads the weights, as a debiased average does
    # before its first update.
    d, start = 0.5, 3
    var = keras.Variable(np.zeros((2,), "float32"))
    opt = keras_ema_opt.SGD(learning_rate=1.0, averaging=keras_ema_opt.EMA(
        d, start_step=start, every=every, debias=True))
    a, k = 0.0, 0
    for t in range(1, 11):
        # The weight after step t is t.
        opt.apply([keras.ops.full((2,), -1.0)], [var])
        if t <= start or k == 0 and (t - start) % every:
            want = float(t)
        elif (t - start) % every == 0:
            # An update every `every` steps decays by d ** every.
            a, k = d ** every * a + (1 - d ** every) * t, k + 1
            want = a / (1 - d ** (every * k))
        np.testing.assert_allclose(to_numpy(opt.average_of(var)), want,
                                   rtol=1e-6, err_msg=f"step {t}")


def test_debiased_average_after_start_step_on_the_fused_adam_step():
    # The same on the fast paths that fold the average into Adam's step
    # (PyTorch's fused Adam, TensorFlow's kernel): against the float64
    # debiased average of the weights each step left.
    d, start = 0.9, 2
    rng = np.random.default_rng(0)
    var = keras.Variable(rng.standard_normal((64,)).astype("float32"))
    opt = keras_ema_opt.Adam(learning_rate=0.1, averaging=keras_ema_opt.EMA(
        d, start_step=start, debias=True))
    a, k = np.zeros((64,)), 0
    for t in range(1, 8):
        opt.apply([keras.ops.convert_to_tensor(
            rng.standard_normal((64,)).astype("float32"))], [var])
        x = to_numpy(var).astype("float64")
        if t <= start:
            want = x
        else:
            a, k = d * a + (1 - d) * x, k + 1
            want = a / (1 - d ** k)
        np.testing.assert_allclose(to_numpy(opt.average_of(var)), want,
                                   rtol=2e-6, atol=1e-6,
                                   err_msg=f"step {t}")


@pytest.mark.parametrize("make", [
    lambda a: keras_ema_opt.Adam(0.5, averaging=a),
    lambda a: keras_ema_opt.SGD(1.0, averaging=a),
    lambda a: keras_ema_opt.averaged(keras.optimizers.SGD(1.0), a),
], ids=["adam", "sgd", "averaged_keras_sgd"])
@pytest.mark.parametrize("strategy", ["ema", "swa"])
def test_average_is_of_the_constrained_weights(make, strategy):
    # Keras' `apply` assigns `variable.constraint(variable)` after the
    # update step, where the averages were taken: an average of NonNeg
    # weights came out negative (SWA's first update copied -1 where the
    # model held 0). The average is of the weights the model holds: the
    # float64 average of the values read after each step.
    rng = np.random.default_rng(0)
    var = keras.Variable(np.abs(rng.standard_normal((32,))).astype(
        "float32"))
    var.constraint = keras.constraints.NonNeg()  # as `add_weight` sets it
    plain = keras.Variable(rng.standard_normal((32,)).astype("float32"))
    averaging = (keras_ema_opt.EMA(0.5) if strategy == "ema"
                 else keras_ema_opt.SWA())
    opt = make(averaging)
    held = {0: to_numpy(var).astype("float64"),
            1: to_numpy(plain).astype("float64")}
    for t in range(1, 6):
        grads = [keras.ops.convert_to_tensor(
            (rng.standard_normal((32,)) + 1.0).astype("float32"))
            for _ in range(2)]
        opt.apply_gradients(zip(grads, [var, plain]))
        for k, v in enumerate((var, plain)):
            x = to_numpy(v).astype("float64")
            held[k] = (0.5 * held[k] + 0.5 * x if strategy == "ema"
                       else held[k] + (x - held[k]) / t)
    assert to_numpy(var).min() == 0.0  # the constraint was active
    for k, v in enumerate((var, plain)):
        np.testing.assert_allclose(to_numpy(opt.average_of(v)), held[k],
                                   rtol=1e-5, atol=1e-6)


def test_debias_state_of_older_code_at_start_step_resumes_debiased():
    # Code before 7596f43 held the copies before `start_step` as a
    # correction of 1 (the debias state 2**126): a file it saved between
    # them and the first update resumed as the plain EMA from the copy.
    # Until an update is made the state is read as 0.
    def run(older_state_at):
        var = keras.Variable(np.zeros((3,), "float32"))
        opt = keras_ema_opt.SGD(learning_rate=1.0,
                                averaging=keras_ema_opt.EMA(
                                    0.8, start_step=3, debias=True))
        for t in range(1, 8):
            if t == older_state_at:
                opt._averager.debias.assign(2.0 ** 126)
            opt.apply([keras.ops.full((3,), -1.0)], [var])
        return to_numpy(opt.average_of(var))

    np.testing.assert_array_equal(run(older_state_at=4), run(None))
    # The float64 debiased average of the weights 4..7.
    a = 0.0
    for k, t in enumerate(range(4, 8), 1):
        a = 0.8 * a + 0.2 * t
    np.testing.assert_allclose(run(None), a / (1 - 0.8 ** 4), rtol=1e-6)


def test_ema_subclass_weights_are_its_rule():
    # An EMA without warm-up gives its weight as a Python number
    # (constant_weights); a subclass defining its own `weights` keeps its
    # rule (it was averaged with its parent's 1 - momentum).
    class HalfEMA(keras_ema_opt.EMA):
        def weights(self, n, t):
            return [keras.ops.convert_to_tensor(0.5, "float32")]

    assert HalfEMA(0.999).constant_weights() is None
    assert keras_ema_opt.EMA(0.999).constant_weights() == [float(
        np.float32(1 - 0.999))]
    var = keras.Variable(np.zeros((1,), "float32"))
    opt = keras_ema_opt.SGD(1.0, averaging=HalfEMA(0.999))
    a = 0.0
    for t in range(1, 4):  # the weight after step t is t
        opt.apply([keras.ops.full((1,), -1.0)], [var])
        a += 0.5 * (t - a)
    np.testing.assert_allclose(to_numpy(opt.average_of(var)), [a])
