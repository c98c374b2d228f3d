"""Averaging strategies: what average to keep, as configuration plus a pure
decay rule. The state and the update live in ``engine.py``."""

import collections.abc
import inspect
import numbers
import os

import keras
import numpy as np
from keras import ops

from keras_ema_opt.averaging import schedules
from keras_ema_opt.errors import InvalidArgumentError
from keras_ema_opt.errors import UnknownArgumentError

_WARMUPS = (None, "num_updates", "power")
_register = keras.saving.register_keras_serializable(package="keras_ema_opt")


def _init_arguments(cls):
    """The keyword arguments the constructors of ``cls`` and of the
    classes it derives from take, sorted."""
    names = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        names.update(
            name for name, p in inspect.signature(init).parameters.items()
            if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                             p.KEYWORD_ONLY))
    return sorted(names)


def _check_int(name, value, minimum):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < minimum
    ):
        raise InvalidArgumentError(
            f"`{name}` must be an integer >= {minimum}. Received: "
            f"{name}={value!r}"
        )
    return int(value)


def _check_bool(name, value):
    # `bool("False")` is True: a flag is a bool, or no flag.
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(
            f"`{name}` must be True or False. Received: {name}={value!r}")
    return bool(value)


_AVERAGE_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _check_average_dtype(value):
    if value is None:
        return None
    try:
        dtype = keras.backend.standardize_dtype(value)
    except (ValueError, TypeError):
        dtype = None
    if dtype not in _AVERAGE_DTYPES:
        # An integer or bool average truncates every update.
        raise InvalidArgumentError(
            f"`average_dtype` must be None or one of {_AVERAGE_DTYPES}. "
            f"Received: average_dtype={value!r}")
    return dtype


def _check_unit(name, value):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 <= value <= 1
    ):
        raise InvalidArgumentError(
            f"`{name}` must be a number in [0, 1]. Received: {name}={value!r}"
        )
    return float(value)


def _check_positive(name, value):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 < value < float("inf")
    ):
        raise InvalidArgumentError(
            f"`{name}` must be a finite number > 0. Received: "
            f"{name}={value!r}")
    return float(value)


# EDM2's widest profile: the uniform average (gamma = 0) has relative
# width 1/sqrt(12) = 0.288675...; a wider one has a negative exponent.
_UNIFORM_WIDTH = 12 ** -0.5


def _is_sigma_rel(value):
    return (not isinstance(value, bool) and isinstance(value, numbers.Real)
            and 0 < value < _UNIFORM_WIDTH)


def _check_sigma_rel(name, value):
    if not _is_sigma_rel(value):
        raise InvalidArgumentError(
            f"`{name}` must be a number in (0, 1/sqrt(12) = 0.288675...) "
            "(1/sqrt(12) is the uniform average, gamma = 0). Received: "
            f"{name}={value!r}")
    return float(value)


