"""Our averages equal the real peers, step by step, on the same weight
trajectory: torch-ema, ema-pytorch, tf.train.ExponentialMovingAverage,
optax.ema(debias=True) and torch.optim.swa_utils.AveragedModel."""

import keras
import numpy as np
import pytest
from conftest import to_numpy

import keras_ema_opt

STEPS = 25


def _ours(averaging, steps=STEPS):
    """Train with SGD + averaging; return the weights w_0..w_T and the
    averages after each step."""
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=(3, 4)).astype("float32")
    w = keras.Variable(w0)
    opt = keras_ema_opt.SGD(learning_rate=0.1, momentum=0.5,
                            averaging=averaging)
    weights, averages = [w0], []
    for _ in range(steps):
        g = rng.normal(size=w0.shape).astype("float32")
        opt.apply_gradients([(keras.ops.convert_to_tensor(g), w)])
        weights.append(to_numpy(w).copy())
        averages.append(to_numpy(opt.average_of(w)).copy())
    return weights, averages


def _close(ours, theirs):
    np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("momentum", [0.9, 0.99])
def test_num_updates_warmup_equals_torch_ema(momentum):
    torch = pytest.importorskip("torch")
    torch_ema = pytest.importorskip("torch_ema")
    weights, ours = _ours(keras_ema_opt.EMA(momentum, warmup="num_updates"))
    p = torch.nn.Parameter(torch.tensor(weights[0]))
    ema = torch_ema.ExponentialMovingAverage([p], decay=momentum)
    for w, a in zip(weights[1:], ours):
        with torch.no_grad():
            p.copy_(torch.tensor(w))
        ema.update([p])
        _close(a, ema.shadow_params[0].numpy())


@pytest.mark.parametrize("momentum", [0.9, 0.99])
def test_num_updates_warmup_equals_tf_exponential_moving_average(momentum):
    tf = pytest.importorskip("tensorflow")
    weights, ours = _ours(keras_ema_opt.EMA(momentum, warmup="num_updates"))
    v = tf.Variable(weights[0])
    n = tf.Variable(0, dtype=tf.int64)
    ema = tf.train.ExponentialMovingAverage(momentum, num_updates=n)
    ema.apply([v])  # creates the shadow as a copy of w_0
    for t, (w, a) in enumerate(zip(weights[1:], ours), start=1):
        v.assign(w)
        n.assign(t)
        ema.apply([v])
        _close(a, ema.average(v).numpy())


@pytest.mark.parametrize("update_after_step", [0, 4])
@pytest.mark.parametrize("power", [2.0 / 3.0, 0.75])
def test_power_warmup_equals_ema_pytorch(update_after_step, power):
    torch = pytest.importorskip("torch")
    ema_pytorch = pytest.importorskip("ema_pytorch")
    # ema-pytorch's first update() copies; its `update_after_step` counts
    # from the call after it: our start_step is update_after_step + 1.
    weights, ours = _ours(keras_ema_opt.EMA(
        0.995, warmup="power", inv_gamma=1.0, power=power, min_momentum=0.1,
        start_step=update_after_step + 1,
    ))
    net = torch.nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.tensor(weights[0]))
    ema = ema_pytorch.EMA(
        net, beta=0.995, update_after_step=update_after_step, update_every=1,
        inv_gamma=1.0, power=power, min_value=0.1,
    )
    for w, a in zip(weights[1:], ours):
        with torch.no_grad():
            net.weight.copy_(torch.tensor(w))
        ema.update()
        _close(a, ema.ema_model.weight.detach().numpy())


@pytest.mark.parametrize("momentum", [0.9, 0.999])
def test_debias_equals_optax(momentum):
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    weights, ours = _ours(keras_ema_opt.EMA(momentum, debias=True))
    tx = optax.ema(momentum, debias=True)
    state = tx.init(jnp.asarray(weights[0]))
    reference = np.zeros_like(weights[0], np.float64)
    for t, (w, a) in enumerate(zip(weights[1:], ours), start=1):
        out, state = tx.update(jnp.asarray(w), state)
        reference = momentum * reference + (1 - momentum) * w
        exact = reference / (1 - momentum**t)
        # optax's float32 1 - d**t cancels where d**t is near 1 (relative
        # error ~1e-5 at d = 0.999); ours keeps 1 - prod(d) directly.
        np.testing.assert_allclose(a, np.asarray(out), rtol=5e-5, atol=5e-6)
        np.testing.assert_allclose(a, exact, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("start_step,every", [(0, 1), (5, 1), (3, 4)])
def test_swa_equals_torch_averaged_model(start_step, every):
    torch = pytest.importorskip("torch")
    from torch.optim import swa_utils

    weights, ours = _ours(keras_ema_opt.SWA(start_step=start_step,
                                            every=every))
    net = torch.nn.Linear(4, 3, bias=False)
    swa = swa_utils.AveragedModel(net)
    for t, (w, a) in enumerate(zip(weights[1:], ours), start=1):
        with torch.no_grad():
            net.weight.copy_(torch.tensor(w))
        if t <= start_step:
            _close(a, w)  # before start_step the average is the weights
            continue
        if (t - start_step) % every == 0:
            swa.update_parameters(net)
        if int(swa.n_averaged) > 0:
            _close(a, swa.module.weight.detach().numpy())
    assert int(swa.n_averaged) == (STEPS - start_step) // every


def test_ema_after_a_copy_equals_torch_averaged_model_ema():
    torch = pytest.importorskip("torch")
    from torch.optim import swa_utils

    weights, ours = _ours(keras_ema_opt.EMA(0.8, start_step=1))
    net = torch.nn.Linear(4, 3, bias=False)
    swa = swa_utils.AveragedModel(
        net, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.8)
    )
    for w, a in zip(weights[1:], ours):
        with torch.no_grad():
            net.weight.copy_(torch.tensor(w))
        swa.update_parameters(net)
        _close(a, swa.module.weight.detach().numpy())


@pytest.mark.parametrize("every", [2, 5])
def test_every_k_compensates_momentum_float64(every):
    """Documented rule, in float64: every k-th step, d = momentum ** k."""
    m, start = 0.9, 2
    weights, ours = _ours(keras_ema_opt.EMA(m, start_step=start,
                                            every=every))
    a = np.asarray(weights[0], np.float64)
    for t, (w, got) in enumerate(zip(weights[1:], ours), start=1):
        w = np.asarray(w, np.float64)
        if t <= start:
            a = w
        elif (t - start) % every == 0:
            a = m**every * a + (1 - m**every) * w
        _close(got, a)
