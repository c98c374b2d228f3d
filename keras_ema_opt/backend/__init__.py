"""Backend hooks: the only place where TensorFlow, JAX or PyTorch is named.

The rest of the package talks to the backend through the names re-exported
here. Each backend module provides the same set:

- ``OptimizerHooks``: a mixin placed before Keras' optimizer in the MRO of
  :class:`keras_ema_opt.Optimizer`. It overrides narrow Keras internals only.
- ``keras_optimizer_class(name)``: the Keras class whose update rule a named
  optimizer reuses (on PyTorch, Keras' multi-tensor ``torch._foreach``
  variant, which is what ``keras.optimizers.<Name>()`` itself builds there;
  Adam and AdamW with a fused update step on PyTorch, and on JAX on a
  CPU).
- ``resolve_jit_compile(requested)``: whether eager ``apply_gradients`` runs
  compiled on this backend and machine.
- ``compiled_apply(optimizer, grads, variables)``: one optimizer step, run
  compiled when that is possible and useful, else eagerly.
- ``compute_gradients(loss, var_list, tape)``: gradients of a loss.
- ``aggregate_gradients(optimizer, grads_and_vars)``: the sum over replicas.
- ``prepare_gradients(grads)``: backend-specific gradient clean-up (sparse
  de-duplication on TensorFlow).
- ``colocate_with(variable)``: a context placing new state beside a variable.
- ``stateless_step(optimizer, grads, trainable_variables)``: run an eager
  step as the optimizer's ``stateless_apply``, its values assigned back,
  and say whether it did (JAX, for Keras' loss-scale wrappers, whose
  stateful step JAX cannot run eagerly; False elsewhere).
- ``scale_gradient(grad, factor)``: a gradient times a scalar in its dtype
  (TensorFlow: a sparse gradient's values).
- ``optimizer_variable(variable)``: an optimizer's new variable as Keras 2
  code may use it (TensorFlow: with ``tf.Variable``'s ``scatter_add``,
  ``sparse_read`` and the like, which Keras 2's slots had).
- ``assign_copy(optimizer, variable, value)``: assign a value that shares no
  buffer with its source.
- ``sync_training_state(model)``: make the variables current in the middle of
  ``fit()`` (JAX keeps the state outside them between epochs).
- ``current_value(variable)``: a copy of a variable's value at this moment,
  even while a step is being traced.
- ``value_visible(variable)``: whether the running step reads the current
  value of a model variable it was not handed (JAX stateless steps do not).
- ``step_gradients(optimizer, grads)``: the gradients an optimizer step
  applies, reduced over the replicas where the backend's own step does not
  do it (the mean over the ranks of ``torch.distributed``).
- ``mark_step_made(optimizer, grads)``: note the gradients that
  ``apply_gradients``' own aggregation made for the coming step (no
  caller holds them: PyTorch's clipping may scale them in place).
- ``sync_initial_state(optimizer, variables)``: make every replica start
  from the same variables before the optimizer state is built (broadcast
  from rank 0 under ``torch.distributed``); returns whether it replaced
  any value.
- ``executing_eagerly()``: whether code runs eagerly here, not traced
  into a graph (TensorFlow's ``tf.function``; always on JAX, whose
  optimizer builds only eagerly, and PyTorch).
- ``on_create(optimizer)``: called when an optimizer is made (TensorFlow:
  under a multi-worker strategy, make Keras' ``fit()`` work there).
- ``chief_only_scope()``: a context for work the chief does alone
  (``model.save``; JAX: no global arrays are made meanwhile).
- ``whole_values_scope(variables)``: a context every process enters, in
  which the chief reads each of ``variables`` whole (JAX: those sharded
  over other processes' devices are gathered, a collective each, and the
  chief holds them as local arrays meanwhile; a no-op elsewhere).
- ``build_scope()``: the context the optimizer state is created in
  (TensorFlow: outside a ``tf.function`` being traced, so that a step
  which builds the optimizer on its first call, as Keras' ``fit()`` does
  without a strategy, is traced once and does not check every variable's
  initialization at each later call).
- ``state_variable_role(role)``: the context a slot or an average named
  after its model variable is created in; ``role`` is its kind
  (``"momentum"``, ``"average"``). TensorFlow makes the variable under its
  role alone, then gives it its own name back: an eager ``VarHandleOp``'s
  kernel is cached per distinct name, about 36 kB a variable when each is
  made under its own.
- ``widen(value, dtype)``: a half-precision variable's value cast to the
  wider dtype its averages are mixed in, holding exactly what the
  variable holds (JAX, and TensorFlow in a function XLA compiles: the
  rounding XLA would drop, where the value was just computed in float32,
  is kept).
- ``fit_failed()``: whether ``finalize_variable_values`` is being called
  by a ``fit()`` ending in an exception (JAX's ``fit()`` calls it from a
  ``finally`` block; the others only after their epochs).
- ``training_forward(model, on_pass)``: a function running
  ``model(inputs, training=True)`` for the updates it makes to the model's
  variables, compiled where the backend allows (JAX: a jitted stateless
  call; TensorFlow: a ``tf.function``; PyTorch: eagerly, without
  autograd); ``on_pass()`` runs as each pass's Python runs (each trace,
  where compiled). It returns the number of samples of the batch the
  pass normalized by (JAX, under a ``keras.distribution``: the global
  batch that the processes' shares make, as in ``fit()``).
- ``check_build(optimizer)``: refuse, with a typed error, what this
  backend cannot run, when the optimizer is built (TensorFlow: Keras'
  gradient accumulation under a ``tf.distribute`` strategy).
- ``host_array(value)``: a numpy copy of a value, whole (JAX: an array
  sharded over other processes' devices is gathered, a collective).
- ``string_probe(shape)``: a tensor of empty strings of ``shape`` that a
  model with a string input takes, or None where the backend feeds a
  model no strings (JAX, PyTorch).
- ``forward_spans_processes()``: whether a model's forward pass needs
  every process of the run (JAX: under a distribution over several
  processes, whose variables are global arrays).
- ``sum_over_processes(values)``: a float64 numpy array summed over the
  processes of a multi-process run, which each join (PyTorch: an
  all-reduce over the ``torch.distributed`` group; TensorFlow: over a
  multi-worker strategy's workers; JAX: ``values`` itself, since every
  process's ``training_forward`` measured the same global batch).
- ``lerp_averages(pairs, weight, gated)``: the averaging update
  ``a <- a + weight (x - a)`` for the ``(average, variable)`` pairs a fast
  path takes (PyTorch: ``torch._foreach_lerp_`` by device and dtype;
  TensorFlow: one fused kernel per average); returns the pairs left to the
  engine's ``keras.ops`` update.
- ``is_chief()``: whether this process is the one that writes files
  (rank 0, process 0, the chief worker).
- ``any_process(flag)``: whether ``flag`` is true on any process of a
  multi-process run, a collective every process joins (PyTorch: an
  all-reduce over the group; TensorFlow: over a multi-worker strategy's
  workers; JAX: an all-gather over ``jax.distributed``'s processes).
- ``from_chief(value)``: the chief's numpy ``value`` on every process of
  a multi-process run, a collective every process joins (JAX: a
  broadcast over ``jax.distributed``'s processes; PyTorch: an all-reduce
  over the group; TensorFlow: ``value`` itself, since a multi-worker
  strategy gives a new variable the chief's initial value).
- ``attach_model(optimizer, model)``: let ``fit()`` on ``model`` feed the
  model's new non-trainable values to the averaging (JAX wraps the model's
  ``train_step``; a no-op elsewhere).
- ``prepare_model(model)``: adjust the model an optimizer is built for
  (JAX: ``fit()`` stores its per-step state on the model outside Keras'
  attribute tracking; a no-op elsewhere).
"""

