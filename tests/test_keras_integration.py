"""Our optimizers wherever Keras takes an optimizer: compile, fit, evaluate,
predict, .keras save and load, resume, and custom loops."""

import keras
import numpy as np
import pytest
from conftest import BACKEND
from conftest import only_on
from conftest import to_numpy
from tables import NAMES
from tables import OPTIMIZERS

import keras_ema_opt
from keras_ema_opt.errors import InvalidArgumentError


def _data(n=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype(
        "float32"
    )
    return x, y


def _model(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )


@pytest.mark.parametrize("name", NAMES)
def test_fit_evaluate_predict(name):
    x, y = _data()
    model = _model()
    model.compile(
        optimizer=getattr(keras_ema_opt, name)(**OPTIMIZERS[name],
                                               use_ema=True),
        loss="mse",
    )
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert np.isfinite(model.evaluate(x, y, verbose=0))
    assert model.predict(x, verbose=0).shape == (32, 1)
    assert int(to_numpy(model.optimizer.iterations)) == 8


@pytest.mark.parametrize("name", ["Adam", "SGD", "Lion"])
def test_l3_fit_twice_with_use_ema(name):
    """Keras 3.15 fails the second fit() on JAX: a weight and its average
    shared one buffer after finalize_variable_values (defect L3)."""
    x, y = _data()
    model = _model()
    opt = getattr(keras_ema_opt, name)(use_ema=True, ema_momentum=0.9)
    model.compile(optimizer=opt, loss="mse")
    for _ in range(2):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        # fit() ends with finalize_variable_values: weights <- averages.
        for var in model.trainable_variables:
            average = opt._model_variables_moving_average[
                opt._get_variable_index(var)
            ]
            np.testing.assert_array_equal(to_numpy(var), to_numpy(average))
            if BACKEND == "jax":
                assert var.value is not average.value
    assert int(to_numpy(opt.iterations)) == 8


@pytest.mark.parametrize("name", NAMES)
def test_keras_file_round_trip_and_lockstep_resume(name, tmp_path):
    x, y = _data()
    kwargs = dict(OPTIMIZERS[name], use_ema=True, ema_momentum=0.9,
                  clipnorm=1.0)
    if name == "AdamW":
        kwargs["learning_rate"] = keras.optimizers.schedules.CosineDecay(
            0.05, 100
        )
    model = _model()
    model.compile(optimizer=getattr(keras_ema_opt, name)(**kwargs),
                  loss="mse")
    for i in range(3):
        model.train_on_batch(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is getattr(keras_ema_opt, name)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    _loaded_moves_in_lockstep(loaded, model, x, y)


def _loaded_moves_in_lockstep(loaded, model, x, y):
    """The loaded model's optimizer state is the saved model's; both
    continue three steps on the same batches and stay in lockstep."""
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables,
                    strict=True):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    for i in range(3, 6):
        batch = (x[(i % 4) * 8:(i % 4 + 1) * 8], y[(i % 4) * 8:(i % 4 + 1) * 8])
        model.train_on_batch(*batch)
        loaded.train_on_batch(*batch)
    for a, b in zip(loaded.weights, model.weights, strict=True):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6,
                                   atol=1e-7)
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6,
                                   atol=1e-7)



