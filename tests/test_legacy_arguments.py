"""OptimizerV2 (tf.keras.optimizers.legacy) arguments on our optimizers,
with tf_keras.optimizers.legacy run side by side as the oracle."""

import keras
import numpy as np
import pytest
from conftest import to_numpy

import keras_ema_opt
from keras_ema_opt.errors import InvalidArgumentError

tf_keras = pytest.importorskip("tf_keras")
tf = pytest.importorskip("tensorflow")

# Classes whose Keras 3 rule equals OptimizerV2's (docs/legacy.md).
CASES = {
    "SGD": dict(learning_rate=0.1, momentum=0.9),
    "Adam": dict(learning_rate=0.05),
    "Adagrad": dict(learning_rate=0.1, epsilon=1e-7),
    "RMSprop": dict(learning_rate=0.01, momentum=0.5),
    "Adamax": dict(learning_rate=0.05),
    "Adadelta": dict(learning_rate=1.0),
    "Ftrl": dict(learning_rate=0.1),
}


def _side_by_side(ours, theirs, steps=10, seed=0):
    rng = np.random.default_rng(seed)
    init = rng.normal(size=(3, 2)).astype("float32")
    ours_v, theirs_v = keras.Variable(init), tf.Variable(init)
    for _ in range(steps):
        g = rng.normal(size=init.shape).astype("float32")
        ours.apply_gradients([(keras.ops.convert_to_tensor(g), ours_v)])
        theirs.apply_gradients([(tf.constant(g), theirs_v)])
    return to_numpy(ours_v), theirs_v.numpy()


@pytest.mark.parametrize("name", sorted(CASES))
def test_decay_is_optimizer_v2_inverse_time_decay(name):
    kwargs = dict(CASES[name], decay=0.05)
    ours, theirs = _side_by_side(
        getattr(keras_ema_opt, name)(**kwargs),
        getattr(tf_keras.optimizers.legacy, name)(**kwargs),
    )
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_decay_keeps_the_learning_rate_settable_and_in_config():
    opt = keras_ema_opt.SGD(learning_rate=0.1, decay=0.5)
    opt.learning_rate = 0.2
    assert opt.get_config()["decay"] == 0.5
    w = keras.Variable(np.array([1.0], "float32"))
    opt.iterations = 2
    opt.apply_gradients([(keras.ops.ones((1,)), w)])
    np.testing.assert_allclose(to_numpy(w), [1.0 - 0.2 / (1 + 0.5 * 2)],
                               rtol=1e-6)
    again = keras_ema_opt.SGD.from_config(opt.get_config())
    assert again.decay == 0.5


def _halve(pairs):
    return [(g * 0.5, v) for g, v in pairs]


def _shift(pairs):
    return [(g + 1.0, v) for g, v in pairs]


def test_gradient_transformers_apply_in_order_as_optimizer_v2():
    ours, theirs = _side_by_side(
        keras_ema_opt.SGD(learning_rate=0.1,
                          gradient_transformers=[_halve, _shift]),
        tf_keras.optimizers.legacy.SGD(learning_rate=0.1,
                                       gradient_transformers=[_halve, _shift]),
    )
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


def test_gradient_transformers_apply_in_fit():
    calls = []

    def count(pairs):
        calls.append(len(pairs))
        return pairs

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras_ema_opt.SGD(gradient_transformers=[count]),
                  loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    assert calls and calls[0] == 2


def test_gradient_aggregator_replaces_aggregation():
    def double(pairs):
        return [(g * 2.0, v) for g, v in pairs]

    ours, theirs = _side_by_side(
        keras_ema_opt.SGD(learning_rate=0.05, momentum=0.5,
                          gradient_aggregator=double),
        tf_keras.optimizers.legacy.SGD(learning_rate=0.05, momentum=0.5,
                                       gradient_aggregator=double),
    )
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    plain, _ = _side_by_side(keras_ema_opt.SGD(learning_rate=0.05,
                                               momentum=0.5), theirs_dummy())
    assert not np.allclose(plain, ours)


def theirs_dummy():
    return tf_keras.optimizers.legacy.SGD()


def _errors(build):
    with pytest.raises(ValueError) as theirs:
        build(tf_keras.optimizers.legacy)
    with pytest.raises(InvalidArgumentError) as ours:
        build(keras_ema_opt)
    return str(ours.value), str(theirs.value)


def test_transformers_with_clipping_error_reads_as_optimizer_v2():
    ours, theirs = _errors(lambda m: m.SGD(clipnorm=1.0,
                                           gradient_transformers=[_halve]))
    assert ours == theirs


def test_negative_decay_error_reads_as_optimizer_v2():
    ours, theirs = _errors(lambda m: m.SGD(decay=-1.0))
    assert ours == theirs


def test_bad_transformer_and_aggregator_are_refused():
    with pytest.raises(InvalidArgumentError, match="list of callables"):
        keras_ema_opt.SGD(gradient_transformers=[1])
    with pytest.raises(InvalidArgumentError, match="must be a callable"):
        keras_ema_opt.SGD(gradient_aggregator="sum")


def test_lr_means_learning_rate_as_in_optimizer_v2():
    with pytest.warns(DeprecationWarning, match="`lr` is deprecated"):
        ours = keras_ema_opt.SGD(lr=0.3, momentum=0.5)
    a, b = _side_by_side(ours, tf_keras.optimizers.legacy.SGD(lr=0.3,
                                                              momentum=0.5))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
