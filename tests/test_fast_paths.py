"""The backend fast paths are taken where they can serve, fall back where
they cannot, and give the results of the general path.

PyTorch: torch's fused Adam kernel for Keras' Adam / AdamW rule, and one
``torch._foreach_lerp_`` per device and dtype for the averages.
TensorFlow: one ``ResourceApplyGradientDescent`` kernel per average. Elsewhere (and for what they
cannot take) the ``keras.ops`` path runs. Oracles: Keras' own optimizers,
and the averaging formula in float64.
"""

import os
import re

import keras
import numpy as np
import pytest

import keras_ema_opt
from conftest import BACKEND
from conftest import ROOT
from conftest import computed
from conftest import only_on
from conftest import to_numpy
from keras_ema_opt.errors import InvalidArgumentError


def _problem(dtypes=("float32", "float32", "float64"),
             shapes=((4, 3), (5,), (2, 3, 2))):
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=s).astype(d) for s, d in zip(shapes, dtypes)]
    grads = [[rng.normal(size=s).astype(d) for s, d in zip(shapes, dtypes)]
             for _ in range(6)]
    return weights, grads


def _train(optimizer, weights, grads, record=False):
    variables = [keras.Variable(w, dtype=w.dtype) for w in weights]
    trajectory = [[w.astype(np.float64) for w in weights]]
    for step in grads:
        optimizer.apply_gradients(zip(
            [keras.ops.convert_to_tensor(g) for g in step], variables))
        trajectory.append([to_numpy(v).astype(np.float64)
                           for v in variables])
    return variables, trajectory


class _Calls:
    """Counts the calls of a framework function, still calling it."""

    def __init__(self, monkeypatch, name, module=None):
        if module is None:
            import torch as module

        self.count = 0
        real = getattr(module, name)

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)


@only_on("torch")
@pytest.mark.parametrize("name,kwargs", [
    ("Adam", dict(learning_rate=0.05)),
    ("Adam", dict(learning_rate=0.05, amsgrad=True)),
    ("AdamW", dict(learning_rate=0.05, weight_decay=0.02)),
])
def test_torch_fused_adam_is_taken_per_dtype_and_equals_keras(
        monkeypatch, name, kwargs):
    calls = _Calls(monkeypatch, "_fused_adam_")
    weights, grads = _problem()
    ours, _ = _train(getattr(keras_ema_opt, name)(**kwargs), weights, grads)
    # One kernel call per (device, dtype) per step: float32 and float64.
    assert calls.count == 2 * len(grads)
    theirs, _ = _train(getattr(keras.optimizers, name)(**kwargs), weights,
                       grads)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6,
                                   atol=1e-6)

@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("use_ema", [False, True])
def test_adam_under_gradient_accumulation_equals_keras(name, use_ema):
    # Under accumulation Keras' `iterations` is a tensor (real steps), not
    # a variable; the PyTorch fused step reads its step count from it.
    kwargs = dict(learning_rate=0.05, gradient_accumulation_steps=3)
    weights, grads = _problem()
    ours, _ = _train(getattr(keras_ema_opt, name)(use_ema=use_ema, **kwargs),
                     weights, grads)
    theirs, _ = _train(getattr(keras.optimizers, name)(**kwargs), weights,
                       grads)
    for a, b, w in zip(ours, theirs, weights):
        assert not np.allclose(to_numpy(b), w)  # two real steps were taken
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6,
                                   atol=1e-6)



@only_on("torch")
@pytest.mark.parametrize("averaging", [
    None, keras_ema_opt.EMA(0.9), keras_ema_opt.EMA(0.9, warmup="power"),
    keras_ema_opt.SWA(start_step=2),
])
@pytest.mark.parametrize("schedule", [False, True])
def test_torch_fused_adam_reads_nothing_back_to_the_host(
        monkeypatch, averaging, schedule):
    """The fused step's size is computed where the step count lives: on
    CUDA, reading it or the learning rate back to the host would wait for
    the device's queued work at every step. No tensor is read back during
    a step (on the CPU here, by the same code as on CUDA), but for the
    one read torch would make itself: ``_foreach_lerp_`` takes its weight
    as a number and reads a tensor weight in C++, once a call, so
    ``_lerp`` reads it once in torch's place (counted below at the
    dispatcher, ``aten._local_scalar_dense``: one read a call of
    ``_lerp``, whether it lerps, copies or keeps), and none for an EMA
    without warm-up, whose weight is a Python number (``Averaging.
    constant_weights``); and the result is Keras' Adam's to round-off."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from keras_ema_opt.backend import torch as torch_backend

    class Reads(TorchDispatchMode):
        """Counts the reads to the host at the dispatcher (Python's
        ``Tensor.item`` and torch's own in C++ alike) and the lerps."""

        def __init__(self):
            super().__init__()
            self.reads = self.lerps = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            self.reads += name.startswith("aten._local_scalar_dense")
            self.lerps += name.startswith("aten._foreach_lerp_")
            return func(*args, **(kwargs or {}))

    lerp_calls = []
    lerp = torch_backend._lerp

    def counted_lerp(*args):
        lerp_calls.append(1)
        return lerp(*args)
    monkeypatch.setattr(torch_backend, "_lerp", counted_lerp)

    def optimizer(cls, **kwargs):
        lr = keras.optimizers.schedules.ExponentialDecay(
            0.05, decay_steps=2, decay_rate=0.5) if schedule else 0.05
        return cls(learning_rate=lr, **kwargs)

    weights, grads = _problem()
    calls = _Calls(monkeypatch, "_fused_adam_")
    ours = optimizer(keras_ema_opt.Adam, averaging=averaging)
    variables = [keras.Variable(w, dtype=w.dtype) for w in weights]

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read back to the host in a step")

    counted = Reads()
    for step in grads:
        grad_tensors = [keras.ops.convert_to_tensor(g) for g in step]
        with monkeypatch.context() as guard:
            # `float(weight)` in `_lerp` is the read counted; any other
            # goes through the dispatcher too.
            for name in ("item", "tolist", "numpy", "__int__", "__bool__"):
                guard.setattr(torch.Tensor, name, refuse)
            with counted:
                ours.apply_gradients(zip(grad_tensors, variables))
    assert calls.count == 2 * len(grads)
    constant = averaging is not None and (
        averaging.constant_weights() is not None)
    assert counted.reads == (0 if constant else len(lerp_calls))
    assert (len(lerp_calls) > 0) == (averaging is not None)
    # SWA(start_step=2): its steps before the start keep the averages
    # without a lerp.
    assert counted.lerps <= len(lerp_calls)
    theirs, _ = _train(optimizer(keras.optimizers.Adam), weights, grads)
    for a, b in zip(variables, theirs):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6,
                                   atol=1e-6)


@only_on("torch")
@pytest.mark.parametrize("averaging", [
    keras_ema_opt.EMA(0.9, warmup="power"), keras_ema_opt.SWA(start_step=2),
    keras_ema_opt.PowerEMA(),
])
def test_torch_fused_adam_plans_each_step_once(monkeypatch, averaging):
    """The gates and decays of a step (a dozen eager ops, on CUDA as many
    launches) are computed once: by the fused update that folds the
    averages in, and reused by the averager's update after it. The
    averages still follow Keras' Adam weights through the strategy's rule
    (a float64 variable and its float64 averages in their own group)."""
    from keras_ema_opt.averaging import engine

    weights, grads = _problem()
    fused = _Calls(monkeypatch, "_fused_adam_")
    plans = []
    real_plan = engine.Averager._plan

    def counted_plan(self, *args, **kwargs):
        plans.append(1)
        return real_plan(self, *args, **kwargs)
    monkeypatch.setattr(engine.Averager, "_plan", counted_plan)
    strategy = type(averaging).from_config(averaging.get_config())
    opt = keras_ema_opt.Adam(0.05, averaging=strategy)
    variables, _ = _train(opt, weights, grads)
    assert fused.count == 2 * len(grads)  # float32 and float64 groups
    assert len(plans) == len(grads)
    monkeypatch.setattr(engine.Averager, "_plan", real_plan)
    # The same averages by the engine's general path: Keras' own Adam step
    # (torch without the fused kernel), then the averager's update.
    import torch
    monkeypatch.delattr(torch, "_fused_adam_")
    reference = keras_ema_opt.averaged(keras.optimizers.Adam(0.05), type(
        averaging).from_config(averaging.get_config()))
    theirs, _ = _train(reference, weights, grads)
    for ours_var, their_var in zip(variables, theirs):
        for slot in range(strategy.num_slots):
            np.testing.assert_allclose(
                to_numpy(opt.average_of(ours_var, slot)),
                to_numpy(reference.average_of(their_var, slot)),
                rtol=1e-6, atol=1e-6, err_msg=f"{ours_var.path} {slot}")


@only_on("torch")
def test_torch_fused_adam_falls_back_for_gradients_of_another_dtype(
        monkeypatch):
    """A float64 gradient for a float32 variable: Keras' own multi-tensor
    step runs (torch's kernel needs one dtype)."""
    calls = _Calls(monkeypatch, "_fused_adam_")
    weights, grads = _problem(("float32",) * 3)
    grads = [[g.astype("float64") if i == 0 else g for i, g in enumerate(s)]
             for s in grads]
    ours, _ = _train(keras_ema_opt.Adam(0.05), weights, grads)
    assert calls.count == 0
    theirs, _ = _train(keras.optimizers.Adam(0.05), weights, grads)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


