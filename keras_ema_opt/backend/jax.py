"""JAX hooks: a jitted, donating eager step and stateless gradients."""

import collections
import contextlib
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.backend.common.stateless_scope import in_stateless_scope

import keras
from keras_ema_opt.backend import _common
from keras_ema_opt.backend import _jax_cpu

colocate_with = _common.no_placement
optimizer_variable = _common.optimizer_variable
scale_gradient = _common.scale_gradient
assign_copy = _common.assign_copy
current_value = _common.current_value
string_probe = _common.string_probe
prepare_gradients = _common.prepare_gradients
step_gradients = _common.step_gradients
mark_step_made = _common.mark_step_made
sync_initial_state = _common.sync_initial_state
check_build = _common.check_build
# `values` itself: under a JAX distribution every process measured the
# same global batches (`training_forward`).
sum_over_processes = _common.sum_over_processes
on_create = _common.on_create
build_scope = _common.build_scope
state_variable_role = _common.state_variable_role
lerp_averages = _common.lerp_averages


def widen(value, dtype):
    """``value`` cast to the wider ``dtype``, holding exactly what its own
    (half-precision) dtype holds. Inside a compiled step the new weight
    is a float32 result cast to bfloat16 or float16, and XLA, which allows
    excess precision, drops that rounding and its cast back: the average
    mixed the unrounded update, a value the weight never held (up to a
    rounding of the weight's dtype each step, unlike TensorFlow and
    PyTorch). ``reduce_precision`` keeps the rounding (float16's
    subnormals, which it flushes to zero, through
    ``_common.keep_float16_subnormals``)."""
    out = keras.ops.cast(value, dtype)
    source = jnp.dtype(getattr(value, "dtype", out.dtype))
    if source in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and (
            jnp.finfo(out.dtype).nmant > jnp.finfo(source).nmant):
        info = jnp.finfo(source)
        rounded = jax.lax.reduce_precision(out, exponent_bits=info.nexp,
                                           mantissa_bits=info.nmant)
        if source == jnp.dtype(jnp.float16):
            rounded = _common.keep_float16_subnormals(out, rounded)
        out = rounded
    return out


class OptimizerHooks:
    """Nothing to override on JAX: Keras' own step is already stateless."""


def keras_optimizer_class(name):
    """Keras' class; Adam and AdamW with the fused CPU step
    (``_common.FusedAdamStep`` over ``_jax_cpu``)."""
    return _common.with_fused_adam(name, _jax_cpu)


def resolve_jit_compile(requested):
    """``jax.jit`` helps on every device, CPU included."""
    return bool(requested)


def compiled_apply(optimizer, grads, variables):
    """One step; under ``jax.jit`` when called eagerly with concrete arrays.

    Inside a traced function (``fit()``'s compiled step, a user's own
    ``jax.jit``, a ``StatelessScope``) the caller's compilation applies.
    The compiled step donates the old buffers of the model and optimizer
    variables, as ``fit()`` does, unless two variables share a buffer.
    """
    if (
        not optimizer.jit_compile
        or in_stateless_scope()
        or any(isinstance(g, jax.core.Tracer) for g in grads)
    ):
        return optimizer.apply(grads, variables)
    _built_on(optimizer, variables)
    grads, variables = optimizer._filter_empty_gradients(grads, variables)
    model_vars = list(optimizer._trainable_variables)
    opt_vars = optimizer.variables
    averager = getattr(optimizer, "_averager", None)
    # Averaged non-trainable variables: read by the step, and written by
    # its overwrite with their averages (`ema_overwrite_frequency`).
    read_vars = [v for _, v in averager.extras()] if averager else []
    key = (tuple(id(v) for v in variables), tuple(id(v) for v in opt_vars))
    model_values = [v.value for v in model_vars]
    opt_values = [v.value for v in opt_vars]
    read_values = [v.value for v in read_vars]
    donate = _distinct_buffers(model_values + opt_values,
                               list(grads) + read_values)
    cache = optimizer.__dict__.setdefault("_keo_compiled", {})
    fn = cache.get((key, donate))
    if fn is None:
        fn = _make_step(optimizer, variables, model_vars, opt_vars, read_vars,
                        donate)
        cache[(key, donate)] = fn
    rate = _common.callable_rate(optimizer)
    rate_values = [] if rate is None else [
        jnp.asarray(keras.ops.convert_to_numpy(rate()), "float32")]
    new_model, new_opt, new_read = fn(model_values, opt_values, list(grads),
                                      read_values, rate_values)
    for var, value in zip(model_vars, new_model):
        var.assign(value)
    for var, value in zip(opt_vars, new_opt):
        var.assign(value)
    for var, value in zip(read_vars, new_read):
        var.assign(value)
    return optimizer.iterations


