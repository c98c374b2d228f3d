"""Pieces shared by the backend modules (no framework imports here)."""

import contextlib

import keras


def keras_optimizer_class(name):
    """The Keras optimizer class called ``name`` (e.g. ``"Adam"``)."""
    return getattr(keras.optimizers, name)


@contextlib.contextmanager
def no_placement(variable):
    """A placement context that does nothing (backends without colocation)."""
    del variable
    yield


def build_scope():
    """Where the optimizer state is created: here, as it is."""
    return contextlib.nullcontext()


def assign_copy(optimizer, variable, value):
    """``variable <- value`` through a fresh buffer.

    JAX variables hold immutable arrays, and ``Variable.assign`` stores the
    array it is given: assigning another variable's array would make both
    variables share one buffer, which a donating ``jax.jit`` (the one
    ``fit()`` uses) then rejects ("Attempt to donate the same buffer twice",
    Keras 3.15 defect L3). ``ops.copy`` gives a buffer of its own everywhere.
    """
    del optimizer
    if isinstance(value, keras.Variable):
        value = value.value
    variable.assign(keras.ops.cast(keras.ops.copy(value), variable.dtype))


def check_no_tape(tape, backend_name):
    if tape is not None:
        raise ValueError(
            "`tape` is a TensorFlow `tf.GradientTape`, which the "
            f"'{backend_name}' backend does not have. Received: tape={tape!r}. "
            "Pass the loss as a callable that takes no arguments and "
            "returns the value to minimize, and leave `tape=None`."
        )


def value_visible(variable):
    """Whether reading ``variable`` now gives its current value (always,
    where variables are stateful)."""
    del variable
    return True


def attach_model(optimizer, model):
    """Nothing to do where the optimizer step reads the model's
    non-trainable variables directly."""
    del optimizer, model


def current_value(variable):
    """A copy of ``variable``'s value now."""
    return keras.ops.copy(variable.value)


def prepare_gradients(grads):
    """Gradients as they are (backends without sparse gradient types)."""
    return list(grads)


def sync_training_state(model):
    """Nothing to do where variables are always current."""
    del model


def prepare_model(model):
    """Nothing to adjust on the model an optimizer is built for."""
    del model


def step_gradients(optimizer, grads):
    """Gradients as the step receives them (no replicas to reduce over, or
    the backend reduces them itself)."""
    del optimizer
    return grads


def mark_step_made(optimizer, grads):
    """Nothing to note: only PyTorch's clipping writes gradients in
    place."""
    del optimizer, grads


def sync_initial_state(optimizer, variables):
    """Nothing to do where every replica starts from the same values."""
    del optimizer, variables


def is_chief():
    """Whether this process writes files (always, outside a multi-process
    run)."""
    return True


def on_create(optimizer):
    """Nothing to prepare when an optimizer is made."""
    del optimizer


def chief_only_scope():
    """A context for work the chief does alone (nothing to arrange)."""
    return contextlib.nullcontext()


def lerp_averages(pairs, weight, gated=False):
    """Update ``average <- average + weight * (value - average)`` for the
    ``(average, variable)`` pairs a fast path can take; return the others
    (here: all of them, for the engine's own ``keras.ops`` update, which
    XLA fuses into the compiled step). ``gated``: the weight may be exactly
    1 (copy) or 0 (keep), which must then be exact."""
    del weight, gated
    return pairs


def callable_rate(optimizer):
    """The optimizer's learning rate when it is a plain callable (Keras 2's
    ``learning_rate=lambda: ...``), else None. A compiled eager step calls
    it outside the program each step and passes the value in: traced, it
    would be read once and frozen (Keras' own eager step calls it each
    step)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    rate = getattr(inner, "_learning_rate", None)
    if rate is None or isinstance(rate, keras.Variable) or isinstance(
            rate, keras.optimizers.schedules.LearningRateSchedule):
        return None
    return rate if callable(rate) else None


@contextlib.contextmanager
def rate_given(optimizer, values):
    """Inside a compiled step: the learning rate is ``values[0]``, the value
    :func:`callable_rate` gave for this step (no change without one)."""
    if not values:
        yield
        return
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    rate = inner._learning_rate
    inner._learning_rate = values[0]
    try:
        yield
    finally:
        inner._learning_rate = rate
