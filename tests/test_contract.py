"""The Keras 2 optimizer contract, rule by rule, with each error's text."""

import re

import keras
import numpy as np
import pytest
from conftest import BACKEND
from conftest import only_on
from conftest import to_numpy

import keras_ema_opt
from keras_ema_opt.errors import InvalidArgumentError
from keras_ema_opt.errors import InvalidArgumentTypeError
from keras_ema_opt.errors import UnknownArgumentError
from keras_ema_opt.errors import UnknownVariableError


def _var(values):
    return keras.Variable(np.asarray(values, dtype="float32"))


def _step(opt, variables, grads=None):
    grads = grads or [keras.ops.ones(tuple(v.shape)) for v in variables]
    return opt.apply_gradients(zip(grads, variables))


# ---------------------------------------------------------------------------
# Constructor
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [-0.1, 1.5, "0.9", None])
def test_ema_momentum_outside_0_1_is_refused(momentum):
    with pytest.raises(
        InvalidArgumentError,
        match=re.escape(
            "`ema_momentum` must be in the range [0, 1]. "
            f"Received: ema_momentum={momentum!r}"
        ),
    ):
        keras_ema_opt.Adam(use_ema=True, ema_momentum=momentum)


@pytest.mark.parametrize("make,received,keras2_type_error", [
    (lambda m: m.SGD(learning_rate="0.1"), "learning_rate='0.1'", True),
    (lambda m: m.SGD(use_ema=True, ema_momentum="0.9"),
     "ema_momentum='0.9'", True),
    (lambda m: m.SGD(momentum=1.5), "momentum=1.5", False),
    (lambda m: m.AdamW(weight_decay=None), "weight_decay=None", False),
    (lambda m: m.Ftrl(l1_regularization_strength=-1.0),
     "l1_regularization_strength=-1.0", False),
])
def test_refused_arguments_are_typed_as_keras2_and_name_the_value(
        make, received, keras2_type_error):
    # Keras 3's own checks raised plain ValueErrors, some without the value
    # (`momentum`) or showing a string as a number (`learning_rate=0.1`),
    # and a wrong type was no TypeError, which Keras 2 raised there (an
    # `except TypeError` of Keras 2 code caught nothing).
    tf_keras = pytest.importorskip("tf_keras")
    with pytest.raises(Exception) as theirs:
        make(tf_keras.optimizers)
    assert isinstance(theirs.value, TypeError) == keras2_type_error, (
        theirs.value)
    with pytest.raises(InvalidArgumentError) as ours:
        make(keras_ema_opt)
    assert isinstance(ours.value, type(theirs.value)), received
    assert isinstance(ours.value, ValueError)  # Keras 3's, too
    assert str(ours.value).endswith(f"Received: {received}")


def _numeric_hyperparameters():
    """``{class name: [argument, ...]}`` of every Keras optimizer, its
    arguments whose default is a number: Keras' own take a string there,
    and fail at the first step."""
    import inspect

    found = {}
    skipped = ("learning_rate", "ema_momentum", "ema_overwrite_frequency",
               "loss_scale_factor")
    for name, cls in sorted(vars(keras.optimizers).items()):
        if not (isinstance(cls, type) and issubclass(
                cls, keras.optimizers.Optimizer)) or name in (
                    "Optimizer", "LossScaleOptimizer"):
            continue
        for param in inspect.signature(cls.__init__).parameters.values():
            default = param.default
            if param.name in skipped or isinstance(default, bool) or not (
                    isinstance(default, (int, float))):
                continue
            found.setdefault(name, []).append(param.name)
    return found


NUMERIC = _numeric_hyperparameters()


def _half():
    return 0.5


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_a_number_given_as_anything_else_is_refused_when_made(name):
    """`Adam(beta_1="0.9")`, `AdamW(weight_decay="x")`: accepted, then at
    the first step a bare `TypeError` or `ValueError` from inside the
    backend (`could not convert string to float`), and on PyTorch a string
    `beta_1` trained. A list or a callable too, which Keras 3's
    docstrings offer and its steps cannot use. Each argument of each
    class (one test a class: the suite's per-test session reset costs
    more than the checks)."""
    cls = keras_ema_opt.contract_class(getattr(keras.optimizers, name))
    for argument in NUMERIC[name]:
        for value in ("0.5", [0.5], _half):
            with pytest.raises(InvalidArgumentTypeError) as info:
                cls(**{argument: value})
            message = str(info.value)
            assert message.startswith(
                f"{name}: `{argument}` must be a number"), message
            assert message.endswith(f"Received: {argument}={value!r}"), (
                message)


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_none_is_refused_where_keras_own_class_cannot_step_with_it(name):
    """Keras' own class is the oracle, argument by argument: where it
    takes None and steps (Muon's `rms_rate=None` turns that scaling off,
    its weight decays None are none), ours takes it and steps the same;
    where its step fails (`Adam(epsilon=None)`: `None is not a valid
    value for jnp.array`), ours refuses None when made."""
    keras_cls = getattr(keras.optimizers, name)
    ours = keras_ema_opt.contract_class(keras_cls)

    def step(cls, argument):
        opt = cls(**{argument: None})
        variables = [_var(np.linspace(0.5, 1.5, 3)),
                     _var(np.linspace(0.5, 1.5, 9).reshape(3, 3))]
        _step(opt, variables)
        return [to_numpy(v) for v in variables]

    for argument in NUMERIC[name]:
        try:
            theirs = step(keras_cls, argument)
        except Exception:  # noqa: BLE001 - any failure of Keras' own step
            theirs = None
        if theirs is None:
            with pytest.raises(InvalidArgumentTypeError, match=re.escape(
                    f"Received: {argument}=None")):
                ours(**{argument: None})
            continue
        for got, want in zip(step(ours, argument), theirs):
            np.testing.assert_allclose(got, want, rtol=1e-6,
                                       err_msg=argument)