# Per step: "copy" (before start_step), "keep" (off the `every` grid) or
# the decay d of `a <- d a + (1 - d) w`.
@pytest.mark.parametrize("averaging,actions", [
    (keras_ema_opt.EMA(0.8), [0.8] * 6),
    (keras_ema_opt.EMA(0.8, start_step=2, every=2),
     ["copy", "copy", "keep", 0.64, "keep", 0.64]),
    (keras_ema_opt.SWA(), [0.0, 1 / 2, 2 / 3, 3 / 4, 4 / 5, 5 / 6]),
])
@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_averages_equal_the_formula_in_float64(averaging, actions,
                                               optimizer):
    """Whatever path updates them (on PyTorch the lerp fast path, with
    float32 and float64 groups; with Adam, folded into torch's fused
    update, each run of variables averaged right after its update), the
    averages follow the formula, once per step."""
    weights, grads = _problem()
    opt = getattr(keras_ema_opt, optimizer)(0.05, averaging=type(
        averaging).from_config(averaging.get_config()))
    variables, trajectory = _train(opt, weights, grads)
    expected = [w.copy() for w in trajectory[0]]
    for step, action in enumerate(actions, 1):
        for i, w in enumerate(trajectory[step]):
            if action == "copy":
                expected[i] = w.copy()
            elif action != "keep":
                expected[i] = action * expected[i] + (1 - action) * w
    for var, want in zip(variables, expected):
        np.testing.assert_allclose(
            to_numpy(opt.average_of(var)).astype(np.float64), want,
            rtol=1e-6, atol=1e-6, err_msg=var.path)


@only_on("torch")
def test_torch_lerp_is_taken_per_dtype_and_falls_back_for_other_dtypes(
        monkeypatch):
    calls = _Calls(monkeypatch, "_foreach_lerp_")
    weights, grads = _problem()
    _train(keras_ema_opt.SGD(0.1, averaging=keras_ema_opt.EMA(0.9)),
           weights, grads)
    assert calls.count == 2 * len(grads)  # float32 and float64 groups
    # float32 averages of bfloat16 weights: no lerp (dtypes differ).
    calls.count = 0
    opt = keras_ema_opt.SGD(0.1, averaging=keras_ema_opt.EMA(
        0.9, average_dtype="float32"))
    variables = [keras.Variable(np.ones(3, "float32"), dtype="bfloat16")]
    opt.apply_gradients([(keras.ops.ones((3,), "bfloat16"), variables[0])])
    assert calls.count == 0
    np.testing.assert_allclose(
        to_numpy(opt.average_of(variables[0])),
        0.9 * 1.0 + 0.1 * to_numpy(variables[0]).astype("float32"),
        rtol=1e-6)


@only_on("tensorflow")
def test_tf_lerp_kernel_serves_plain_averages(monkeypatch):
    """One fused kernel per average and step for a plain EMA."""
    import tensorflow as tf

    calls = _Calls(monkeypatch, "ResourceApplyGradientDescent", tf.raw_ops)
    weights, grads = _problem()
    _train(keras_ema_opt.SGD(0.1, averaging=keras_ema_opt.EMA(0.9)),
           weights, grads)
    assert calls.count == 3 * len(grads)


@only_on("tensorflow")
@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_tf_gated_averages_take_the_kernel_and_copy_exactly(monkeypatch,
                                                            mode):
    """A strategy whose steps may copy or keep (``start_step``, ``every``)
    takes one branch a step for all its averages: an exact copy, the
    averages kept bit for bit, or the fused kernel (eagerly, in a traced
    step and under XLA), instead of the engine's seven-op ``where``."""
    import tensorflow as tf

    calls = _Calls(monkeypatch, "ResourceApplyGradientDescent", tf.raw_ops)
    weights, grads = _problem()
    opt = keras_ema_opt.SGD(0.1, averaging=keras_ema_opt.EMA(
        0.8, start_step=2, every=2))
    variables = [keras.Variable(w, dtype=w.dtype) for w in weights]
    opt.build(variables)

    def step(gs):
        opt.apply_gradients(zip(gs, variables))
    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    actions = ["copy", "copy", "keep", 0.64, "keep", 0.64]
    expected = [w.astype(np.float64) for w in weights]
    for grad, action in zip(grads, actions):
        before = [to_numpy(opt.average_of(v)) for v in variables]
        step([tf.constant(g) for g in grad])
        for i, (var, old) in enumerate(zip(variables, before)):
            new, w = to_numpy(opt.average_of(var)), to_numpy(var)
            if action == "copy":
                np.testing.assert_array_equal(new, w, err_msg=var.path)
                expected[i] = w.astype(np.float64)
            elif action == "keep":
                np.testing.assert_array_equal(new, old, err_msg=var.path)
            else:
                expected[i] = action * expected[i] + (1 - action) * w
                np.testing.assert_allclose(new, expected[i], rtol=1e-6,
                                           atol=1e-6, err_msg=var.path)
    # Eagerly the kernel runs on the two averaging steps only; traced, the
    # branch that holds it is traced once.
    assert calls.count == 3 * (2 if mode == "eager" else 1)


@only_on("torch")
def test_torch_compiled_fit_steps_through_keras_own_update():
    """Under ``model.compile(jit_compile=True)`` (torch.compile) the fused
    kernel, whose step size is computed on the host, steps aside for
    Keras' traceable update: the same training as without compilation."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    states = []
    for jit in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras_ema_opt.Adam(
            0.05, averaging=keras_ema_opt.EMA(0.5, finalize=False)),
            loss="mse", jit_compile=jit)
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        states.append([to_numpy(v) for v in model.weights] + [
            to_numpy(model.optimizer.average_of(v))
            for v in model.trainable_weights])
    for a, b in zip(*states):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _fit_with_state_reads(prepare, monkeypatch, averaging):
    """A JAX fit of a small model whose callback reads the weights through
    Keras' state sync at each batch; returns (weights read mid-fit, final
    weights and averages, tracker calls a step after the first two)."""
    from keras.src.utils import tracking

    from keras_ema_opt import backend

    if not prepare:
        monkeypatch.setattr(backend, "prepare_model", lambda model: None)
    calls = {"on": False, "count": 0}
    real_track = tracking.Tracker.track

    def track(self, attr):
        calls["count"] += calls["on"]
        return real_track(self, attr)
    monkeypatch.setattr(tracking.Tracker, "track", track)

    class Reads(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.reads = []

        def on_train_batch_begin(self, batch, logs=None):
            calls["on"] = batch >= 2

        def on_train_batch_end(self, batch, logs=None):
            calls["on"] = False
            if batch % 2:  # `self.model` syncs the state into the variables
                self.reads.append([to_numpy(w) for w in self.model.weights])

    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras_ema_opt.Adam(0.05, averaging=averaging),
                  loss="mse")
    reads = Reads()
    model.fit(x, x, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[reads], validation_data=(x[:16], x[:16]))
    final = [to_numpy(v) for v in model.weights + model.optimizer.variables]
    per_step = calls["count"] / 4
    # evaluate() and predict() store their state the same way.
    calls["on"], calls["count"] = True, 0
    final.append(np.asarray(model.evaluate(x, x, batch_size=8, verbose=0)))
    final.append(model.predict(x, batch_size=8, verbose=0))
    calls["on"] = False
    return reads.reads, final, (per_step, calls["count"] / 12), model


@only_on("jax")
@pytest.mark.skipif(keras.config.is_nnx_enabled(),
                    reason="Flax NNX models keep Keras' own state storage")
@pytest.mark.parametrize("averaging", [None, keras_ema_opt.EMA(0.5)])
def test_jax_fit_state_is_stored_untracked_and_reads_the_same(
        averaging, monkeypatch):
    """Keras' JAX fit() (evaluate(), predict()) stores each step's new
    state on the model, and its attribute tracking walked it array by
    array; stored untracked, a step makes a couple of tracker calls, and
    what callbacks read through the state sync, the end state, and what
    evaluate() and predict() give are the same to the bit."""
    reads, final, (per_step, per_batch), model = _fit_with_state_reads(
        True, monkeypatch, averaging)
    old_reads, old_final, (old_per_step, old_per_batch), _ = (
        _fit_with_state_reads(False, monkeypatch, averaging))
    arrays = len(model.weights) + len(model.optimizer.variables)
    assert old_per_step >= arrays  # Keras' own walk: each array at least
    assert per_step <= 3
    # evaluate() and predict(): 6 + 6 batches; Keras' walk there covers the
    # model's variables and the metrics'.
    assert old_per_batch >= len(model.weights)
    assert per_batch <= 3
    assert model._jax_state is None  # reset by Keras at the end, as before
    assert len(reads) == len(old_reads) == 3
    for got, want in zip(reads + [final], old_reads + [old_final]):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


@only_on("jax")
@pytest.mark.skipif(keras.config.is_nnx_enabled(),
                    reason="Flax NNX models keep Keras' own state storage")
def test_jax_fit_state_is_untracked_on_the_model_being_fit():
    """Where ``track_non_trainable`` names a submodel, the model being fit
    (which receives the state) is the one prepared; an optimizer built on
    its own prepares none."""
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3),
                              keras.layers.BatchNormalization()])
    outer = keras.Sequential([keras.Input((3,)), inner,
                              keras.layers.Dense(2)])
    optimizer = keras_ema_opt.Adam(
        0.05, averaging=keras_ema_opt.EMA(0.5, include_non_trainable=True))
    optimizer.track_non_trainable(inner)
    outer.compile(optimizer=optimizer, loss="mse")
    x = np.ones((8, 3), "float32")
    outer.fit(x, np.ones((8, 2), "float32"), epochs=1, verbose=0)
    assert "_setattr_hook" in vars(outer)
    assert "_setattr_hook" not in vars(inner)
    alone = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    keras_ema_opt.Adam(0.05).build(alone.trainable_variables)
    assert "_setattr_hook" not in vars(alone)


@only_on("tensorflow")
@pytest.mark.parametrize("averaging", [
    keras_ema_opt.EMA(0.9), keras_ema_opt.SWA(), keras_ema_opt.PowerEMA(),
])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_tf_step_that_builds_the_optimizer_lifts_its_state(averaging,
                                                          jit_compile):
    """Keras' TensorFlow ``fit()`` (no strategy) builds the optimizer inside
    the first trace of its step. The averages start as copies of the
    weights: created inside that trace from a tensor of more than 128
    elements (captured as a placeholder, not a constant), ``tf.function``
    could not lift their initial values. It then checked every optimizer
    variable's initialization at each later call (a third of a 60-layer MLP's
    fit step) and refused XLA outright ("failed to lift variable
    creations"). They are created outside the trace: XLA runs, and the
    averages still start from the weights before the first update."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(16, 12)).astype("float32")
    grads = [rng.normal(size=w0.shape).astype("float32") for _ in range(3)]
    variable = keras.Variable(w0)
    opt = keras_ema_opt.SGD(0.1, averaging=averaging)

    @tf.function(jit_compile=jit_compile)
    def step(g):
        opt.apply([g], [variable])

    weights = [w0.astype(np.float64)]
    for g in grads:
        step(tf.constant(g))
        weights.append(weights[-1] - 0.1 * g.astype(np.float64))
    np.testing.assert_allclose(to_numpy(variable), weights[-1],
                               rtol=1e-5, atol=1e-6)
    if isinstance(averaging, keras_ema_opt.EMA):
        average = weights[0]
        for w in weights[1:]:
            average = 0.9 * average + 0.1 * w
    elif isinstance(averaging, keras_ema_opt.SWA):
        average = np.mean(weights[1:], axis=0)
    else:
        return
    np.testing.assert_allclose(to_numpy(opt.average_of(variable)),
                               average, rtol=1e-5, atol=1e-6)


@only_on("tensorflow")
@pytest.mark.parametrize("make", ["ours", "averaged"])
def test_tf_state_variables_are_made_under_their_kind(make, tmp_path,
                                                     monkeypatch):
    """TensorFlow caches an eager ``VarHandleOp``'s kernel per variable name
    (its ``debug_name``; about 36 kB each, for the process's life): each
    slot and average is made under its kind alone, so those of one shape
    share one (``benchmarks``' peak memory). The ``tf.Variable`` then has
    its own name back (TF1's name-keyed ``Saver`` refuses two of one
    name), and the ``keras.Variable`` its name and path. Each is its own
    variable, and a save and load round trip restores each."""
    import tensorflow as tf
    from tensorflow.python.ops import gen_resource_variable_ops as ops

    made = []
    handle_op = ops.var_handle_op

    def recorded(*args, **kwargs):
        made.append(kwargs.get("debug_name").rstrip("/"))
        return handle_op(*args, **kwargs)
    monkeypatch.setattr(ops, "var_handle_op", recorded)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3),
                              keras.layers.Dense(3)])
    if make == "ours":
        opt = keras_ema_opt.AdamW(0.01, averaging=keras_ema_opt.EMA(0.9))
        kinds = {"momentum", "velocity", "average"}
    else:
        opt = keras_ema_opt.averaged(keras.optimizers.Lion(0.01),
                                     keras_ema_opt.PowerEMA())
        kinds = {"momentum", "average_0", "average_1"}
    del made[:]
    opt.build(model.trainable_variables)
    slots = [v for v in opt.variables
             if v.path.split("/")[-1].startswith("sequential_dense")]
    assert len(slots) == 4 * len(kinds)
    # 12 slots made under 3 names (the counters under theirs).
    assert sorted(n for n in made if n.split("/")[-1] in kinds) == sorted(
        f"{opt.name}/{k}" for k in kinds for _ in range(4))
    for v in slots:
        assert v.value.name == f"{opt.name}/{v.name}:0", v.value.name
        assert v.path == f"{opt.name}/{v.name}"
        assert v.name.startswith("sequential_dense")
    # Distinct resources, which TF1's Saver (by name) takes together.
    same = [v for v in slots if v.shape == slots[0].shape
            and v.name.endswith(slots[0].name.split("_")[-1])]
    assert len(same) == 2
    same[0].assign(np.full(same[0].shape, 7.0, "float32"))
    assert not np.any(to_numpy(same[1]) == 7.0)
    tf.compat.v1.train.Saver(
        var_list=[v.value for v in model.variables + opt.variables]).save(
            None, os.path.join(tmp_path, "v1"))
    # A fit, then a save and load round trip.
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(1).normal(size=(16, 3)).astype("float32")
    model.fit(x, x, epochs=2, batch_size=8, verbose=0)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert len(loaded.optimizer.variables) == len(opt.variables)
    for v, saved in zip(loaded.optimizer.variables, opt.variables):
        assert v.name.split("_")[-1] == saved.name.split("_")[-1]
        np.testing.assert_array_equal(to_numpy(v), to_numpy(saved))
    # In a graph a variable's name is its identity: left as Keras has it.
    from keras_ema_opt import backend

    del made[:]
    with tf.Graph().as_default(), backend.state_variable_role("momentum"):
        graph_var = tf.Variable(1.0, name="dense_kernel_momentum")
    assert graph_var.name == "dense_kernel_momentum:0"
    assert made == ["dense_kernel_momentum"]


