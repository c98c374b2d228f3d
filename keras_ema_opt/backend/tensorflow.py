"""TensorFlow hooks: tf.distribute aggregation, XLA, sparse gradients, tapes."""

import contextlib
import weakref

import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util

import keras
from keras_ema_opt.backend import _common
from keras_ema_opt.backend import _tf_cpu

value_visible = _common.value_visible
attach_model = _common.attach_model
prepare_model = _common.prepare_model
sync_training_state = _common.sync_training_state
fit_failed = _common.fit_failed
# Keras' TensorFlow step all-reduces inside `_backend_update_step`, and
# tf.distribute creates mirrored variables with the same initial values.
step_gradients = _common.step_gradients
mark_step_made = _common.mark_step_made
sync_initial_state = _common.sync_initial_state
host_array = _common.host_array
from_chief = _common.from_chief
forward_spans_processes = _common.forward_spans_processes
chief_only_scope = _common.chief_only_scope
whole_values_scope = _common.whole_values_scope
stateless_step = _common.stateless_step
_tf_variable = _tf_cpu.tf_variable


def string_probe(shape):
    """Empty strings of ``shape``, as a model with a string input takes
    them (a numpy array of strings is no dtype Keras knows)."""
    return tf.fill(shape, "")


def lerp_averages(pairs, weight, gated=False):
    """``a <- a - weight (a - x)`` as one fused kernel per average
    (``ResourceApplyGradientDescent``), in place of the engine's five graph
    ops. Where the weight may be exactly 1 or 0 (``gated``: a strategy
    with ``start_step`` or ``every``), the step picks one of three branches
    by the weight, once for all the averages: keep them (0), copy the
    variables exactly (1), or the kernel; the engine's exact ``where`` form
    costs seven passes over each average in a graph step. Not under a
    ``tf.distribute`` strategy (its mirrored variables are updated by the
    engine, also when a step on its variables runs outside its scope),
    nor across dtypes, nor for bfloat16 and float16 averages: the kernel
    computes in the variable's dtype, with the weight and ``a - x``
    rounded to it, where the engine mixes them in float32 and rounds
    once (as the JAX step and torch's ``lerp``)."""
    if tf.distribute.has_strategy() or any(
            isinstance(_tf_variable(slot), tf.distribute.DistributedValues)
            for slot, _ in pairs):
        # Also outside the strategy's scope: a cross-replica step on
        # mirrored variables (the kernel would write one copy).
        return pairs
    rest, fused = [], []
    for slot, var in pairs:
        a, x = _tf_variable(slot), _tf_variable(var)
        if a.dtype != x.dtype or not a.dtype.is_floating or (
                a.dtype.size < 4):
            rest.append((slot, var))
        else:
            fused.append((a, x))
    if not fused:
        return rest

    def mix():
        cast = {}
        for a, x in fused:
            if a.dtype not in cast:
                cast[a.dtype] = tf.cast(weight, a.dtype)
            tf.raw_ops.ResourceApplyGradientDescent(
                var=a.handle, alpha=cast[a.dtype],
                delta=a.read_value() - x.read_value())
        return tf.constant(True)

    if not gated:
        mix()
        return rest

    def copy():
        for a, x in fused:
            a.assign(x.read_value())
        return tf.constant(True)

    weight = tf.convert_to_tensor(weight, tf.float32)
    branch = tf.where(tf.equal(weight, 0.0), 0,
                      tf.where(tf.equal(weight, 1.0), 1, 2))
    tf.switch_case(branch, [lambda: tf.constant(True), copy, mix])
    return rest


def keras_optimizer_class(name):
    """Keras' class; Adam and AdamW with the fused CPU step
    (``_common.FusedAdamStep`` over ``_tf_cpu``)."""
    return _common.with_fused_adam(name, _tf_cpu)


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


# tf.Variable's methods a Keras 2 optimizer called on its slots (tf_keras'
# own SGD and Adam: `m.scatter_add(...)` for sparse gradients), which
# Keras 3's variables lack.
_TF_VARIABLE_METHODS = (
    "scatter_add", "scatter_sub", "scatter_update", "scatter_max",
    "scatter_min", "scatter_mul", "scatter_div", "batch_scatter_update",
    "scatter_nd_add", "scatter_nd_sub", "scatter_nd_update",
    "scatter_nd_max", "scatter_nd_min", "sparse_read", "gather_nd",
    "read_value")


