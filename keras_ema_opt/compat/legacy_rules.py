"""OptimizerV2 update rules that Keras 3 changed (``tf.keras.optimizers.legacy``).

Only where the math differs (``docs/legacy.md``, reference §4.3):

- ``LegacyAdagrad``: ``var -= lr g / (sqrt(acc) + eps)`` (Keras 3 puts eps
  inside the square root);
- ``LegacyRMSprop`` (OptimizerV2 with ``momentum=0``): ``var -= lr g /
  (sqrt(rms) + eps)``, centered or not (with momentum OptimizerV2 used the
  same rule as Keras 3: use ``keras_ema_opt.RMSprop``);
- ``LegacyNadam``: Dozat's momentum schedule ``mu_t = beta_1 (1 - 0.5 *
  0.96 ** (schedule_decay * t))`` with its running product
  ``momentum_cache`` (Keras 3 drops ``schedule_decay``).

Each is a ``keras_ema_opt.Optimizer``: the Keras 2 contract, OptimizerV2's
``decay`` (not for Nadam, where ``decay`` is the schedule decay, as in
OptimizerV2's config), averaging.
"""

import contextlib

import keras
import numpy as np
from keras import initializers
from keras import ops
from keras.src.utils import tracking

from keras_ema_opt import backend
from keras_ema_opt.errors import InvalidArgumentError
from keras_ema_opt.optimizer import Optimizer
from keras_ema_opt.optimizers import AveragedLossScaleOptimizer
from keras_ema_opt.optimizers import LossScaleWrapping

_register = keras.saving.register_keras_serializable(package="keras_ema_opt")


@_register
class LegacyAdagrad(Optimizer):
    """OptimizerV2 Adagrad: ``acc += g^2; var -= lr g / (sqrt(acc) + eps)``.

    Equal to ``tf_keras.optimizers.legacy.Adagrad`` (``ResourceApplyAdagradV2``).

    Example:

    ```python
    from keras_ema_opt.compat import LegacyAdagrad

    optimizer = LegacyAdagrad(learning_rate=0.01, decay=1e-4)
    ```
    """

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1,
                 epsilon=1e-7, name="Adagrad", **kwargs):
        if initial_accumulator_value < 0.0:
            raise InvalidArgumentError(
                "initial_accumulator_value must be non-negative: "
                f"{initial_accumulator_value}"
            )
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.epsilon = float(epsilon)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._accumulators = [
            self.add_variable_from_reference(
                v, "accumulator",
                initializer=keras.initializers.Constant(
                    self.initial_accumulator_value),
            )
            for v in var_list
        ]

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        acc = self._accumulators[self._get_variable_index(variable)]
        self.assign_add(acc, ops.square(gradient))
        self.assign_sub(variable, ops.divide(
            ops.multiply(lr, gradient), ops.add(ops.sqrt(acc), self.epsilon)))

    def get_config(self):
        config = super().get_config()
        config.update(initial_accumulator_value=self.initial_accumulator_value,
                      epsilon=self.epsilon)
        return config