def _buffer_address(variable):
    value = variable.value
    if BACKEND == "jax":
        return value.unsafe_buffer_pointer()
    if BACKEND == "torch":
        return value.data_ptr()
    # A CPU EagerTensor's numpy view shares its buffer.
    return np.asarray(value.read_value()).__array_interface__["data"][0]


@pytest.mark.parametrize("averaging", [
    keras_ema_opt.EMA(0.9), keras_ema_opt.PowerEMA(),
])
def test_averages_start_in_buffers_of_their_own(averaging):
    """An average made from its weight owns its memory from the start. On
    TensorFlow an ``identity`` of the weight shares the weight's buffer,
    and the first step then had to copy both before writing either: one
    transient copy of every averaged weight at the peak (measured by
    ``python -m benchmarks``: growth per state byte 1.39, 1.09 now)."""
    rng = np.random.default_rng(0)
    variable = keras.Variable(rng.normal(size=(300,)).astype("float32"))
    opt = keras_ema_opt.SGD(0.1, averaging=averaging)
    opt.build([variable])
    addresses = {_buffer_address(variable)}
    averages = [v for v in opt.variables
                if "average" in v.name and tuple(v.shape) == (300,)]
    assert len(averages) == averaging.num_slots
    for average in averages:
        addresses.add(_buffer_address(average))
        np.testing.assert_array_equal(to_numpy(average), to_numpy(variable))
    assert len(addresses) == 1 + averaging.num_slots


def _conv_problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(4, 4, 4, 3)).astype("float32")
    return x, y


def _conv_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3)])


@pytest.mark.parametrize("use_ema", [False, True])
def test_minimize_of_a_conv_equals_keras_adam(use_ema):
    # On PyTorch, Keras' Conv permutes its kernel: `torch.autograd.grad`
    # (minimize's gradients) gives a kernel gradient laid out otherwise
    # than the kernel, which torch's fused kernel would read in storage
    # order (12.9 relative off after three steps, before the fix).
    x, y = map(keras.ops.convert_to_tensor, _conv_problem())

    def train(opt, minimize):
        model = _conv_model()
        variables = model.trainable_variables

        def loss():
            return keras.ops.mean((model(x) - y) ** 2)

        for _ in range(3):
            if minimize:
                opt.minimize(loss, variables)
            else:  # Keras' own optimizer, the same gradients
                pairs = keras_ema_opt.backend.compute_gradients(loss,
                                                                variables)
                opt.apply_gradients(pairs)
        return [to_numpy(v) for v in variables]

    # With an average the fused step folds it in (its formula is tested
    # elsewhere; the weights are the kernel's).
    ours = train(keras_ema_opt.Adam(0.01, use_ema=use_ema), True)
    theirs = train(keras.optimizers.Adam(0.01), False)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_broadcast_gradients_and_transposed_variables_equal_keras_adam():
    # A broadcast gradient (stride 0 on PyTorch) and a variable made from
    # a transposed array: the fused kernel must not walk their storage.
    rng = np.random.default_rng(1)
    base = rng.normal(size=(3, 2)).astype("float32")

    def train(opt):
        wide = keras.Variable(np.arange(6, dtype="float32").reshape(2, 3))
        tall = keras.Variable(keras.ops.transpose(
            keras.ops.convert_to_tensor(base)))
        for step in range(3):
            row = keras.ops.convert_to_tensor(
                np.array([0.5, -1.0, 2.0], "float32") * (step + 1))
            grads = [keras.ops.broadcast_to(row, (2, 3)),
                     keras.ops.transpose(keras.ops.convert_to_tensor(
                         base * (step + 1)))]
            opt.apply_gradients(zip(grads, [wide, tall]))
        return [to_numpy(wide), to_numpy(tall)]

    for a, b in zip(train(keras_ema_opt.Adam(0.1)),
                    train(keras.optimizers.Adam(0.1))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_variable_listed_twice_is_averaged_once_a_step():
    # Tied weights listed by two layers: one update of the average a step
    # (the fused path lerped it twice, a decay of d^2).
    weights, grads = _problem(("float32", "float32", "float32"))
    d = 0.8
    opt = keras_ema_opt.Adam(0.05, averaging=keras_ema_opt.EMA(d))
    variables = [keras.Variable(w) for w in weights]
    tied = variables[0]
    expected = weights[0].astype(np.float64)
    for step in grads:
        pairs = list(zip([keras.ops.convert_to_tensor(g) for g in step],
                         variables))
        pairs.append((keras.ops.convert_to_tensor(step[0] * 0.5), tied))
        opt.apply_gradients(pairs)
        expected = d * expected + (1 - d) * to_numpy(tied).astype(np.float64)
    average = to_numpy(opt._averager.slots_of(opt, tied)[0])
    np.testing.assert_allclose(average, expected, rtol=1e-5, atol=1e-7)


def test_float64_adam_equals_keras_adam():
    # Keras computes the step size in float64 for float64 variables; the
    # fused path did it in float32 (6.6e-5 relative off the rule in
    # float64 after 50 steps, against Keras' 1.4e-7).
    rng = np.random.default_rng(2)
    w0 = rng.normal(size=(7,))
    grads = [rng.normal(size=(7,)) for _ in range(50)]

    def train(opt):
        var = keras.Variable(w0, dtype="float64")
        if to_numpy(var).dtype != np.float64:
            pytest.skip("float64 is off (JAX without jax_enable_x64)")
        for g in grads:
            opt.apply_gradients([(keras.ops.convert_to_tensor(g, "float64"),
                                  var)])
        return to_numpy(var)

    np.testing.assert_allclose(train(keras_ema_opt.Adam(0.01)),
                               train(keras.optimizers.Adam(0.01)),
                               rtol=1e-7, atol=1e-10)


@only_on("torch")
def test_a_gradient_of_another_shape_never_reaches_the_fused_kernel():
    """The fused kernel walks as many gradient elements as the variable
    has: a (3,) gradient stored at the start of a longer buffer moved the
    second row by what lay after it. A gradient of another shape than its
    variable is refused before any kernel runs (Keras broadcast a smaller
    one, and refused one larger than the variable)."""
    storage = keras.ops.convert_to_tensor(
        np.array([1, 1, 1, -1, -1, -1], "float32"))
    for grad, shape in ((storage[:3], (2, 3)), (storage, (3,))):
        var = keras.Variable(np.zeros(shape, "float32"))
        with pytest.raises(InvalidArgumentError, match=re.escape(
                f"is {shape}. Received: a gradient of shape "
                f"{tuple(grad.shape)}")):
            keras_ema_opt.Adam(0.1).apply_gradients([(grad, var)])
        np.testing.assert_array_equal(to_numpy(var), np.zeros(shape))


def test_a_gradient_that_is_its_variable_value():
    """``apply_gradients([(w.value, w)])`` (the gradient of |w|^2 / 2): the
    value passed as the gradient is not donated with the variable's (JAX's
    compiled eager step raised 'buffer previously donated')."""
    results = []
    for opt in (keras_ema_opt.SGD(0.1, use_ema=True),
                keras.optimizers.SGD(0.1)):
        w = keras.Variable(np.array([1.0, 2.0, 3.0], "float32"))
        for _ in range(2):
            opt.apply_gradients([(w.value, w)])
        results.append(to_numpy(w))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)


