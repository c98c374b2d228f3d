"""`keras_ema_opt.update_bn`: BatchNorm statistics recomputed for the
weights in the model (SWA's step 3, Izmailov et al. 2018).

Oracles: a float64 numpy forward pass of the model in training mode (each
BatchNormalization normalizing by its batch's mean and biased variance),
whose batch statistics are averaged weighted by batch size; and
`torch.optim.swa_utils.update_bn` run side by side on a torch copy of the
model (its running variance is unbiased: ours times n / (n - 1))."""

import keras
import numpy as np
import pytest

import keras_ema_opt
from keras_ema_opt.errors import InvalidArgumentError
from conftest import to_numpy

EPS = 1e-3


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(5),
        keras.layers.BatchNormalization(momentum=0.9),
        keras.layers.ReLU(),
        keras.layers.Dense(4),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(1),
    ])
    rng = np.random.RandomState(seed)
    for v in model.variables:
        shape = tuple(v.shape)
        if "moving_variance" in v.path:
            v.assign(rng.uniform(0.5, 2.0, shape).astype("float32"))
        else:
            v.assign(rng.randn(*shape).astype("float32"))
    return model


def _x(n=70, seed=1):
    return np.random.RandomState(seed).randn(n, 3).astype("float32") * 2 + 1


def _reference(model, x, batch_size):
    """Float64 forward in training mode; batch statistics averaged."""
    w = [to_numpy(v).astype("float64") for v in model.weights]
    k1, b1, g1, be1, _, _, k2, b2, g2, be2, _, _ = w[:12]
    sums = [0.0, 0.0, 0.0, 0.0]
    for start in range(0, len(x), batch_size):
        batch = x[start:start + batch_size].astype("float64")
        h = batch @ k1 + b1
        m1, v1 = h.mean(0), h.var(0)
        h = np.maximum((h - m1) / np.sqrt(v1 + EPS) * g1 + be1, 0)
        h = h @ k2 + b2
        m2, v2 = h.mean(0), h.var(0)
        for i, s in enumerate((m1, v1, m2, v2)):
            sums[i] = sums[i] + len(batch) * s
    return [s / len(x) for s in sums]


def _statistics(model):
    return [to_numpy(v).astype("float64")
            for layer in model.layers
            if isinstance(layer, keras.layers.BatchNormalization)
            for v in (layer.moving_mean, layer.moving_variance)]


def _snapshot(model):
    return [to_numpy(v).copy() for v in model.variables]


def test_update_bn_equals_float64_reference():
    model, x = _mlp(), _x()
    weights = [to_numpy(v).copy() for v in model.trainable_variables]
    expected = _reference(model, x, 16)
    seen = keras_ema_opt.update_bn(model, x, batch_size=16)
    assert seen == 70  # 4 batches of 16 and one of 6, weighted by size
    for got, want in zip(_statistics(model), expected):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    for v, before in zip(model.trainable_variables, weights):
        np.testing.assert_array_equal(to_numpy(v), before)
    assert [model.layers[i].momentum for i in (1, 4)] == [0.9, 0.5]