def test_a_users_own_arguments_are_its_own_to_check():
    # A number argument of a user's class may take None ("off"): the
    # checks are for Keras' own classes' arguments.
    class Thresholded(keras.optimizers.SGD):
        def __init__(self, threshold=1.0, **kwargs):
            super().__init__(**kwargs)
            self.threshold = threshold

        def get_config(self):
            return {**super().get_config(), "threshold": self.threshold}

    opt = keras_ema_opt.averaged(Thresholded(threshold=None,
                                             learning_rate=0.5),
                                 keras_ema_opt.EMA(0.9))
    assert opt.threshold is None
    var = _var([1.0])
    _step(opt, [var])
    np.testing.assert_allclose(to_numpy(var), [0.5])


@pytest.mark.parametrize("argument", ["weight_decay", "clipnorm",
                                      "clipvalue", "global_clipnorm"])
def test_an_optional_number_given_as_a_string_is_refused(argument):
    with pytest.raises(InvalidArgumentTypeError, match=re.escape(
            f"Adam: `{argument}` must be a number or None. Received: "
            f"{argument}='1'")):
        keras_ema_opt.Adam(**{argument: "1"})


@pytest.mark.parametrize("beta_1", [
    np.float32(0.5), np.array(0.5), 0, keras.Variable(0.5, trainable=False),
    keras.ops.convert_to_tensor(np.float32(0.5))], ids=[
        "numpy-scalar", "0-d-array", "int", "variable", "tensor"])
def test_numbers_in_every_form_keras_takes_are_accepted(beta_1):
    # What Keras takes for a hyperparameter: a float, a 0-d tensor or a
    # variable. Adam's first step is the learning rate
    # whatever beta_1 is (the moment over its bias correction is g).
    opt = keras_ema_opt.Adam(learning_rate=0.1, beta_1=beta_1)
    var = _var([1.0])
    _step(opt, [var])
    np.testing.assert_allclose(to_numpy(var), [0.9], rtol=1e-5)


@pytest.mark.parametrize("momentum", [
    0, 1, np.float32(0.5), np.array(0.5), keras.Variable(0.5, trainable=False),
    keras.ops.convert_to_tensor(np.float32(0.5))], ids=[
        "int-0", "int-1", "numpy-scalar", "0-d-array", "variable", "tensor"])
def test_sgd_momentum_in_every_form_keras_2_took(momentum):
    # Keras 3's SGD takes only a Python float; tf_keras took these, and
    # wrote `"momentum": 0` into the configs of `SGD(0.01, momentum=0)`.
    # Two steps of gradient 1 from 1.0, learning rate 0.1: the velocity
    # is -0.1, then -0.1 * (1 + m).
    m = float(np.asarray(keras.ops.convert_to_numpy(momentum)))
    opt = keras_ema_opt.SGD(learning_rate=0.1, momentum=momentum)
    assert type(opt.momentum) is float and opt.momentum == m
    var = _var([1.0])
    _step(opt, [var])
    _step(opt, [var])
    np.testing.assert_allclose(to_numpy(var), [1.0 - 0.1 - 0.1 * (1 + m)],
                               rtol=1e-6)
    again = keras_ema_opt.SGD.from_config(
        dict(opt.get_config(), momentum=int(m)) if m in (0, 1)
        else opt.get_config())
    assert again.momentum == m


def test_sgd_config_tf_keras_writes_with_an_int_momentum_loads():
    # tf_keras keeps `momentum` as given: `SGD(0.01, momentum=0)` writes
    # an int, which Keras 3's SGD refused (and with it every `.keras` and
    # `.h5` file of such a model, through `load_legacy`).
    tf_keras = pytest.importorskip("tf_keras")
    config = tf_keras.optimizers.serialize(
        tf_keras.optimizers.SGD(0.01, momentum=0))
    assert type(config["config"]["momentum"]) is int
    opt = keras_ema_opt.deserialize(config)
    assert isinstance(opt, keras_ema_opt.SGD) and opt.momentum == 0.0


@pytest.mark.parametrize("steps,error", [
    ("2", InvalidArgumentTypeError), (2.5, InvalidArgumentError),
    (1, InvalidArgumentError), (-3, InvalidArgumentError),
    (float("inf"), InvalidArgumentError), (float("nan"),
                                           InvalidArgumentError)])