@pytest.mark.parametrize("name,kwargs,attribute,value", [
    ("AdamW", dict(weight_decay=0.0), "weight_decay", 0.5),
    ("SGD", dict(momentum=0.9), "momentum", 0.5),
    ("SGD", dict(), "clipnorm", 0.1),
    ("Adam", dict(), "beta_1", 0.0),
])
def test_a_hyperparameter_set_between_steps_takes_effect(name, kwargs,
                                                         attribute, value):
    """A compiled eager step (JAX; TensorFlow under XLA) held the Python
    attributes it read when traced; Keras' own step reads them anew."""
    results = []
    for module in (keras_ema_opt, keras.optimizers):
        opt = getattr(module, name)(learning_rate=0.1, **kwargs)
        w = keras.Variable(np.array([1.0, 2.0, 3.0, 4.0], "float32"))
        grad = keras.ops.convert_to_tensor(
            np.array([0.5, 1.0, 1.5, 2.0], "float32"))
        opt.apply_gradients([(grad, w)])
        setattr(opt, attribute, value)
        opt.apply_gradients([(grad, w)])
        results.append(to_numpy(w))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)


def test_ema_overwrite_frequency_set_between_steps_takes_effect():
    opt = keras_ema_opt.SGD(0.1, use_ema=True, ema_momentum=0.5)
    w = keras.Variable(np.array([1.0], "float32"))
    grad = keras.ops.ones((1,))
    opt.apply_gradients([(grad, w)])
    opt.ema_overwrite_frequency = 2
    opt.apply_gradients([(grad, w)])
    # float64 rule: w 1 -> 0.9 -> 0.8; average 1 -> 0.95 -> 0.875, and
    # step 2 overwrites the weight with it.
    np.testing.assert_allclose(to_numpy(w), [0.875], rtol=1e-6)


def _clip_cases():
    rng = np.random.default_rng(3)
    big = rng.normal(size=(40, 30)).astype("float32")          # norm ~35
    small = (rng.normal(size=(7,)) * 1e-3).astype("float32")  # below c
    zero = np.zeros((3, 2), "float32")
    nan = big[:5].copy()
    nan[1, 2] = np.nan
    inf = small.copy()
    inf[0] = np.inf
    return {"finite": [big, small, zero], "with None": [big, None, small],
            "nan": [small, nan, zero], "inf": [inf, big]}


@pytest.mark.parametrize("clip", [dict(clipnorm=0.5),
                                  dict(global_clipnorm=2.0),
                                  dict(clipvalue=0.01)])
@pytest.mark.parametrize("case", sorted(_clip_cases()))
def test_clipping_equals_keras_rule(clip, case, monkeypatch):
    """Gradient clipping gives Keras' own clipped gradients (zero, NaN and
    infinite norms too); on PyTorch by torch's multi-tensor kernels (one
    norm kernel for all the gradients, not Keras' ops per gradient)."""
    grads = _clip_cases()[case]
    tensors = [None if g is None else keras.ops.convert_to_tensor(g)
               for g in grads]
    norms = _Calls(monkeypatch, "_foreach_norm") if BACKEND == "torch" else (
        None)
    ours = keras_ema_opt.SGD(0.1, **clip)._clip_gradients(tensors)
    if norms is not None:
        assert norms.count == (0 if "clipvalue" in clip else 1)
    expected = keras.optimizers.SGD(0.1, **clip)._clip_gradients(tensors)
    assert [g is None for g in ours] == [g is None for g in grads]
    for a, b in zip(ours, expected):
        if a is not None:
            np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=2e-6,
                                       atol=1e-9)


@pytest.mark.parametrize("clip", [dict(clipnorm=0.5),
                                  dict(global_clipnorm=2.0),
                                  dict(clipvalue=0.01)])
def test_clipped_steps_equal_keras(clip):
    """Steps with clipping (and an EMA) train as Keras' own optimizer."""
    weights, grads = _problem(dtypes=("float32",) * 3)
    grads = [[g * 10 for g in step] for step in grads]
    _, ours = _train(keras_ema_opt.SGD(0.1, use_ema=True, **clip), weights,
                     grads)
    _, keras_ = _train(keras.optimizers.SGD(0.1, use_ema=True, **clip),
                       weights, grads)
    np.testing.assert_allclose(np.concatenate([w.ravel() for w in ours[-1]]),
                               np.concatenate([w.ravel() for w in keras_[-1]]),
                               rtol=1e-5, atol=1e-7)


_CLIPS = [dict(clipnorm=0.5), dict(global_clipnorm=2.0),
          dict(clipvalue=0.01)]


@only_on("torch")
@pytest.mark.parametrize("clip", _CLIPS)
@pytest.mark.parametrize("own", [True, False])
def test_torch_clips_the_variables_own_grads_in_place(clip, own):
    """Gradients that are the variables' own ``.grad`` (as ``fit()`` passes
    them) are clipped in place, as ``torch.nn.utils.clip_grad_norm_``
    does: the same tensors afterwards hold Keras' clipped gradients, and
    the step equals Keras'. Gradients the caller holds otherwise are left
    as they were."""
    import torch

    rng = np.random.default_rng(5)
    values = [rng.normal(size=s).astype("float32") for s in
              [(20, 10), (10,), (7, 3)]]
    raw = [(rng.normal(size=v.shape) * 3).astype("float32") for v in values]
    ours_vars = [keras.Variable(v) for v in values]
    keras_vars = [keras.Variable(v) for v in values]
    grads = []
    for var, g in zip(ours_vars, raw):
        t = torch.tensor(g)
        if own:
            var.value.grad = t
        grads.append(t)
    pointers = [g.data_ptr() for g in grads]
    opt = keras_ema_opt.SGD(0.1, use_ema=True, **clip)
    with torch.no_grad():
        opt.apply(grads, ours_vars)
    reference = keras.optimizers.SGD(0.1, use_ema=True, **clip)
    expected = reference._clip_gradients(
        [keras.ops.convert_to_tensor(g) for g in raw])
    reference.apply([keras.ops.convert_to_tensor(g) for g in raw],
                    keras_vars)
    assert [g.data_ptr() for g in grads] == pointers
    for g, before, clipped in zip(grads, raw, expected):
        np.testing.assert_allclose(
            to_numpy(g), to_numpy(clipped) if own else before, rtol=2e-6,
            atol=1e-9)
    for a, b in zip(ours_vars, keras_vars):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6,
                                   atol=1e-8)


@only_on("torch")
def test_torch_leaves_differentiable_own_grads_unclipped():
    """A ``.grad`` that is itself differentiated (``backward(create_graph=
    True)``) is not written in place: the clipped values are new
    tensors."""
    import torch

    var = keras.Variable(np.ones((4,), "float32"))
    grad = torch.full((4,), 10.0, requires_grad=True) * 1.0
    var.value.grad = grad
    before = grad.detach().clone()
    with torch.no_grad():
        keras_ema_opt.SGD(0.1, clipvalue=0.5).apply([grad], [var])
    np.testing.assert_array_equal(grad.detach().numpy(), before.numpy())
    np.testing.assert_allclose(to_numpy(var), np.full((4,), 0.95), rtol=1e-6)


@only_on("torch")
@pytest.mark.parametrize("layout", ["same tensor", "views of one buffer",
                                    "broadcast"])
def test_torch_own_grads_that_cannot_be_written_are_clipped_anew(layout):
    """Own ``.grad`` tensors that share storage (one tensor, or views of
    one buffer, behind two variables: it would be scaled twice), or a
    broadcast one (stride 0: not writable element by element), are
    clipped into new tensors, as Keras clips, and left unchanged."""
    import torch

    a = keras.Variable(np.zeros((3,), "float32"))
    b = keras.Variable(np.zeros((3,), "float32"))
    if layout == "same tensor":
        a.value.grad = b.value.grad = torch.full((3,), 4.0)
    elif layout == "views of one buffer":
        buffer = torch.full((3,), 4.0)
        a.value.grad, b.value.grad = buffer, buffer[:]
    else:
        a.value.grad = torch.tensor([4.0]).expand(3)
        b.value.grad = torch.tensor([4.0]).expand(3)
    grads = [a.value.grad, b.value.grad]
    with torch.no_grad():
        keras_ema_opt.SGD(1.0, global_clipnorm=1.0).apply(grads, [a, b])
    for g in grads:
        np.testing.assert_array_equal(g.numpy(), np.full((3,), 4.0))
    expected = -np.full((3,), 1 / np.sqrt(6))
    np.testing.assert_allclose(to_numpy(a), expected, rtol=1e-6)
    np.testing.assert_allclose(to_numpy(b), expected, rtol=1e-6)