@_register
class LegacyRMSprop(Optimizer):
    """OptimizerV2 RMSprop without momentum: eps outside the square root.

    ``rms = rho rms + (1 - rho) g^2``; centered: ``mg = rho mg + (1 - rho) g``
    and ``denom = rms - mg^2``; ``var -= lr g / (sqrt(denom) + eps)``. Equal
    to ``tf_keras.optimizers.legacy.RMSprop(momentum=0)``.

    Example:

    ```python
    from keras_ema_opt.compat import LegacyRMSprop

    optimizer = LegacyRMSprop(learning_rate=0.001, rho=0.9, centered=True)
    ```
    """

    def __init__(self, learning_rate=0.001, rho=0.9, momentum=0.0,
                 epsilon=1e-7, centered=False, name="RMSprop", **kwargs):
        if momentum:
            raise InvalidArgumentError(
                "LegacyRMSprop is OptimizerV2's rule without momentum. "
                f"Received: momentum={momentum}. With momentum OptimizerV2 "
                "used Keras 3's rule: use keras_ema_opt.RMSprop."
            )
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.rho = float(rho)
        self.momentum = 0.0
        self.epsilon = float(epsilon)
        self.centered = bool(centered)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._velocities = [self.add_variable_from_reference(v, "velocity")
                            for v in var_list]
        self._average_gradients = [
            self.add_variable_from_reference(v, "average_gradient")
            for v in var_list
        ] if self.centered else []

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        index = self._get_variable_index(variable)
        rms = self._velocities[index]
        rho = ops.cast(self.rho, variable.dtype)
        self.assign(rms, ops.add(ops.multiply(rho, rms),
                                 ops.multiply(1 - rho, ops.square(gradient))))
        denominator = rms
        if self.centered:
            mg = self._average_gradients[index]
            self.assign(mg, ops.add(ops.multiply(rho, mg),
                                    ops.multiply(1 - rho, gradient)))
            denominator = ops.subtract(rms, ops.square(mg))
        self.assign_sub(variable, ops.divide(
            ops.multiply(lr, gradient),
            ops.add(ops.sqrt(denominator), self.epsilon)))

    def get_config(self):
        config = super().get_config()
        config.update(rho=self.rho, momentum=0.0, epsilon=self.epsilon,
                      centered=self.centered)
        return config


@_register
class LegacyNadam(Optimizer):
    """OptimizerV2 Nadam with Dozat's momentum schedule.

    ``mu_t = beta_1 (1 - 0.5 * 0.96 ** (schedule_decay * t))``,
    ``momentum_cache = prod mu``; ``g' = g / (1 - cache_t)``,
    ``m = beta_1 m + (1 - beta_1) g``, ``m' = m / (1 - cache_t mu_{t+1})``,
    ``v = beta_2 v + (1 - beta_2) g^2``, ``v' = v / (1 - beta_2^t)``,
    ``var -= lr ((1 - mu_t) g' + mu_{t+1} m') / (sqrt(v') + eps)``. Equal to
    ``tf_keras.optimizers.legacy.Nadam``. As there, ``decay`` (the key
    OptimizerV2 writes into configs) is ``schedule_decay``, not a
    learning-rate decay, and learning-rate schedules are refused.

    Example:

    ```python
    from keras_ema_opt.compat import LegacyNadam

    optimizer = LegacyNadam(learning_rate=0.002, schedule_decay=0.004)
    ```
    """

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-7, schedule_decay=0.004, name="Nadam", **kwargs):
        if "decay" in kwargs:
            schedule_decay = kwargs.pop("decay")
        if isinstance(learning_rate,
                      keras.optimizers.schedules.LearningRateSchedule):
            raise InvalidArgumentError(
                "The Nadam optimizer does not support "
                "tf.keras.optimizers.LearningRateSchedules as the "
                "learning rate."
            )
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1 = float(beta_1)
        self.beta_2 = float(beta_2)
        self.epsilon = float(epsilon)
        self.schedule_decay = float(schedule_decay)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._momentums = [self.add_variable_from_reference(v, "momentum")
                           for v in var_list]
        self._velocities = [self.add_variable_from_reference(v, "velocity")
                            for v in var_list]
        dtype = var_list[0].dtype if var_list else keras.config.floatx()
        self._momentum_cache = self.add_variable(
            (), dtype=dtype, initializer="ones", name="momentum_cache")

    def _mu(self, step, dtype):
        return ops.multiply(
            ops.cast(self.beta_1, dtype),
            1.0 - 0.5 * ops.power(ops.cast(0.96, dtype),
                                  ops.multiply(self.schedule_decay, step)))

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        dtype = self._momentum_cache.dtype
        step = ops.cast(self.iterations + 1, dtype)
        self.assign(self._momentum_cache,
                    ops.multiply(self._momentum_cache, self._mu(step, dtype)))
        super()._backend_update_step(grads, trainable_variables, learning_rate)

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        step = ops.cast(self.iterations + 1, dtype)
        mu_t, mu_next = self._mu(step, dtype), self._mu(step + 1, dtype)
        cache = ops.cast(self._momentum_cache, dtype)
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        beta_1 = ops.cast(self.beta_1, dtype)
        beta_2 = ops.cast(self.beta_2, dtype)
        g_prime = ops.divide(gradient, 1.0 - cache)
        self.assign(m, ops.add(ops.multiply(beta_1, m),
                               ops.multiply(1.0 - beta_1, gradient)))
        m_prime = ops.divide(m, 1.0 - ops.multiply(cache, mu_next))
        self.assign(v, ops.add(ops.multiply(beta_2, v),
                               ops.multiply(1.0 - beta_2, ops.square(gradient))))
        v_prime = ops.divide(v, 1.0 - ops.power(beta_2, step))
        m_bar = ops.add(ops.multiply(1.0 - mu_t, g_prime),
                        ops.multiply(mu_next, m_prime))
        self.assign_sub(variable, ops.divide(
            ops.multiply(lr, m_bar), ops.add(ops.sqrt(v_prime), self.epsilon)))

    def get_config(self):
        config = super().get_config()
        config.update(beta_1=self.beta_1, beta_2=self.beta_2,
                      epsilon=self.epsilon,
                      schedule_decay=self.schedule_decay)
        return config