def _delegate(name):
    def method(self, *args, **kwargs):
        return getattr(self.value, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"``tf.Variable.{name}`` of the variable's value."
    return method


class _Keras2SlotVariable(keras.Variable):
    """A Keras 3 variable with ``tf.Variable``'s sparse and read methods
    (``scatter_add``, ``sparse_read``, ...), run on its ``tf.Variable`` (a
    distributed one under a strategy), as Keras 2's slots had them."""


for _name in _TF_VARIABLE_METHODS:
    setattr(_Keras2SlotVariable, _name, _delegate(_name))


def scale_gradient(grad, factor):
    """``grad`` times a scalar ``factor`` in its dtype; a sparse gradient's
    values (Keras 2's ``_multiply_gradient``)."""
    factor = tf.cast(factor, grad.dtype)
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices,
                                dense_shape=grad.dense_shape)
    return grad * factor


def optimizer_variable(variable):
    """An optimizer's new variable as Keras 2 code may use it: with
    ``tf.Variable``'s methods. The instance is given the subclass that
    adds them (no state of its own: the same object, tracked and saved as
    before)."""
    if type(variable) is keras.Variable:
        variable.__class__ = _Keras2SlotVariable
    return variable


def build_scope():
    """Create the optimizer state eagerly, even from a traced step.

    Without a strategy, Keras' TensorFlow ``fit()`` builds the optimizer
    inside the first trace of its step. Variables whose initial value is
    read from another variable (averages start as copies of the weights)
    cannot be lifted out of that trace, and ``tf.function`` then guards
    every later call with one ``VarIsInitializedOp`` per optimizer variable
    and a ``cond``: about a third of the step on a 60-layer MLP. Created
    under ``tf.init_scope()`` (as Keras creates its deferred variables),
    the state exists before the step runs and the step is traced once.
    Under a ``tf.distribute`` strategy too (Keras' ``fit()`` builds there
    before tracing; a custom loop's first ``apply_gradients`` in
    ``strategy.run`` inside a ``tf.function`` builds in the trace, and
    the variables made there failed the step, as Keras 3's own; tf_keras
    built under ``tf.init_scope()`` as here).
    """
    if tf.inside_function():
        return tf.init_scope()
    return contextlib.nullcontext()


def widen(value, dtype):
    """``value`` cast to the wider ``dtype``, holding exactly what its own
    (half-precision) dtype holds. In a function XLA compiles, the new
    weight is a float32 result cast to bfloat16 or float16, and XLA, which
    allows excess precision, drops that rounding and its cast back (the
    average mixed the unrounded update, as on JAX): XLA's
    ``reduce_precision`` keeps it (float16's subnormals, which it flushes
    to zero, through ``_common.keep_float16_subnormals``). Elsewhere, a
    cast."""
    out = tf.cast(value, dtype)
    source = tf.as_dtype(value.dtype)
    if source in (tf.bfloat16, tf.float16) and out.dtype.size > source.size \
            and control_flow_util.GraphOrParentsInXlaContext(
                tf_ops.get_default_graph()):
        from tensorflow.compiler.tf2xla.python import xla as tf_xla

        bits = {tf.bfloat16: (8, 7), tf.float16: (5, 10)}[source]
        rounded = tf_xla.reduce_precision(out, exponent_bits=bits[0],
                                          mantissa_bits=bits[1])
        if source == tf.float16:
            rounded = _common.keep_float16_subnormals(out, rounded)
        out = rounded
    return out


@contextlib.contextmanager
def state_variable_role(role):
    """Create a slot or an average eagerly with its kind (``role``:
    ``"momentum"``, ``"average"``) as the name its ``VarHandleOp`` runs
    with, then give the ``tf.Variable`` its own name back.

    TensorFlow's eager runtime caches each op's kernel by its attributes,
    and a ``VarHandleOp`` carries the variable's name (``debug_name``):
    one cached kernel per name, about 36 kB that stays for the process's
    life. Keras names each slot after its model variable, under its
    optimizer's scope (``adam/dense_kernel_momentum``): a kernel of its
    own for every slot (36 MB for Adam with an average over 330 model
    variables, whatever their size). Made under its kind, the slots of
    one shape share one. The variable's ``name`` and ``_shared_name``
    (which checkpoints, SavedModels and TF1's name-keyed ``Saver`` read)
    are its own again afterwards, for a mirrored variable's every replica.
    In a graph (a ``tf.function``, where a name is a variable's identity)
    nothing changes.
    """
    def creator(next_creator, **kwargs):
        name = kwargs.get("name")
        if not tf.executing_eagerly() or not name or name == role:
            return next_creator(**kwargs)
        kwargs["name"] = role
        variable = next_creator(**kwargs)
        _rename(variable, role, name)
        return variable

    with tf.variable_creator_scope(creator):
        yield