def _clipping_in_lockstep(monkeypatch, ours, theirs, scale, n_steps):
    """``n_steps`` steps of ``ours`` (on torch tensors) and ``theirs`` (a
    Keras optimizer) on the same random gradients (times ``scale``) of two
    variables, with the torch backend's clipping rules spied: the caller's
    gradients stay as they were and the weights equal theirs. Returns
    whether each clipping ran in place, the variables' initial values, the
    steps' gradients and ``ours``' variables."""
    import torch

    from keras_ema_opt.backend import torch as torch_backend

    monkeypatch.syspath_prepend(os.path.join(ROOT, "tests", "scripts"))
    import distributed_common

    calls = []
    monkeypatch.setattr(torch_backend, "_CLIP_RULES",
                        distributed_common.clipping_spies(calls))
    rng = np.random.default_rng(7)
    values = [rng.normal(size=s).astype("float32") for s in [(6, 4), (4,)]]
    steps = [[(rng.normal(size=v.shape) * scale).astype("float32")
              for v in values] for _ in range(n_steps)]
    ours_vars = [keras.Variable(v) for v in values]
    keras_vars = [keras.Variable(v) for v in values]
    for raw in steps:
        grads = [torch.tensor(g) for g in raw]
        with torch.no_grad():
            ours.apply(grads, ours_vars)
        theirs.apply([keras.ops.convert_to_tensor(g) for g in raw],
                     keras_vars)
        for g, before in zip(grads, raw):
            np.testing.assert_array_equal(g.numpy(), before)
    for a, b in zip(ours_vars, keras_vars):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6,
                                   atol=1e-8)
    return calls, values, steps, ours_vars


@only_on("torch")
@pytest.mark.parametrize("clip", _CLIPS)
def test_torch_clips_the_accumulated_average_in_place(clip, monkeypatch):
    """Under gradient accumulation the update step clips the average that
    Keras' step makes (``(g + acc) / steps``) in place: no caller holds
    it. The caller's gradients stay as they were, and the steps equal
    Keras' own optimizer's with the same accumulation and clipping."""
    calls, _, _, _ = _clipping_in_lockstep(
        monkeypatch,
        keras_ema_opt.SGD(0.1, gradient_accumulation_steps=2, **clip),
        keras.optimizers.SGD(0.1, gradient_accumulation_steps=2, **clip),
        scale=3, n_steps=4)
    assert calls == [True, True]  # the two update steps, in place


@only_on("torch")
@pytest.mark.parametrize("clip", _CLIPS)
def test_torch_clips_loss_scale_unscaled_gradients_in_place(clip,
                                                           monkeypatch):
    """Around ours, a ``LossScaleOptimizer`` divides the gradients it is
    handed by its scale and hands ours the quotients, new tensors that
    only its step holds: ours clips those in place. The caller's
    gradients stay as they were, and the steps equal those of Keras' own
    optimizer in a ``LossScaleOptimizer``. A gradient it passes on as
    received (a variable that ``overwrite_with_gradient``) is written to
    its variable before the clipping, and left as it was."""
    import torch

    ours = keras.optimizers.LossScaleOptimizer(
        keras_ema_opt.SGD(0.1, use_ema=True, **clip), initial_scale=8.0)
    calls, values, steps, variables = _clipping_in_lockstep(
        monkeypatch, ours, keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, use_ema=True, **clip),
            initial_scale=8.0),
        scale=300, n_steps=3)
    assert calls == [True] * 3
    # The quotients are noted only for the step of a loss scaler: ours
    # called directly afterwards clips the caller's gradients anew.
    calls.clear()
    grads = [torch.tensor(g) for g in steps[0]]
    with torch.no_grad():
        ours.inner_optimizer.apply(grads, variables)
    assert calls == [False]
    for g, before in zip(grads, steps[0]):
        np.testing.assert_array_equal(g.numpy(), before)
    # A gradient passed on as received: not clipped, not written.
    calls.clear()
    passed = keras.Variable(np.zeros((4,), "float32"))
    passed.overwrite_with_gradient = True
    ours = keras.optimizers.LossScaleOptimizer(
        keras_ema_opt.SGD(0.1, **clip), initial_scale=8.0)
    grads = [torch.tensor(g) for g in steps[0]] + [torch.ones(4)]
    with torch.no_grad():
        ours.apply(grads, [keras.Variable(v) for v in values] + [passed])
    assert calls == [True]
    for g, before in zip(grads, steps[0] + [np.ones(4, "float32")]):
        np.testing.assert_array_equal(g.numpy(), before)
    np.testing.assert_array_equal(to_numpy(passed), np.ones(4))


@only_on("torch")
@pytest.mark.parametrize("where", ["ours", "scaler"])
def test_torch_subclass_steps_keep_their_unscaled_gradients(where):
    """A subclass that may keep the gradients between the loss scaler and
    ours (its own ``apply``, as for logging their norm, or the scaler's
    step) has them left as they were: clipped into new tensors."""
    import torch

    kept = []

    class Logging(keras_ema_opt.SGD):
        def apply(self, grads, trainable_variables=None):
            kept.extend(grads)
            return super().apply(grads, trainable_variables)

    class Scaler(keras.optimizers.LossScaleOptimizer):
        def _stateful_handle_finite_grads(self, grads, trainable_variables):
            kept.extend(g / self.dynamic_scale for g in grads)
            self.inner_optimizer.apply(list(kept), trainable_variables)

    inner = (Logging if where == "ours" else keras_ema_opt.SGD)(
        0.1, global_clipnorm=1.0)
    scaler = (keras.optimizers.LossScaleOptimizer if where == "ours"
              else Scaler)(inner, initial_scale=8.0)
    variables = [keras.Variable(np.zeros((3,), "float32"))]
    with torch.no_grad():
        scaler.apply([torch.full((3,), 80.0)], variables)
    np.testing.assert_array_equal(kept[0].numpy(), np.full((3,), 10.0))
    np.testing.assert_allclose(to_numpy(variables[0]),
                               np.full((3,), -0.1 / np.sqrt(3)), rtol=1e-6)


@only_on("torch")
def test_torch_aggregation_replaced_on_the_instance_is_the_callers():
    """An ``aggregate_gradients`` set on the instance may return tensors
    its caller keeps: ``apply_gradients`` clips them into new tensors."""
    import torch

    opt = keras_ema_opt.SGD(0.1, global_clipnorm=1.0)
    kept = []

    def aggregate(pairs):
        kept.extend((g * 2.0, v) for g, v in pairs)
        return list(kept)

    opt.aggregate_gradients = aggregate
    w = keras.Variable(np.zeros((2,), "float32"))
    with torch.no_grad():
        opt.apply_gradients([(torch.full((2,), 5.0), w)])
    np.testing.assert_array_equal(kept[0][0].numpy(), np.full((2,), 10.0))


@only_on("torch")
def test_torch_a_step_that_raises_leaves_nothing_noted():
    """What a step noted it made is that step's only: a step that raises
    (here a variable the optimizer was not built for) leaves nothing for
    the next one."""
    import torch

    opt = keras_ema_opt.SGD(0.1, global_clipnorm=1.0)
    scaler = keras.optimizers.LossScaleOptimizer(opt, initial_scale=8.0)
    scaler.build([keras.Variable(np.zeros((2,), "float32"))])
    with pytest.raises(Exception):
        with torch.no_grad():
            scaler.apply([torch.ones(2)],
                         [keras.Variable(np.zeros((2,), "float32"))])
    assert "_keo_step_made" not in vars(opt)
    assert "_keo_loss_scale_inputs" not in vars(opt)
    assert vars(opt).get("_keo_clip_context") is None


@only_on("torch")
@pytest.mark.parametrize("jit_compile", [False, True])
def test_torch_fit_with_loss_scaling_and_clipping_trains_as_keras(
        jit_compile):
    """``fit()`` with a ``LossScaleOptimizer`` around ours and clipping
    trains as Keras' own optimizer does there, eagerly (where ours clips
    the unscaled gradients in place) and under ``torch.compile`` (where
    the clipping is Keras')."""
    ours = _fit_small(keras.optimizers.LossScaleOptimizer(
        keras_ema_opt.Adam(0.01, global_clipnorm=1.0)), jit_compile)
    theirs = _fit_small(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01, global_clipnorm=1.0)), jit_compile)
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _fit_small(optimizer, jit_compile=False):
    """A two-layer model trained by ``optimizer`` for one epoch of two
    batches whose loss is large (the clipping rules clip)."""
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32") * 50
    y = np.random.default_rng(1).normal(size=(16, 3)).astype("float32") * 50
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                              keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


@only_on("torch")
def test_torch_step_made_gradients_sharing_memory_are_not_written():
    """The rule that lets the clipping write a gradient Keras' step made:
    a fresh tensor may be written; an input, a view of an input's memory,
    or a view of a variable's (an accumulator's) may not."""
    import torch

    from keras_ema_opt.backend.torch import _writable_in_place

    given = torch.ones(6)
    accumulator = keras.Variable(np.zeros((6,), "float32"))

    def writable(grad):
        return _writable_in_place([grad], set(), [given],
                                  lambda: [accumulator])

    assert writable(given * 2)
    assert not writable(given)
    assert not writable(given.view(2, 3))
    assert not writable(given[:3])
    assert not writable(accumulator.value.view(2, 3))
    # A mean the step made (owned), as disjoint views of one buffer: yes;
    # two views overlapping: no.
    flat = torch.ones(6)
    head, tail, overlap = flat[:3], flat[3:], flat[2:5]
    assert _writable_in_place([head, tail], {id(head), id(tail)}, [], list)
    assert not _writable_in_place([head, overlap], {id(head), id(overlap)},
                                  [], list)