def stateless_step(optimizer, grads, trainable_variables):
    """Run an eager step of ``optimizer`` as its ``stateless_apply`` on the
    variables' values, assigned back; False inside a traced step or a
    ``StatelessScope`` (the caller's own step runs there).

    Keras' loss-scale wrappers step with a ``cond`` whose branches assign
    their variables; JAX traces both branches, and the assignments leaked
    their tracers (``UnexpectedTracerError``): their stateless step, which
    ``fit()`` runs, returns the values instead.
    """
    grads = list(grads)
    if in_stateless_scope() or any(isinstance(g, jax.core.Tracer)
                                   for g in grads):
        return False
    variables = list(optimizer._trainable_variables
                     if trainable_variables is None else trainable_variables)
    _built_on(optimizer, variables)
    # `stateless_apply` takes a gradient for each variable the optimizer
    # was built on, in that order: those given go to their places, None
    # elsewhere (no step for them, as an eager step of a subset takes).
    built = list(optimizer._trainable_variables)
    place = {optimizer._var_key(v): i for i, v in enumerate(built)}
    full = [None] * len(built)
    for grad, var in zip(grads, variables):
        full[place[optimizer._var_key(var)]] = grad
    opt_vars = optimizer.variables
    before = [v.value for v in opt_vars]
    # The averages of non-trainable variables (BatchNorm statistics): the
    # stateless step leaves them, as to fit()'s step (`attach_model`);
    # they are updated right after, from the statistics the caller's
    # forward pass left.
    averaging = getattr(optimizer, "inner_optimizer", optimizer)
    has_extras = getattr(averaging, "_averager", None) is not None
    averaging._keo_fit_step = has_extras
    try:
        new_model, new_opt = optimizer.stateless_apply(
            before, full, [v.value for v in built])
    finally:
        averaging._keo_fit_step = False
    held, values = [], []
    if has_extras:
        held = [v for _, v in averaging._averager.extras()]
        values, new_opt = _update_extras(averaging, optimizer, held, before,
                                         new_opt, [v.value for v in held])
    for var, value in zip(built + opt_vars + held,
                          list(new_model) + list(new_opt) + list(values)):
        var.assign(value)
    return True


def _built_on(optimizer, variables):
    """Build ``optimizer`` on ``variables`` where it is not built (as
    Keras' ``apply`` does), and refuse variables it was not built on."""
    if not optimizer.built:
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)
        optimizer.built = True
    optimizer._check_variables_are_known(variables)


def _make_step(optimizer, variables, model_vars, opt_vars, read_vars, donate):
    def step(model_values, opt_values, grads, read_values, rate_values):
        mapping = list(zip(model_vars, model_values))
        mapping += list(zip(opt_vars, opt_values))
        mapping += list(zip(read_vars, read_values))
        with StatelessScope(state_mapping=mapping) as scope, \
                _common.rate_given(optimizer, rate_values):
            optimizer.apply(grads, variables)
        return (
            [scope.get_current_value(v) for v in model_vars],
            [scope.get_current_value(v) for v in opt_vars],
            # `ema_overwrite_frequency` writes their averages into them.
            [scope.get_current_value(v) for v in read_vars],
        )

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def value_visible(variable):
    """Inside a stateless step only the variables it maps have their current
    value; any other reads as a constant captured when it was traced."""
    if not in_stateless_scope():
        return True
    return get_stateless_scope().get_current_value(variable) is not None