def test_update_bn_equals_torch_swa_utils_update_bn():
    torch = pytest.importorskip("torch")
    from torch.optim import swa_utils

    model, x = _mlp(), _x(64)
    w = [to_numpy(v) for v in model.weights]
    tmodel = torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5, eps=EPS),
        torch.nn.ReLU(),
        torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4, eps=EPS),
        torch.nn.Linear(4, 1),
    ).double()
    linears = [tmodel[0], tmodel[3], tmodel[5]]
    norms = [tmodel[1], tmodel[4]]
    with torch.no_grad():
        for layer, (k, b) in zip(linears, (w[0:2], w[6:8], w[12:14])):
            layer.weight.copy_(torch.tensor(k.T.astype("float64")))
            layer.bias.copy_(torch.tensor(b.astype("float64")))
        for layer, (g, be) in zip(norms, (w[2:4], w[8:10])):
            layer.weight.copy_(torch.tensor(g.astype("float64")))
            layer.bias.copy_(torch.tensor(be.astype("float64")))
    dataset = torch.utils.data.TensorDataset(torch.tensor(x))
    loader = torch.utils.data.DataLoader(dataset, batch_size=16)
    swa_utils.update_bn(
        torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.tensor(x, dtype=torch.float64)),
            batch_size=16),
        tmodel)
    # A loader of (x,) tuples, and one over the tensor itself, whose
    # batches are bare tensors (Keras' own numpy iterator split each into
    # its rows).
    bare = torch.utils.data.DataLoader(torch.tensor(x), batch_size=16)
    for given in (loader, bare):
        assert keras_ema_opt.update_bn(model, given) == 64
        got = _statistics(model)
        for i, layer in enumerate(norms):
            np.testing.assert_allclose(
                got[2 * i], layer.running_mean.numpy(), rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(
                got[2 * i + 1], layer.running_var.numpy() * 15 / 16,
                rtol=2e-5, atol=1e-6)


def _forms(x):
    import tensorflow as tf

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            part = x[16 * i:16 * (i + 1)]
            return part, part[:, :1]

    def generator():
        while True:
            for start in range(0, len(x), 16):
                yield (x[start:start + 16],)

    return {
        "tf.data (x, y)": dict(x=tf.data.Dataset.from_tensor_slices(
            (x, x[:, :1])).batch(16)),
        "PyDataset": dict(x=Batches()),
        "endless generator, steps": dict(x=generator(), steps=5),
        "arrays, steps": dict(x=x, batch_size=16, steps=3),
    }


@pytest.mark.parametrize(
    "form", ["tf.data (x, y)", "PyDataset", "endless generator, steps",
             "arrays, steps"])
def test_update_bn_takes_what_fit_takes(form):
    model, x = _mlp(), _x()
    n = 48 if form == "arrays, steps" else 70
    expected = _reference(model, x[:n], 16)
    assert keras_ema_opt.update_bn(model, **_forms(x)[form]) == n
    for got, want in zip(_statistics(model), expected):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_update_bn_of_a_nested_convolutional_model():
    keras.utils.set_random_seed(3)
    inner = keras.Sequential([
        keras.layers.Conv2D(3, 3),
        keras.layers.BatchNormalization(),
    ], name="inner")
    inputs = keras.Input((6, 6, 2))
    outputs = keras.layers.Dense(1)(
        keras.layers.Flatten()(inner(inputs)))
    model = keras.Model(inputs, outputs)
    x = np.random.RandomState(4).randn(20, 6, 6, 2).astype("float32")
    conv = keras.Model(inner.inputs[0], inner.layers[0].output)
    expected = [0.0, 0.0]
    for start in range(0, 20, 8):
        h = to_numpy(conv(x[start:start + 8])).astype("float64")
        expected[0] = expected[0] + len(h) * h.mean((0, 1, 2))
        expected[1] = expected[1] + len(h) * h.var((0, 1, 2))
    keras_ema_opt.update_bn(model, x, batch_size=8)
    bn = inner.layers[1]
    np.testing.assert_allclose(
        to_numpy(bn.moving_mean), expected[0] / 20, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(
        to_numpy(bn.moving_variance), expected[1] / 20, rtol=2e-5, atol=1e-6)


def test_update_bn_changes_nothing_else():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4)(inputs)
    h = keras.layers.BatchNormalization(name="frozen")(h)
    h = keras.layers.Dropout(0.5)(h)
    h = keras.layers.Dense(4)(h)
    h = keras.layers.BatchNormalization(renorm=True, name="renorm")(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    x = _x(32)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, x[:, :1], batch_size=8, verbose=0)
    model.get_layer("frozen").trainable = False
    renorm = model.get_layer("renorm")
    recomputed = {id(v) for v in (renorm.moving_mean, renorm.moving_variance,
                                  renorm.moving_stddev)}
    before = {v.path: to_numpy(v).copy() for v in model.variables
              if id(v) not in recomputed}
    with pytest.warns(UserWarning, match=r"trainable=False.*\['frozen'\]"):
        keras_ema_opt.update_bn(model, x, batch_size=8)
    for v in model.variables:
        if id(v) not in recomputed:  # dropout's seed, renorm's own, frozen
            np.testing.assert_array_equal(to_numpy(v), before[v.path], v.path)
    np.testing.assert_allclose(
        to_numpy(renorm.moving_stddev) ** 2,
        to_numpy(renorm.moving_variance) + renorm.epsilon, rtol=1e-5)
    assert model.get_layer("frozen").momentum == 0.99


def test_update_bn_restores_the_statistics_when_the_data_fails():
    model, x = _mlp(), _x()
    before = _snapshot(model)

    def failing():
        yield (x[:16],)
        yield (x[16:32],)
        raise RuntimeError("the third batch could not be read")

    with pytest.raises(RuntimeError, match="third batch"):
        keras_ema_opt.update_bn(model, failing())
    for v, value in zip(model.variables, before):
        np.testing.assert_array_equal(to_numpy(v), value)
    assert [model.layers[i].momentum for i in (1, 4)] == [0.9, 0.5]


def test_update_bn_without_batch_norm_reads_no_data():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])

    def unread():
        raise AssertionError("read")
        yield

    assert keras_ema_opt.update_bn(model, unread()) == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=0), r"`steps` must be a positive integer or None\. "
                    r"Received: steps=0\."),
    (dict(steps=2.0), r"`steps` must be .* Received: steps=2\.0 "
                      r"\(of type float\)"),
    (dict(batch_size="16"), r"`batch_size` must be .* "
                            r"Received: batch_size='16' \(of type str\)"),
    (dict(batch_size=True), r"`batch_size` must be .* "
                            r"Received: batch_size=True \(of type bool\)"),
    (dict(all_processes=1), r"`all_processes` must be True or False\. "
                            r"Received: all_processes=1"),
])
def test_update_bn_refuses_bad_counts(kwargs, message):
    model, x = _mlp(), _x()
    before = _snapshot(model)
    with pytest.raises(InvalidArgumentError, match=message):
        keras_ema_opt.update_bn(model, x, **kwargs)
    for v, value in zip(model.variables, before):
        np.testing.assert_array_equal(to_numpy(v), value)