@only_on("torch")
@pytest.mark.parametrize("accumulate", [None, 2])
def test_torch_fit_clips_in_place_and_trains_as_keras(accumulate):
    """In ``fit()`` the clipped gradients are the ``.grad`` tensors
    themselves (their global norm is the threshold after the step; Keras'
    own optimizer leaves them unclipped), and the weights equal those of
    Keras' optimizer with the same clipping. Under gradient accumulation
    the step clips new tensors and ``.grad`` keeps its raw values."""
    import torch

    def fit(optimizer):
        model = _fit_small(optimizer)
        grads = [v.value.grad for v in model.trainable_weights]
        norm = float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        return model, norm

    kwargs = dict(global_clipnorm=1.0,
                  gradient_accumulation_steps=accumulate)
    ours, ours_norm = fit(keras_ema_opt.Adam(0.01, **kwargs))
    theirs, their_norm = fit(keras.optimizers.Adam(0.01, **kwargs))
    assert their_norm > 10.0  # the loss is large: the rule clips
    if accumulate:
        assert ours_norm == pytest.approx(their_norm, rel=1e-4)
    else:
        assert ours_norm == pytest.approx(1.0, rel=1e-5)
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@only_on("torch")
def test_torch_clipping_falls_back_for_mixed_dtypes(monkeypatch):
    """Gradients of two dtypes (or anything but dense float32/float64 of
    one device) take Keras' own clipping."""
    norms = _Calls(monkeypatch, "_foreach_norm")
    grads = [keras.ops.ones((3,), "float32"), keras.ops.ones((2,), "float64")]
    ours = keras_ema_opt.SGD(0.1, global_clipnorm=1.0)._clip_gradients(grads)
    expected = keras.optimizers.SGD(0.1, global_clipnorm=1.0)._clip_gradients(
        grads)
    assert norms.count == 0
    for a, b in zip(ours, expected):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-7)


# JAX and TensorFlow on a CPU: Keras' Adam with the averages folded in,
# one C++ kernel (keras_ema_opt/backend/adam_average.h; an XLA FFI target
# on JAX, a custom op on TensorFlow). Oracles: Keras' own Adam run op by
# op (in float32, as the kernel computes) and the averaging engine's own
# `keras.ops` update run op by op, both to the bit.

def _cpu_kernel():
    if BACKEND == "jax":
        from keras_ema_opt.backend import _jax_cpu as kernel
    else:
        from keras_ema_opt.backend import _tf_cpu as kernel
    return kernel


def _kernel_off(monkeypatch):
    monkeypatch.setattr(_cpu_kernel()._kernel, "ready", False)
    # TensorFlow's fused average kernel (`a - u (a - x)`, not from the
    # nearer end) is not the engine's rule where u >= 1/2.
    monkeypatch.setattr(keras_ema_opt.backend, "lerp_averages",
                        lambda pairs, weight, gated=False: pairs)


def _state_of(optimizer, variables):
    return [to_numpy(v) for v in variables] + [
        to_numpy(v) for v in computed(optimizer.variables)]


_KERNEL_CASES = [
    ("Adam", dict(learning_rate=0.05), None),
    ("Adam", dict(learning_rate=0.05), keras_ema_opt.EMA(0.9)),
    ("Adam", dict(learning_rate=0.05),
     keras_ema_opt.EMA(0.999, warmup="power")),
    ("Adam", dict(learning_rate=0.05), keras_ema_opt.SWA(start_step=2)),
    ("Adam", dict(learning_rate=0.05), keras_ema_opt.EMA(0.9, debias=True)),
    ("AdamW", dict(learning_rate=0.05, weight_decay=0.02),
     keras_ema_opt.PowerEMA()),
    ("AdamW", dict(learning_rate=0.05, weight_decay=0.02), None),
    ("Adam", dict(learning_rate=0.05, weight_decay=0.01),
     keras_ema_opt.EMA(0.9)),
    ("Adam", dict(learning_rate=0.05, gradient_accumulation_steps=2),
     keras_ema_opt.EMA(0.9)),
    ("AdamW", dict(learning_rate=0.05, weight_decay=0.02,
                   gradient_accumulation_steps=2), keras_ema_opt.EMA(0.9)),
]


@only_on("jax", "tensorflow")
def test_cpu_kernel_is_built_where_a_compiler_is():
    import shutil

    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler on this machine")
    ready, reason = _cpu_kernel().status()
    assert ready, reason


def _kernel_problem():
    """Three float32 tensors, one of 40,200 elements: the kernel's pieces
    of 16,384 (two whole, a tail) taken by more than one thread."""
    return _problem(("float32",) * 3, shapes=((4, 3), (5,), (200, 201)))


def _train_in_function(optimizer, weights, grads, jit_compile=False):
    """TensorFlow: each step in one ``tf.function`` (traced once)."""
    import tensorflow as tf

    variables = [keras.Variable(w) for w in weights]

    @tf.function(jit_compile=jit_compile)
    def step(given):
        optimizer.apply_gradients(zip(given, variables))

    for given in grads:
        step([tf.constant(g) for g in given])
    return variables


def _ready_kernel():
    kernel = _cpu_kernel()
    ready, reason = kernel.status()
    if not ready:
        pytest.skip(reason)
    return kernel


@only_on("jax", "tensorflow")
@pytest.mark.parametrize("name,kwargs,averaging", _KERNEL_CASES)
def test_cpu_kernel_equals_keras_and_the_engine_to_the_bit(
        monkeypatch, name, kwargs, averaging):
    kernel = _ready_kernel()
    weights, grads = _kernel_problem()

    def train(jit_compile):
        calls = _Calls(monkeypatch, "apply", kernel)
        opt = getattr(keras_ema_opt, name)(
            averaging=averaging, jit_compile=jit_compile, **kwargs)
        if jit_compile and BACKEND == "tensorflow":
            # No XLA on a CPU (Keras 2's rule): the step in a graph.
            variables = _train_in_function(opt, weights, grads)
        else:
            variables, _ = _train(opt, weights, grads)
        return _state_of(opt, variables), opt, calls.count

    fused_compiled, _, compiled_calls = train(True)
    fused_eager, opt, eager_calls = train(False)
    assert compiled_calls >= 1 and eager_calls >= len(grads) // max(
        1, kwargs.get("gradient_accumulation_steps") or 1)
    _kernel_off(monkeypatch)
    engine, _, _ = train(False)  # the rule op by op, no kernel
    # Keras' own JAX `apply_gradients` runs op by op.
    theirs = getattr(keras.optimizers, name)(**kwargs)
    keras_own, _ = _train(theirs, weights, grads)
    assert len(fused_eager) == len(fused_compiled) == len(engine)
    for a, b in zip(fused_eager, engine):
        np.testing.assert_array_equal(a, b)
    ours_slots = [opt._momentums, opt._velocities]
    their_slots = [theirs._momentums, theirs._velocities]
    for a, b in zip([*map(to_numpy, opt._trainable_variables)]
                    + [to_numpy(s) for slots in ours_slots for s in slots],
                    [*map(to_numpy, keras_own)]
                    + [to_numpy(s) for slots in their_slots for s in slots]):
        np.testing.assert_array_equal(a, b)
    # Compiled, the kernel computes the same (the weight decay in its
    # pass); what XLA computes around it (the debias state and its weight;
    # under accumulation the decay and the averages) it rounds otherwise
    # than op by op, to the last bit.
    plain = not kwargs.get("gradient_accumulation_steps") and not getattr(
        averaging, "debias", False)
    for a, b in zip(fused_compiled, fused_eager):
        if plain:
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@only_on("jax", "tensorflow")
@pytest.mark.parametrize("averaging", [None, keras_ema_opt.EMA(0.9),
                                       keras_ema_opt.PowerEMA()])
def test_fit_takes_the_cpu_kernel_and_trains_as_without(
        monkeypatch, averaging):
    kernel = _ready_kernel()
    calls = _Calls(monkeypatch, "apply", kernel)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")

    def fit():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                  keras.layers.Dense(1)])
        opt = keras_ema_opt.Adam(0.01, averaging=averaging)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return _state_of(opt, model.trainable_variables)

    fused = fit()
    assert calls.count > 0
    _kernel_off(monkeypatch)
    general = fit()
    # XLA's fused loops of the general step round differently from the
    # rule op by op (to the last bit or two); the kernel is the latter.
    for a, b in zip(fused, general):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


@only_on("jax", "tensorflow")
@pytest.mark.parametrize("compiled", [False, True])
def test_cpu_kernel_decays_the_weights_keras_decays(monkeypatch, compiled):
    """AdamW's decay in the kernel's pass, for the variables Keras decays
    (one excluded here): Keras' own AdamW op by op, to the bit; the
    decayed and the excluded variables in a kernel call each, and no
    decay of Keras' run besides."""
    kernel = _ready_kernel()
    weights, grads = _kernel_problem()
    calls = []
    real = kernel.apply

    def recorded(optimizer, scalars, members, averages, decay=False):
        calls.append((len(members), averages, decay))
        return real(optimizer, scalars, members, averages, decay)

    monkeypatch.setattr(kernel, "apply", recorded)
    decays = []  # Keras' own decay of a step, where it runs
    for cls in keras.optimizers.AdamW.__mro__:
        if "_apply_weight_decay" in vars(cls):
            def counted(self, variables,
                        original=vars(cls)["_apply_weight_decay"]):
                decays.append(len(variables))
                return original(self, variables)
            monkeypatch.setattr(cls, "_apply_weight_decay", counted)

    def train(opt, in_function=False):
        variables = [keras.Variable(w) for w in weights]
        opt.exclude_from_weight_decay(var_list=[variables[1]])

        def step(given):
            opt.apply_gradients(zip(given, variables))
        if in_function:
            import tensorflow as tf

            step = tf.function(step)
        for given in grads:
            step([keras.ops.convert_to_tensor(g) for g in given])
        return [to_numpy(v) for v in variables]

    ours = train(keras_ema_opt.AdamW(
        learning_rate=0.05, weight_decay=0.02, jit_compile=compiled,
        averaging=keras_ema_opt.EMA(0.9)),
        in_function=compiled and BACKEND == "tensorflow")
    assert calls and all(averages == 1 for _, averages, _ in calls)
    assert {(n, decay) for n, _, decay in calls} == {(2, True), (1, False)}
    assert not decays  # Keras' own decay never ran
    # Keras' own op by op (in a TensorFlow graph, Grappler rewrites its
    # arithmetic: a last bit otherwise).
    theirs = train(keras.optimizers.AdamW(learning_rate=0.05,
                                          weight_decay=0.02))
    assert decays
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)