def attach_model(optimizer, model):
    """Average ``model``'s non-trainable variables in its ``fit()``.

    JAX's ``fit()`` step calls ``optimizer.stateless_apply`` with the
    trainable variables only, while the new non-trainable values (BatchNorm
    statistics) come back from the forward pass beside it. The model's
    ``train_step`` is wrapped (on this instance) so that, after Keras' step,
    the averages of the non-trainable variables take one update from the
    new values, with the counters the step itself used.
    """
    if getattr(model, "_keo_averaging_step", None) is optimizer:
        return
    original = model.train_step
    if getattr(original, "_keo_wrapped", None) is not None:
        original = original._keo_wrapped

    def train_step(state, data):
        current = getattr(model, "optimizer", None)
        if current is not optimizer and getattr(
                current, "inner_optimizer", None) is not optimizer:
            # Recompiled with another optimizer since: Keras' own step.
            return original(state, data)
        before = state[2]
        optimizer._keo_fit_step = True  # while tracing: statistics come next
        try:
            logs, state = original(state, data)
        finally:
            optimizer._keo_fit_step = False
        trainable, non_trainable, after, metrics = state
        non_trainable, after = _average_non_trainable(
            optimizer, model, before, after, non_trainable
        )
        return logs, (trainable, non_trainable, after, metrics)

    train_step._keo_wrapped = original
    model.train_step = train_step
    model._keo_averaging_step = optimizer
    model.train_function = None  # rebuilt around the wrapped step


def prepare_model(model):
    """Keep the per-step state of ``model``'s ``fit()`` out of Keras'
    attribute tracking.

    After each step (of ``fit``, ``evaluate`` and ``predict``) Keras' JAX
    trainer stores the new state on the model, ``model._jax_state =
    {...}``, for callbacks that sync it, and ``Layer.__setattr__`` walks it
    array by array through its tracker: about 0.85 us an array
    (``python -m benchmarks.host``), 0.3 ms a step for a 60-layer MLP's 360
    arrays of Adam state and one more array for each averaged variable,
    for values that are never variables or layers. On this model
    instance, the dict is stored as a ``collections.UserDict``, a mapping
    the tracker passes over whole; Keras reads it with ``.get`` as before.
    Nothing changes with Flax NNX (its own ``__setattr__`` rules) or where
    Keras has no ``_setattr_hook``.
    """
    from keras.src.backend.config import is_nnx_enabled

    base = getattr(type(model), "_setattr_hook", None)
    if (base is None or is_nnx_enabled()
            or "_setattr_hook" in vars(model)):
        return
    owner = weakref.ref(model)

    def hook(name, value):
        layer = owner()
        if layer is not None:
            name, value = base(layer, name, value)
        if name == "_jax_state" and type(value) is dict:
            # A mapping that is no dict: the tracker passes over it whole.
            value = collections.UserDict(value)
        return name, value

    object.__setattr__(model, "_setattr_hook", hook)


def _average_non_trainable(optimizer, model, before, after, non_trainable):
    return _update_extras(optimizer, model.optimizer,
                          model.non_trainable_variables, before, after,
                          non_trainable)


def _update_extras(optimizer, stepping, held, before, after, values):
    """One update of ``optimizer``'s averages of non-trainable variables
    after a stateless step of ``stepping`` (itself, or the loss-scale
    wrapper around it) took ``stepping.variables`` from ``before`` to
    ``after``; ``held`` are the non-trainable variables, at ``values``.
    Returns the new ``(values, after)``."""
    averager = optimizer._averager
    extras = averager.extras()
    if not extras:
        return values, after
    state_vars = stepping.variables
    # The counters as the optimizer's step saw them, and whether the step
    # was taken: a loss-scale optimizer skips non-finite ones, and halves
    # its scale then, which a step taken never does (a skipped step may
    # still count in `iterations`: compat.LegacyLossScaleOptimizer).
    position = {id(v): i for i, v in enumerate(state_vars)}
    scale = getattr(stepping, "dynamic_scale", None)
    if scale is not None and id(scale) in position:
        i_scale = position[id(scale)]
        applied = jnp.greater_equal(after[i_scale], before[i_scale])
    else:
        i_iter = position[id(optimizer._iterations)]
        applied = jnp.not_equal(after[i_iter], before[i_iter])
    # One scope: the overwrite reads the averages the update just wrote.
    mapping = list(zip(state_vars, before))
    mapping += list(zip(held, values))
    frequency = optimizer.ema_overwrite_frequency
    with StatelessScope(state_mapping=mapping) as scope:
        averager.update(optimizer, extras_only=True, applied=applied)
        if frequency:
            averager.overwrite(optimizer, frequency, extras_only=True,
                               applied=applied)
    after = list(after)
    for i, _ in extras:
        for slot in averager.slots[i]:
            after[position[id(slot)]] = scope.get_current_value(slot)
    return [scope.get_current_value(v) for v in held], after


