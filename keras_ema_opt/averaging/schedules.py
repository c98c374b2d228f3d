"""Decay schedules: pure ``n -> decay`` functions in ``keras.ops``.

Convention everywhere: ``n`` is the 1-based number of the averaging update
being made (1 at the first update), ``t`` the 1-based optimizer step just
taken, and the decay ``d`` is the weight kept on the old average::

    a <- d * a + (1 - d) * w
"""

import math

from keras import ops


def constant(momentum, n):
    """``d = momentum`` (Keras 2 ``use_ema``, optax ``ema``)."""
    del n
    return ops.convert_to_tensor(momentum, "float32")


def num_updates(momentum, n):
    """``d = min(momentum, (1 + n) / (10 + n))``.

    tf.train.ExponentialMovingAverage with ``num_updates=n``; torch-ema
    (``use_num_updates=True``), whose counter is ``n`` after its increment.
    """
    n = ops.cast(n, "float32")
    return ops.minimum(ops.cast(momentum, "float32"), (1.0 + n) / (10.0 + n))


def power(momentum, n, inv_gamma=1.0, power=2.0 / 3.0, min_momentum=0.0):
    """``d = clip(1 - (1 + n / inv_gamma) ** -power, min_momentum, momentum)``.

    The warm-up of ema-pytorch ``EMA`` and timm ``ModelEmaV3(use_warmup)``
    (after Karras' and crowsonkb's schedule); ``n`` plays their
    ``step - update_after_step - 1``. With ``power=2/3`` it reaches 0.999
    at about 31.6k updates, with ``3/4`` at about 10k.
    """
    n = ops.cast(n, "float32")
    d = 1.0 - ops.power(1.0 + n / inv_gamma, -power)
    return ops.clip(d, min_momentum, momentum)


def running_mean(n):
    """``d = (n - 1) / n``: the uniform mean of the ``n`` models seen (SWA).

    torch ``swa_utils.AveragedModel``: ``a + (w - a) / (n_averaged + 1)``.
    """
    n = ops.cast(n, "float32")
    return (n - 1.0) / n


def power_function(gamma, t, dt):
    """``d = (1 - dt / t) ** (gamma + 1)`` (Karras et al. 2024, EDM2).

    The per-update factor of the power-function EMA whose profile is
    ``p_t(tau) ~ tau ** gamma`` on ``[0, t]``, for an update every ``dt``
    steps; ``t`` is the step just taken. At ``t = dt`` it is 0 (a copy).
    ema-pytorch's ``(1 - 1 / (step + 1)) ** (gamma + 1)`` is the ``dt = 1``
    case and is wrong for ``update_every > 1``.
    """
    t = ops.cast(t, "float32")
    ratio = ops.maximum(1.0 - ops.cast(dt, "float32") / t, 0.0)
    return ops.power(ratio, gamma + 1.0)


def sigma_rel_to_gamma(sigma_rel):
    """The exponent ``gamma`` of a power EMA of relative width ``sigma_rel``.

    Largest real root of ``g^3 + 7 g^2 + (16 - s^-2) g + (12 - s^-2) = 0``
    (EDM2 Algorithm 2, ``std_to_exp``). Plain Python float math.
    """
    import numpy as np

    s2 = float(sigma_rel) ** -2
    roots = np.roots([1.0, 7.0, 16.0 - s2, 12.0 - s2])
    real = roots[np.abs(roots.imag) < 1e-9].real
    return float(real.max())


def gamma_to_sigma_rel(gamma):
    """``sigma_rel = sqrt((g + 1) / ((g + 2)^2 (g + 3)))`` (EDM2)."""
    g = float(gamma)
    return ((g + 1) / ((g + 2) ** 2 * (g + 3))) ** 0.5


# ---------------------------------------------------------------------------
# Weights: w = 1 - d, the weight of the new value in a <- a + w (x - a),
# formed without the cancellation of 1 - d. In float32, 1 - (1 - 1/t) is
# 1.5% off at t = 1e6 and 19% at 2e7 (the spacing of floats near 1 is
# 6e-8): a power EMA's width, and SWA's uniform weights, drift over a long
# run. The peers form 1 - d in float64 (EDM2, ema-pytorch, torch-ema).


def constant_weight(momentum, every=1):
    """``1 - momentum ** every``, in float64 (a float32 tensor)."""
    return ops.convert_to_tensor(constant_weight_value(momentum, every),
                                 "float32")


def constant_weight_value(momentum, every=1):
    """``1 - momentum ** every``, formed in float64, as a Python float."""
    momentum = float(momentum)
    return 1.0 if momentum == 0.0 else -math.expm1(
        every * math.log(momentum))


def num_updates_weight(momentum, n):
    """``1 -`` :func:`num_updates`: ``max(1 - momentum, 9 / (10 + n))``."""
    n = ops.cast(n, "float32")
    return ops.maximum(ops.cast(1.0 - float(momentum), "float32"),
                       9.0 / (10.0 + n))


def power_weight(momentum, n, inv_gamma=1.0, power=2.0 / 3.0,
                 min_momentum=0.0):
    """``1 -`` :func:`power`: ``clip((1 + n / inv_gamma) ** -power,
    1 - momentum, 1 - min_momentum)``."""
    n = ops.cast(n, "float32")
    w = ops.power(1.0 + n / inv_gamma, -power)
    return ops.clip(w, 1.0 - float(momentum), 1.0 - float(min_momentum))


def running_mean_weight(n):
    """``1 -`` :func:`running_mean`: ``1 / n``."""
    return 1.0 / ops.cast(n, "float32")


def power_function_weight(gamma, t, dt):
    """``1 -`` :func:`power_function`: ``1 - (1 - dt / t) ** (gamma + 1)
    = -expm1((gamma + 1) log1p(-dt / t))``; 1 at ``t = dt`` (a copy)."""
    t = ops.cast(t, "float32")
    ratio = ops.minimum(ops.cast(dt, "float32") / t, 1.0)
    return -ops.expm1((gamma + 1.0) * ops.log1p(-ratio))


def repeated_weight(w, k):
    """The weight of ``k`` updates of weight ``w`` in one: ``1 - (1 - w)
    ** k = -expm1(k log1p(-w))``."""
    if k == 1:
        return w
    return -ops.expm1(float(k) * ops.log1p(-w))