def test_gradient_accumulation_steps_must_be_an_integer_of_2_or_more(
        steps, error):
    # Keras 3 took 2.5 (a fractional count of steps) and raised a bare
    # TypeError from a comparison for "2".
    with pytest.raises(error, match=re.escape(
            "`gradient_accumulation_steps` must be an integer >= 2 or None. "
            f"Received: gradient_accumulation_steps={steps!r}")):
        keras_ema_opt.SGD(gradient_accumulation_steps=steps)
    assert keras_ema_opt.SGD(
        gradient_accumulation_steps=np.int64(3)).gradient_accumulation_steps \
        == 3


def test_ema_arguments_are_only_checked_with_use_ema():
    # Keras 2 validates them only when `use_ema=True`.
    opt = keras_ema_opt.SGD(ema_momentum=3.0, ema_overwrite_frequency=0)
    assert opt.ema_momentum == 3.0


# 0 is Keras 2's "never" (tf_keras checks a truthy frequency only):
# tests/test_keras2_oracle.py.
@pytest.mark.parametrize("frequency", [-2, 2.5, "3"])
def test_ema_overwrite_frequency_must_be_int_at_least_1(frequency):
    with pytest.raises(
        InvalidArgumentError,
        match=re.escape(
            "`ema_overwrite_frequency` must be an integer >= 1 or None. "
            f"Received: ema_overwrite_frequency={frequency!r}"
        ),
    ):
        keras_ema_opt.SGD(use_ema=True, ema_overwrite_frequency=frequency)


def test_clipnorm_and_global_clipnorm_not_both():
    with pytest.raises(
        InvalidArgumentError,
        match=re.escape(
            "At most one of `clipnorm` and `global_clipnorm` can be set. "
            "Received: clipnorm=1.0, global_clipnorm=2.0."
        ),
    ):
        keras_ema_opt.Adam(clipnorm=1.0, global_clipnorm=2.0)


def test_clipnorm_with_clipvalue_is_accepted_and_clipnorm_wins():
    # Keras 3 refuses the pair; Keras 2 accepted it and clipped by norm.
    both = keras_ema_opt.SGD(learning_rate=1.0, clipnorm=1.0, clipvalue=0.1)
    norm = keras_ema_opt.SGD(learning_rate=1.0, clipnorm=1.0)
    a, b = _var([0.0, 0.0]), _var([0.0, 0.0])
    g = keras.ops.convert_to_tensor(np.array([3.0, 4.0], "float32"))
    both.apply_gradients([(g, a)])
    norm.apply_gradients([(g, b)])
    np.testing.assert_allclose(to_numpy(a), [-0.6, -0.8], rtol=1e-6)
    np.testing.assert_allclose(to_numpy(a), to_numpy(b))


def test_unknown_argument_lists_the_accepted_ones():
    with pytest.raises(UnknownArgumentError) as info:
        keras_ema_opt.Adam(learning_rate=0.1, betta_1=0.5)
    message = str(info.value)
    assert "Adam does not accept the argument(s) {'betta_1': 0.5}" in message
    assert "Accepted arguments: amsgrad, averaging, beta_1, beta_2" in message
    assert "jit_compile" in message
    # Keras 2 raised TypeError here, Keras 3 ValueError: both still catch it.
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, ValueError)


def test_lr_is_the_deprecated_spelling_of_learning_rate():
    with pytest.warns(DeprecationWarning, match="`lr` is deprecated"):
        opt = keras_ema_opt.SGD(lr=0.25)
    assert float(to_numpy(opt.learning_rate)) == 0.25
    # Both: `learning_rate` is used, as tf_keras uses it, and a warning
    # says `lr` is not.
    with pytest.warns(DeprecationWarning, match=r"SGD: `lr=0.1` is not "
                      r"used: `learning_rate=0.2` is given too"):
        opt = keras_ema_opt.SGD(lr=0.1, learning_rate=0.2)
    assert float(to_numpy(opt.learning_rate)) == pytest.approx(0.2)
    theirs = pytest.importorskip("tf_keras").optimizers.SGD(
        lr=0.1, learning_rate=0.2)
    assert float(theirs.learning_rate.numpy()) == pytest.approx(0.2)

    # `lr=` alone to a subclass of the base class, whose `learning_rate`
    # has a default: the rate given.
    class Plain(keras_ema_opt.Optimizer):
        def update_step(self, gradient, variable, learning_rate):
            variable.assign_sub(learning_rate * gradient)

    with pytest.warns(DeprecationWarning, match="`lr` is deprecated"):
        plain = Plain(lr=0.5)
    assert float(to_numpy(plain.learning_rate)) == 0.5


def test_is_legacy_optimizer_is_dropped():
    opt = keras_ema_opt.Adam(learning_rate=0.1, is_legacy_optimizer=False)
    assert "is_legacy_optimizer" not in opt.get_config()


@pytest.mark.parametrize("lr", [1, np.float32(0.5), np.array(0.25), 0.125])
def test_learning_rate_accepts_any_real_number(lr):
    # Keras 3 refuses ints and NumPy float32; Keras 2 took them.
    opt = keras_ema_opt.SGD(learning_rate=lr)
    assert float(to_numpy(opt.learning_rate)) == float(lr)


