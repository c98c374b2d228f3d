"""Pieces shared by the backend modules (no framework imports here)."""

import contextlib
import functools

import keras
import numpy as np


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


# float16's smallest normal value (2**-14) and the spacing of its
# subnormals below it (2**-24).
_FLOAT16_TINY = float(np.finfo(np.float16).tiny)
_FLOAT16_SUBNORMAL = float(np.finfo(np.float16).smallest_subnormal)


def keep_float16_subnormals(widened, rounded):
    """``rounded``, XLA's ``reduce_precision`` of ``widened`` to float16's
    bits (which keeps a compiled step's rounding of a float16 weight, but
    flushes float16's subnormals, below 6.1e-5, to zero), with those
    values rounded to their own spacing instead (2**-24)."""
    subnormal = keras.ops.multiply(
        keras.ops.round(keras.ops.divide(widened, _FLOAT16_SUBNORMAL)),
        _FLOAT16_SUBNORMAL)
    return keras.ops.where(
        keras.ops.less(keras.ops.abs(widened), _FLOAT16_TINY), subnormal,
        rounded)


def widen(value, dtype):
    """``value`` (a variable's, of a half-precision float dtype) cast to
    the wider ``dtype`` the averages are mixed in: here, a cast."""
    return keras.ops.cast(value, dtype)


def state_variable_role(role):
    """Where a slot or an average of the kind ``role`` is created: as it
    is (its framework names it as Keras does)."""
    del role
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


def stateless_step(optimizer, grads, trainable_variables):
    """False: the optimizer's own stateful step runs (JAX runs a
    loss-scale wrapper's eager step through its stateless one)."""
    del optimizer, grads, trainable_variables
    return False


def scale_gradient(grad, factor):
    """``grad`` times a scalar ``factor``, in the gradient's dtype."""
    return keras.ops.multiply(grad, keras.ops.cast(factor, grad.dtype))


def optimizer_variable(variable):
    """An optimizer's new variable, as it is (TensorFlow adds
    ``tf.Variable``'s methods for Keras 2 code)."""
    return variable


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
    """Nothing to do where every replica starts from the same values:
    returns False (no value replaced)."""
    del optimizer, variables
    return False


def batch_size(inputs):
    """The number of samples of a batch of model inputs (a structure)."""
    import keras

    return int(keras.tree.flatten(inputs)[0].shape[0])


def string_probe(shape):
    """No string tensor: Keras' JAX and PyTorch backends feed a model no
    strings (``predict`` converts its inputs to their tensors)."""
    del shape
    return None


def host_array(value):
    """A numpy copy of ``value``, whole."""
    import keras

    return keras.ops.convert_to_numpy(value)


def check_build(optimizer):
    """Nothing this backend refuses when an optimizer is built."""
    del optimizer


def forward_spans_processes():
    """Whether a forward pass needs every process (no: each runs its own
    copy of the model)."""
    return False


def sum_over_processes(values):
    """The sum of ``values`` (a float64 numpy array) over the processes of
    a multi-process run: ``values`` itself outside one."""
    return values


def is_chief():
    """Whether this process writes files (always, outside a multi-process
    run)."""
    return True


def any_process(flag):
    """Whether ``flag`` is true on any process of a multi-process run (a
    collective every process joins): ``flag`` itself outside one."""
    return bool(flag)


def any_process_over(sum_over_processes):
    """``any_process`` of a backend whose ``sum_over_processes`` is an
    all-reduce every process joins: the sum of the flags, positive."""
    def any_process(flag):
        total = sum_over_processes(np.array([float(bool(flag))]))
        return bool(total[0] > 0)
    return any_process


def from_chief(value):
    """The chief's numpy ``value`` on every process of a multi-process run
    (a collective every process joins): ``value`` itself outside one, and
    on TensorFlow, whose multi-worker strategies give a new variable the
    chief's initial value themselves."""
    return value


def from_chief_over(sum_over_processes, is_chief):
    """``from_chief`` of a backend whose ``sum_over_processes`` is an
    all-reduce every process joins: the sum of the chief's value and the
    others' zeros (exact in float64 for 32-bit integers)."""
    def from_chief(value):
        value = np.asarray(value)
        mine = value if is_chief() else np.zeros_like(value)
        total = sum_over_processes(mine.astype(np.float64))
        return np.asarray(total).astype(value.dtype)
    return from_chief


def on_create(optimizer):
    """Nothing to prepare when an optimizer is made."""
    del optimizer


def fit_failed():
    """Whether ``finalize_variable_values`` is being called by a ``fit()``
    that is ending in an exception: never here (Keras' ``fit()`` calls it
    only once its epochs are done)."""
    return False


def chief_only_scope():
    """A context for work the chief does alone (nothing to arrange)."""
    return contextlib.nullcontext()


def whole_values_scope(variables):
    """A context in which the chief reads each of ``variables`` whole
    (every process enters it; here, each holds its values whole)."""
    del variables
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


def with_fused_adam(name, kernel):
    """Keras' class ``name``; for Adam and AdamW, with
    :class:`FusedAdamStep` in front, running ``kernel`` (``_jax_cpu``,
    ``_tf_cpu``)."""
    cls = keras_optimizer_class(name)
    if name not in ("Adam", "AdamW"):
        return cls
    return _with_fused_step(cls, kernel)


