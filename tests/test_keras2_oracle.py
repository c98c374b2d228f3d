"""tf_keras (Keras 2) run side by side as the oracle: same gradients, same
weights and averages; same error texts."""

import re
import warnings

import keras
import numpy as np
import pytest
from conftest import only_on
from conftest import to_numpy

import keras_ema_opt
from keras_ema_opt.errors import InvalidArgumentError
from keras_ema_opt.errors import LegacyConfigError

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


@only_on("tensorflow")
@pytest.mark.parametrize("clip", [
    {"clipvalue": 0.5}, {"clipnorm": 1.0}, {"global_clipnorm": 1.0}],
    ids=["clipvalue", "clipnorm", "global_clipnorm"])
def test_sparse_duplicates_are_clipped_as_the_dense_gradient(clip):
    # A row looked up twice: its slices are summed before clipping, as the
    # dense gradient they stand for is clipped (and as JAX and PyTorch,
    # whose gradients are dense, clip it). tf_keras clipped the slices as
    # they came (docs/legacy.md): its oracle here is the dense gradient.
    sparse = tf.IndexedSlices(tf.constant([[1.0, 2.0], [1.0, 0.25]]),
                              tf.constant([0, 0]), tf.constant([3, 2]))
    table = np.ones((3, 2), "float32")
    ours_v, theirs_v = keras.Variable(table), tf.Variable(table)
    ours = keras_ema_opt.SGD(1.0, **clip)
    theirs = tf_keras.optimizers.SGD(1.0, **clip, jit_compile=False)
    ours.apply_gradients([(sparse, ours_v)])
    theirs.apply_gradients([(tf.convert_to_tensor(sparse), theirs_v)])
    np.testing.assert_allclose(to_numpy(ours_v), theirs_v.numpy(), rtol=1e-6)
    assert not np.allclose(to_numpy(ours_v), table)


# -- the Keras 2 contract where Keras 3 differs (from review) ----------------


def _train_both(ours, theirs, init, steps=3, grads=None):
    """The same gradients through ours and tf_keras; both weights out."""
    ours_v = [keras.Variable(w) for w in init]
    theirs_v = [tf.Variable(w) for w in init]
    grads = grads or _grads(steps, [w.shape for w in init])
    for step in grads:
        ours.apply_gradients(
            zip([keras.ops.convert_to_tensor(g) for g in step], ours_v))
        theirs.apply_gradients(zip([tf.constant(g) for g in step], theirs_v))
    return [to_numpy(v) for v in ours_v], [v.numpy() for v in theirs_v]


INIT = [np.array([[1.0, -2.0], [0.5, 3.0]], "float32"),
        np.array([0.25, -0.75], "float32")]


def test_a_none_gradient_is_dropped_with_keras2_warning():
    def step(module, make, tensor):
        a, b = make([1.0]), make([2.0])
        opt = module.SGD(0.1)
        opt.apply_gradients([(None, a), (tensor([1.0]), b)])
        return [float(np.asarray(v.numpy())[0]) for v in (a, b)], int(
            np.asarray(opt.iterations.numpy()))

    theirs = step(tf_keras.optimizers, tf.Variable, tf.constant)
    with pytest.warns(UserWarning, match="Gradients do not exist for "
                      r"variables \['variable'\] when minimizing the loss"):
        ours = step(keras_ema_opt, keras.Variable,
                    keras.ops.convert_to_tensor)
    assert ours == theirs == ([1.0, pytest.approx(1.9)], 1)


