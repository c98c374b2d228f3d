"""A custom optimizer written for Keras 2 (tf.keras.optimizers.Optimizer,
2.11+) runs unchanged on keras_ema_opt.Optimizer, on every backend, and
matches the same class running on tf_keras."""

import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import only_on
from conftest import to_numpy

import keras_ema_opt

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from keras2_idioms import keras2_momentum_sgd  # noqa: E402

tf_keras = pytest.importorskip("tf_keras")
tf = pytest.importorskip("tensorflow")


def test_keras2_subclass_matches_tf_keras():
    Ours = keras2_momentum_sgd(keras_ema_opt.Optimizer, keras.ops)
    Theirs = keras2_momentum_sgd(tf_keras.optimizers.Optimizer, tf)
    init = np.array([[1.0, -2.0], [0.5, 3.0]], "float32")
    ours_v, theirs_v = keras.Variable(init), tf.Variable(init)
    ours = Ours(learning_rate=0.1, momentum=0.5, use_ema=True,
                ema_momentum=0.9)
    theirs = Theirs(learning_rate=0.1, momentum=0.5, use_ema=True,
                    ema_momentum=0.9, jit_compile=False)
    rng = np.random.default_rng(0)
    for _ in range(5):
        g = rng.normal(size=init.shape).astype("float32")
        ours.apply_gradients([(keras.ops.convert_to_tensor(g), ours_v)])
        theirs.apply_gradients([(tf.constant(g), theirs_v)])
    np.testing.assert_allclose(to_numpy(ours_v), theirs_v.numpy(), rtol=1e-6)
    np.testing.assert_allclose(
        to_numpy(ours._model_variables_moving_average[0]),
        theirs._model_variables_moving_average[0].numpy(), rtol=1e-6,
    )
    assert ours.name == "MomentumSGD"


def keras2_sparse_momentum(base):
    """tf_keras' own SGD's sparse branch: ``tf.Variable`` methods called on
    the slots (``scatter_add``) and read back (``sparse_read``)."""

    class SparseMomentum(keras2_momentum_sgd(base, tf)):
        def __init__(self, **kwargs):
            super().__init__(learning_rate=0.1, name="SparseMomentum",
                             **kwargs)

        def update_step(self, gradient, variable):
            m = self.momentums[self._index_dict[self._var_key(variable)]]
            lr = tf.cast(self.learning_rate, variable.dtype)
            m.assign(self.momentum * m)
            m.scatter_add(tf.IndexedSlices(-gradient.values * lr,
                                           gradient.indices))
            rows = m.sparse_read(gradient.indices)
            variable.scatter_add(tf.IndexedSlices(rows, gradient.indices))

    return SparseMomentum


@only_on("tensorflow")
@pytest.mark.parametrize("use_ema", [False, True])
def test_keras2_subclass_calling_tf_variable_methods_on_its_slots(
        use_ema, tmp_path):
    """Keras 3's variables have no ``scatter_add``: the step failed with an
    AttributeError. Saved and loaded again, the slots keep them."""
    init = np.arange(8, dtype="float32").reshape(4, 2)
    ours_v, theirs_v = keras.Variable(init), tf.Variable(init)
    ours = keras2_sparse_momentum(keras_ema_opt.Optimizer)(
        use_ema=use_ema, ema_momentum=0.5)
    theirs = keras2_sparse_momentum(tf_keras.optimizers.Optimizer)(
        use_ema=use_ema, ema_momentum=0.5, jit_compile=False)
    for rows in ([0, 2], [2, 3], [0, 2]):
        grad = tf.IndexedSlices(tf.ones((2, 2)), tf.constant(rows),
                                tf.constant([4, 2]))
        ours.apply_gradients([(grad, ours_v)])
        theirs.apply_gradients([(grad, theirs_v)])
    np.testing.assert_allclose(to_numpy(ours_v), theirs_v.numpy(),
                               rtol=1e-6)
    np.testing.assert_allclose(to_numpy(ours.momentums[0]), theirs.momentums[0].numpy(),
                               rtol=1e-6)
    if use_ema:
        np.testing.assert_allclose(
            to_numpy(ours._model_variables_moving_average[0]),
            theirs._model_variables_moving_average[0].numpy(), rtol=1e-6)
    assert isinstance(ours.momentums[0], keras.Variable)
    # A checkpoint restores into the slots as into any variable.
    checkpoint = tf.train.Checkpoint(opt=ours)
    saved = checkpoint.write(str(tmp_path / "ckpt"))
    before = to_numpy(ours.momentums[0])
    ours.momentums[0].assign(np.zeros((4, 2), "float32"))
    checkpoint.read(saved).assert_consumed()
    np.testing.assert_array_equal(to_numpy(ours.momentums[0]), before)