def test_positional_arguments_follow_the_keras_signature():
    opt = keras_ema_opt.Adam(0.01, 0.8)
    assert opt.beta_1 == 0.8
    with pytest.raises(TypeError):
        keras_ema_opt.SGD(0.1, 0.0, False, None, None, None, None, False,
                          0.99, None, None, None, "name", "extra")


def test_jit_compile_in_effect_per_backend():
    opt = keras_ema_opt.Adam(jit_compile=True)
    expected = {"jax": True, "torch": False}.get(BACKEND)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        # Keras 2: XLA only where a GPU is found.
        expected = bool(tf.config.list_physical_devices("GPU"))
    assert opt.jit_compile is expected
    assert keras_ema_opt.Adam(jit_compile=False).jit_compile is False
    assert opt.get_config()["jit_compile"] is expected


# ---------------------------------------------------------------------------
# iterations and learning rate
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_callable_learning_rate_is_read_at_every_step(jit):
    # A compiled eager step (JAX's jax.jit; TensorFlow's XLA, forced here
    # on a CPU) calls the callable each step, as Keras' own eager step does,
    # instead of freezing the value it had when traced.
    rate = {"value": 0.1}
    w = _var([1.0])
    opt = keras_ema_opt.SGD(learning_rate=lambda: rate["value"],
                            use_ema=True)
    opt.jit_compile = jit and BACKEND != "torch"
    theirs = _var([1.0])
    keras_opt = keras.optimizers.SGD(learning_rate=lambda: rate["value"])
    for value in (0.1, 0.5, 0.25):
        rate["value"] = value
        _step(opt, [w])
        _step(keras_opt, [theirs])
    np.testing.assert_allclose(to_numpy(w), to_numpy(theirs), rtol=1e-6)
    np.testing.assert_allclose(to_numpy(w), [1.0 - 0.1 - 0.5 - 0.25],
                               rtol=1e-6)


@keras.saving.register_keras_serializable(package="keo_test")
def _registered_rate():
    return 0.3


def test_callable_learning_rate_survives_config_and_save(tmp_path):
    # Keras 3 serializes a callable rate as the function; a registered one
    # comes back from the config and from a saved model. Ours took the
    # serialized function for a schedule (its `config` is a name, not a
    # dict) and failed in from_config: `load_model` of our own file too.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 2)), rng.normal(size=(8, 1))
    rates = {}
    for label, cls in (("keras", keras.optimizers.SGD),
                       ("ours", keras_ema_opt.SGD)):
        config = cls(learning_rate=_registered_rate).get_config()
        again = cls.from_config(config)
        assert again._learning_rate is _registered_rate, label
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=cls(learning_rate=_registered_rate),
                      loss="mse")
        model.fit(x, y, epochs=1, verbose=0)
        path = str(tmp_path / f"{label}.keras")
        model.save(path)
        loaded = keras.saving.load_model(path).optimizer
        rates[label] = float(to_numpy(loaded.learning_rate))
        assert loaded._learning_rate is _registered_rate, label
    assert rates == {"keras": pytest.approx(0.3), "ours": pytest.approx(0.3)}


def test_iterations_assignable_before_build():
    opt = keras_ema_opt.SGD(learning_rate=0.1)
    opt.iterations = 5
    w = _var([1.0])
    _step(opt, [w])
    assert int(to_numpy(opt.iterations)) == 6


def test_iterations_variable_replaces_the_counter_in_place():
    shared = keras.Variable(10, dtype="int64" if BACKEND != "jax" else "int32",
                            trainable=False)
    opt = keras_ema_opt.Adam(learning_rate=0.1)
    opt.iterations = shared
    assert opt.iterations is shared
    assert opt.variables[0] is shared
    _step(opt, [_var([1.0])])
    assert int(to_numpy(shared)) == 11


def test_iterations_not_assignable_after_build():
    opt = keras_ema_opt.SGD(learning_rate=0.1)
    _step(opt, [_var([1.0])])
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "Cannot set `iterations` to a new Variable after the Optimizer "
            "weights have been created. Here it is attempting to set "
            "`iterations` to 3."
        ),
    ):
        opt.iterations = 3


@pytest.mark.parametrize("value", [1.5, "2", [1]])
def test_iterations_refuses_non_integers(value):
    opt = keras_ema_opt.SGD()
    with pytest.raises(InvalidArgumentError, match="must be an integer"):
        opt.iterations = value


def test_iterations_counts_real_steps_under_accumulation():
    opt = keras_ema_opt.SGD(gradient_accumulation_steps=2)
    opt.iterations = 3
    assert int(to_numpy(opt.iterations)) == 3
    assert int(to_numpy(opt._iterations)) == 6


def test_learning_rate_and_lr_alias():
    opt = keras_ema_opt.SGD(learning_rate=0.1)
    opt.learning_rate = 0.2
    assert float(to_numpy(opt.lr)) == pytest.approx(0.2)
    opt.lr = np.float32(0.3)
    assert float(to_numpy(opt.learning_rate)) == pytest.approx(0.3)


@pytest.mark.parametrize("rate", [
    "0.5", "abc", None, True, [0.1], np.array([0.1, 0.2], "float32")],
    ids=["numeric-string", "string", "none", "bool", "list", "array"])
