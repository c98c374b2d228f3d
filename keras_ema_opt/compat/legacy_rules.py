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

import keras
import numpy as np
from keras import ops

from keras_ema_opt.errors import InvalidArgumentError
from keras_ema_opt.optimizer import Optimizer
from keras_ema_opt.optimizers import AveragedLossScaleOptimizer

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
class LegacyLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras 3's ``LossScaleOptimizer`` counting its skipped steps, as
    Keras 2's did.

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

    Example:

    ```python
    import keras
    from keras_ema_opt.compat import LegacyLossScaleOptimizer

    optimizer = LegacyLossScaleOptimizer(keras.optimizers.Adam(1e-3))
    ```
    """

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