def test_update_bn_inside_swap_average():
    model, x = _mlp(), _x(64)
    y = x.sum(axis=1, keepdims=True)
    optimizer = keras_ema_opt.SGD(0.05, averaging=keras_ema_opt.SWA(
        start_step=2, include_non_trainable=True, finalize=False))
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    raw = _snapshot(model)
    with optimizer.swap_average(model):
        expected = _reference(model, x, 16)
        keras_ema_opt.update_bn(model, x, batch_size=16)
        for got, want in zip(_statistics(model), expected):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    for v, value in zip(model.variables, raw):
        np.testing.assert_array_equal(to_numpy(v), value)


def test_update_bn_refuses_data_without_samples():
    import tensorflow as tf

    model = _mlp()
    before = _snapshot(model)
    empty = tf.data.Dataset.from_tensor_slices(_x()[:0]).batch(16)
    with pytest.raises(InvalidArgumentError, match=(
            r"update_bn: the data gave no samples\. Received: x of type "
            r"\w*Dataset\w*\. Pass the training inputs")):
        keras_ema_opt.update_bn(model, empty)
    for v, value in zip(model.variables, before):
        np.testing.assert_array_equal(to_numpy(v), value)


def test_update_bn_refuses_no_inputs():
    """Keras' data adapter failed on None with a bare KeyError."""
    model = _mlp()
    with pytest.raises(InvalidArgumentError, match=(
            r"update_bn: `x` must be the inputs.*Received: x=None")):
        keras_ema_opt.update_bn(model, None)


@pytest.mark.parametrize("model", [None, "model", np.ones((2, 3))])
def test_update_bn_refuses_what_is_not_a_model(model):
    with pytest.raises(InvalidArgumentError, match=r"(?s)`model` must be a "
                       r"Keras model .*Received: .* of type"):
        keras_ema_opt.update_bn(model, _x(8))


def test_update_bn_refuses_a_model_not_built():
    model = keras.Sequential([keras.layers.Dense(2),
                              keras.layers.BatchNormalization(name="bn")])
    with pytest.raises(InvalidArgumentError, match=(
            r"update_bn: the model's BatchNormalization layers \['bn'\] are "
            r"not built, so they have no statistics yet\. Build the model")):
        keras_ema_opt.update_bn(model, _x())