def test_learning_rate_setter_refuses_what_the_constructor_refuses(rate):
    # Keras' own setter assigned these to its variable: on JAX "0.5"
    # trained at 0.5 and True at 1.0; elsewhere an untyped error from the
    # backend, of a different class on each.
    with pytest.raises(InvalidArgumentTypeError, match=re.escape(
            f"Received: learning_rate={rate!r}")):
        keras_ema_opt.SGD(learning_rate=rate)
    opt = keras_ema_opt.SGD(learning_rate=0.1)
    for alias in ("learning_rate", "lr"):
        with pytest.raises(InvalidArgumentTypeError, match=re.escape(
                f"Received: learning_rate={rate!r}")):
            setattr(opt, alias, rate)
    var = _var([1.0])
    _step(opt, [var])
    np.testing.assert_allclose(to_numpy(var), [0.9], rtol=1e-6)


def test_float_learning_rate_refused_after_a_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    opt = keras_ema_opt.SGD(learning_rate=schedule)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "This optimizer was created with a `LearningRateSchedule` object "
            "as its `learning_rate` constructor argument, hence its learning "
            "rate is not settable."
        ),
    ):
        opt.learning_rate = 0.1
    _step(opt, [_var([1.0])])
    assert float(to_numpy(opt.lr)) == pytest.approx(0.05)


# ---------------------------------------------------------------------------
# Variables
# ---------------------------------------------------------------------------


def test_add_variable_keras2_argument_order():
    opt = keras_ema_opt.SGD()
    v = opt.add_variable((2,), "float32", "ones", "counter")
    assert tuple(v.shape) == (2,)
    assert "float32" in str(v.dtype)
    np.testing.assert_array_equal(to_numpy(v), [1.0, 1.0])
    assert "counter" in v.name
    scalar = opt.add_variable(None, name="scalar")
    assert tuple(scalar.shape) == ()
    assert any(x is v for x in opt.variables)
    assert any(x is scalar for x in opt.variables)


def test_add_variable_from_reference_both_spellings():
    opt = keras_ema_opt.SGD()
    w = _var([[1.0, 2.0], [3.0, 4.0]])
    zeros = opt.add_variable_from_reference(w, "m")
    np.testing.assert_array_equal(to_numpy(zeros), np.zeros((2, 2)))
    shaped = opt.add_variable_from_reference(w, "row", shape=(2,))
    assert tuple(shaped.shape) == (2,)
    copy = opt.add_variable_from_reference(w, "copy", initial_value=w)
    np.testing.assert_array_equal(to_numpy(copy), to_numpy(w))
    w.assign(np.zeros((2, 2), "float32"))
    assert to_numpy(copy)[1, 1] == 4.0  # a copy, not a view
    keras3 = opt.add_variable_from_reference(
        reference_variable=w, name="v", initializer="ones"
    )
    np.testing.assert_array_equal(to_numpy(keras3), np.ones((2, 2)))
    ids = {id(x) for x in opt.variables}
    assert all(id(x) in ids for x in (zeros, shaped, copy, keras3))


def test_build_takes_keras2_var_list_keyword():
    # tf_keras' `Optimizer.build(self, var_list)`: Keras 2 code calls it
    # by keyword, and Keras 2 subclasses call their parent's so.
    w, v = _var([1.0, 2.0]), _var([1.0, 2.0])
    by_keyword, by_position = keras_ema_opt.Adam(0.1), keras_ema_opt.Adam(0.1)
    by_keyword.build(var_list=[w])
    by_position.build([v])
    assert [tuple(x.shape) for x in by_keyword.variables] == [
        tuple(x.shape) for x in by_position.variables]
    _step(by_keyword, [w])
    _step(by_position, [v])
    np.testing.assert_array_equal(to_numpy(w), to_numpy(v))

    class Keras2Subclass(keras_ema_opt.SGD):
        def build(self, var_list):
            super().build(var_list=var_list)
            self.seen = len(var_list)

    u = _var([1.0, 2.0])
    sub = Keras2Subclass(0.5)
    _step(sub, [u])
    assert sub.seen == 1
    np.testing.assert_allclose(to_numpy(u), [0.5, 1.5])
    with pytest.raises(TypeError, match="Received: neither"):
        keras_ema_opt.SGD().build()
    with pytest.raises(TypeError, match="Received: both"):
        keras_ema_opt.SGD().build([u], var_list=[u])


def test_add_variable_from_reference_errors():
    opt = keras_ema_opt.SGD()
    w = _var([1.0, 2.0])
    with pytest.raises(
        InvalidArgumentError,
        match=re.escape("must have the shape of the variable created from"),
    ) as info:
        opt.add_variable_from_reference(w, "m", initial_value=np.zeros(3))
    assert "(2,)" in str(info.value) and "(3,)" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="Received neither"):
        opt.add_variable_from_reference(variable_name="m")


def test_variables_is_a_list_callable_as_in_keras2():
    opt = keras_ema_opt.Adam()
    w = _var([1.0])
    _step(opt, [w])
    assert opt.variables() == opt.variables
    assert opt.variables[0] is opt.iterations