class Averaging:
    """Base class of the averaging strategies.

    Args:
        start_step: Before optimizer step ``start_step`` (1-based, after the
            update) the average is a copy of the weights; averaging starts
            at the step after it.
        every: Average every ``every`` optimizer steps (counted from
            ``start_step``).
        average_dtype: Dtype of the averages, e.g. ``"float32"`` for
            bfloat16 / float16 weights; ``None`` keeps each variable's dtype.
        finalize: Whether ``finalize_variable_values`` (called by ``fit()``
            at its end) writes the averages into the model (Keras 2), or
            leaves the raw weights there (``False``).
        include_non_trainable: Also average the model's non-trainable float
            variables (BatchNorm moving statistics), so that the averaged
            model's statistics match its averaged weights (timm
            ``ModelEmaV3``). Integer variables are never averaged. The
            model is the one whose ``compile``/``fit`` builds the
            optimizer; a custom loop names it with
            ``optimizer.track_non_trainable(model)`` before the first step.

    A strategy defines ``decays(n, t)``: the weight ``d`` kept on the old
    average at the ``n``-th averaging update, made at optimizer step ``t``
    (``a <- d * a + (1 - d) * w``), one per slot. Where ``d`` comes close
    to 1 (after many updates), it also defines ``weights(n, t)``: the
    ``1 - d`` themselves, formed without cancellation (the built-in
    strategies do).

    Example:

    ```python
    import keras
    import keras_ema_opt

    class HalfLife(keras_ema_opt.Averaging):
        # An EMA whose half-life grows with n: d = 0.5 ** (1 / (1 + n / 10)).
        def decays(self, n, t):
            n = keras.ops.cast(n, "float32")
            return [keras.ops.power(0.5, 1.0 / (1.0 + n / 10.0))]

    optimizer = keras_ema_opt.Adam(averaging=HalfLife())
    ```
    """

    num_slots = 1
    #: "copy": averages start as the weights; "zeros": as zeros (debias).
    initial = "copy"
    debias = False

    def __init__(
        self,
        start_step=0,
        every=1,
        average_dtype=None,
        finalize=True,
        include_non_trainable=False,
        **unknown,
    ):
        if unknown:
            raise UnknownArgumentError(
                f"{type(self).__name__} does not accept the argument(s) "
                f"{unknown}. Accepted arguments: "
                f"{', '.join(_init_arguments(type(self)))}.")
        self.start_step = _check_int("start_step", start_step, 0)
        self.include_non_trainable = _check_bool("include_non_trainable",
                                                 include_non_trainable)
        self.every = _check_int("every", every, 1)
        self.average_dtype = _check_average_dtype(average_dtype)
        self.finalize = _check_bool("finalize", finalize)

    def decays(self, n, t):
        """Decays (one per slot) for update ``n`` made at step ``t``."""
        raise NotImplementedError

    def constant_weights(self):
        """The weights ``1 - d`` (one per slot) as Python floats, each the
        float32 value :meth:`weights` gives, where they are the same at
        every update; else None. A backend then reads no tensor for them
        (on CUDA each read waits for the device)."""
        return None

    def weights(self, n, t):
        """``1 - d`` (one per slot) for update ``n`` made at step ``t``:
        the weight of the new value in ``a <- a + w (x - a)``, which the
        update uses. By default ``1 - decays(n, t)`` in float32."""
        return [ops.subtract(1.0, ops.cast(d, "float32"))
                for d in self.decays(n, t)]

    def get_config(self):
        return {
            "start_step": self.start_step,
            "every": self.every,
            "average_dtype": self.average_dtype,
            "finalize": self.finalize,
            "include_non_trainable": self.include_non_trainable,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other):
        return type(self) is type(other) and (
            self.get_config() == other.get_config()
        )

    __hash__ = object.__hash__