class _OwnRuleAdam(keras_ema_opt.Adam):
    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, 100.0 * gradient)


@only_on("jax", "tensorflow")
@pytest.mark.parametrize("case", ["amsgrad", "float16", "listed twice",
                                  "own rule", "bfloat16 gradients",
                                  "numpy betas"])
def test_cpu_kernel_leaves_what_it_cannot_take_to_keras(monkeypatch,
                                                           case):
    kernel = _ready_kernel()
    calls = _Calls(monkeypatch, "apply", kernel)
    # With a weight decay: Keras' own step, where it runs, decays first.
    kwargs = dict(learning_rate=0.05, weight_decay=0.01)
    dtypes = ("float32",) * 3
    cls, keras_cls = keras_ema_opt.Adam, keras.optimizers.Adam
    if case == "amsgrad":
        kwargs["amsgrad"] = True
    if case == "float16":
        dtypes = ("float32", "float16", "float32")
    if case == "own rule":
        cls = _OwnRuleAdam
        kwargs.pop("weight_decay")
    if case == "numpy betas":
        kwargs.update(beta_1=np.float32(0.9), beta_2=np.float32(0.99))
    weights, grads = _problem(dtypes)

    def train(opt):
        variables = [keras.Variable(w, dtype=w.dtype) for w in weights]
        for step in grads:
            given = [keras.ops.convert_to_tensor(
                g, "bfloat16" if case.startswith("bfloat16") else None)
                for g in step]
            pairs = list(zip(given, variables))
            if case == "listed twice":
                pairs.append((given[0] * 0.5, variables[0]))
            opt.apply_gradients(pairs)
        return [to_numpy(v) for v in variables]

    ours = train(cls(averaging=keras_ema_opt.EMA(0.9), **kwargs))
    assert calls.count == 0
    if case == "own rule":  # w - 100 g at each step
        expected = weights[0] - 100.0 * sum(g[0] for g in grads)
        np.testing.assert_allclose(ours[0], expected, rtol=1e-5)
        return
    theirs = train(keras_cls(**kwargs))
    for a, b in zip(ours, theirs):  # ours compiled, Keras' op by op
        tolerance = 4 * float(np.finfo(b.dtype).eps)  # a rounding or two
        np.testing.assert_allclose(a.astype(np.float64), b, rtol=tolerance,
                                   atol=tolerance)


@only_on("tensorflow")
@pytest.mark.parametrize("around", ["function", "cond", "inner_function"])
def test_tf_cpu_kernel_is_ordered_with_the_reads_of_its_function(
        monkeypatch, around):
    """In a function (the step inside a ``tf.cond``, or a function of its
    own called by it, too), automatic control dependencies order the op
    after the function's reads of a weight, a moment and an average before
    the step, and before its reads of them after it: the values of the
    same reads eagerly. The op takes the moments' and averages' handles
    packed in one tensor, which hides them from automatic control
    dependencies; ``_tf_cpu._order_around_packs`` names them (without it
    every case here reads stale or updated values)."""
    import tensorflow as tf

    kernel = _ready_kernel()
    calls = _Calls(monkeypatch, "apply", kernel)
    weights, grads = _kernel_problem()

    def run(in_function):
        variables = [keras.Variable(w) for w in weights]
        opt = keras_ema_opt.Adam(0.05, averaging=keras_ema_opt.EMA(0.9),
                                 jit_compile=False)
        opt.build(variables)
        average = opt._averager.slots_of(opt, variables[2])[0]
        watched = (variables[2], opt._momentums[2], average)

        def update(given):
            opt.apply_gradients(zip(given, variables))
            return tf.constant(True)
        if in_function and around == "inner_function":
            update = tf.function(update)

        def step(given):
            before = [v.value * 1.0 for v in watched]
            if in_function and around == "cond":
                tf.cond(tf.constant(True), lambda: update(given),
                        lambda: tf.constant(False))
            else:
                update(given)
            return before + [v.value * 1.0 for v in watched]
        if in_function:
            step = tf.function(step)
        return [to_numpy(t) for given in grads
                for t in step([tf.constant(g) for g in given])]

    eager = run(False)
    eager_calls = calls.count
    in_function = run(True)
    assert eager_calls == len(grads) and calls.count > eager_calls
    for a, b in zip(in_function, eager):
        np.testing.assert_array_equal(a, b)


@only_on("tensorflow")
def test_tf_cpu_kernel_keeps_its_order_with_more_packs_than_kept():
    """A trace whose steps use more packs than an optimizer keeps (one
    step a variable here): the packs the optimizer let go live on with
    the graph that took them, so automatic control dependencies, which run
    when the trace ends, still order every read of the first variable's
    moment and average with the op that updates them (before or after it,
    never unordered: a lost update), and the values equal eager's."""
    import tensorflow as tf
    from keras_ema_opt.backend import _tf_cpu

    _ready_kernel()
    count = _tf_cpu._MAX_PACKS + 2
    rng = np.random.default_rng(0)
    shapes = [(300, 301)] + [(8,)] * (count - 1)
    weights = [rng.normal(size=s).astype("float32") for s in shapes]
    grads = [[rng.normal(size=s).astype("float32") for s in shapes]
             for _ in range(3)]

    def run(in_function):
        variables = [keras.Variable(w) for w in weights]
        opt = keras_ema_opt.Adam(0.05, averaging=keras_ema_opt.EMA(0.9),
                                 jit_compile=False)
        opt.build(variables)
        watched = (opt._momentums[0],
                   opt._averager.slots_of(opt, variables[0])[0])

        def step(given):
            before = [v.value * 1.0 for v in watched]
            for grad, variable in zip(given, variables):
                opt.apply_gradients([(grad, variable)])
            return before + [v.value * 1.0 for v in watched]
        if in_function:
            step = tf.function(step)
        out = [to_numpy(t) for given in grads
               for t in step([tf.constant(g) for g in given])]
        return out, step, variables, watched

    eager, *_ = run(False)
    in_function, step, variables, watched = run(True)
    for a, b in zip(in_function, eager):
        np.testing.assert_array_equal(a, b)

    graph = step.get_concrete_function(
        [tf.constant(g) for g in grads[0]]).graph

    def captured(variable):
        return graph._function_captures.by_val_internal[
            id(_tf_cpu.tf_variable(variable).handle)]

    def ancestors(op):
        seen, stack = set(), [op]
        while stack:
            o = stack.pop()
            for parent in [*o.control_inputs, *(t.op for t in o.inputs)]:
                if parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        return seen

    first = [o for o in graph.get_operations()
             if o.type == "KerasEmaOptAdamAverage"
             and o.inputs[0] is captured(variables[0])]
    assert len(first) == 1
    reads = [c for v in watched for c in captured(v).consumers()
             if c.type == "ReadVariableOp"]
    assert len(reads) >= 4
    for read in reads:
        assert (first[0] in ancestors(read)
                or read in ancestors(first[0])), read.name


@only_on("tensorflow")
def test_tf_cpu_kernel_packs_the_slots_once():
    """The slots' handles are packed once an optimizer and group, eagerly,
    and reused by every step after (eager or traced); an optimizer keeps
    its latest few packs only, and a pack dies with its optimizer."""
    import gc
    import weakref

    import tensorflow as tf
    from keras_ema_opt.backend import _tf_cpu

    _ready_kernel()
    weights, grads = _kernel_problem()
    variables = [keras.Variable(w) for w in weights]
    opt = keras_ema_opt.Adam(0.05, averaging=keras_ema_opt.EMA(0.9))
    opt.apply_gradients(zip([tf.constant(g) for g in grads[0]], variables))
    packs = opt.__dict__[_tf_cpu._PACKS_ATTR]
    assert len(packs) == 1
    (pack,) = packs.values()
    assert pack.packed.dtype == tf.resource
    assert pack.packed.shape == (len(weights) * 3,)  # m, v, the average
    first = pack.packed

    @tf.function
    def step(given):
        opt.apply_gradients(zip(given, variables))
    step([tf.constant(g) for g in grads[1]])
    opt.apply_gradients(zip([tf.constant(g) for g in grads[2]], variables))
    assert list(packs.values()) == [pack] and pack.packed is first

    others = [[tf.Variable(tf.zeros(2)) for _ in range(2)]
              for _ in range(_tf_cpu._MAX_PACKS + 3)]
    for group in others:
        _tf_cpu._packed(opt, group)
    assert len(packs) == _tf_cpu._MAX_PACKS
    assert pack not in packs.values()  # the least recently used went
    assert _tf_cpu._packed(opt, others[-1]) is packs[
        tuple(map(id, others[-1]))].packed

    def used_once():
        # A frame of its own: TensorFlow's tracing of ``step`` keeps this
        # test's locals.
        eager_only = keras_ema_opt.Adam(0.05,
                                        averaging=keras_ema_opt.EMA(0.9))
        eager_only.apply_gradients(zip([tf.constant(g) for g in grads[0]],
                                       variables))
        (pack,) = eager_only.__dict__[_tf_cpu._PACKS_ATTR].values()
        assert pack in _tf_cpu._LIVE_PACKS
        return weakref.ref(pack)
    dies = used_once()
    gc.collect()
    assert dies() is None