def test_unknown_variable_raises_keyerror_with_keras2_advice():
    opt = keras_ema_opt.Adam()
    a, b = _var([1.0]), _var([2.0])
    _step(opt, [a])
    with pytest.raises(
        KeyError,
        match=re.escape(
            "This usually means you are trying to call the optimizer to "
            "update different parts of the model separately. Please call "
            "`optimizer.build(variables)` with the full list of trainable "
            "variables before the training loop"
        ),
    ) as info:
        _step(opt, [b])
    assert isinstance(info.value, UnknownVariableError)
    assert isinstance(info.value, ValueError)  # Keras 3's type still works


def test_subset_of_built_variables_is_fine():
    opt = keras_ema_opt.SGD(learning_rate=0.5)
    a, b = _var([1.0]), _var([2.0])
    opt.build([a, b])
    _step(opt, [b])
    np.testing.assert_allclose(to_numpy(a), [1.0])
    np.testing.assert_allclose(to_numpy(b), [1.5])


# ---------------------------------------------------------------------------
# apply_gradients, aggregation, finalize
# ---------------------------------------------------------------------------


def test_apply_gradients_returns_iterations_and_accepts_keras2_flags():
    opt = keras_ema_opt.SGD(learning_rate=0.5)
    w = _var([1.0])
    g = keras.ops.ones((1,))
    assert opt.apply_gradients([(g, w)], skip_gradients_aggregation=True) \
        is opt.iterations
    opt.apply_gradients([(g, w)], experimental_aggregate_gradients=False)
    opt.apply_gradients(iter([(g, w)]), name="custom_scope")
    np.testing.assert_allclose(to_numpy(w), [-0.5])
    assert opt.apply_gradients([]) is opt.iterations
    with pytest.raises(UnknownArgumentError, match="does not accept"):
        opt.apply_gradients([(g, w)], foo=1)


def test_aggregate_gradients_is_identity_outside_a_distribution():
    opt = keras_ema_opt.SGD()
    w = _var([1.0, 2.0])
    g = keras.ops.convert_to_tensor(np.array([0.5, -1.0], "float32"))
    (out, var), = opt.aggregate_gradients([(g, w)])
    assert var is w
    np.testing.assert_array_equal(to_numpy(out), [0.5, -1.0])


def test_finalize_variable_values_is_keras2_by_identity():
    opt = keras_ema_opt.SGD(learning_rate=1.0, use_ema=True, ema_momentum=0.5)
    a, b = _var([1.0]), _var([1.0])
    _step(opt, [a, b])  # weights 0, averages 0.5 * 1 + 0.5 * 0 = 0.5
    opt.finalize_variable_values([b])
    np.testing.assert_allclose(to_numpy(a), [0.0])
    np.testing.assert_allclose(to_numpy(b), [0.5])
    # b got a buffer of its own: moving the average leaves b alone.
    _step(opt, [a, b])
    np.testing.assert_allclose(to_numpy(b), [-0.5])
    keras_ema_opt.SGD().finalize_variable_values([a])  # no EMA: no-op


def test_ema_overwrite_frequency_overwrites_weights():
    opt = keras_ema_opt.SGD(learning_rate=1.0, use_ema=True, ema_momentum=0.5,
                            ema_overwrite_frequency=2)
    w = _var([4.0])
    _step(opt, [w])  # w 3, a 3.5
    np.testing.assert_allclose(to_numpy(w), [3.0])
    _step(opt, [w])  # w 2, a 2.75, then w <- a
    np.testing.assert_allclose(to_numpy(w), [2.75])


# ---------------------------------------------------------------------------
# compute_gradients and minimize
# ---------------------------------------------------------------------------


def test_compute_gradients_of_a_callable_loss():
    w = _var([1.0, -2.0])
    unused = _var([5.0])
    opt = keras_ema_opt.SGD()
    pairs = opt.compute_gradients(
        lambda: keras.ops.sum(keras.ops.square(w)), [w, unused]
    )
    assert [v for _, v in pairs] == [w, unused]
    np.testing.assert_allclose(to_numpy(pairs[0][0]), [2.0, -4.0])
    # Unconnected: None (TensorFlow, PyTorch) or zeros (JAX traces values).
    g = pairs[1][0]
    assert g is None or not np.any(to_numpy(g))


def test_non_scalar_loss_is_summed_and_non_trainable_is_watched():
    w = keras.Variable(np.array([1.0, 3.0], "float32"), trainable=False)
    pairs = keras_ema_opt.SGD().compute_gradients(lambda: w * w, [w])
    np.testing.assert_allclose(to_numpy(pairs[0][0]), [2.0, 6.0])


def test_compute_gradients_with_callable_var_list():
    layer = keras.layers.Dense(1, kernel_initializer="ones")
    x = keras.ops.ones((2, 3))
    opt = keras_ema_opt.SGD()
    pairs = opt.compute_gradients(
        lambda: keras.ops.sum(layer(x)), lambda: layer.trainable_variables
    )
    kernel_grad = to_numpy(pairs[0][0])
    np.testing.assert_allclose(kernel_grad, np.full((3, 1), 2.0))