def _rename(variable, role, name):
    """Put ``name`` in place of ``role`` in the handle names of
    ``variable`` (and of its replicas: ``adam/momentum/replica_1``);
    left as they are where TensorFlow keeps them otherwise."""
    parts = (variable.values if isinstance(
        variable, tf.distribute.DistributedValues) else (variable,))
    first = getattr(parts[0], "_handle_name", None)
    if not isinstance(first, str) or not first.endswith(f"{role}:0"):
        return
    head = first[:-2]  # "<scope>/<role>", each replica's name begins so
    scope = head[: -len(role)]
    for part in parts:
        handle = getattr(part, "_handle_name", None)
        if isinstance(handle, str) and handle.startswith(head):
            part._handle_name = scope + name + handle[len(head):]


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
        def step(g, rate_values):
            with _common.rate_given(optimizer, rate_values):
                return optimizer.apply(g, variables)

        fn = tf.function(step, jit_compile=True)
        cache[key] = fn
    # `None` gradients cannot cross the tf.function boundary as such.
    grads, variables = optimizer._filter_empty_gradients(grads, variables)
    if len(variables) != len(key):
        return optimizer.apply(grads, variables)
    rate = _common.callable_rate(optimizer)
    fn(list(grads), [] if rate is None else [
        tf.cast(tf.convert_to_tensor(rate()), tf.float32)])
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

    A ``Snapshot``, not an ``identity``: an identity shares the variable's
    buffer, so the average made from it would too, and the first step
    would then copy both the weight and its average before it could write
    either (one transient copy of every averaged weight at the peak).
    """
    with tf.init_scope():
        return tf.raw_ops.Snapshot(input=_tf_variable(variable).read_value())



def check_build(optimizer):
    """Refuse Keras' gradient accumulation under a ``tf.distribute``
    strategy, before it fails in the first step: Keras 3.15 accumulates in
    an ``ops.cond`` around the update, which cannot hold the strategy's
    cross-replica call ("merge_call called while defining a new graph"),
    with any number of replicas; Keras' own optimizers fail the same way.
    """
    from keras_ema_opt.errors import InvalidArgumentError

    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        raise InvalidArgumentError(
            "gradient_accumulation_steps does not run under a tf.distribute "
            "strategy in Keras 3.15 (its accumulation step is a cond around "
            "the update, which cannot hold the strategy's cross-replica "
            "call; Keras' own optimizers fail in their first step). "
            f"Received: gradient_accumulation_steps={steps} under "
            f"{type(strategy).__name__}. Accumulate on JAX or PyTorch "
            "(tested under their distributions), or train with a larger "
            "batch.")


def sum_over_processes(values):
    """The sum of ``values`` (a float64 numpy array) over the workers of
    a multi-worker strategy (the current one, else the one an optimizer was
    last made under): one replica of each worker gives its values, the
    others zeros, and the strategy all-reduces them (every worker joins).
    ``values`` itself outside a multi-worker run."""
    strategy = tf.distribute.get_strategy()
    if _task_resolver(strategy) is None:
        strategy = next((s() for s in reversed(_MULTI_WORKER)
                         if s() is not None), None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) \
            or getattr(strategy.extended, "_num_workers", 1) <= 1:
        return values
    values = np.asarray(values, np.float64)
    local = len(strategy.extended.worker_devices)

    def give(context):
        first = context.replica_id_in_sync_group % local == 0
        return tf.constant(values if first else np.zeros_like(values))

    with strategy.scope():
        per_replica = strategy.experimental_distribute_values_from_function(
            give)
        total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica,
                                axis=None)
    return np.asarray(total, np.float64)


# Whether a flag is true on any worker of a multi-worker strategy (an
# all-reduce every worker joins); the flag itself outside one.
any_process = _common.any_process_over(sum_over_processes)


def is_chief():
    """The chief of a multi-worker run (the ``chief`` task, else worker 0,
    as Keras 2's ``_is_chief``; an ``evaluator``, outside the training
    cluster, writes its own files, as TensorFlow's ``multi_worker_util.
    is_chief`` says), read from the current strategy's cluster resolver,
    else from that of the multi-worker strategy an optimizer was last made
    under (outside its scope), else from ``TF_CONFIG``; always, outside a
    multi-worker run."""
    resolver = _task_resolver(tf.distribute.get_strategy())
    for strategy in reversed(list(_MULTI_WORKER)):
        # Outside the scope (where Keras runs callbacks), the strategy an
        # optimizer was made under: its cluster may come from a resolver
        # and not from TF_CONFIG (SLURM's, a SimpleClusterResolver).
        resolver = resolver or _task_resolver(strategy())
    if resolver is None:
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = resolver.cluster_spec().as_dict()
    if sum(len(tasks) for tasks in cluster.values()) <= 1:
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type in (None, "chief", "evaluator"):
        return True
    return task_type == "worker" and task_id == 0 and "chief" not in cluster


# ---------------------------------------------------------------------------
# MultiWorkerMirroredStrategy and Keras 3's `fit()`
# ---------------------------------------------------------------------------
#
# Keras 3.15's TensorFlow trainer cannot run `fit()` under a collective
# multi-worker strategy: before the first step it `strategy.reduce`s a
# distributed input batch in eager mode (which a collective strategy cannot
# turn into a tensor), and each step reduces scalar logs with `axis=0`
# (which a scalar has not). Both break for any model and optimizer. When an
# optimizer of ours is made under such a strategy, the two functions are
# wrapped once: under a multi-worker strategy the symbolic build uses the
# local shape-only value and the scalar logs are averaged over replicas
# with `axis=None`; anywhere else the originals run. docs/distributed-
# tensorflow.md tells the story.

_FIXED = []


def _task_resolver(strategy):
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or resolver.task_type is None:
        return None
    return resolver


# Weak references to the multi-worker strategies optimizers were made
# under, oldest first (for `is_chief` outside their scope).
_MULTI_WORKER = []


def on_create(optimizer):
    """An optimizer made under a multi-worker strategy: make ``fit()``
    work there (see above), and remember the strategy."""
    del optimizer
    strategy = tf.distribute.get_strategy()
    if _multi_worker(strategy):
        _fix_multi_worker_fit()
        _MULTI_WORKER[:] = [r for r in _MULTI_WORKER
                            if r() is not None and r() is not strategy]
        _MULTI_WORKER.append(weakref.ref(strategy))


def _multi_worker(strategy):
    extended = getattr(strategy, "extended", None)
    in_multi_worker = getattr(extended, "_in_multi_worker_mode", None)
    return bool(in_multi_worker and in_multi_worker())


def _fix_multi_worker_fit():
    if _FIXED:
        return
    from keras.src.backend.tensorflow import trainer as tf_trainer

    cls = tf_trainer.TensorFlowTrainer
    original_build = cls._maybe_symbolic_build
    original_reduce = tf_trainer.reduce_per_replica

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or strategy is None or not _multi_worker(
                strategy):
            return original_build(self, iterator, data_batch)
        for _, _, it in iterator:
            data_batch = tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues) else v,
                next(it))
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not _multi_worker(strategy):
            return original_reduce(values, strategy, reduction)

        def mean(value):
            if not isinstance(value, tf.distribute.DistributedValues):
                return value
            return strategy.reduce("MEAN", value, axis=None)

        return tf.nest.map_structure(mean, values)

    cls._maybe_symbolic_build = _maybe_symbolic_build
    tf_trainer.reduce_per_replica = reduce_per_replica
    _FIXED.append(True)


def training_forward(model, on_pass):
    """A function running ``model(inputs, training=True)`` as one graph
    (traced once per input signature; its variable updates included),
    calling ``on_pass()`` as each trace begins."""
    def body(inputs):
        on_pass()
        return model(inputs, training=True)

    graph = tf.function(body, reduce_retracing=True)

    def run(inputs):
        graph(tf.nest.map_structure(tf.convert_to_tensor, inputs))
        return _common.batch_size(inputs)
    return run


def executing_eagerly():
    """Whether this runs eagerly, not traced into a ``tf.function``."""
    return tf.executing_eagerly()