@_register
class EMA(Averaging):
    """Exponential moving average of the weights.

    ``a <- d * a + (1 - d) * w`` after each optimizer step, with ``d``:

    - ``warmup=None``: ``momentum`` (Keras 2 ``use_ema``; averages start as
      the weights, as in Keras 2, tf.train.ExponentialMovingAverage and
      torch-ema);
    - ``warmup="num_updates"``: ``min(momentum, (1 + n) / (10 + n))``,
      ``n`` the 1-based update number (tf.train.ExponentialMovingAverage's
      ``num_updates``, torch-ema);
    - ``warmup="power"``: ``clip(1 - (1 + n / inv_gamma) ** -power,
      min_momentum, momentum)`` (ema-pytorch ``EMA``, timm ``ModelEmaV3``).

    ``every=k`` updates the average every ``k`` steps with ``d ** k`` so that
    ``momentum`` keeps its meaning per optimizer step: the average has the
    same time constant, ``1 / (1 - momentum)`` steps, whatever ``k``; a
    warm-up counts optimizer steps as well (the ``n``-th update takes the
    warm-up's ``d`` at ``n k``, to the power ``k``). ema-pytorch's
    ``update_every`` uses ``d`` once per update instead, a time constant
    ``k`` times longer.
    ``debias=True`` gives the zero-started average divided by its bias
    correction, ``a / (1 - prod(d))`` (optax ``ema(debias=True)``; Adam's
    bias correction), held as that quotient itself, ``b <- b + (w / c)
    (x - b)`` with ``c = 1 - prod(d)`` after the update: the first update
    copies the weights, and weights that never move are held exactly.

    Args:
        momentum: Decay in ``[0, 1]`` (the ceiling with a warm-up).
        warmup: ``None``, ``"num_updates"`` or ``"power"``.
        start_step, every, average_dtype, finalize: see ``Averaging``.
        debias: Zero start with bias correction.
        inv_gamma, power, min_momentum: the ``"power"`` warm-up.

    Example:

    ```python
    import keras
    import keras_ema_opt

    optimizer = keras_ema_opt.AdamW(
        averaging=keras_ema_opt.EMA(0.999, warmup="power", start_step=100)
    )
    ```
    """

    def __init__(
        self,
        momentum=0.999,
        warmup=None,
        start_step=0,
        every=1,
        debias=False,
        inv_gamma=1.0,
        power=2.0 / 3.0,
        min_momentum=0.0,
        **kwargs,
    ):
        super().__init__(start_step=start_step, every=every, **kwargs)
        self.momentum = _check_unit("momentum", momentum)
        if warmup not in _WARMUPS:
            raise InvalidArgumentError(
                "`warmup` must be one of None, 'num_updates', 'power'. "
                f"Received: warmup={warmup!r}"
            )
        self.warmup = warmup
        self.debias = _check_bool("debias", debias)
        if self.debias and warmup is None and self.momentum == 1:
            # The correction divides by 1 - momentum^n: 0 / 0 (optax's
            # ema(1.0, debias=True) is NaN). Below 1, however close, the
            # weight 1 - momentum is taken in float64 and the average
            # tends to the running mean, which is `SWA`.
            raise InvalidArgumentError(
                "`EMA(debias=True)` without a warm-up needs `momentum` "
                "below 1 (its bias correction divides by 1 - momentum^n, "
                "0 at 1; the mean of the weights is `SWA`). "
                f"Received: momentum={momentum!r}")
        self.initial = "zeros" if self.debias else "copy"
        self.inv_gamma = _check_positive("inv_gamma", inv_gamma)
        self.power = _check_positive("power", power)
        self.min_momentum = _check_unit("min_momentum", min_momentum)
        if self.min_momentum > self.momentum:
            raise InvalidArgumentError(
                "`min_momentum` must be at most `momentum` (the floor and "
                "the ceiling of the warm-up). Received: "
                f"min_momentum={min_momentum!r}, momentum={momentum!r}")

    def constant_weights(self):
        # A subclass's own `weights` (or `decays`) is its rule.
        if self.warmup is not None or type(self).weights is not EMA.weights \
                or type(self).decays is not EMA.decays:
            return None
        return [float(np.float32(schedules.constant_weight_value(
            self.momentum, self.every)))]

    def weights(self, n, t):
        del t
        k = self.every
        if self.warmup is None:
            return [schedules.constant_weight(self.momentum, k)]
        # The warm-up counts optimizer steps too: the n-th update every k
        # steps takes the per-step weight at step n k, k times over.
        steps = ops.cast(n, "float32") * float(k)
        if self.warmup == "num_updates":
            w = schedules.num_updates_weight(self.momentum, steps)
        else:
            w = schedules.power_weight(
                self.momentum, steps, self.inv_gamma, self.power,
                self.min_momentum)
        return [schedules.repeated_weight(w, k)]

    def decays(self, n, t):
        return [ops.subtract(1.0, w) for w in self.weights(n, t)]

    def get_config(self):
        return {
            "momentum": self.momentum,
            "warmup": self.warmup,
            "debias": self.debias,
            "inv_gamma": self.inv_gamma,
            "power": self.power,
            "min_momentum": self.min_momentum,
            **super().get_config(),
        }