def test_minimize_one_sgd_step():
    w = _var([3.0, 1.0])
    opt = keras_ema_opt.SGD(learning_rate=0.25)
    opt.minimize(lambda: keras.ops.sum(w * w), [w])
    np.testing.assert_allclose(to_numpy(w), [1.5, 0.5])
    assert int(to_numpy(opt.iterations)) == 1


def test_minimize_a_model_loss_matches_fit_step():
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    y = np.random.default_rng(1).normal(size=(8, 1)).astype("float32")

    def make():
        keras.utils.set_random_seed(7)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])

    model = make()
    opt = keras_ema_opt.Adam(learning_rate=0.1)
    xt, yt = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)
    for _ in range(3):
        opt.minimize(
            lambda: keras.ops.mean(keras.ops.square(model(xt) - yt)),
            model.trainable_variables,
        )
    reference = make()
    reference.compile(optimizer=keras.optimizers.Adam(learning_rate=0.1),
                      loss="mse")
    reference.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    for a, b in zip(model.weights, reference.weights):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-5,
                                   atol=1e-6)


def test_tensor_loss_without_tape_is_keras2_valueerror():
    w = _var([1.0])
    loss = keras.ops.sum(w * 2.0)
    with pytest.raises(
        ValueError,
        match=re.escape("`tape` is required when a `Tensor` loss is passed."),
    ):
        keras_ema_opt.SGD().minimize(loss, [w])


@only_on("jax", "torch")
def test_tape_is_refused_where_there_is_none():
    with pytest.raises(ValueError, match="does not have. Received: tape="):
        keras_ema_opt.SGD().compute_gradients(lambda: 0.0, [_var([1.0])],
                                              tape=object())


@only_on("tensorflow")
def test_tensor_loss_with_its_tape():
    import tensorflow as tf

    w = _var([1.0, 2.0])
    opt = keras_ema_opt.SGD(learning_rate=0.5)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w.value * w.value)
    opt.minimize(loss, [w], tape=tape)
    np.testing.assert_allclose(to_numpy(w), [0.0, 0.0])


# ---------------------------------------------------------------------------
# jit_compile paths
# ---------------------------------------------------------------------------


@only_on("jax")
def test_jax_eager_apply_gradients_runs_jitted():
    w = _var([1.0, 2.0])
    opt = keras_ema_opt.Adam(learning_rate=0.1, use_ema=True)
    _step(opt, [w])
    assert opt._keo_compiled, "eager apply_gradients did not compile"
    eager = keras_ema_opt.Adam(learning_rate=0.1, use_ema=True,
                               jit_compile=False)
    v = _var([1.0, 2.0])
    _step(eager, [v])
    assert not getattr(eager, "_keo_compiled", None)
    np.testing.assert_allclose(to_numpy(w), to_numpy(v), rtol=1e-6)


@only_on("jax")
def test_jax_jitted_step_survives_a_shared_buffer():
    # Two variables holding one array: donation would fail, so it is skipped.
    a = _var([1.0, 2.0])
    b = keras.Variable(a.value)
    opt = keras_ema_opt.SGD(learning_rate=1.0)
    _step(opt, [a, b])
    np.testing.assert_allclose(to_numpy(a), [0.0, 1.0])
    np.testing.assert_allclose(to_numpy(b), [0.0, 1.0])


@only_on("tensorflow")
def test_tensorflow_xla_path_equals_eager():
    import tensorflow as tf

    grads = [tf.constant([0.5, -1.0]), tf.constant([[1.0], [2.0]])]
    results = []
    for jit in (True, False):
        opt = keras_ema_opt.Adam(learning_rate=0.1, use_ema=True)
        opt.jit_compile = jit  # force XLA on a CPU-only machine
        ws = [_var([1.0, 2.0]), _var([[1.0], [0.0]])]
        for _ in range(3):
            opt.apply_gradients(zip(grads, ws))
        assert bool(getattr(opt, "_keo_compiled", None)) is jit
        results.append([to_numpy(w) for w in ws])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6)


# ---------------------------------------------------------------------------
# Sparse gradients (TensorFlow)
# ---------------------------------------------------------------------------


@only_on("tensorflow")
@pytest.mark.parametrize("name", ["SGD", "Adam", "Adagrad", "RMSprop"])
def test_sparse_duplicate_indices_are_summed(name):
    import tensorflow as tf

    table = np.arange(12, dtype="float32").reshape(4, 3)
    values = np.ones((3, 3), "float32") * np.array([[1.0], [2.0], [4.0]])
    sparse = tf.IndexedSlices(
        tf.constant(values), tf.constant([1, 3, 1]), tf.constant([4, 3])
    )
    dense = np.zeros_like(table)
    dense[1] = values[0] + values[2]
    dense[3] = values[1]
    kwargs = {"learning_rate": 0.1}
    if name == "SGD":
        kwargs["momentum"] = 0.9
    w_sparse, w_dense = keras.Variable(table), keras.Variable(table)
    opt_sparse = getattr(keras_ema_opt, name)(**kwargs)
    opt_dense = getattr(keras_ema_opt, name)(**kwargs)
    for _ in range(2):
        opt_sparse.apply_gradients([(sparse, w_sparse)])
        opt_dense.apply_gradients([(tf.constant(dense), w_dense)])
    np.testing.assert_allclose(to_numpy(w_sparse), to_numpy(w_dense),
                               rtol=1e-6)


