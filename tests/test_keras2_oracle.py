"""tf_keras (Keras 2) run side by side as the oracle: same gradients, same
weights and averages; same error texts."""

import re

import keras
import numpy as np
import pytest
from conftest import only_on
from conftest import to_numpy

import keras_ema_opt

tf_keras = pytest.importorskip("tf_keras")
tf = pytest.importorskip("tensorflow")

CASES = {
    "SGD": dict(learning_rate=0.1, momentum=0.9),
    "Adam": dict(learning_rate=0.05),
    "AdamW": dict(learning_rate=0.05, weight_decay=0.01),
}


def _grads(steps, shapes):
    rng = np.random.default_rng(5)
    return [[rng.normal(size=s).astype("float32") for s in shapes]
            for _ in range(steps)]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("overwrite", [None, 3])
def test_weights_and_averages_equal_tf_keras(name, overwrite):
    kwargs = dict(CASES[name], use_ema=True, ema_momentum=0.8,
                  ema_overwrite_frequency=overwrite)
    init = [np.linspace(-1, 1, 6, dtype="float32").reshape(2, 3),
            np.array([0.5, -0.5], "float32")]
    ours_v = [keras.Variable(w) for w in init]
    theirs_v = [tf.Variable(w) for w in init]
    ours = getattr(keras_ema_opt, name)(**kwargs)
    theirs = getattr(tf_keras.optimizers, name)(**kwargs, jit_compile=False)
    for grads in _grads(7, [w.shape for w in init]):
        ours.apply_gradients(
            zip([keras.ops.convert_to_tensor(g) for g in grads], ours_v)
        )
        theirs.apply_gradients(zip([tf.constant(g) for g in grads], theirs_v))
    for a, b in zip(ours_v, theirs_v):
        np.testing.assert_allclose(to_numpy(a), b.numpy(), rtol=1e-6,
                                   atol=1e-7)
    for a, b in zip(ours._model_variables_moving_average,
                    theirs._model_variables_moving_average):
        np.testing.assert_allclose(to_numpy(a), b.numpy(), rtol=1e-6,
                                   atol=1e-7)
    assert int(to_numpy(ours.iterations)) == int(theirs.iterations.numpy())


def _message(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


@pytest.mark.parametrize(
    "build",
    [
        lambda m: m.Adam(use_ema=True, ema_momentum=1.5),
        lambda m: m.Adam(clipnorm=1.0, global_clipnorm=2.0),
    ],
    ids=["ema_momentum", "clipnorm_and_global_clipnorm"],
)
def test_constructor_errors_read_as_keras2(build):
    their_type, theirs = _message(lambda: build(tf_keras.optimizers))
    our_type, ours = _message(lambda: build(keras_ema_opt))
    assert issubclass(our_type, their_type)
    assert ours == theirs


def test_iterations_error_reads_as_keras2():
    def after_build(module, var):
        opt = module.SGD()
        opt.build([var])
        opt._built = True  # tf_keras marks itself built in its subclasses
        opt.iterations = 3

    their_type, theirs = _message(
        lambda: after_build(tf_keras.optimizers, tf.Variable([1.0]))
    )
    our_type, ours = _message(
        lambda: after_build(keras_ema_opt, keras.Variable([1.0]))
    )
    assert our_type is their_type is RuntimeError
    # Keras 2 lacks a space after the value ("to 3.Usually"); we add it.
    assert ours == theirs.replace(".Usually", ". Usually")


def test_schedule_error_reads_as_keras2():
    def set_float(module, schedule):
        module.SGD(learning_rate=schedule).learning_rate = 0.1

    their_type, theirs = _message(lambda: set_float(
        tf_keras.optimizers,
        tf_keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5),
    ))
    our_type, ours = _message(lambda: set_float(
        keras_ema_opt,
        keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5),
    ))
    assert our_type is their_type is TypeError
    assert ours == theirs


def test_missing_tape_error_reads_as_keras2():
    loss = tf.constant(1.0)
    their_type, theirs = _message(
        lambda: tf_keras.optimizers.SGD().minimize(loss, [tf.Variable(1.0)])
    )
    our_type, ours = _message(
        lambda: keras_ema_opt.SGD().minimize(loss, [keras.Variable(1.0)])
    )
    assert our_type is their_type is ValueError
    # Keras 2's message up to the received values (reprs differ).
    assert ours.split(" Received")[0] == theirs.split(" Received")[0]


def test_unknown_variable_error_keeps_keras2_advice():
    def call(module, make, tensor):
        a, b = make([1.0]), make([2.0])
        opt = module.SGD()
        opt.apply_gradients([(tensor([1.0]), a)])
        opt.apply_gradients([(tensor([1.0]), b)])

    their_type, theirs = _message(
        lambda: call(tf_keras.optimizers, tf.Variable, tf.constant)
    )
    our_type, ours = _message(
        lambda: call(keras_ema_opt, keras.Variable,
                     keras.ops.convert_to_tensor)
    )
    assert issubclass(our_type, their_type)
    advice = re.search(r"This usually means.*training loop", theirs).group(0)
    assert advice in ours


@only_on("tensorflow")  # tf.IndexedSlices are TensorFlow gradients
@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_sparse_duplicates_equal_tf_keras(name):
    table = np.arange(12, dtype="float32").reshape(4, 3)
    sparse = tf.IndexedSlices(
        tf.constant(np.arange(9, dtype="float32").reshape(3, 3)),
        tf.constant([2, 0, 2]),
        tf.constant([4, 3]),
    )
    ours_v, theirs_v = keras.Variable(table), tf.Variable(table)
    ours = getattr(keras_ema_opt, name)(**CASES[name])
    theirs = getattr(tf_keras.optimizers, name)(**CASES[name],
                                                jit_compile=False)
    for _ in range(3):
        ours.apply_gradients([(sparse, ours_v)])
        theirs.apply_gradients([(sparse, theirs_v)])
    np.testing.assert_allclose(to_numpy(ours_v), theirs_v.numpy(), rtol=1e-6)
