"""Every named optimizer equals Keras' own on the same gradients, and its
EMA equals the Keras 2 closed form over the weight trajectory."""

import keras
import numpy as np
import pytest
from conftest import to_numpy
from tables import NAMES
from tables import OPTIMIZERS
from tables import gradients
from tables import initial_weights

import keras_ema_opt

STEPS = 5


def _run(optimizer, steps=STEPS, record=False):
    variables = [keras.Variable(w) for w in initial_weights()]
    trajectory = [[w.copy() for w in initial_weights()]]
    for grads in gradients(steps):
        optimizer.apply_gradients(
            zip([keras.ops.convert_to_tensor(g) for g in grads], variables)
        )
        if record:
            trajectory.append([to_numpy(v) for v in variables])
    return variables, trajectory


def _assert_same_as_keras(name, kwargs):
    ours, _ = _run(getattr(keras_ema_opt, name)(**kwargs))
    theirs, _ = _run(getattr(keras.optimizers, name)(**kwargs))
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(
            to_numpy(a), to_numpy(b), rtol=1e-6, atol=1e-6
        )


def _adam_float64(lr, amsgrad=False, weight_decay=None, b1=0.9, b2=0.999,
                  eps=1e-7, steps=STEPS):
    """Keras' Adam / AdamW rule in float64 (``keras/src/optimizers/adam.py``:
    ``alpha = lr sqrt(1 - b2^t) / (1 - b1^t)``, ``w -= alpha m / (sqrt(v)
    + eps)``; AdamW first ``w *= 1 - lr wd``)."""
    ws = [w.astype(np.float64) for w in initial_weights()]
    m = [np.zeros_like(w) for w in ws]
    v = [np.zeros_like(w) for w in ws]
    v_hat = [np.zeros_like(w) for w in ws]
    for t, grads in enumerate(gradients(steps), 1):
        for i, g in enumerate(grads):
            g = g.astype(np.float64)
            if weight_decay:
                ws[i] = ws[i] * (1 - lr * weight_decay)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            v_hat[i] = np.maximum(v_hat[i], v[i])
            alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
            ws[i] = ws[i] - alpha * m[i] / (
                np.sqrt(v_hat[i] if amsgrad else v[i]) + eps)
    return ws


@pytest.mark.parametrize("name,kwargs", [
    ("Adam", dict(learning_rate=0.05)),
    ("Adam", dict(learning_rate=0.05, amsgrad=True)),
    ("AdamW", dict(learning_rate=0.05, weight_decay=0.01)),
])
def test_fast_paths_are_keras_rule_to_round_off(name, kwargs):
    """Ours is at least as close to Keras' rule computed in float64 as
    Keras' own implementation is: on PyTorch torch's fused kernel replaces
    Keras' ten multi-tensor passes (``backend/torch.py``), fed Keras'
    float32 step size (both 1.8e-6 from float64 for Adam with AMSGrad,
    most of it Keras' float32 ``1 - beta_2^t``)."""
    reference = _adam_float64(
        kwargs["learning_rate"], kwargs.get("amsgrad", False),
        kwargs.get("weight_decay"))

    def error(optimizer):
        got, _ = _run(optimizer)
        return max(float(np.max(np.abs(to_numpy(a) - b)))
                   for a, b in zip(got, reference))

    ours = error(getattr(keras_ema_opt, name)(**kwargs))
    theirs = error(getattr(keras.optimizers, name)(**kwargs))
    assert ours <= max(theirs, 5e-7), (ours, theirs)


@pytest.mark.parametrize("name", NAMES)
def test_five_steps_equal_keras(name):
    _assert_same_as_keras(name, OPTIMIZERS[name])