def test_keras2_subclass_config_round_trip_and_schedule():
    Ours = keras2_momentum_sgd(keras_ema_opt.Optimizer, keras.ops)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    opt = Ours(learning_rate=schedule, momentum=0.0)
    w = keras.Variable(np.array([1.0], "float32"))
    for _ in range(2):
        opt.apply_gradients([(keras.ops.ones((1,)), w)])
    # lr 0.1 then 0.05, no momentum: 1 - 0.15
    np.testing.assert_allclose(to_numpy(w), [0.85], rtol=1e-6)
    again = Ours.from_config(opt.get_config())
    assert again.get_config() == opt.get_config()


def test_name_given_twice_is_refused():
    class Named(keras_ema_opt.Optimizer):
        def update_step(self, gradient, variable, learning_rate):
            pass

    with pytest.raises(ValueError, match="received a name twice"):
        Named("a", name="b")
    assert Named("first").name == "first"


@pytest.mark.parametrize("name", ["Adam", "SGD", "RMSprop"])
def test_keras2_subclass_calling_its_parents_two_argument_step(name):
    # Keras 2's idiom `super().update_step(gradient, variable)` in a
    # subclass of a named optimizer: Keras 3's step takes the learning rate
    # too (it raised TypeError on TensorFlow and JAX). Oracle: the same
    # subclass of tf_keras' optimizer, with a schedule read at each step.
    def subclass(base):
        class Doubled(base):
            def update_step(self, gradient, variable):
                return super().update_step(gradient * 2, variable)
        return Doubled

    def schedule(module):
        return module.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)

    init = np.array([[1.0, -2.0], [0.5, 3.0]], "float32")
    ours_v, theirs_v = keras.Variable(init), tf.Variable(init)
    ours = subclass(getattr(keras_ema_opt, name))(
        learning_rate=schedule(keras), use_ema=True, ema_momentum=0.9)
    theirs = subclass(getattr(tf_keras.optimizers, name))(
        learning_rate=schedule(tf_keras), use_ema=True, ema_momentum=0.9,
        jit_compile=False)
    rng = np.random.default_rng(1)
    for _ in range(4):
        g = rng.normal(size=init.shape).astype("float32")
        ours.apply_gradients([(keras.ops.convert_to_tensor(g), ours_v)])
        theirs.apply_gradients([(tf.constant(g), theirs_v)])
    np.testing.assert_allclose(to_numpy(ours_v), theirs_v.numpy(),
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        to_numpy(ours.average_of(ours_v)),
        theirs._model_variables_moving_average[0].numpy(), rtol=1e-6,
        atol=1e-7)
    assert isinstance(ours, getattr(keras_ema_opt, name))


def _one_step(optimizer):
    v = keras.Variable(np.ones(2, "float32"))
    optimizer.apply_gradients([(keras.ops.ones(2), v)])
    return to_numpy(v)


def test_keras2_subclasses_of_subclasses_and_mixins():
    # The rate reaches each class along the instance's MRO: both branches
    # of a diamond run (gradient x2 x3), a mixin before the optimizer
    # base is no optimizer, and a step that never calls its parent's.
    class Twice(keras_ema_opt.SGD):
        def update_step(self, gradient, variable):
            return super().update_step(gradient * 2, variable)

    class Thrice(keras_ema_opt.SGD):
        def update_step(self, gradient, variable):
            return super().update_step(gradient * 3, variable)

    class Both(Twice, Thrice):
        pass

    class Mixin:
        extra = 1

    class Own(Mixin, keras_ema_opt.Optimizer):
        def update_step(self, gradient, variable):
            variable.assign_sub(self.learning_rate * gradient)

    class Logged(Mixin, keras_ema_opt.SGD):
        def update_step(self, gradient, variable):
            return super().update_step(gradient * 2, variable)

    for optimizer, step in ((Both(0.1), 0.6), (Own(learning_rate=0.1), 0.1),
                            (Logged(0.1), 0.2)):
        np.testing.assert_allclose(_one_step(optimizer), 1.0 - step,
                                   rtol=1e-6)