def test_update_bn_averages_every_call_of_a_layer_in_a_pass():
    # TimeDistributed runs its BatchNormalization once a timestep; a layer
    # shared by two branches runs twice. Each call's statistics count.
    x = np.random.RandomState(0).randn(24, 5, 3).astype("float32")
    x += np.arange(5, dtype="float32")[None, :, None]  # timestep t: mean t
    keras.utils.set_random_seed(0)
    per_step = keras.layers.TimeDistributed(keras.layers.BatchNormalization())
    inputs = keras.Input((5, 3))
    shared = keras.layers.BatchNormalization()
    first = keras.layers.Flatten()(inputs)
    outputs = keras.layers.Concatenate()([
        keras.layers.Flatten()(per_step(inputs)), shared(first),
        shared(keras.layers.Rescaling(2.0)(first))])
    model = keras.Model(inputs, outputs)
    keras_ema_opt.update_bn(model, x, batch_size=8)
    batches = [x[i:i + 8].astype("float64") for i in range(0, 24, 8)]
    np.testing.assert_allclose(  # the mean over timesteps and batches
        to_numpy(per_step.layer.moving_mean),
        np.mean([b[:, t].mean(0) for b in batches for t in range(5)], 0),
        rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        to_numpy(per_step.layer.moving_variance),
        np.mean([b[:, t].var(0) for b in batches for t in range(5)], 0),
        rtol=1e-5, atol=1e-6)
    flat = [b.reshape(len(b), -1) for b in batches]
    np.testing.assert_allclose(  # x and 2x: 1.5 times x's mean
        to_numpy(shared.moving_mean),
        np.mean([f.mean(0) for f in flat], 0) * 1.5, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        to_numpy(shared.moving_variance),
        np.mean([f.var(0) for f in flat], 0) * 2.5, rtol=1e-5, atol=1e-6)
    assert per_step.layer.momentum == shared.momentum == 0.99


class _InferenceBlock(keras.layers.Layer):
    """Calls its BatchNormalization with training=False always."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.bn = keras.layers.BatchNormalization(name="inference_bn")
        self.tracker = keras.metrics.Mean(name="activations")

    def call(self, x, training=None):
        self.tracker.update_state(x)
        return self.bn(self.dense(x), training=False)


def test_update_bn_keeps_what_the_pass_does_not_run_in_training_mode():
    model, x = _mlp(), _x()
    block = _InferenceBlock()
    outer = keras.Sequential([keras.Input((3,)), block, model])
    block.bn.moving_mean.assign(np.arange(3, dtype="float32"))
    block.tracker.update_state(np.ones((2, 3), "float32"))
    before = {v.path: to_numpy(v).copy()
              for v in block.bn.variables + block.tracker.variables}
    with pytest.warns(UserWarning, match=(
            r"update_bn: these BatchNormalization layers did not run in "
            r"training mode in the model's forward pass \(called with "
            r"`training=False`, or not reached\) and keep their "
            r"statistics: \['inference_bn'\]")):
        keras_ema_opt.update_bn(outer, x, batch_size=16)
    for v in block.bn.variables + block.tracker.variables:
        np.testing.assert_array_equal(to_numpy(v), before[v.path], v.path)
    # the model's own layers, behind the block, were measured
    assert not np.allclose(to_numpy(model.layers[1].moving_variance),
                           to_numpy(_mlp().layers[1].moving_variance))


class _InlineMomentsNorm(keras.layers.BatchNormalization):
    """Computes its moments inline, as Keras before 3.15 may: no
    ``_moments`` to count calls by."""

    @property
    def _moments(self):
        raise AttributeError("_moments")

    def call(self, inputs, training=None, mask=None):
        if training and self.trainable:
            mean, variance = keras.ops.moments(inputs, axes=[0])
            self.moving_mean.assign(self.moving_mean * self.momentum
                                    + mean * (1.0 - self.momentum))
            self.moving_variance.assign(
                self.moving_variance * self.momentum
                + variance * (1.0 - self.momentum))
        else:
            mean, variance = self.moving_mean, self.moving_variance
        return keras.ops.batch_normalization(
            inputs, mean, variance, axis=-1, offset=self.beta,
            scale=self.gamma, epsilon=self.epsilon)


def test_update_bn_of_a_layer_computing_its_moments_inline():
    keras.utils.set_random_seed(0)
    norm = _InlineMomentsNorm(momentum=0.7)
    model = keras.Sequential([keras.Input((3,)), norm, keras.layers.Dense(1)])
    x = _x()
    keras_ema_opt.update_bn(model, x, batch_size=16)
    batches = [x[i:i + 16].astype("float64") for i in range(0, 70, 16)]
    weights = [len(b) / 70 for b in batches]
    np.testing.assert_allclose(
        to_numpy(norm.moving_mean),
        sum(w * b.mean(0) for w, b in zip(weights, batches)), rtol=1e-5)
    np.testing.assert_allclose(
        to_numpy(norm.moving_variance),
        sum(w * b.var(0) for w, b in zip(weights, batches)), rtol=1e-5)
    assert norm.momentum == 0.7 and "_moments" not in vars(norm)