@only_on("tensorflow")
def test_tf_cpu_kernel_stays_out_of_xla_and_sparse_gradients(monkeypatch):
    """The op has no XLA kernel and takes dense gradients: a step XLA
    compiles, and one with an ``IndexedSlices`` gradient, run Keras' own
    step, and the averages as before."""
    import tensorflow as tf

    kernel = _ready_kernel()
    calls = _Calls(monkeypatch, "apply", kernel)
    weights, grads = _kernel_problem()
    averaging = keras_ema_opt.EMA(0.9)
    ours = _train_in_function(keras_ema_opt.Adam(0.05, averaging=averaging),
                              weights, grads, jit_compile=True)
    assert calls.count == 0
    theirs, _ = _train(keras.optimizers.Adam(0.05), weights, grads)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6,
                                   atol=1e-6)
    opt = keras_ema_opt.Adam(0.05, averaging=averaging)
    variable = keras.Variable(weights[0])
    sparse = tf.IndexedSlices(tf.constant(grads[0][0][:2]),
                              tf.constant([0, 1]), tf.constant([4, 3]))
    opt.apply_gradients([(sparse, variable)])
    assert calls.count == 0
    assert not np.array_equal(to_numpy(variable)[:2], weights[0][:2])
    np.testing.assert_array_equal(to_numpy(variable)[2:], weights[0][2:])


@only_on("jax")
def test_jax_cpu_kernel_steps_an_ensemble_and_is_differentiable(
        monkeypatch):
    """Under ``jax.vmap`` (one optimizer state per member) and through
    ``jax.grad`` (a loss after the step), as Keras' own step."""
    import jax

    _ready_kernel()
    weights, grads = _problem(("float32",) * 3)

    def results():
        opt = keras_ema_opt.Adam(0.05, averaging=keras_ema_opt.EMA(0.9))
        variables = [keras.Variable(w) for w in weights]
        opt.build(variables)
        opt_values = [v.value for v in opt.variables]
        values = [v.value for v in variables]

        def step(g, w):
            new_w, new_opt = opt.stateless_apply(opt_values, g, w)
            return new_w, new_opt

        members = [np.stack([g, 2 * g]) for g in grads[0]]
        stacked = [np.stack([w, w]) for w in values]
        ensemble = jax.vmap(step)(members, stacked)

        def loss(g):
            new_w, _ = step(g, values)
            return sum(jax.numpy.sum(w * w) for w in new_w)

        gradient = jax.grad(loss)(list(grads[0]))
        return jax.tree_util.tree_leaves((ensemble, gradient))

    calls = _Calls(monkeypatch, "adam_average", _cpu_kernel())
    fused = results()
    assert calls.count >= 2
    _kernel_off(monkeypatch)
    general = results()
    assert len(fused) == len(general)
    for a, b in zip(fused, general):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                   atol=1e-6)


_FAKE_COMPILER = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fake 1.0"; exit 0; fi
while [ "$#" -gt 0 ]; do
  if [ "$1" = "-o" ]; then echo partial > "$2"; fi
  shift
done
echo "fake: cannot compile" >&2
exit 1
"""

_PREFIX = {"jax": "jax", "tensorflow": "tf"}.get(BACKEND, "")
_STATUS = ("import numpy as np, keras, keras_ema_opt as k, json\n"
           f"from keras_ema_opt.backend import _{_PREFIX}_cpu as kernel\n"
           "v = keras.Variable(np.ones(3, 'float32'))\n"
           "k.Adam(0.1, averaging=k.EMA(0.5)).apply_gradients("
           "[(np.ones(3, 'float32'), v)])\n"
           "print(json.dumps([*kernel.status(), float(v.numpy()[0])]))\n")


def _compiler_script(path, text):
    """An executable shell script at ``path`` standing for the compiler."""
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def _kernel_status(cache, **env):
    """(ready, reason, weight after one step) in a fresh process whose
    kernels are kept in ``cache``."""
    from conftest import last_json
    from conftest import run_python

    return last_json(run_python("-c", _STATUS, backend=BACKEND,
                                KERAS_EMA_OPT_CACHE=str(cache), **env))


@only_on("jax", "tensorflow")
def test_cpu_kernel_build_failure_falls_back_and_leaves_no_file(
        tmp_path):
    fake = _compiler_script(tmp_path / "fake-c++", _FAKE_COMPILER)
    cache = tmp_path / "cache"
    ready, reason, value = _kernel_status(cache, CXX=fake)
    assert not ready and "fake: cannot compile" in reason
    assert value == pytest.approx(0.9, rel=1e-5)  # Keras' own step ran
    assert list(cache.iterdir()) == []  # no partial library kept
    ready, reason, value = _kernel_status(cache,
                                          KERAS_EMA_OPT_CPU_KERNELS="0")
    assert (ready, reason) == (False, "KERAS_EMA_OPT_CPU_KERNELS=0")
    assert value == pytest.approx(0.9, rel=1e-5)


@only_on("jax", "tensorflow")
def test_cpu_kernel_is_built_once_into_its_cache(tmp_path):
    import shutil

    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler on this machine")
    cache = tmp_path / "cache"
    for _ in range(2):
        ready, reason, value = _kernel_status(cache)
        assert ready, reason
        assert value == pytest.approx(0.9, rel=1e-5)
        built = sorted(p.name for p in cache.iterdir())
        assert len(built) == 1
        assert built[0].startswith(f"{_PREFIX}_adam_average-")
        if _ == 0:
            stamp = (cache / built[0]).stat().st_mtime_ns
    assert (cache / built[0]).stat().st_mtime_ns == stamp  # reused
    # Cut short (a disk that filled, a copy interrupted): mapping it would
    # kill the process with SIGBUS; it is built again instead.
    from keras_ema_opt.backend import _native

    library = cache / built[0]
    whole = library.read_bytes()
    assert _native.whole_elf(library)
    library.write_bytes(whole[:5000])
    assert not _native.whole_elf(library)
    ready, reason, value = _kernel_status(cache)
    assert ready, reason
    assert value == pytest.approx(0.9, rel=1e-5)
    assert sorted(p.name for p in cache.iterdir()) == built
    assert _native.whole_elf(library)


def test_whole_elf_is_false_for_any_file_cut_short_or_not_elf(tmp_path):
    # Never an exception (a cached library it raised on was never rebuilt):
    # every length of a real ELF file's first bytes, a header whose
    # program-header size is too small, and other files.
    import shutil

    from keras_ema_opt.backend import _native

    real = open(shutil.which("true"), "rb").read()
    path = tmp_path / "lib.so"
    assert _native.whole_elf(shutil.which("true"))
    for n in [*range(0, 130), len(real) // 2, len(real) - 1]:
        path.write_bytes(real[:n])
        assert _native.whole_elf(path) is False, n
    wide = real[4] == 2
    broken = bytearray(real)
    broken[0x36 if wide else 0x2A] = broken[(0x36 if wide else 0x2A) + 1] = 0
    path.write_bytes(bytes(broken))
    assert _native.whole_elf(path) is False
    path.write_bytes(b"#!/bin/sh\n")
    assert _native.whole_elf(path) is False
    assert _native.whole_elf(tmp_path / "missing.so") is False


_COPYING_COMPILER = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "copying 1.0"; exit 0; fi
while [ "$#" -gt 0 ]; do
  if [ "$1" = "-o" ]; then
    cp "$(which true)" "$2"; echo built >> "$(dirname "$0")/builds.log"
  fi
  shift
done
"""


@only_on("jax", "tensorflow")
def test_cpu_kernel_built_but_not_loadable_is_not_built_in_every_process(
        tmp_path):
    # A whole library that does not load where it was built (here an
    # executable; a cache mounted noexec): Keras' own step runs, and later
    # processes try the file without compiling it again.
    fake = _compiler_script(tmp_path / "copying-c++", _COPYING_COMPILER)
    cache = tmp_path / "cache"
    for _ in range(2):
        ready, reason, value = _kernel_status(cache, CXX=fake)
        assert not ready
        assert "set KERAS_EMA_OPT_CACHE to another folder" in reason
        assert value == pytest.approx(0.9, rel=1e-5)  # Keras' own step
        assert (tmp_path / "builds.log").read_text() == "built\n"
    assert len(list(cache.glob("*.so.unloadable"))) == 1


_TWO_CPUS = """
import json
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, keras_ema_opt
from keras_ema_opt.backend import _tf_cpu
init = np.arange(6, dtype="float32").reshape(2, 3)
out = {}
for name, make in [("keras", lambda: keras.optimizers.Adam(0.1)),
                   ("ours", lambda: keras_ema_opt.Adam(
                       0.1, averaging=keras_ema_opt.EMA(0.9)))]:
    with tf.device("/CPU:1"):
        v1 = keras.Variable(init)
    v0 = keras.Variable(init + 1)
    opt, seen = make(), []
    for step in range(3):
        opt.apply_gradients([(tf.fill((2, 3), 1.0 + step), v1),
                             (tf.fill((2, 3), 2.0 - step), v0)])
        seen.append([v1.numpy().tolist(), v0.numpy().tolist()])
    out[name] = seen
    if name == "ours":
        out["averages"] = [opt.average_of(v).numpy().tolist()
                           for v in (v1, v0)]
print(json.dumps(out))
"""


@only_on("tensorflow")
def test_tf_variables_on_two_cpu_devices_fall_back_to_keras_step():
    # One op cannot take handles on two (logical) CPU devices: Keras' own
    # step runs there (the op raised), the same rule; the averages follow
    # the weights by the EMA's float64 formula, from the initial weights.
    from conftest import last_json
    from conftest import run_python

    got = last_json(run_python("-c", _TWO_CPUS, backend=BACKEND))
    np.testing.assert_allclose(got["ours"], got["keras"], rtol=1e-6)
    init = np.arange(6, dtype="float64").reshape(2, 3)
    want = [init, init + 1]
    for step in got["ours"]:
        want = [0.9 * a + 0.1 * np.asarray(w, "float64")
                for a, w in zip(want, step)]
    for a, b in zip(got["averages"], want):
        np.testing.assert_allclose(a, b, rtol=1e-6)