def _functional(seed=3):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization()(
        keras.layers.Dense(8, activation="relu")(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


H5_CASES = {
    "adam_ema": (_model, lambda: keras_ema_opt.Adam(
        0.01, use_ema=True, ema_momentum=0.9)),
    "sgd_swa_functional": (_functional, lambda: keras_ema_opt.SGD(
        0.01, momentum=0.9, averaging=keras_ema_opt.SWA(start_step=1))),
    # The averages of BatchNormalization's statistics too, which need the
    # model the loader is building.
    "averaged_lion_bn": (_model, lambda: keras_ema_opt.averaged(
        keras.optimizers.Lion(0.001),
        keras_ema_opt.EMA(0.9, include_non_trainable=True))),
}


@pytest.mark.parametrize("case", sorted(H5_CASES))
def test_h5_file_round_trip_and_lockstep_resume(case, tmp_path):
    """Keras 3.15 loads a `.h5` file's optimizer by building it with
    `model._trainable_variables` (none for a Sequential or functional
    model): its state was lost with a warning, and the first step refused
    the model's variables (Keras' own Adam alike). Ours is built for the
    model's trainable variables there: the file's state loads, and the
    loaded model moves in lockstep with the one that was saved."""
    x, y = _data()
    make_model, make_optimizer = H5_CASES[case]
    model = make_model()
    # "mse" would not load back: Keras 3.15's `.h5` loader cannot
    # deserialize the alias.
    model.compile(optimizer=make_optimizer(), loss="mean_squared_error")
    for i in range(3):
        model.train_on_batch(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
    path = tmp_path / "model.h5"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is type(model.optimizer)
    shapes = [tuple(v.shape) for v in model.optimizer.variables]
    assert [tuple(v.shape) for v in loaded.optimizer.variables] == shapes
    assert len(shapes) > 3  # the slots and averages, not the scalars alone
    _loaded_moves_in_lockstep(loaded, model, x, y)
    assert int(to_numpy(loaded.optimizer.iterations)) == 6


def test_save_on_chief_writes_h5_and_keeps_the_compile_config(tmp_path):
    """`save_on_chief` writes the format of the path's extension (it wrote
    a `.keras` zip under any name), refuses other extensions before
    writing, and puts back the optimizer that Keras 3.15's `.h5` writer
    takes out of the model's compile config: a `.keras` save after it had
    recorded none, and loaded Keras' default RMSprop without the state."""
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras_ema_opt.Adam(0.01, use_ema=True),
                  loss="mean_squared_error")
    model.train_on_batch(x[:8], y[:8])
    save = keras_ema_opt.distributed.save_on_chief
    for name in ("model.h5", "model.hdf5"):
        loaded = keras.saving.load_model(save(model, tmp_path / name))
        assert type(loaded.optimizer) is keras_ema_opt.Adam
        assert len(loaded.optimizer.variables) == len(
            model.optimizer.variables)
    for bad in ("model.pt", "model.keras.tmp", "model"):
        with pytest.raises(InvalidArgumentError,
                           match=r"\.keras, \.h5, \.hdf5\. Received: "
                           rf"filepath='.*{bad}'"):
            save(model, tmp_path / bad)
    model.save(tmp_path / "after.keras")
    loaded = keras.saving.load_model(tmp_path / "after.keras")
    assert type(loaded.optimizer) is keras_ema_opt.Adam
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables,
                    strict=True):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "after.keras", "model.h5", "model.hdf5"]

def test_save_on_chief_into_a_folder_that_is_a_file(tmp_path):
    """In one process (the chief), the file system's own error, and no
    file left behind; `on_chief` gives back what the write returned. The
    other processes of a run raise `ChiefWriteError` at the same call
    (tests/test_distributed.py)."""
    model = _model()
    model.compile(optimizer=keras_ema_opt.Adam(0.01, use_ema=True),
                  loss="mean_squared_error")
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError):
        keras_ema_opt.distributed.save_on_chief(
            model, tmp_path / "file" / "model.keras")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert keras_ema_opt.distributed.on_chief(lambda: 7, "x") == 7


def test_custom_loop_with_minimize_and_ema():
    x, y = _data()
    model = _model()
    model(x[:1])
    opt = keras_ema_opt.Adam(learning_rate=0.05, use_ema=True,
                             ema_momentum=0.5)
    xt, yt = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)

    def loss():
        return keras.ops.mean(
            keras.ops.square(model(xt, training=False) - yt)
        )

    before = float(to_numpy(loss()))
    for _ in range(20):
        opt.minimize(loss, model.trainable_variables)
    assert float(to_numpy(loss())) < before
    opt.finalize_variable_values(model.trainable_variables)
    assert float(to_numpy(loss())) < before


@only_on("jax")
def test_stateless_apply_inside_a_users_jit():
    import jax

    w = keras.Variable(np.array([1.0, 2.0], "float32"))
    opt = keras_ema_opt.Adam(learning_rate=0.1, use_ema=True)
    opt.build([w])

    @jax.jit
    def step(opt_values, w_value, grad):
        (new_w,), new_opt = opt.stateless_apply(opt_values, [grad], [w_value])
        return new_w, new_opt

    grad = np.array([1.0, 1.0], "float32")
    new_w, new_opt = step([v.value for v in opt.variables], w.value, grad)
    reference = keras_ema_opt.Adam(learning_rate=0.1, use_ema=True,
                                   jit_compile=False)
    v = keras.Variable(np.array([1.0, 2.0], "float32"))
    reference.apply_gradients([(keras.ops.convert_to_tensor(grad), v)])
    np.testing.assert_allclose(np.asarray(new_w), to_numpy(v), rtol=1e-6)