def nadam_u_product(beta_1, iterations):
    """Nadam's ``u_product`` after ``iterations`` steps:
    ``prod_{s <= t} beta_1 (1 - 0.5 * 0.96 ** s)``, the same in Keras 2 and
    Keras 3. Recomputed when state is migrated, since tf_keras' own value is
    wrong under ``tf.function`` (reference legacy-formats §4.3)."""
    steps = np.arange(1, (iterations or 0) + 1, dtype=np.float64)
    return float(np.prod(beta_1 * (1 - 0.5 * 0.96 ** steps)))


@_register
class LegacyLossScaleOptimizer(LossScaleWrapping,
                               keras.optimizers.LossScaleOptimizer):
    """Keras 3's ``LossScaleOptimizer`` with Keras 2's: skipped steps
    counted, and the custom-loop methods.

    A step whose gradients are not finite is skipped by both: the weights
    and slots stay, the scale halves. Keras 2's wrapper (OptimizerV2's
    ``LossScaleOptimizer`` and the experimental ``LossScaleOptimizerV3``)
    still added one to the inner optimizer's ``iterations``; Keras 3's
    does not. Adam's bias correction, schedules and averaging warm-ups
    then read other step numbers, and a migrated mixed-precision model
    resumed under Keras 3's wrapper drifted from Keras 2 after its next
    skipped step (2e-2 relative after three steps of Adam). Migrated
    loss-scale optimizers are made with this class; with
    ``gradient_accumulation_steps`` (no Keras 2 optimizer had it) a
    skipped step is not counted, as Keras 3 does, since one count would
    shift the accumulation's cycle. ``keras_ema_opt.averaged()`` of one
    gives an ``AveragedLegacyLossScaleOptimizer``, which keeps counting.

    Where the inner optimizer averages (a migrated ``use_ema=True``), its
    averaging API reaches it through the wrapper (``average_of``,
    ``swap_average``, ``assign_averages``, ``track_non_trainable``, ...).

    Keras 2's custom training loop runs unchanged: ``get_scaled_loss``,
    ``get_unscaled_gradients``, then ``apply_gradients`` of the unscaled
    gradients (Keras 3's ``apply`` divides the gradients it is given by the
    scale, as ``fit()`` gives them scaled: after ``get_unscaled_gradients``
    the next step takes them as they are); ``compute_gradients`` and
    ``minimize`` scale and unscale themselves; ``loss_scale``,
    ``dynamic_counter`` and ``dynamic``. The scale and its counter exist
    from construction, as Keras 2's did, so that a step traced before the
    first ``apply_gradients`` reads the scale variable, not the initial
    value (Keras 3 makes them at ``build``).

    Args:
        inner_optimizer: The optimizer to wrap.
        initial_scale: The first loss scale (``None``: Keras 2's default,
            ``2 ** 15``).
        dynamic_growth_steps: Finite steps before the scale doubles
            (``None``: ``2000``).
        name, **kwargs: Keras 3's; ``dynamic=False`` is refused, as by
            Keras 3 (a fixed scale is the inner optimizer's
            ``loss_scale_factor``).

    Example:

    ```python
    import keras
    import numpy as np
    from keras_ema_opt.compat import LegacyLossScaleOptimizer

    w = keras.Variable(np.ones(3, "float32"))
    optimizer = LegacyLossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.minimize(lambda: keras.ops.sum(w * w), [w])  # as in Keras 2
    np.testing.assert_allclose(keras.ops.convert_to_numpy(w), 0.8)
    ```
    """

    def __init__(self, inner_optimizer, initial_scale=2.0**15,
                 dynamic_growth_steps=2000, name=None, **kwargs):
        if isinstance(initial_scale, bool):
            raise InvalidArgumentError(
                "LegacyLossScaleOptimizer takes Keras 3's arguments: the "
                "second is `initial_scale` (Keras 2's second was `dynamic`; "
                "pass it by keyword). Received: "
                f"initial_scale={initial_scale!r}")
        super().__init__(
            inner_optimizer,
            2.0**15 if initial_scale is None else initial_scale,
            2000 if dynamic_growth_steps is None else dynamic_growth_steps,
            name=name, **kwargs)
        self._keo_unscale_next = False
        self._keo_given_unscaled = False
        self._keo_in_step = False
        self._make_scale_variables()

    @tracking.no_automatic_dependency_tracking
    def _make_scale_variables(self):
        # Keras 3's `LossScaleOptimizer.build` makes these two, in this
        # order, right after `iterations` and the learning rate: the
        # order of `variables` (and of saved files) is the same.
        self.step_counter = self.add_variable(
            shape=(), dtype="int", initializer=initializers.Zeros(),
            aggregation="none", name="step_counter")
        self.dynamic_scale = self.add_variable(
            shape=(), dtype="float32",
            initializer=initializers.Constant(self.initial_scale),
            aggregation="none", name="dynamic_scale")

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        # `LossScaleOptimizer.build` without its two variables (made at
        # construction).
        self.inner_optimizer.build(var_list)
        super(keras.optimizers.LossScaleOptimizer, self).build(var_list)

    # -- Keras 2's custom-loop API -----------------------------------------

    @property
    def dynamic(self):
        """Always ``True``: the scale is dynamic (Keras 2's property)."""
        return True

    @property
    def loss_scale(self):
        """The current loss scale, a float32 tensor (Keras 2's property):
        its value now, which a later step does not change."""
        return ops.copy(self.dynamic_scale.value)

    @property
    def dynamic_counter(self):
        """Finite steps since the scale last changed (Keras 2's
        property): the counter variable."""
        return self.step_counter

    def scale_loss(self, loss):
        """Keras 3's: ``loss`` times the scale; the step that follows
        takes its gradients as scaled (``fit()`` calls it in each step), so
        a ``get_unscaled_gradients`` whose gradients were not applied
        leaves no mark on it."""
        self._keo_unscale_next = False
        return ops.multiply(loss, self.dynamic_scale)

    def get_scaled_loss(self, loss):
        """``loss`` times the loss scale, in the loss's dtype (Keras 2).

        Args:
            loss: A tensor, or a callable returning one (then a callable).
        """
        if callable(loss):
            def scaled():
                return self._scaled(loss())

            return scaled
        return self._scaled(loss)

    def _scaled(self, loss):
        loss = ops.convert_to_tensor(loss)
        return ops.multiply(loss, ops.cast(self.loss_scale, loss.dtype))

    def get_unscaled_gradients(self, grads):
        """The gradients of a scaled loss, each times ``1 / loss_scale``
        (``None`` kept; sparse gradients' values), as Keras 2 gave them.
        The next ``apply_gradients`` takes its gradients as unscaled."""
        reciprocal = ops.divide(1.0, self.loss_scale)
        unscaled = [None if g is None else backend.scale_gradient(
            g, reciprocal) for g in grads]
        self._keo_unscale_next = True
        return unscaled

    def compute_gradients(self, loss, var_list, tape=None):
        """Keras 2's: the gradients of the scaled loss, unscaled.

        Args:
            loss: A callable returning the loss (every backend), or, on
                TensorFlow, a tensor computed under ``tape``.
            var_list: Variables, or a callable returning them.
            tape: A ``tf.GradientTape`` (TensorFlow, with a tensor loss).

        Returns:
            A list of ``(gradient, variable)`` pairs.
        """
        if not callable(loss) and tape is None:
            raise ValueError(
                "`tape` is required when a `Tensor` loss is passed. "
                f"Received: loss={loss}, tape={tape}.")
        if tape is not None and not callable(loss):
            with tape:  # the scaling is recorded with the loss
                scaled = self.get_scaled_loss(loss)
        else:
            scaled = self.get_scaled_loss(loss)
        pairs = backend.compute_gradients(scaled, var_list, tape)
        grads = self.get_unscaled_gradients([g for g, _ in pairs])
        return list(zip(grads, [v for _, v in pairs]))

    def minimize(self, loss, var_list, tape=None):
        """``compute_gradients`` then ``apply_gradients`` (Keras 2)."""
        return self.apply_gradients(
            self.compute_gradients(loss, var_list, tape))

    # -- the step ----------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        with self._step_gradients():
            super().apply(grads, trainable_variables)

    def stateless_apply(self, optimizer_variables, grads,
                        trainable_variables):
        with self._step_gradients():
            return super().stateless_apply(optimizer_variables, grads,
                                           trainable_variables)

    @contextlib.contextmanager
    def _step_gradients(self):
        """A step: its gradients are unscaled where
        ``get_unscaled_gradients`` gave them since the last step (a step
        within a step, the outer one's)."""
        if self._keo_in_step:
            yield
            return
        self._keo_given_unscaled = self._keo_unscale_next
        self._keo_unscale_next = False
        self._keo_in_step = True
        try:
            yield
        finally:
            self._keo_given_unscaled = False
            self._keo_in_step = False

    def _overwrite_variable_with_gradient(self, variable):
        # Keras 3's wrapper divides each gradient by the scale but where
        # this is true (a variable that takes its gradient as its value);
        # gradients `get_unscaled_gradients` gave are not divided again.
        return self._keo_given_unscaled or (
            super()._overwrite_variable_with_gradient(variable))

    def _counts_skipped(self):
        return not self.inner_optimizer.gradient_accumulation_steps

    def _stateful_handle_non_finite_grads(self):
        super()._stateful_handle_non_finite_grads()
        if self._counts_skipped():
            self.inner_optimizer.iterations.assign_add(1)

    def _stateless_handle_non_finite_grads(self, optimizer_variables,
                                           trainable_variables):
        trainable, values = super()._stateless_handle_non_finite_grads(
            optimizer_variables, trainable_variables)
        if self._counts_skipped():
            counter = self.inner_optimizer.iterations
            values = [ops.add(value, 1) if variable is counter else value
                      for variable, value in zip(self.variables, values)]
        return trainable, values


@_register
class AveragedLegacyLossScaleOptimizer(AveragedLossScaleOptimizer,
                                       LegacyLossScaleOptimizer):
    """What ``keras_ema_opt.averaged()`` makes of a
    ``LegacyLossScaleOptimizer``: its inner optimizer keeps the averages
    (``AveragedLossScaleOptimizer``'s API), and its skipped steps still
    count in ``iterations``.

    Example:

    ```python
    import keras
    import keras_ema_opt
    from keras_ema_opt.compat import LegacyLossScaleOptimizer

    optimizer = keras_ema_opt.averaged(
        LegacyLossScaleOptimizer(keras.optimizers.Adam()),
        keras_ema_opt.EMA(0.99))
    ```
    """