def test_exclude_from_weight_decay_takes_one_string_as_one_pattern():
    # Keras 2 and 3 alike read var_names="bias" as the patterns b, i, a
    # and s: "kernel" kept its decay only because it has none of them.
    opt = keras_ema_opt.AdamW(learning_rate=0.0, weight_decay=0.5)
    kernel = keras.Variable(np.ones((2,), "float32"), name="kernel")
    scale = keras.Variable(np.ones((2,), "float32"), name="scale")
    opt.exclude_from_weight_decay(var_names="bias")
    opt.build([kernel, scale])
    assert opt._use_weight_decay(kernel) and opt._use_weight_decay(scale)


@pytest.mark.parametrize("arguments", [
    {"var_names": 5}, {"var_names": ["bias", 3]}, {"var_list": 5},
    {"var_list": "variable"}],
    ids=["names-int", "names-not-strings", "list-int", "one-variable"])
def test_exclude_from_weight_decay_names_what_it_takes(arguments):
    (argument, given), = arguments.items()
    if given == "variable":
        # Read as a list, a 2-D variable yields its rows: without end on
        # JAX (an index past the end does not raise there).
        given = arguments[argument] = keras.Variable(np.ones((2, 2)))
    with pytest.raises(InvalidArgumentTypeError, match=re.escape(
            f"Received: {argument}={given!r}")):
        keras_ema_opt.AdamW().exclude_from_weight_decay(**arguments)


def test_finalize_variable_values_names_what_it_takes():
    opt = keras_ema_opt.SGD(use_ema=True)
    with pytest.raises(InvalidArgumentTypeError,
                       match=re.escape("Received: var_list=5")):
        opt.finalize_variable_values(5)
    one = keras.Variable(np.ones((2, 2)))  # rows without end on JAX
    for opt in (keras_ema_opt.SGD(), keras_ema_opt.SGD(use_ema=True)):
        with pytest.raises(InvalidArgumentTypeError, match=re.escape(
                "`finalize_variable_values` takes a list of variables.")):
            opt.finalize_variable_values(one)


@pytest.mark.parametrize("kind", ["float", "schedule", "callable"])
def test_the_rate_reads_as_a_number_for_every_kind_of_rate(kind):
    # docs/legacy.md: `float(optimizer.learning_rate)` and
    # `keras.ops.convert_to_numpy` read every kind of rate on every
    # backend (the getter is no variable under a schedule or callable).
    rate, expected = {
        "float": (0.1, 0.1),
        "schedule": (keras.optimizers.schedules.ExponentialDecay(
            0.1, 1, 0.5), 0.05),
        "callable": (lambda: 0.3, 0.3)}[kind]
    opt = keras_ema_opt.SGD(rate)
    _step(opt, [_var([1.0])])
    for read in (float, lambda x: float(keras.ops.convert_to_numpy(x))):
        assert read(opt.learning_rate) == pytest.approx(expected)
        assert read(opt.lr) == pytest.approx(expected)


@pytest.mark.parametrize("name", ["SGD", "Adam", "Adagrad"])
@pytest.mark.parametrize("shape", [(1,), (), (3, 1)])
def test_a_gradient_of_another_shape_is_refused_on_every_backend(
        name, shape):
    # Keras broadcast a (1,) or () gradient into a (3,) update on JAX and
    # PyTorch, and raised from inside TensorFlow's ops there; tf_keras
    # broadcast in its SGD and raised in its Adagrad.
    var = _var([1.0, 2.0, 3.0])
    opt = getattr(keras_ema_opt, name)(0.1)
    with pytest.raises(InvalidArgumentError, match=re.escape(
            f"is (3,). Received: a gradient of shape {shape}")):
        _step(opt, [var], [keras.ops.ones(shape)])
    np.testing.assert_array_equal(to_numpy(var), [1.0, 2.0, 3.0])
    _step(opt, [var])  # the right shape still steps
    assert not np.allclose(to_numpy(var), [1.0, 2.0, 3.0])


def test_apply_and_exclusions_take_any_iterable_of_variables():
    # Keras reads them once (list()): the checks before it read a
    # generator first and left Keras an empty one, so that the step moved
    # nothing and the exclusion excluded nothing, without a word.
    variables = [_var([1.0, 1.0]), _var([1.0, 1.0, 1.0])]
    opt = keras_ema_opt.SGD(0.5)
    opt.apply([keras.ops.ones((2,)), keras.ops.ones((3,))],
              (v for v in variables))
    for var in variables:
        np.testing.assert_array_equal(to_numpy(var), 0.5)
    kernel = keras.Variable(np.ones((2,), "float32"), name="kernel")
    opt = keras_ema_opt.AdamW(weight_decay=0.5)
    opt.exclude_from_weight_decay(var_list=(v for v in [kernel]),
                                  var_names=(n for n in ["nothing"]))
    opt.build([kernel])
    assert not opt._use_weight_decay(kernel)