@functools.lru_cache(maxsize=None)  # one class per rule: identity holds
def _with_fused_step(cls, kernel):
    return type(cls.__name__, (FusedAdamStep, cls),
                {"__module__": cls.__module__, "_fused_kernel": kernel})


class FusedAdamStep:
    """Keras' Adam update on a CPU as one C++ kernel over every float32
    variable of the step, with its decoupled weight decay (AdamW, or Adam
    with ``weight_decay``) and the step's averages folded in
    (``adam_average.h``): one pass over each tensor, in place of Keras'
    ops per variable (and, on JAX, XLA's CPU loops, one per output, which
    read the new moments and weights back). The rule is Keras', in float32
    and in its order of operations, with the step size ``alpha = lr sqrt(1
    - b2^t) / (1 - b1^t)`` computed by the same ``keras.ops`` as Keras' own
    step: equal to Keras' step op by op, to the bit (tested). Where the
    kernel cannot serve (see :func:`fused_adam_plan` and the backend's
    ``serves``), Keras' own step runs, its weight decay first.

    ``_fused_kernel``: the backend's kernel module, with ``serves(grads,
    variables)`` and ``apply(optimizer, scalars, members, averages,
    decay)``.
    """

    _fused_kernel = None

    def _apply_weight_decay(self, variables):
        # Keras calls this right before `_backend_update_step` (in both
        # branches of gradient accumulation): the decay is held for the
        # kernel, which applies it in its pass, or for Keras' own step,
        # which applies it first (`_release_weight_decay`).
        self._release_weight_decay()  # none left from a step that failed
        if self.weight_decay is None:
            return
        if self.gradient_accumulation_steps:
            super()._apply_weight_decay(variables)
            return
        self.__dict__["_held_weight_decay"] = list(variables)

    def _release_weight_decay(self):
        """The variables whose weight decay :meth:`_apply_weight_decay`
        held for this step (None: none held)."""
        return self.__dict__.pop("_held_weight_decay", None)

    def _backend_update_step(self, grads, trainable_variables,
                             learning_rate):
        held = self._release_weight_decay()
        plan = fused_adam_plan(self, grads, trainable_variables)
        if plan is None:
            if held is not None:
                super()._apply_weight_decay(held)
            return super()._backend_update_step(grads, trainable_variables,
                                                learning_rate)
        ops = keras.ops
        lr = ops.cast(learning_rate, "float32")
        local_step = ops.cast(self.iterations + 1, "float32")
        beta_1_power = ops.power(ops.cast(self.beta_1, "float32"),
                                 local_step)
        beta_2_power = ops.power(ops.cast(self.beta_2, "float32"),
                                 local_step)
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        decayed = set() if held is None else {
            id(v) for v in held if self._use_weight_decay(v)}
        # The Python numbers rounded to float32 below, as Keras' step does
        # (its decay: `variable - variable * wd * lr`, both cast first).
        constants = [alpha, 1 - self.beta_1, 1 - self.beta_2, self.epsilon,
                     self.weight_decay if decayed else 0.0, lr]
        averager, groups = plan
        folding = any(groups[1:])
        weights = averager.fold_weights(self) if folding else []
        for k, members in enumerate(groups):
            if not members:
                continue
            scalars = ops.stack([ops.cast(c, "float32")
                                 for c in constants + weights[:k]])
            parts = {True: [], False: []}  # a kernel call each: decayed or not
            for member in members:
                parts[id(member[1]) in decayed].append(member)
            for decay, part in parts.items():
                if part:
                    self._fused_kernel.apply(self, scalars, part, k, decay)
        if folding:
            averager.folded([var for members in groups[1:]
                             for _, var, _, _ in members])


def fused_adam_plan(optimizer, grads, variables):
    """``(averager, groups)`` for the fused step, or None where Keras' own
    step must run: ``groups[k]`` holds ``(grad, variable, index, slots)``
    of the variables updated with ``k`` averages (0 where the averaging
    engine updates them itself: another dtype, or a step under gradient
    accumulation, whose averages move only on real steps)."""
    from keras_ema_opt.optimizer import not_overridden

    kernel = optimizer._fused_kernel
    # A subclass's own rule is its own; so is a hyperparameter that is not
    # a plain number (a tensor, a callable).
    if not not_overridden(optimizer, keras.optimizers.Adam, "update_step"):
        return None
    decay = () if optimizer.weight_decay is None else (
        optimizer.weight_decay,)
    if optimizer.amsgrad or not all(isinstance(c, (int, float)) for c in (
            optimizer.beta_1, optimizer.beta_2, optimizer.epsilon, *decay)):
        return None
    variables = list(variables)
    if len({id(v) for v in variables}) != len(variables) or any(
            g is None or tuple(g.shape) != tuple(v.shape)
            for g, v in zip(grads, variables)):
        return None
    if not kernel.serves(grads, variables):
        return None
    averager = getattr(optimizer, "_averager", None)
    fold = averager is not None and not (
        optimizer.gradient_accumulation_steps)
    groups = [[] for _ in range(kernel.MAX_AVERAGES + 1)]
    for grad, var in zip(grads, variables):
        slots = averager.fold_slots_of(optimizer, var) if fold else None
        if not slots or len(slots) > kernel.MAX_AVERAGES or any(
                s.dtype != "float32" for s in slots):
            slots = ()
        groups[len(slots)].append(
            (grad, var, optimizer._get_variable_index(var), tuple(slots)))
    return averager, groups