def _distinct_buffers(donated, kept):
    """Whether ``donated`` may be donated: no two of them are one array,
    and none is also passed undonated (a gradient that is a variable's own
    value, ``apply_gradients([(w.value, w)])``, or a value only read)."""
    ids = {id(v) for v in donated}
    return len(ids) == len(donated) and not any(id(v) in ids for v in kept)


def compute_gradients(loss, var_list, tape=None):
    """Gradients of a callable loss through ``jax.vjp`` over variable values.

    The loss is evaluated with the variables of ``var_list`` replaced by
    traced values (a ``StatelessScope``); a non-scalar loss is summed, as a
    TensorFlow tape does. With a callable ``var_list`` the loss runs once
    first, so that variables it creates exist, in a ``StatelessScope`` of
    its own: what it assigns (BatchNorm's statistics, a dropout seed) is
    dropped, and the traced run's is kept, so the loss's side effects
    happen once, as on TensorFlow (they happened twice). The variables it
    creates are made when that scope ends, from their initializers (one
    made from a value, which Keras refuses there, makes that first run a
    plain one).
    """
    _common.check_no_tape(tape, "jax")
    if callable(var_list):
        try:
            with StatelessScope():
                loss()
        except ValueError as e:
            if "while in a stateless scope" not in str(e):
                raise
            # A variable the loss makes from a value, not an initializer,
            # cannot be made in a StatelessScope: the first run is a plain
            # one (its side effects then happen twice, this call alone).
            loss()
        var_list = var_list()
    var_list = list(var_list)
    differentiated = {id(v) for v in var_list}
    updated = []  # the other variables the loss assigned, in order

    def total(values):
        with _Recording(state_mapping=list(zip(var_list, values))) as scope:
            value = jnp.sum(loss())
        updated[:] = [v for v in scope.assigned_variables
                      if id(v) not in differentiated]
        return value, [scope.get_current_value(v) for v in updated]

    grads, new_values = jax.grad(total, has_aux=True)(
        [v.value for v in var_list])
    # What the forward pass changed besides the variables differentiated
    # (BatchNorm's moving statistics, a dropout seed), as TensorFlow's and
    # PyTorch's eager passes change it.
    for variable, value in zip(updated, new_values):
        variable.assign(value)
    return list(zip(grads, var_list))


class _Recording(StatelessScope):
    """A ``StatelessScope`` that also keeps the variables assigned in it
    (Keras' keeps their values by ``id`` only)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._assigned = {}

    def add_update(self, update):
        super().add_update(update)
        self._assigned.setdefault(id(update[0]), update[0])

    @property
    def assigned_variables(self):
        return list(self._assigned.values())


def aggregate_gradients(optimizer, grads_and_vars):
    """Identity: under ``keras.distribution`` gradients are already global.

    A data-parallel step computes its gradient over the global batch inside
    one jitted program; XLA inserts the all-reduce.
    """
    del optimizer
    return list(grads_and_vars)


def sync_training_state(model):
    """Write ``fit()``'s in-flight JAX state back into the variables."""
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None and getattr(model, "_jax_state", None) is not None:
        sync()


@contextlib.contextmanager
def chief_only_scope():
    """Work the chief does alone (``model.save``): Keras creates variables
    while saving, which under a multi-process distribution would be global
    arrays, placed collectively by every process. They are made local for
    the duration."""
    from keras.src.distribution import distribution_lib

    current = distribution_lib.distribution()
    if current is None or jax.process_count() == 1:
        yield
        return
    distribution_lib.set_distribution(None)
    try:
        yield
    finally:
        distribution_lib.set_distribution(current)