@_register
class SWA(Averaging):
    """Stochastic weight averaging: the uniform mean of the weights.

    ``a <- a + (w - a) / (n + 1)`` at every ``every``-th step after
    ``start_step`` (Izmailov et al. 2018; torch ``swa_utils.AveragedModel``,
    TF Addons ``SWA``); the first update copies.

    Example:

    ```python
    import keras_ema_opt

    optimizer = keras_ema_opt.SGD(
        learning_rate=0.05, averaging=keras_ema_opt.SWA(start_step=1000, every=10)
    )
    ```
    """

    def weights(self, n, t):
        del t
        return [schedules.running_mean_weight(n)]

    def decays(self, n, t):
        del t
        return [schedules.running_mean(n)]


@_register
class PowerEMA(Averaging):
    """Power-function EMAs with snapshots for post-hoc reconstruction (EDM2).

    Keeps one average per ``sigma_rel`` (the profile ``p_t(tau) ~ tau^gamma``
    of relative width ``sigma_rel``; ``gamma`` from EDM2's ``std_to_exp``),
    updated every ``every`` steps with ``d = (1 - every / t) ** (gamma + 1)``
    at step ``t`` (Karras et al. 2024, eq. 2 with ``dt = every``; the first
    update copies). Every ``snapshot_every`` steps the averages can be
    written to ``snapshot_dir`` (the ``PowerEMASnapshots`` callback in
    ``fit``, ``optimizer.save_snapshot()`` in a custom loop), and after
    training ``synthesize(sigma_rel)`` rebuilds the weights of a power EMA of
    any other width by the paper's least-squares solve.

    Args:
        sigma_rels: Relative widths of the averages kept (EDM2: 0.05, 0.10).
        every: Update interval in optimizer steps.
        snapshot_every: Snapshot interval in optimizer steps, or ``None``.
        snapshot_dir: Folder of the snapshots.
        average_dtype, finalize: see ``Averaging``; ``finalize`` and swaps
            use the first width.

    Example:

    ```python
    import tempfile
    import keras_ema_opt

    averaging = keras_ema_opt.PowerEMA(
        sigma_rels=(0.05, 0.10), snapshot_every=100,
        snapshot_dir=tempfile.mkdtemp(),
    )
    optimizer = keras_ema_opt.Adam(averaging=averaging)
    # ... model.fit(..., callbacks=[keras_ema_opt.callbacks.PowerEMASnapshots()])
    # weights = averaging.synthesize(sigma_rel=0.08)
    ```
    """

    def __init__(
        self,
        sigma_rels=(0.05, 0.10),
        every=1,
        snapshot_every=None,
        snapshot_dir=None,
        average_dtype=None,
        finalize=True,
        **kwargs,
    ):
        start_step = kwargs.pop("start_step", 0)
        if start_step:
            raise InvalidArgumentError(
                "PowerEMA has no `start_step`: its power-function profile "
                f"starts at step 0 (EDM2). Received: start_step={start_step!r}")
        super().__init__(start_step=0, every=every,
                         average_dtype=average_dtype, finalize=finalize,
                         **kwargs)
        if isinstance(sigma_rels, (numbers.Real, str, bytes)) or not (
                isinstance(sigma_rels, collections.abc.Iterable)):
            raise InvalidArgumentError(
                "`sigma_rels` must be a sequence of widths, e.g. "
                f"(0.05, 0.10). Received: sigma_rels={sigma_rels!r}")
        sigma_rels = tuple(sigma_rels)
        if not sigma_rels or not all(_is_sigma_rel(s) for s in sigma_rels):
            raise InvalidArgumentError(
                "`sigma_rels` must be a non-empty sequence of numbers in "
                "(0, 1/sqrt(12) = 0.288675...) (1/sqrt(12) is the uniform "
                f"average, gamma = 0). Received: sigma_rels={sigma_rels!r}"
            )
        sigma_rels = tuple(float(s) for s in sigma_rels)
        if len(set(sigma_rels)) != len(sigma_rels):
            raise InvalidArgumentError(
                "`sigma_rels` must name each width once (a repeated width "
                "keeps a second copy of the same average, and the post-hoc "
                f"solve learns nothing from it). Received: "
                f"sigma_rels={sigma_rels!r}")
        self.sigma_rels = sigma_rels
        self.gammas = tuple(schedules.sigma_rel_to_gamma(s)
                            for s in sigma_rels)
        self.num_slots = len(sigma_rels)
        if snapshot_every is not None:
            snapshot_every = _check_int("snapshot_every", snapshot_every, 1)
            if snapshot_dir is None:
                raise InvalidArgumentError(
                    "`snapshot_every` needs a `snapshot_dir` to write to. "
                    f"Received: snapshot_every={snapshot_every}, "
                    "snapshot_dir=None"
                )
        if snapshot_dir is not None and not isinstance(
                snapshot_dir, (str, os.PathLike)):
            raise InvalidArgumentError(
                "`snapshot_dir` must be a folder path (str or os.PathLike) "
                f"or None. Received: snapshot_dir={snapshot_dir!r} of type "
                f"{type(snapshot_dir).__name__}")
        self.snapshot_every = snapshot_every
        self.snapshot_dir = None if snapshot_dir is None else os.fspath(
            snapshot_dir)

    def weights(self, n, t):
        del n
        return [schedules.power_function_weight(g, t, self.every)
                for g in self.gammas]

    def decays(self, n, t):
        del n
        return [schedules.power_function(g, t, self.every)
                for g in self.gammas]

    def synthesize(self, sigma_rel, step=None, snapshot_dir=None):
        """Weights of a power EMA of width ``sigma_rel`` from the snapshots.

        Args:
            sigma_rel: The width, in ``(0, 1/sqrt(12))``.
            step: The step of one of the snapshots (default: the last);
                the snapshots up to it are used.
            snapshot_dir: The folder of the snapshots (default: this
                averaging's).

        Returns:
            A dict ``variable path -> float32 numpy array``; assign it with
            ``keras_ema_opt.averaging.assign_by_path(model, weights)``.

        Raises:
            InvalidArgumentError: a ``step`` that is no snapshot's, and
                snapshots that are damaged or do not come from one model.

        Example:

        ```python
        import tempfile
        import keras
        import numpy as np
        import keras_ema_opt

        folder = tempfile.mkdtemp()
        averaging = keras_ema_opt.PowerEMA(snapshot_every=2,
                                           snapshot_dir=folder)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras_ema_opt.SGD(averaging=averaging),
                      loss="mse")
        model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=2, verbose=0,
                  callbacks=[keras_ema_opt.callbacks.PowerEMASnapshots()])
        weights = averaging.synthesize(sigma_rel=0.08)   # a width not kept
        keras_ema_opt.averaging.assign_by_path(model, weights)
        ```
        """
        from keras_ema_opt.averaging import posthoc

        directory = snapshot_dir or self.snapshot_dir
        if directory is None:
            raise InvalidArgumentError(
                "synthesize() needs the snapshot folder: pass "
                "`snapshot_dir=` here or to PowerEMA."
            )
        gamma = schedules.sigma_rel_to_gamma(
            _check_sigma_rel("sigma_rel", sigma_rel))
        return posthoc.synthesize(directory, gamma, step)

    def get_config(self):
        config = super().get_config()
        config.pop("start_step")
        return {
            "sigma_rels": list(self.sigma_rels),
            "snapshot_every": self.snapshot_every,
            "snapshot_dir": self.snapshot_dir,
            **config,
        }