@pytest.mark.parametrize("use_ema", [False, True])
def test_a_variable_without_gradient_at_the_first_step_trains_later(use_ema):
    """Keras 2 built the optimizer on every variable given, then dropped
    the None gradients: a variable first given without a gradient (a head
    not used by the first batch) trains at the next step. Built on the
    others alone, the optimizer refused it there."""
    def run(module, make, tensor):
        w, v = make([1.0, 1.0]), make([1.0, 1.0])
        opt = module.Adam(0.1, use_ema=use_ema, ema_momentum=0.5)
        opt.apply_gradients([(tensor([1.0, 1.0]), w), (None, v)])
        v.assign([5.0, 5.0])  # moved outside the optimizer: in the average
        opt.apply_gradients([(tensor([1.0, 1.0]), w),
                             (tensor([1.0, -1.0]), v)])
        opt.apply_gradients([(tensor([1.0, 1.0]), w), (None, v)])
        averages = opt._model_variables_moving_average if use_ema else []
        return [np.asarray(x.numpy()) for x in [w, v, *averages]]

    theirs = run(tf_keras.optimizers, tf.Variable, tf.constant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the None gradients' warning
        ours = run(keras_ema_opt, keras.Variable,
                   keras.ops.convert_to_tensor)
    assert len(ours) == len(theirs) == (4 if use_ema else 2)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(to_numpy(a), b, rtol=1e-6)


def test_minimize_with_an_unused_variable_equals_tf_keras():
    def run(module, make):
        w, unused = make(3.0), make(1.0)
        opt = module.SGD(0.1)
        # Its gradient is None on TensorFlow (a warning), zeros elsewhere.
        opt.minimize(lambda: w * w, [w, unused])
        return float(np.asarray(w.numpy())), float(np.asarray(unused.numpy()))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = run(keras_ema_opt, keras.Variable)
    assert ours == pytest.approx(run(tf_keras.optimizers, tf.Variable))



@pytest.mark.parametrize("lazy", [False, True])
def test_a_callable_var_list_runs_the_losss_side_effects_once(lazy):
    """With ``var_list`` a callable, JAX runs the loss once before the
    traced run, for the variables it creates: its BatchNorm update (and
    dropout seed) happened twice a call. The moving mean and the step, a
    call of ``minimize`` and one of ``compute_gradients`` after it, equal
    tf_keras'; ``lazy``: the model is built by the first loss."""
    x = np.arange(12, dtype="float32").reshape(4, 3)

    def run(lib, optimizers, mean):
        layers = [lib.layers.Dense(3, kernel_initializer="ones"),
                  lib.layers.BatchNormalization(momentum=0.5)]
        model = lib.Sequential(layers if lazy else [lib.Input((3,))] + layers)
        calls = []

        def loss():
            calls.append(1)
            return mean(model(x, training=True) ** 2)

        opt = optimizers.SGD(1e-4)
        opt.minimize(loss, lambda: model.trainable_variables)
        first = float(np.asarray(model.layers[-1].moving_mean)[0])
        opt.compute_gradients(loss, lambda: model.trainable_variables)
        second = float(np.asarray(model.layers[-1].moving_mean)[0])
        return first, second, [np.asarray(w) for w in model.get_weights()]

    theirs = run(tf_keras, tf_keras.optimizers, tf.reduce_mean)
    ours = run(keras, keras_ema_opt, keras.ops.mean)
    # Momentum 0.5 towards the batch's mean of Dense(ones): 16.5 + bias.
    assert theirs[:2] == pytest.approx((8.25, 12.375), rel=1e-3)
    assert ours[:2] == pytest.approx(theirs[:2], rel=1e-6)
    for a, b in zip(ours[2], theirs[2], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)



def test_a_callable_var_list_whose_loss_makes_a_variable_from_a_value():
    # Keras refuses to make a variable from a value in a StatelessScope,
    # where JAX's first run of the loss goes: that run is then a plain one.
    def run(make, optimizers):
        store = {}

        def loss():
            if "w" not in store:
                store["w"] = make(np.array([1.0, -2.0], "float32"))
            return store["w"] * store["w"]

        optimizers.SGD(0.1).minimize(loss, lambda: [store["w"]])
        return np.asarray(store["w"].numpy())

    np.testing.assert_allclose(run(keras.Variable, keras_ema_opt),
                               run(tf.Variable, tf_keras.optimizers),
                               rtol=1e-6)

@pytest.mark.parametrize("shape", ["flat", "triples"])
def test_malformed_pairs_raise_a_value_error_as_in_keras2(shape):
    """Not (gradient, variable) pairs: Keras 2 (and 3) raise ValueError
    unpacking them; ours is a ValueError too (it was a TypeError), whose
    message names the item."""
    def pairs(g, w):
        return [g, w] if shape == "flat" else [(g, w, w)]

    w_theirs = tf.Variable([1.0])
    their_type, _ = _message(lambda: tf_keras.optimizers.SGD(
        ).apply_gradients(pairs(tf.ones((1,)), w_theirs)))
    w = keras.Variable([1.0])
    with pytest.raises(InvalidArgumentError,
                       match=r"takes an iterable of \(gradient, variable\) "
                       r"pairs\. Received the item"):
        keras_ema_opt.SGD().apply_gradients(
            pairs(keras.ops.ones((1,)), w))
    assert issubclass(their_type, ValueError)
    assert issubclass(InvalidArgumentError, their_type)
    np.testing.assert_array_equal(to_numpy(w), [1.0])  # nothing stepped

def test_only_none_gradients_is_keras2_error():
    their_type, theirs = _message(lambda: tf_keras.optimizers.SGD(
        ).apply_gradients([(None, tf.Variable(1.0))]))
    our_type, ours = _message(lambda: keras_ema_opt.SGD(
        ).apply_gradients([(None, keras.Variable(1.0))]))
    assert issubclass(our_type, their_type)
    assert ours.startswith("No gradients provided for any variable: ")
    assert theirs.startswith("No gradients provided for any variable: ")


def test_numpy_gradients_equal_tf_keras():
    ours_v = [keras.Variable(w) for w in INIT]
    theirs_v = [tf.Variable(w) for w in INIT]
    ours, theirs = keras_ema_opt.Adam(0.1), tf_keras.optimizers.Adam(0.1)
    for step in _grads(3, [w.shape for w in INIT]):
        # float64 NumPy gradients for float32 variables, as Keras 2 took.
        ours.apply_gradients(zip([g.astype("float64") for g in step],
                                 ours_v))
        theirs.apply_gradients(zip(step, theirs_v))
    for a, b in zip(ours_v, theirs_v):
        np.testing.assert_allclose(to_numpy(a), b.numpy(), rtol=1e-6)


def test_a_tf_keras_config_with_a_schedule_trains_as_tf_keras():
    schedule = tf_keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)
    theirs = tf_keras.optimizers.Adam(schedule, jit_compile=False)
    config = theirs.get_config()
    assert config["learning_rate"]["config"]["name"] is None  # the trap
    ours = keras_ema_opt.Adam.from_config(config)
    for a, b in zip(*_train_both(ours, theirs, INIT, steps=4)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_tf_keras_2_12_config_with_a_schedule_trains_as_tf_keras():
    """tf.keras 2.11 and 2.12 serialized a schedule without "module" (the
    legacy format): the class method refused it, as Keras 3 looks it up
    by module."""
    schedule = tf_keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)
    theirs = tf_keras.optimizers.Adam(schedule, jit_compile=False)
    config = theirs.get_config()
    config["learning_rate"] = tf_keras.optimizers.schedules.serialize(
        schedule, use_legacy_format=True)
    assert "module" not in config["learning_rate"]
    ours = keras_ema_opt.Adam.from_config(config)
    assert type(ours._learning_rate).__name__ == "ExponentialDecay"
    for a, b in zip(*_train_both(ours, theirs, INIT, steps=4)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_tf_keras_schedule_object_is_converted():
    def schedule():
        return tf_keras.optimizers.schedules.PiecewiseConstantDecay(
            [1, 2], [0.1, 0.05, 0.01])

    ours = keras_ema_opt.SGD(schedule(), momentum=0.5)
    theirs = tf_keras.optimizers.SGD(schedule(), momentum=0.5,
                                     jit_compile=False)
    for a, b in zip(*_train_both(ours, theirs, INIT, steps=4)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert ours.get_config()["learning_rate"]["class_name"] == (
        "PiecewiseConstantDecay")
    ours.learning_rate = schedule()  # the setter converts too
    assert isinstance(ours._learning_rate,
                      keras.optimizers.schedules.PiecewiseConstantDecay)
    # Tensors in a tf_keras schedule's config become numbers.
    ours.learning_rate = tf_keras.optimizers.schedules.PiecewiseConstantDecay(
        [tf.constant(1), tf.constant(2)], [0.1, 0.05, 0.01])
    assert keras_ema_opt.SGD.from_config(
        ours.get_config()).get_config() == ours.get_config()
    ours.learning_rate = schedule()
    assert isinstance(ours._learning_rate,
                      keras.optimizers.schedules.PiecewiseConstantDecay)


def test_a_custom_tf_keras_schedule_is_refused_by_name():
    class Halving(tf_keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 0.1 * 0.5 ** tf.cast(step, tf.float32)

    with pytest.raises(keras_ema_opt.errors.InvalidArgumentError,
                       match="Keras 2 schedule of the class Halving"):
        keras_ema_opt.SGD(Halving())


@pytest.mark.parametrize("rate", ["tf_constant", "tf_variable",
                                  "keras_tensor", "keras_variable",
                                  "numpy_float32"])
def test_a_scalar_tensor_learning_rate_equals_tf_keras(rate):
    make = {
        "tf_constant": lambda: tf.constant(0.1),
        "tf_variable": lambda: tf.Variable(0.1),
        "keras_tensor": lambda: keras.ops.convert_to_tensor(0.1),
        "keras_variable": lambda: keras.Variable(0.1),
        "numpy_float32": lambda: np.float32(0.1),
    }[rate]
    ours = keras_ema_opt.SGD(make(), momentum=0.9)
    theirs = tf_keras.optimizers.SGD(tf.constant(0.1), momentum=0.9,
                                     jit_compile=False)
    for a, b in zip(*_train_both(ours, theirs, INIT)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_mesh_none_is_accepted_and_a_mesh_refused():
    tf_keras.optimizers.Adam(mesh=None)
    keras_ema_opt.Adam(mesh=None)
    with pytest.raises(keras_ema_opt.errors.InvalidArgumentError,
                       match="received mesh='a mesh'.*Accepted: mesh=None"):
        keras_ema_opt.Adam(mesh="a mesh")


@pytest.mark.parametrize("frequency,stored", [(0, None), (False, None),
                                               (True, 1)])
def test_ema_overwrite_frequency_zero_or_a_bool_as_tf_keras(frequency,
                                                            stored):
    # tf_keras (and Keras 3) take a bool as the int it is: True overwrites
    # every step, and False, like 0, never.
    theirs = tf_keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5,
                                     ema_overwrite_frequency=frequency,
                                     jit_compile=False)
    for ours in (keras_ema_opt.SGD.from_config(theirs.get_config()),
                 keras_ema_opt.SGD(0.1, use_ema=True, ema_momentum=0.5,
                                   ema_overwrite_frequency=frequency)):
        assert ours.ema_overwrite_frequency == stored
    ours = keras_ema_opt.SGD.from_config(theirs.get_config())
    for a, b in zip(*_train_both(ours, theirs, INIT, steps=4)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    for a, b in zip(ours._model_variables_moving_average,
                    theirs._model_variables_moving_average):
        np.testing.assert_allclose(to_numpy(a), b.numpy(), rtol=1e-6)


@pytest.mark.parametrize("frequency", [1.5, "3", np.int64(2)])
def test_ema_overwrite_frequency_without_use_ema_kept_as_tf_keras(frequency):
    # Unchecked and unchanged where `use_ema` is off (a float was
    # truncated to an int); an integer type as an int.
    theirs = tf_keras.optimizers.SGD(ema_overwrite_frequency=frequency)
    ours = keras_ema_opt.SGD(ema_overwrite_frequency=frequency)
    want = theirs.get_config()["ema_overwrite_frequency"]
    got = ours.get_config()["ema_overwrite_frequency"]
    assert got == want and type(got) is (
        int if isinstance(frequency, np.integer) else type(want))
    assert keras_ema_opt.SGD.from_config(ours.get_config(
        )).ema_overwrite_frequency == want


@pytest.mark.parametrize("names", [["my_dense"], ["my_dense/bias"],
                                   ["bias"], ["kernel:0"], ["^kernel$"]])
def test_exclude_from_weight_decay_names_match_as_tf_keras(names):
    def run(module, optimizers):
        model = module.Sequential([
            module.Input((2,)),
            module.layers.Dense(2, name="my_dense",
                                kernel_initializer="ones",
                                bias_initializer="ones")])
        opt = optimizers.SGD(learning_rate=0.1, weight_decay=0.5)
        opt.exclude_from_weight_decay(var_names=names)
        variables = model.trainable_variables
        opt.apply_gradients(
            zip([np.zeros(v.shape, "float32") for v in variables], variables))
        return [np.asarray(v.numpy()) for v in variables]

    theirs = run(tf_keras, tf_keras.optimizers)
    ours = run(keras, keras_ema_opt)
    if names == ["^kernel$"]:
        # Keras 3's name ("kernel") matches too; Keras 2's ("my_dense/
        # kernel:0") did not: excluded in ours, a superset of both.
        theirs[0] = np.ones((2, 2), "float32")
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_exclude_from_weight_decay_after_a_step_raises_as_tf_keras():
    def after_step(module, var, zeros):
        opt = module.SGD(0.1, weight_decay=0.5)
        opt.apply_gradients([(zeros([1]), var)])
        opt.exclude_from_weight_decay(var_list=[var])

    their_type, theirs = _message(
        lambda: after_step(tf_keras.optimizers, tf.Variable([1.0]), tf.zeros))
    our_type, ours = _message(
        lambda: after_step(keras_ema_opt, keras.Variable([1.0]),
                           keras.ops.zeros))
    assert issubclass(our_type, their_type)
    # Keras 2's text but for its typo ("configued"), then when it applies.
    assert ours.startswith(theirs.replace("configued", "configured"))


def test_exclude_from_weight_decay_after_load_model_applies(tmp_path):
    # Exclusions are not saved (in Keras 2 nor 3): a loaded optimizer is
    # built and has not stepped; it takes them again, as Keras' AdamW.
    def trained(optimizer):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(
            1, bias_initializer="ones")])
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(np.ones((4, 2), "float32"), np.zeros((4, 1), "float32"),
                  epochs=1, verbose=0)
        path = str(tmp_path / f"{type(optimizer).__module__}.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        loaded.optimizer.exclude_from_weight_decay(var_names=["bias"])
        variables = loaded.trainable_variables
        loaded.optimizer.apply_gradients(
            zip([keras.ops.zeros(v.shape) for v in variables], variables))
        return [to_numpy(v) for v in variables]

    ours = trained(keras_ema_opt.AdamW(0.1, weight_decay=0.5))
    theirs = trained(keras.optimizers.AdamW(0.1, weight_decay=0.5))
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def _tensor(values, theirs):
    return tf.constant(values) if theirs else keras.ops.convert_to_tensor(
        values)


def _value(variable):
    return np.asarray(to_numpy(variable))


@pytest.mark.parametrize("overwrite", [None, 3])
def test_use_ema_averages_the_variables_of_the_step(overwrite):
    """A variable left out of a step (its gradient None) keeps its average
    and is not overwritten with it, as in tf_keras (Keras 3 moves the
    averages of every variable the optimizer was built with)."""
    kw = dict(learning_rate=0.5, use_ema=True, ema_momentum=0.5,
              ema_overwrite_frequency=overwrite)
    init = [np.array([1.0, 2.0], "float32"), np.array([3.0], "float32")]
    runs = {}
    for theirs in (False, True):
        variables = ([tf.Variable(w) for w in init] if theirs
                     else [keras.Variable(w) for w in init])
        opt = (tf_keras.optimizers.SGD(**kw, jit_compile=False) if theirs
               else keras_ema_opt.SGD(**kw))
        ones = [_tensor(np.ones_like(w), theirs) for w in init]
        opt.apply_gradients(zip(ones, variables))
        for _ in range(3):
            opt.apply_gradients([(ones[0], variables[0]),
                                 (None, variables[1])])
        averages = (opt._model_variables_moving_average if theirs else
                    [opt.average_of(v) for v in variables])
        runs[theirs] = [_value(v) for v in variables + list(averages)]
    for ours, theirs in zip(runs[False], runs[True]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


@pytest.mark.parametrize("overwrite", [None, 2])
def test_use_ema_set_after_construction(overwrite):
    """``optimizer.use_ema = True`` before the first step averages, as in
    tf_keras (and Keras 3); after it, a change is refused."""
    init = np.array([1.0, -2.0, 3.0], "float32")
    runs = {}
    for theirs in (False, True):
        var = tf.Variable(init) if theirs else keras.Variable(init)
        opt = (tf_keras.optimizers.SGD(0.1, jit_compile=False) if theirs
               else keras_ema_opt.SGD(0.1))
        opt.use_ema = True
        opt.ema_momentum = 0.5
        opt.ema_overwrite_frequency = overwrite
        for i in range(4):
            opt.apply_gradients([(_tensor(np.full(3, 1.0 + i, "float32"),
                                          theirs), var)])
        opt.finalize_variable_values([var])
        runs[theirs] = _value(var)
        if not theirs:
            assert opt.use_ema
            with pytest.raises(InvalidArgumentError,
                               match="cannot change once the optimizer is "
                                     "built"):
                opt.use_ema = False
    np.testing.assert_allclose(runs[False], runs[True], rtol=1e-6)
    unset = keras_ema_opt.SGD(0.1, use_ema=True)
    unset.use_ema = False
    assert unset.averaging is None and not unset.use_ema


def test_keras2_positional_base_class_call():
    """``super().__init__(name, weight_decay, clipnorm, clipvalue,
    global_clipnorm, use_ema, ema_momentum, ema_overwrite_frequency,
    jit_compile)``, Keras 2's order, as tf_keras' own optimizers call it:
    the ninth argument is ``jit_compile`` (it went to Keras 3's
    ``loss_scale_factor``, and every gradient was divided by False)."""

    def make(base, cast):
        class PlainSGD(base):
            def __init__(self, learning_rate=0.1, **kwargs):
                super().__init__("PlainSGD", None, None, None, None, True,
                                 0.5, None, False, **kwargs)
                self._learning_rate = self._build_learning_rate(
                    learning_rate)

            def update_step(self, gradient, variable):
                variable.assign_sub(
                    cast(self.learning_rate, variable.dtype) * gradient)

        return PlainSGD()

    ours = make(keras_ema_opt.Optimizer, keras.ops.cast)
    theirs = make(tf_keras.optimizers.Optimizer, tf.cast)
    assert ours.loss_scale_factor is None and not ours.jit_compile
    assert (ours.name, ours.use_ema, ours.ema_momentum) == (
        "PlainSGD", True, 0.5)
    values = []
    for opt, var, theirs_ in ((ours, keras.Variable([1.0, 2.0]), False),
                              (theirs, tf.Variable([1.0, 2.0]), True)):
        for _ in range(2):
            opt.apply_gradients([(_tensor(np.ones(2, "float32"), theirs_),
                                  var)])
        values.append(_value(var))
    np.testing.assert_allclose(values[0], values[1], rtol=1e-6)
    with pytest.raises(InvalidArgumentError,
                       match="loss_scale_factor=True"):
        keras_ema_opt.SGD(loss_scale_factor=True)


def test_decay_learning_rate_reads_the_base_rate():
    """OptimizerV2's ``decay``: ``learning_rate`` reads back the rate given
    (the step uses ``lr / (1 + decay t)``); Keras' LearningRateScheduler
    and ReduceLROnPlateau read it and write it back every epoch, which
    compounded the decay when the getter returned the decayed rate."""
    ours = keras_ema_opt.SGD(learning_rate=0.1, decay=0.5)
    theirs = tf_keras.optimizers.legacy.SGD(learning_rate=0.1, decay=0.5)
    ours_v, theirs_v = keras.Variable([1.0]), tf.Variable([1.0])
    for epoch in range(4):
        theirs.learning_rate = float(
            tf_keras.backend.get_value(theirs.learning_rate))
        ours.learning_rate = float(to_numpy(ours.learning_rate))
        for _ in range(2):
            ours.apply_gradients([(keras.ops.ones((1,)), ours_v)])
            theirs.apply_gradients([(tf.ones((1,)), theirs_v)])
    np.testing.assert_allclose(float(to_numpy(ours.lr)), 0.1, rtol=1e-7)
    np.testing.assert_allclose(_value(ours_v), theirs_v.numpy(), rtol=1e-6)


def test_ema_momentum_as_a_scalar_tensor():
    """``ema_momentum=tf.constant(0.5)`` is taken as tf_keras takes it (it
    was refused as not a real number)."""
    runs = []
    for theirs in (False, True):
        var = tf.Variable([1.0, 2.0]) if theirs else keras.Variable(
            [1.0, 2.0])
        opt = (tf_keras.optimizers.SGD if theirs else keras_ema_opt.SGD)(
            0.1, use_ema=True, ema_momentum=tf.constant(0.5),
            **({"jit_compile": False} if theirs else {}))
        for _ in range(3):
            opt.apply_gradients([(_tensor(np.ones(2, "float32"), theirs),
                                  var)])
        opt.finalize_variable_values([var])
        runs.append(_value(var))
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-6)


# ---------------------------------------------------------------------------
# The module functions: tf.keras.optimizers.get / serialize / deserialize
# ---------------------------------------------------------------------------

# The names tf_keras' `get` knows (its Lion and Adafactor classes are not
# among them; ours knows them too: the last test below).
_GET_NAMES = ["adam", "sgd", "rmsprop", "adagrad", "adamw", "nadam", "ftrl",
              "adamax", "adadelta"]


@pytest.mark.parametrize("name", _GET_NAMES)
def test_module_get_gives_ours_of_tf_keras_class(name):
    theirs = tf_keras.optimizers.get(name)
    ours = keras_ema_opt.get(name)
    assert type(ours) is getattr(keras_ema_opt, type(theirs).__name__)
    assert keras_ema_opt.get(ours) is ours
    # OptimizerV2 (`tf.keras.optimizers.legacy`, which has no AdamW): the
    # rules Keras 3 changed come back as compat's legacy classes, the
    # others as ours.
    if name == "adamw":
        for module in (tf_keras.optimizers, keras_ema_opt):
            with pytest.raises(ValueError, match="Unknown optimizer"):
                module.get(name, use_legacy_optimizer=True)
        return
    legacy = type(tf_keras.optimizers.get(
        name, use_legacy_optimizer=True)).__name__
    ours_legacy = type(keras_ema_opt.get(name, use_legacy_optimizer=True))
    if name in ("adagrad", "nadam", "rmsprop"):
        assert ours_legacy is getattr(keras_ema_opt.compat, "Legacy" + legacy)
    else:
        assert ours_legacy is getattr(keras_ema_opt, legacy)


@pytest.mark.parametrize("name", ["experimentaladam", "ExperimentalSGD",
                                  "experimentaladagrad",
                                  "experimentaladadelta"])
@pytest.mark.parametrize("legacy", [False, True])
def test_module_get_takes_keras2_experimental_aliases(name, legacy):
    # Keras 2 gave the experimental class for these, OptimizerV2 or not
    # (its Adagrad: not the OptimizerV2 rule of compat.LegacyAdagrad).
    theirs = tf_keras.optimizers.get(name, use_legacy_optimizer=legacy)
    assert "legacy" not in type(theirs).__module__
    ours = keras_ema_opt.get(name, use_legacy_optimizer=legacy)
    assert type(ours) is getattr(keras_ema_opt, type(theirs).__name__)


def test_module_refuses_what_optimizer_v2_lacked_and_a_bare_wrapper():
    for name in ("lion", "Adafactor", {"class_name": "AdamW", "config": {}}):
        with pytest.raises(LegacyConfigError, match="Unknown optimizer "
                           "'(lion|Adafactor|AdamW)' with use_legacy_"
                           "optimizer=True.*Accepted: SGD, Adam"):
            keras_ema_opt.deserialize(name, use_legacy_optimizer=True)
    # A user's class of such a name is theirs to give.
    ours = keras_ema_opt.deserialize(
        "Lion", custom_objects={"Lion": keras_ema_opt.SGD},
        use_legacy_optimizer=True)
    assert type(ours) is keras_ema_opt.SGD
    # The loss-scale wrapper needs the optimizer it wraps (Keras 2 raised a
    # bare KeyError), in any case of its name.
    with pytest.raises(LegacyConfigError, match="pass its config"):
        keras_ema_opt.get("lossscaleoptimizer")
    with pytest.raises(LegacyConfigError, match="'inner_optimizer'. "
                       "Received the config keys \\['dynamic'\\]"):
        keras_ema_opt.deserialize({"class_name": "lossscaleoptimizer",
                                   "config": {"dynamic": True}})
    wrapped = keras_ema_opt.deserialize(
        {"class_name": "lossscaleoptimizer",
         "config": {"inner_optimizer": "adam", "dynamic": True}})
    assert isinstance(wrapped, keras.optimizers.LossScaleOptimizer)
    assert type(wrapped.inner_optimizer) is keras_ema_opt.Adam


def test_module_serialize_deserialize_read_tf_keras_and_round_trip():
    theirs = tf_keras.optimizers.SGD(learning_rate=0.1, momentum=0.9,
                                     nesterov=True)
    for config in (tf_keras.optimizers.serialize(theirs),
                   tf_keras.optimizers.serialize(
                       theirs, use_legacy_format=True)):
        ours = keras_ema_opt.deserialize(config)
        assert type(ours) is keras_ema_opt.SGD
        assert (float(to_numpy(ours.learning_rate)), ours.momentum,
                ours.nesterov) == (pytest.approx(0.1), 0.9, True)
    original = keras_ema_opt.Adam(0.01, averaging=keras_ema_opt.SWA(
        start_step=3))
    for legacy_format in (False, True):
        config = keras_ema_opt.serialize(original,
                                         use_legacy_format=legacy_format)
        assert set(config) >= {"class_name", "config"}
        again = keras_ema_opt.deserialize(config)
        assert type(again) is keras_ema_opt.Adam
        assert again.get_config() == original.get_config()


def test_module_get_refuses_what_keras2_refused():
    for module in (tf_keras.optimizers, keras_ema_opt):
        with pytest.raises(ValueError, match="Could not interpret "
                           "optimizer identifier"):
            module.get(123)
    with pytest.raises(InvalidArgumentError, match="Received: 123 of type "
                       "int"):
        keras_ema_opt.get(123)
    with pytest.raises(InvalidArgumentError, match="Received: 'adam'"):
        keras_ema_opt.serialize("adam")
    assert type(keras_ema_opt.get("lion")) is keras_ema_opt.Lion
    assert type(keras_ema_opt.get("adafactor")) is keras_ema_opt.Adafactor