@pytest.mark.parametrize("name", NAMES)
def test_five_steps_equal_keras_with_clipping_and_decay(name):
    kwargs = dict(OPTIMIZERS[name], global_clipnorm=0.5)
    if name != "AdamW":
        kwargs["weight_decay"] = 0.004
    _assert_same_as_keras(name, kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_ema_is_the_keras2_closed_form(name):
    """a_T = m^T w_0 + sum_t (1 - m) m^(T - t) w_t, in float64 by hand."""
    m = 0.75
    opt = getattr(keras_ema_opt, name)(
        **OPTIMIZERS[name], use_ema=True, ema_momentum=m
    )
    variables, trajectory = _run(opt, record=True)
    T = len(trajectory) - 1
    for i, var in enumerate(variables):
        ws = [np.asarray(step[i], dtype=np.float64) for step in trajectory]
        expected = m**T * ws[0] + sum(
            (1 - m) * m ** (T - t) * ws[t] for t in range(1, T + 1)
        )
        np.testing.assert_allclose(
            to_numpy(opt.average_of(var)),
            expected,
            rtol=1e-5,
            atol=1e-6,
        )
    # The EMA leaves the weights themselves on their trajectory without it
    # (which equals Keras', above).
    plain, _ = _run(getattr(keras_ema_opt, name)(**OPTIMIZERS[name]))
    for a, b in zip(variables, plain):
        np.testing.assert_allclose(
            to_numpy(a), to_numpy(b), rtol=1e-6, atol=1e-6
        )


@pytest.mark.parametrize("name", NAMES)
def test_config_round_trip(name):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    kwargs = dict(OPTIMIZERS[name], learning_rate=schedule, use_ema=True,
                  ema_momentum=0.9, ema_overwrite_frequency=3, clipnorm=1.0)
    opt = getattr(keras_ema_opt, name)(**kwargs)
    config = opt.get_config()
    again = type(opt).from_config(config)
    assert type(again) is type(opt)
    assert again.get_config() == config
    assert isinstance(
        again._learning_rate, keras.optimizers.schedules.ExponentialDecay
    )
    # Through Keras' own serialization, as `.keras` files store it.
    blob = keras.saving.serialize_keras_object(opt)
    assert blob["class_name"] == name
    assert blob["registered_name"] == f"keras_ema_opt>{name}"
    revived = keras.saving.deserialize_keras_object(blob)
    assert type(revived) is type(opt)
    assert revived.get_config() == config


# ---------------------------------------------------------------------------
# Registration: what a .keras file names, and what loads it
# ---------------------------------------------------------------------------

_SAVE_AND_LOAD = r"""
import json, subprocess, sys, numpy as np, keras, keras_ema_opt
path, name = sys.argv[1], sys.argv[2]
x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
y = x[:, :2] * 2.0
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                          keras.layers.Dense(2)])
model.compile(optimizer=keras_ema_opt.averaged(
    getattr(keras.optimizers, name)(learning_rate=0.01),
    keras_ema_opt.EMA(0.9)), loss="mse")
model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
model.save(path)
model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
print(json.dumps({"weights": [w.tolist() for w in model.get_weights()]}))
"""

_RESUME = r"""
import json, sys, numpy as np, keras
import keras_ema_opt  # noqa: F401  (registers its classes)
path = sys.argv[1]
x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
y = x[:, :2] * 2.0
model = keras.saving.load_model(path)
model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
print(json.dumps({"class": type(model.optimizer).__name__,
                  "weights": [w.tolist() for w in model.get_weights()]}))
"""


@pytest.mark.parametrize("name", ["Muon"])
def test_averaged_keras_optimizer_resumes_in_a_new_process(tmp_path, name):
    # Only the named optimizers were registered at import: a file of
    # averaged(keras.optimizers.Muon(...)) did not load in a new process.
    from conftest import last_json
    from conftest import run_python

    path = tmp_path / "model.keras"
    straight = last_json(run_python("-c", _SAVE_AND_LOAD, path, name))
    resumed = last_json(run_python("-c", _RESUME, path))
    assert resumed["class"] == name
    for a, b in zip(straight["weights"], resumed["weights"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                                   atol=1e-7)


def test_a_user_class_named_like_keras_does_not_replace_ours(tmp_path):
    class Adam(keras.optimizers.Adam):  # a user's rule, a Keras name
        def update_step(self, gradient, variable, learning_rate):
            self.assign_sub(variable, gradient * 0.0)

    theirs = keras_ema_opt.averaged(Adam(0.01), keras_ema_opt.EMA(0.9))
    assert keras.saving.get_registered_object(
        "keras_ema_opt>Adam") is keras_ema_opt.Adam
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras_ema_opt.Adam(0.01), loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    model.save(tmp_path / "ours.keras")
    loaded = keras.saving.load_model(tmp_path / "ours.keras")
    assert type(loaded.optimizer) is keras_ema_opt.Adam
    # The user's own averaged class still round-trips, under its own name.
    model.compile(optimizer=theirs, loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    model.save(tmp_path / "theirs.keras")
    loaded = keras.saving.load_model(tmp_path / "theirs.keras")
    assert Adam in type(loaded.optimizer).__mro__
