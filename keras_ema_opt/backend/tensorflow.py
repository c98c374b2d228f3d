"""TensorFlow hooks: tf.distribute aggregation, XLA, sparse gradients, tapes."""

import tensorflow as tf
from keras.src.backend.tensorflow.optimizer import TFOptimizer

import keras
from keras_ema_opt.backend import _common

keras_optimizer_class = _common.keras_optimizer_class
value_visible = _common.value_visible
attach_model = _common.attach_model
sync_training_state = _common.sync_training_state


class OptimizerHooks:
    """Overrides of Keras' ``TFOptimizer`` internals."""

    def _all_reduce_sum_gradients(self, grads_and_vars):
        # Keras 3 sums over replicas inside its update step. When the
        # gradients came through `apply_gradients`, that sum was already done
        # by `aggregate_gradients` (or skipped on request, as
        # `skip_gradients_aggregation=True` asks): do not do it twice.
        if getattr(self, "_gradients_aggregated", False):
            return list(grads_and_vars)
        return super()._all_reduce_sum_gradients(grads_and_vars)


def resolve_jit_compile(requested):
    """Keras 2's rule: XLA only where a GPU is present (it helps only there)."""
    return bool(requested and tf.config.list_physical_devices("GPU"))


def compiled_apply(optimizer, grads, variables):
    """One step; under XLA when ``jit_compile`` holds and we run eagerly.

    Inside a ``tf.function`` (a custom loop that compiles itself, or
    ``fit()``) the caller's compilation applies and we add nothing.
    """
    if not optimizer.jit_compile or not tf.executing_eagerly():
        return optimizer.apply(grads, variables)
    if not optimizer.built:
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)
        optimizer.built = True
    key = tuple(id(v) for v in variables)
    cache = optimizer.__dict__.setdefault("_keo_compiled", {})
    fn = cache.get(key)
    if fn is None:
        fn = tf.function(
            lambda g: optimizer.apply(g, variables), jit_compile=True
        )
        cache[key] = fn
    # `None` gradients cannot cross the tf.function boundary as such.
    grads, variables = optimizer._filter_empty_gradients(grads, variables)
    if len(variables) != len(key):
        return optimizer.apply(grads, variables)
    fn(list(grads))
    return optimizer.iterations


def compute_gradients(loss, var_list, tape=None):
    """Keras 2's ``compute_gradients``: a tape around a callable loss."""
    if tape is None:
        tape = tf.GradientTape()
    if callable(loss):
        with tape:
            if not callable(var_list):
                tape.watch([_tf_variable(v) for v in var_list])
            loss = loss()
            if callable(var_list):
                var_list = var_list()
    var_list = list(var_list)
    grads = tape.gradient(loss, [_tf_variable(v) for v in var_list])
    return list(zip(grads, var_list))


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def aggregate_gradients(optimizer, grads_and_vars):
    """Sum over the replicas of the current tf.distribute strategy.

    Outside a replica context (no strategy) the pairs come back unchanged.
    """
    return TFOptimizer._all_reduce_sum_gradients(optimizer, grads_and_vars)


def prepare_gradients(grads):
    """Sum the values of duplicate indices in ``tf.IndexedSlices`` (Keras 2)."""
    return [_deduplicate(g) if isinstance(g, tf.IndexedSlices) else g
            for g in grads]


def _deduplicate(grad):
    unique, positions = tf.unique(grad.indices)
    summed = tf.math.unsorted_segment_sum(
        grad.values, positions, tf.shape(unique)[0]
    )
    return tf.IndexedSlices(summed, unique, grad.dense_shape)


def colocate_with(variable):
    """Place new optimizer state beside ``variable`` under tf.distribute."""
    strategy = tf.distribute.get_strategy()
    return strategy.extended.colocate_vars_with(_tf_variable(variable))


def assign_copy(optimizer, variable, value):
    """``variable <- value`` on every replica of the variable."""
    strategy = optimizer._distribution_strategy
    strategy.extended.update(
        _tf_variable(variable),
        lambda target, source: target.assign(tf.cast(source, target.dtype)),
        args=(_tf_variable(value),),
    )


def current_value(variable):
    """A copy of ``variable``'s value now, read eagerly.

    The optimizer is often built inside ``fit()``'s first traced step: a
    read traced there would run after that step's forward pass had updated
    the BatchNorm statistics, not now.
    """
    with tf.init_scope():
        return tf.identity(_tf_variable(variable).read_value())