import keras

_BACKEND = keras.backend.backend()

if _BACKEND == "tensorflow":
    from keras_ema_opt.backend import tensorflow as _impl
elif _BACKEND == "jax":
    from keras_ema_opt.backend import jax as _impl
elif _BACKEND == "torch":
    from keras_ema_opt.backend import torch as _impl
else:  # pragma: no cover - guarded by Keras itself
    raise ImportError(
        f"keras_ema_opt supports the 'jax', 'tensorflow' and 'torch' Keras "
        f"backends. Received: KERAS_BACKEND={_BACKEND!r}. Set the "
        "KERAS_BACKEND environment variable to one of those before importing "
        "keras."
    )

NAME = _BACKEND
OptimizerHooks = _impl.OptimizerHooks
keras_optimizer_class = _impl.keras_optimizer_class
resolve_jit_compile = _impl.resolve_jit_compile
compiled_apply = _impl.compiled_apply
compute_gradients = _impl.compute_gradients
aggregate_gradients = _impl.aggregate_gradients
prepare_gradients = _impl.prepare_gradients
colocate_with = _impl.colocate_with
optimizer_variable = _impl.optimizer_variable
scale_gradient = _impl.scale_gradient
stateless_step = _impl.stateless_step
assign_copy = _impl.assign_copy
sync_training_state = _impl.sync_training_state
value_visible = _impl.value_visible
current_value = _impl.current_value
attach_model = _impl.attach_model
prepare_model = _impl.prepare_model
step_gradients = _impl.step_gradients
mark_step_made = _impl.mark_step_made
sync_initial_state = _impl.sync_initial_state
is_chief = _impl.is_chief
any_process = _impl.any_process
from_chief = _impl.from_chief
on_create = _impl.on_create
chief_only_scope = _impl.chief_only_scope
whole_values_scope = _impl.whole_values_scope
lerp_averages = _impl.lerp_averages
build_scope = _impl.build_scope
state_variable_role = _impl.state_variable_role
widen = _impl.widen
training_forward = _impl.training_forward
fit_failed = _impl.fit_failed
sum_over_processes = _impl.sum_over_processes
check_build = _impl.check_build
host_array = _impl.host_array
string_probe = _impl.string_probe
forward_spans_processes = _impl.forward_spans_processes
executing_eagerly = _impl.executing_eagerly

__all__ = [
    "NAME",
    "OptimizerHooks",
    "aggregate_gradients",
    "assign_copy",
    "colocate_with",
    "optimizer_variable",
    "scale_gradient",
    "stateless_step",
    "compiled_apply",
    "compute_gradients",
    "keras_optimizer_class",
    "prepare_gradients",
    "resolve_jit_compile",
    "sync_training_state",
    "value_visible",
    "current_value",
    "attach_model",
    "prepare_model",
    "step_gradients",
    "mark_step_made",
    "sync_initial_state",
    "is_chief",
    "any_process",
    "from_chief",
    "on_create",
    "chief_only_scope",
    "whole_values_scope",
    "lerp_averages",
    "build_scope",
    "state_variable_role",
    "widen",
    "training_forward",
    "sum_over_processes",
    "check_build",
    "host_array",
    "forward_spans_processes",
    "executing_eagerly",
    "fit_failed",
]