@contextlib.contextmanager
def whole_values_scope(variables):
    """A context in which the chief reads each of ``variables`` whole, for
    ``model.save`` (``save_on_chief``): a variable sharded over devices of
    other processes (a ``ModelParallel`` layout across processes) holds
    only this process's shards, which Keras' saving cannot read. Every
    process enters it and gathers each such value, in the variables'
    order (a collective each); the chief holds the whole values, as
    arrays on its CPU device, until the context ends (or a gather fails),
    and its global arrays then again."""
    held = []
    chief = is_chief()
    # Held on the host (the CPU device), not on the accelerator that holds
    # this process's shards, where the whole model may not fit.
    try:
        host = jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS=cuda)
        host = None
    try:
        for variable in variables:
            value = getattr(variable, "_value", None)
            if not isinstance(value, jax.Array) or (
                    value.is_fully_addressable or value.is_fully_replicated):
                continue
            whole = host_array(value)  # a collective: every process joins
            if chief:
                held.append((variable, value))
                variable._value = jax.device_put(whole, host)
        yield
    finally:  # also where a gather failed part way
        for variable, value in reversed(held):
            variable._value = value


def is_chief():
    """Process 0 of a multi-process JAX run (``jax.distributed``)."""
    return jax.process_index() == 0


def from_chief(value):
    """Process 0's numpy ``value`` on every process of a multi-process JAX
    run (a broadcast every process joins: a replicated array must hold
    the same value on each); ``value`` itself in one process."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    value = np.asarray(value)
    return np.asarray(
        multihost_utils.broadcast_one_to_all(value)).astype(value.dtype)


def any_process(flag):
    """Whether ``flag`` is true on any process of a multi-process JAX run
    (an all-gather every process joins); ``flag`` itself in one process."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(
        np.array([bool(flag)], np.int32))
    return bool(np.any(flags))


def training_forward(model, on_pass):
    """A function running ``model(inputs, training=True)`` compiled: Keras'
    stateless call under ``jax.jit``, whose new non-trainable values (the
    layers' updates) are then assigned to the model's variables;
    ``on_pass()`` is called as each trace begins."""
    @jax.jit
    def new_values(trainable, non_trainable, inputs):
        on_pass()
        _, values = model.stateless_call(
            trainable, non_trainable, inputs, training=True)
        return values

    def run(inputs):
        from keras.src.backend.jax.trainer import _distribute_data

        # As Keras' fit() does: under a distribution, each process's batch
        # is its share of one global batch (the normalization's batch). In
        # one process, a batch the devices cannot split evenly (a last,
        # shorter one) runs whole on each instead, as it did.
        try:
            inputs = _distribute_data(inputs)
        except ValueError:
            if jax.process_count() > 1:
                raise
            inputs = keras.tree.map_structure(jax.device_put, inputs)
        values = new_values(
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            inputs,
        )
        for variable, value in zip(model.non_trainable_variables, values):
            variable.assign(value)
        return _common.batch_size(inputs)  # the global batch's
    return run


def host_array(value):
    """A numpy copy of ``value``, whole: an array sharded over devices of
    other processes (a ``ModelParallel`` layout across processes) is
    gathered, a collective every process joins."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        if value.is_fully_replicated:  # whole on this process too
            return np.asarray(value.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value,
                                                            tiled=True))
    return keras.ops.convert_to_numpy(value)


def forward_spans_processes():
    """Whether a forward pass needs every process: under a distribution
    over several processes, whose variables are global arrays."""
    from keras.src.distribution import distribution_lib

    return jax.process_count() > 1 and (
        distribution_lib.distribution() is not None)


def fit_failed():
    """Whether ``finalize_variable_values`` is being called by a ``fit()``
    that is ending in an exception.

    Keras' JAX ``fit()`` calls it from a ``finally`` block, after an error
    too, where the other backends' ``fit()`` does not call it; after an
    error in the first step it finds the variables emptied (their values
    live in the step's state), and a read of one would replace the error.
    Its local ``training_finished`` tells the two apart.
    """
    frame = sys._getframe(1)
    while frame is not None and (
            frame.f_code.co_name == "finalize_variable_values"):
        frame = frame.f_back
    return (frame is not None and frame.f_code.co_name == "fit"
            and frame.f_locals.get("training_finished") is False
            and sys.exc_info()[0] is not None)


def executing_eagerly():
    """Always: an optimizer builds only eagerly on JAX (its stateless
    step needs it built)."""
    return True
