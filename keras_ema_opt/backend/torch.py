"""PyTorch hooks: Keras' multi-tensor update rules, autograd, torch.distributed."""

import functools
import importlib

import numpy as np
import torch

from keras_ema_opt.backend import _common

colocate_with = _common.no_placement
optimizer_variable = _common.optimizer_variable
scale_gradient = _common.scale_gradient
stateless_step = _common.stateless_step
check_build = _common.check_build
host_array = _common.host_array
string_probe = _common.string_probe
forward_spans_processes = _common.forward_spans_processes
build_scope = _common.build_scope
state_variable_role = _common.state_variable_role
widen = _common.widen
chief_only_scope = _common.chief_only_scope
whole_values_scope = _common.whole_values_scope
assign_copy = _common.assign_copy
value_visible = _common.value_visible
current_value = _common.current_value
attach_model = _common.attach_model
prepare_model = _common.prepare_model
prepare_gradients = _common.prepare_gradients
sync_training_state = _common.sync_training_state
fit_failed = _common.fit_failed


def training_forward(model, on_pass):
    """A function running ``model(inputs, training=True)`` without autograd
    (no graph is kept for a pass no gradient is taken of), calling
    ``on_pass()`` before each pass."""
    def run(inputs):
        on_pass()
        with torch.no_grad():
            model(inputs, training=True)
        return _common.batch_size(inputs)
    return run

# Keras builds these multi-tensor (`torch._foreach_*`) classes when
# `keras.optimizers.<Name>()` is called on PyTorch; reusing them keeps our
# optimizers bit-identical to Keras' and as fast.
_PARALLEL = {
    "Adadelta": "torch_adadelta",
    "Adagrad": "torch_adagrad",
    "Adam": "torch_adam",
    "Adamax": "torch_adamax",
    "AdamW": "torch_adamw",
    "Lion": "torch_lion",
    "Nadam": "torch_nadam",
    "RMSprop": "torch_rmsprop",
    "SGD": "torch_sgd",
}


def keras_optimizer_class(name):
    module = _PARALLEL.get(name)
    if module is None:
        return _common.keras_optimizer_class(name)
    try:
        module = importlib.import_module(
            f"keras.src.backend.torch.optimizers.{module}"
        )
    except ImportError:  # pragma: no cover - older or newer Keras layouts
        return _common.keras_optimizer_class(name)
    cls = getattr(module, name, None) or _common.keras_optimizer_class(name)
    if not hasattr(cls, "_parallel_update_step"):
        return cls
    return _with_own_steps(_FUSED.get(name), cls)


@functools.lru_cache(maxsize=None)  # one class per rule: identity holds
def _with_own_steps(fused, cls):
    bases = (_SubclassStep,) + ((fused,) if fused is not None else ()) + (
        cls,)
    return type(cls.__name__, bases, {"__module__": cls.__module__,
                                      "_keras_rule": cls})


class _SubclassStep:
    """A subclass's own ``update_step`` runs, variable by variable: Keras'
    PyTorch optimizers step all the variables at once in
    ``_parallel_update_step`` (``torch._foreach_*``), which never calls
    ``update_step``, so a Keras 2 subclass overriding it (``def
    update_step(self, gradient, variable)``) was ignored."""

    def _parallel_update_step(self, grads, variables, learning_rate):
        if type(self).update_step is not self._keras_rule.update_step:
            for grad, variable in zip(grads, variables):
                self.update_step(grad, variable, learning_rate)
            return None
        return super()._parallel_update_step(grads, variables,
                                             learning_rate)


class _FusedAdamStep:
    """Keras' Adam update (``AdamW``: its decoupled decay is applied before,
    by Keras) as torch's fused kernel: one pass over each tensor instead of
    Keras' ten ``torch._foreach`` passes and four temporaries. With
    averaging, the averages are folded into the update: each device and
    dtype group is averaged (one ``torch._foreach_lerp_`` per slot) right
    after its fused update, with the weights computed once for the step.
    One call per group, not per run of variables: runs of about a
    megabyte, to read the new weights back from cache, cost more in calls
    than they saved (measured in docs/performance.md).

    The rule is Keras': ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2)
    g^2`` (``v_hat = max(v_hat, v)`` with AMSGrad), ``w <- w - alpha m /
    (sqrt(v) + eps)`` with ``alpha = lr sqrt(1 - b2^t) / (1 - b1^t)``
    computed in float32 as Keras computes it. torch's kernel would apply its
    own bias corrections (and add epsilon after them); it is given a step
    count so large that they are exactly 1, and ``alpha`` as its learning
    rate: the same update as Keras', to float32 round-off (tested against
    ``keras.optimizers.Adam``, tf_keras and the rule in float64). Where the
    kernel cannot serve (a device or dtype it lacks, gradients of another
    dtype than their variable, a step traced by ``torch.compile``), Keras'
    own multi-tensor step runs.
    """

    def _parallel_update_step(self, grads, variables, learning_rate):
        if not hasattr(torch, "_fused_adam_") or _compiling() or (
                _stateless()):
            # Under torch.compile (`model.compile(jit_compile=True)`) the
            # compiler fuses Keras' own step itself; inside a stateless
            # scope the variables' tensors are not the stored ones.
            return super()._parallel_update_step(grads, variables,
                                                 learning_rate)
        plan = _plan(self, variables)
        if not plan.takes(grads):
            return super()._parallel_update_step(grads, variables,
                                                 learning_rate)
        beta_1, beta_2 = float(self.beta_1), float(self.beta_2)
        # In the dtype of the first variable, as Keras: float64 for a
        # float64 model (in float32 `1 - b2^t` is 1e-5 off at the first
        # step), float32 for 16- and 32-bit ones.
        dtype = torch.float64 if plan.variables[0]._value.dtype == (
            torch.float64) else torch.float32
        alpha = _step_size(self.iterations, learning_rate, beta_1, beta_2,
                           dtype)
        averager = getattr(self, "_averager", None)
        weights = averager.fold_weights(self) if plan.averaged else None
        gated = weights is not None and averager.fold_gated()
        for group in plan.groups:
            # The kernel walks each tensor's storage in order: a gradient
            # laid out otherwise (a Conv kernel's from `torch.autograd.grad`
            # is permuted, a broadcast one has stride 0) is made dense.
            torch._fused_adam_(
                group.params,
                [_dense(grads[j]) for j in group.indices],
                group.m, group.v, group.v_hat, group.steps,
                lr=_kernel_rate(alpha, group.device),
                beta1=beta_1, beta2=beta_2, weight_decay=0.0,
                eps=float(self.epsilon), amsgrad=bool(self.amsgrad),
                maximize=False)
            if weights is not None:
                for averages, weight in zip(group.averages, weights):
                    if averages:
                        _lerp(averages, group.averaged_params, weight,
                              gated)
        if weights is not None:
            averager.folded(plan.averaged)


class _Group:
    """Tensors of the variables of one device and dtype: theirs, their Adam
    slots, their averages (per slot), fixed for the optimizer's life."""

    def __init__(self, optimizer, variables, indices, averager):
        first = variables[indices[0]]._value
        self.device, self.dtype = first.device, first.dtype
        self.indices = indices
        members = [variables[j] for j in indices]
        index = [optimizer._get_variable_index(v) for v in members]
        self.params = [v._value for v in members]
        self.m = [optimizer._momentums[i]._value for i in index]
        self.v = [optimizer._velocities[i]._value for i in index]
        self.v_hat = [optimizer._velocity_hats[i]._value for i in index] if (
            optimizer.amsgrad) else []
        self.steps = [_no_bias_correction(self.device)] * len(members)
        self.averaged, self.averaged_params = [], []
        slots = [averager.fold_slots_of(optimizer, v) if averager else None
                 for v in members]
        count = max((len(s) for s in slots if s), default=0)
        self.averages = [[] for _ in range(count)]
        seen = set()
        for var, var_slots in zip(members, slots):
            if id(var) in seen:
                continue  # listed twice in the step: averaged once
            seen.add(id(var))
            if not var_slots or any(s._value.dtype != self.dtype
                                    for s in var_slots):
                continue  # averaged by the engine (another dtype)
            self.averaged.append(var)
            self.averaged_params.append(var._value)
            for k, slot in enumerate(var_slots):
                self.averages[k].append(slot._value)

    def current(self, variables):
        return all(variables[j]._value is p
                   for j, p in zip(self.indices, self.params))


class _Plan:
    """How a fused step runs over one list of variables."""

    def __init__(self, optimizer, variables):
        self.variables = list(variables)
        averager = getattr(optimizer, "_averager", None)
        groups = {}
        for j, var in enumerate(self.variables):
            value = var._value
            groups.setdefault((value.device, value.dtype), []).append(j)
        self.groups = [_Group(optimizer, self.variables, indices, averager)
                       for indices in groups.values()]
        # The kernel walks storage in order: a variable (or slot) laid out
        # otherwise, e.g. `keras.Variable(x.T)`, takes Keras' own step.
        self.fusable = all(dtype in _FUSED_DTYPES and device.type in (
            "cpu", "cuda") for device, dtype in groups) and all(
            t.is_contiguous() for g in self.groups
            for t in (*g.params, *g.m, *g.v, *g.v_hat))
        self.averaged = [v for g in self.groups for v in g.averaged]

    def current(self):
        return all(g.current(self.variables) for g in self.groups)

    def takes(self, grads):
        """Whether the fused kernel can take these gradients: dense, of
        their variable's shape, dtype and device (the kernel walks as many
        elements of the gradient as the variable has: Keras' own step
        broadcasts a smaller one, or refuses it)."""
        return self.fusable and all(
            isinstance(g, torch.Tensor) and not g.is_sparse
            and g.dtype == var._value.dtype and g.device == var._value.device
            and g.shape == var._value.shape
            for g, var in zip(grads, self.variables))


def _plan(optimizer, variables):
    key = tuple(id(v) for v in variables)
    cache = optimizer.__dict__.setdefault("_keo_fused_plans", {})
    plan = cache.get(key)
    if plan is None or not plan.current():
        plan = cache[key] = _Plan(optimizer, variables)
    return plan


def _stateless():
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    return in_stateless_scope() or str(keras_device()) == "meta"


def _tensors(variables):
    """The torch tensors of Keras variables. Keras' ``Variable.value``
    checks for a stateless scope, a symbolic device and autocasting on
    every read (about 4 us, a thousand reads a step); outside those, which
    an eager optimizer step is, the stored tensor is read directly."""
    if _stateless():
        return [v.value for v in variables]
    return [v._value for v in variables]


def keras_device():
    from keras.src.backend.torch.core import get_device

    return get_device()


def _compiling():
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _kernel_rate(alpha, device):
    # torch's CPU kernel reads a double learning rate; its CUDA kernel
    # reads a float (a float64 tensor there is a dtype error).
    if device.type != "cpu":
        return alpha.to(device=device, dtype=torch.float32)
    return alpha.to(device)


def _dense(tensor):
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _step_size(iterations, learning_rate, beta_1, beta_2,
               dtype=torch.float32):
    """Keras' ``alpha = lr sqrt(1 - b2^t) / (1 - b1^t)`` for torch's
    kernel, by the torch ops of Keras' own step in ``dtype``, as a 0-dim
    tensor on the step count's device. For float32 variables it is
    Keras' value bit for bit (numpy's float32 power is one ulp off
    torch's at some steps). Keras computes it in the dtype of the first
    variable: here float64 where that is float64, else float32 (in
    bfloat16 ``beta_2 = 0.999`` rounds to 1 and Keras' step size to 0). Nothing is read back
    to the host: on CUDA that would wait at every step for the work
    queued before it."""
    # A variable, or under gradient accumulation Keras' count of real
    # steps (``_iterations // steps``), a tensor.
    step = getattr(iterations, "value", iterations)
    if not isinstance(step, torch.Tensor):
        step = torch.as_tensor(step)
    lr = learning_rate.value if hasattr(learning_rate, "value") else (
        learning_rate)
    if isinstance(lr, torch.Tensor):
        lr = lr.to(device=step.device, dtype=dtype)
    else:
        lr = torch.full((), float(lr), dtype=dtype, device=step.device)
    t = (step + 1).to(dtype)
    beta_1_power = torch.pow(beta_1, t)
    beta_2_power = torch.pow(beta_2, t)
    return lr * torch.sqrt(1 - beta_2_power) / (1 - beta_1_power)


_STEPS = {}


def _no_bias_correction(device):
    """A step count at which ``1 - beta^t`` is exactly 1 in torch's kernel
    (``beta < 1``): its bias corrections then change nothing."""
    step = _STEPS.get(device)
    if step is None:
        step = _STEPS[device] = torch.tensor(1e9, dtype=torch.float32,
                                             device=device)
    return step


def _clip_rule(optimizer, grads):
    """The multi-tensor form of the optimizer's clipping of ``grads``, or
    None for Keras' own (no clipping, a threshold that is not a number,
    gradients that are not dense float32/float64 tensors of one device and
    dtype, a step traced by ``torch.compile``)."""
    for name, rule in _CLIP_RULES:
        threshold = getattr(optimizer, name, None)
        if threshold:
            break
    else:
        return None
    if (not isinstance(threshold, (int, float)) or threshold <= 0
            or not grads or _compiling()
            or not all(isinstance(g, torch.Tensor) and g.layout ==
                       torch.strided for g in grads)
            or len({(g.device, g.dtype) for g in grads}) != 1
            or grads[0].dtype not in (torch.float32, torch.float64)):
        return None
    return functools.partial(rule, threshold=float(threshold))


def _clip_each_norm(grads, threshold, in_place=False):
    """Keras' ``clipnorm``: ``g c / max(||g||, c)`` per gradient (a NaN
    norm gives NaN), as ``g (c / max(||g||, c))``: the scales of all the
    gradients in one vector op, then one multiplication of each gradient
    (Keras' rule to float32 round-off): one pass over the gradients fewer
    than multiplying by ``c`` and dividing by the norms."""
    norms = torch.stack(torch._foreach_norm(grads))
    scales = threshold / torch.clamp_min(norms, threshold)
    return _scaled(grads, list(scales.unbind()), in_place)


def _clip_global_norm(grads, threshold, in_place=False):
    """Keras' ``global_clipnorm`` (``clip_by_global_norm``): all gradients
    times ``c min(1 / n, 1 / c)`` for their global norm ``n``, NaN where
    ``n`` is not finite."""
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    scale = threshold * torch.minimum(
        1.0 / norm, torch.tensor(1.0 / threshold, dtype=norm.dtype,
                                 device=norm.device)) + (norm - norm)
    return _scaled(grads, scale, in_place)


def _scaled(grads, scales, in_place):
    """``grads`` times ``scales`` (one for all, or one each): written into
    ``grads`` when ``in_place``, else new tensors."""
    if in_place:
        torch._foreach_mul_(grads, scales)
        return grads
    return list(torch._foreach_mul(grads, scales))


def _clip_value(grads, threshold, in_place=False):
    """Keras' ``clipvalue``: each element into ``[-c, c]``."""
    if in_place:
        torch._foreach_clamp_max_(grads, threshold)
        clipped = grads
    else:
        clipped = list(torch._foreach_clamp_max(grads, threshold))
    torch._foreach_clamp_min_(clipped, -threshold)
    return clipped


def _own_gradients(grads, variables):
    """The ids of those of ``grads`` that are their variable's own
    ``.grad`` tensor, as Keras' ``fit()`` hands them to the optimizer on
    PyTorch (``[v.value.grad for v in trainable_weights]``). Not one that
    is itself differentiated (``backward(create_graph=True)``)."""
    return {id(grad) for grad, param in zip(grads, _tensors(variables))
            if grad is not None and param.is_leaf and grad is param.grad
            and not grad.requires_grad}


def _writable_in_place(grads, owned, inputs, held):
    """Whether ``grads`` may be clipped in place. Each one is dense (a
    broadcast ``.grad``, of stride 0, cannot be written element by
    element) and either in ``owned`` (a variable's own ``.grad``, or a
    mean over the ranks the step made) or made by Keras' step itself
    (gradient accumulation's ``(g + acc) / steps``): none of the step's
    ``inputs``, and sharing memory with none of them nor with the tensors
    of the variables ``held()`` returns. And no two overlap in memory:
    one buffer behind two variables' ``.grad`` would be scaled twice,
    while the disjoint views of the ranks' flat buffer are each scaled
    once."""
    if not all(g.is_contiguous() for g in grads):
        return False
    made = [g for g in grads if id(g) not in owned]
    if made:
        given = [t for t in inputs if isinstance(t, torch.Tensor)]
        if {id(g) for g in made} & {id(t) for t in given}:
            return False
        foreign = {t.untyped_storage().data_ptr()
                   for t in given + _tensors(held())}
        if any(g.untyped_storage().data_ptr() in foreign for g in made):
            return False
    spans = sorted((g.data_ptr(), g.data_ptr() + g.numel() * g.element_size())
                   for g in grads)
    return all(start >= end for (_, end), (start, _) in zip(spans,
                                                           spans[1:]))


# Keras' order: the first clipping argument set applies.
_CLIP_RULES = (("clipnorm", _clip_each_norm),
               ("global_clipnorm", _clip_global_norm),
               ("clipvalue", _clip_value))
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_FUSED = {"Adam": _FusedAdamStep, "AdamW": _FusedAdamStep}


class OptimizerHooks:
    """Overrides of Keras' ``TorchOptimizer``."""

    def _backend_apply_gradients(self, grads, trainable_variables):
        # What the clipping below needs to decide which gradients it may
        # scale in place (`_clip_gradients`): this step's gradients and
        # variables, the mean over the ranks that `step_gradients` or
        # `apply_gradients` made for it (`mark_step_made`), and what a
        # `LossScaleOptimizer` around this one was handed (`_unscaled`).
        # Holding them until the step ends keeps their ids from being
        # reused meanwhile.
        self.__dict__["_keo_clip_context"] = (
            grads, trainable_variables,
            self.__dict__.pop("_keo_step_made", ()),
            self.__dict__.get("_keo_loss_scale_inputs"))
        try:
            return super()._backend_apply_gradients(grads,
                                                    trainable_variables)
        finally:
            self.__dict__["_keo_clip_context"] = None

    def _clip_gradients(self, grads):
        # Keras' clipping rules with torch's multi-tensor kernels (one
        # `_foreach_norm` and one `_foreach_mul` for all the gradients, in
        # place of Keras' five to eight ops per gradient); the rule is
        # Keras', to float32 round-off (the norms sum in another order).
        # Gradients that are all their variables' own `.grad` (`fit()`'s)
        # or made by the step (the mean over the ranks, accumulation's
        # average, a loss scaler's quotients) are clipped in place, as
        # `torch.nn.utils.clip_grad_norm_` does: no new gradient-sized
        # tensors, which glibc's malloc would fault in afresh at every
        # step. Any other gradients are left as the caller holds them.
        present = [g for g in grads if g is not None]
        rule = _clip_rule(self, present)
        if rule is None:
            return super()._clip_gradients(grads)
        context = self.__dict__.get("_keo_clip_context")
        in_place = False
        if context is not None:
            inputs, variables, made, scaled = context
            owned = _own_gradients(inputs, variables)
            owned.update(id(g) for g in made)
            owned.update(id(g) for g in _unscaled(scaled, inputs))
            in_place = _writable_in_place(
                present, owned, inputs,
                lambda: list(self.variables) + list(variables))
        clipped = iter(rule(present, in_place=in_place))
        return [None if g is None else next(clipped) for g in grads]

    def _apply_weight_decay(self, variables):
        # Keras' torch step hands `torch._foreach_mul_` the variables to
        # decay, which raises on an empty list: every variable excluded
        # (`exclude_from_weight_decay`) is a step without decay. A
        # `weight_decay` of None is the class's own to read: Keras' torch
        # step skips it, and Muon still decays its Adam-updated variables
        # by `adam_weight_decay` (skipping it here left them undecayed).
        if not any(self._use_weight_decay(v) for v in variables):
            return
        super()._apply_weight_decay(variables)


def resolve_jit_compile(requested):
    """PyTorch runs the optimizer step eagerly.

    The update is already a handful of fused multi-tensor kernels; compiling
    it with ``torch.compile`` costs seconds per shape set and recompiles when
    the variable list changes, so ``jit_compile`` has no effect here and
    reads ``False``. ``model.compile(jit_compile=True)`` still compiles the
    model's own step in ``fit()``.
    """
    del requested
    return False


def compiled_apply(optimizer, grads, variables):
    return optimizer.apply(grads, variables)


def compute_gradients(loss, var_list, tape=None):
    """Gradients of a callable loss with ``torch.autograd.grad``.

    Variables in a static ``var_list`` are watched for the call, trainable or
    not, as a TensorFlow tape watches them; a non-scalar loss is summed.
    """
    _common.check_no_tape(tape, "torch")
    static = not callable(var_list)
    watched = []
    if static:
        var_list = list(var_list)
        for v in var_list:
            if not v.value.requires_grad:
                v.value.requires_grad_(True)
                watched.append(v)
    try:
        with torch.enable_grad():
            value = loss()
            if not static:
                var_list = list(var_list())
            tensors = [v.value for v in var_list]
            grads = torch.autograd.grad(
                torch.sum(value), tensors, allow_unused=True
            )
    finally:
        for v in watched:
            v.value.requires_grad_(False)
    return list(zip(grads, var_list))


def _world_size():
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def _all_reduce_mean(tensors):
    """The mean over the ranks of each tensor (new tensors: the inputs are
    left as they are), one ``all_reduce`` per device and dtype over a flat
    buffer, as DDP's buckets do."""
    dist = torch.distributed
    world = dist.get_world_size()
    out = list(tensors)
    groups = {}
    for i, t in enumerate(out):
        if t is not None:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for indices in groups.values():
        # `cat` always allocates: the buffer shares no memory with a grad.
        flat = torch.cat([out[i].detach().reshape(-1) for i in indices])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world)
        parts = torch.split(flat, [out[i].numel() for i in indices])
        for i, part in zip(indices, parts):
            out[i] = part.view(out[i].shape)
    return out


def aggregate_gradients(optimizer, grads_and_vars):
    """The mean over the ranks of ``torch.distributed`` when a group of
    more than one process is running (each rank's loss is the mean over
    its share of the global batch, so the mean of the gradients is the
    gradient of the global batch, as DDP computes it)."""
    del optimizer
    pairs = list(grads_and_vars)
    if _world_size() == 1:
        return pairs
    grads = _all_reduce_mean([g for g, _ in pairs])
    return [(g, v) for g, (_, v) in zip(grads, pairs)]


def step_gradients(optimizer, grads):
    """In ``fit()`` (which calls ``optimizer.apply``) and in any step that
    did not come through ``apply_gradients``, the gradients are reduced to
    their mean over the ranks here, the optimizer's aggregation step."""
    if getattr(optimizer, "_gradients_aggregated", False) or (
            _world_size() == 1):
        # Nothing to reduce: one process, or `apply_gradients` aggregated
        # them and noted what its aggregation made (`mark_step_made`;
        # `Optimizer.apply` drops the note when the step ends).
        return grads
    reduced = _all_reduce_mean(grads)
    mark_step_made(optimizer, reduced)
    return reduced


def _unscaled(given, grads):
    """Those of ``grads`` that a ``LossScaleOptimizer`` made from the
    gradients ``given`` to it (their division by the loss scale: new
    tensors that only its step holds); none outside such a step (``given``
    None). A gradient it passed on as it received it, or one sharing
    memory with those, is not one of them."""
    if not given:
        return []
    given = [g for g in given if isinstance(g, torch.Tensor)]
    ids = {id(g) for g in given}
    storages = {g.untyped_storage().data_ptr() for g in given}
    return [g for g in grads if isinstance(g, torch.Tensor)
            and id(g) not in ids
            and g.untyped_storage().data_ptr() not in storages]


def mark_step_made(optimizer, grads):
    """Note ``grads``, made by the step itself (the mean over the ranks
    that ``step_gradients`` or ``apply_gradients`` took), for the clipping
    of the step to come: no caller holds them, so it may scale them in
    place (``OptimizerHooks``). Not when ``gradient_transformers`` are
    set: a transformer is handed them and may keep them."""
    made = [g for g in grads if g is not None]
    if made and not optimizer.gradient_transformers:
        optimizer.__dict__["_keo_step_made"] = made
    else:
        optimizer.__dict__.pop("_keo_step_made", None)


def on_create(optimizer):
    """An optimizer made on PyTorch: a ``LossScaleOptimizer`` around one of
    ours then decides finiteness for all ranks (below)."""
    del optimizer
    _wrap_loss_scale_optimizer()


_LOSS_SCALE_WRAPPED = []


def _wrap_loss_scale_optimizer():
    """Wrap two methods of Keras' ``LossScaleOptimizer``, for one of ours
    inside it.

    Its ``check_finite`` checks each rank's own gradients for
    ``inf``/``nan`` before its inner optimizer (ours) all-reduces them:
    with an overflow on one rank only, that rank skipped the step while
    the others waited in the all-reduce (a hang, or collectives paired
    with the next step's). Under ``torch.distributed`` the check around
    one of our optimizers is agreed over the ranks (finite only where
    every rank is), as DDP, which all-reduces first, has every rank see
    the ``inf``. Wrapped once; elsewhere Keras' check runs unchanged.

    Its ``apply`` around one of ours notes the gradients it was handed,
    so that ours can tell the unscaled gradients it then receives (new
    tensors of the loss scaler's own) from a caller's, and clip them in
    place (``_unscaled``); not where a subclass (of the scaler, or of
    ours) replaces the steps between them, which could keep the
    quotients."""
    if _LOSS_SCALE_WRAPPED:
        return
    _LOSS_SCALE_WRAPPED.append(True)
    import keras

    from keras_ema_opt.optimizer import Optimizer
    from keras_ema_opt.optimizer import not_overridden

    cls = keras.optimizers.LossScaleOptimizer
    keras_check = cls.check_finite

    @functools.wraps(keras_check)
    def check_finite(self, grads):
        finite = keras_check(self, grads)
        if _world_size() == 1 or not isinstance(
                getattr(self, "inner_optimizer", None), Optimizer):
            return finite
        flag = torch.as_tensor(finite).to(torch.int32).clone()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return flag.bool()

    cls.check_finite = check_finite

    keras_apply = cls.apply

    @functools.wraps(keras_apply)
    def apply(self, grads, trainable_variables=None):
        inner = getattr(self, "inner_optimizer", None)
        if _compiling() or not (
                isinstance(inner, Optimizer)
                and not_overridden(inner, Optimizer, "apply")
                and all(not_overridden(self, cls, name) for name in (
                    "_common_apply", "_stateful_handle_finite_grads"))):
            # Under torch.compile the clipping is Keras' (`_clip_rule`).
            # A subclass's step (of the scaler, or of ours) could keep
            # the quotients.
            return keras_apply(self, grads, trainable_variables)
        # What it was handed: the unscaled gradients it makes from them
        # and hands to ours are held by no caller (`_unscaled`).
        grads = list(grads)
        inner.__dict__["_keo_loss_scale_inputs"] = grads
        try:
            return keras_apply(self, grads, trainable_variables)
        finally:
            inner.__dict__.pop("_keo_loss_scale_inputs", None)

    cls.apply = apply


def sync_initial_state(optimizer, variables):
    """Broadcast ``variables`` from rank 0 before the optimizer state (and
    the averages, which start as copies) is built, as DDP does when it
    wraps a module: every rank then starts from the same weights.
    Returns whether it broadcast (a group of more than one rank)."""
    del optimizer
    if _world_size() == 1:
        return False
    dist = torch.distributed
    with torch.no_grad():
        for var in variables:
            value = var.value
            dist.broadcast(value.data if hasattr(value, "data") else value,
                           src=0)
    return True


def sum_over_processes(values):
    """The sum of ``values`` (a float64 numpy array) over the ranks of a
    running ``torch.distributed`` group (an all-reduce every rank joins),
    in float64, on the group's device."""
    if _world_size() == 1:
        return values
    dist = torch.distributed
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    # A copy: the all-reduce writes in place, and the caller's array stays.
    total = torch.tensor(np.asarray(values, np.float64), device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.cpu().numpy()


# Whether a flag is true on any rank (an all-reduce every rank joins).
any_process = _common.any_process_over(sum_over_processes)


def is_chief():
    """Rank 0 of ``torch.distributed`` (always, without a group)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or (
        dist.get_rank() == 0)


# Rank 0's value on every rank (an all-reduce every rank joins).
from_chief = _common.from_chief_over(sum_over_processes, is_chief)


def lerp_averages(pairs, weight, gated=False):
    """``a <- a + weight (x - a)`` as one ``torch._foreach_lerp_`` per
    device and dtype (one pass, no temporary; as torch's ``AveragedModel``
    and timm do), with ``weight`` a 0-dim tensor, or a Python float where
    the strategy's weight is the same at every update (see ``_lerp`` for
    how a tensor is read). torch's lerp is exact at the ends for finite values:
    weight 1 copies, 0 keeps. Where the weight may be exactly 0 or 1
    (``gated``: SWA's steps between samples, a ``start_step``), the
    weight read once: 0 keeps the averages whatever the variables hold
    (a NaN too, as the engine's rule and the JAX and TensorFlow kernels
    do) without a pass, and 1 copies them. Pairs whose average has
    another dtype than its variable (``average_dtype``), and 16-bit ones
    under ``torch.compile``, are returned, for the engine's own update."""
    groups = {}
    rest = []
    slots = _tensors([slot for slot, _ in pairs])
    values = _tensors([var for _, var in pairs])
    for (slot, var), a, x in zip(pairs, slots, values):
        if (a.dtype != x.dtype or a.device != x.device
                or not a.is_floating_point()
                or (a.element_size() < 4 and _compiling())):
            # Under torch.compile, 16-bit averages are mixed by the
            # engine's rule, which the compiler fuses (the weight is not
            # read on the host there; see `_lerp`).
            rest.append((slot, var))
            continue
        avs, xs = groups.setdefault((a.device, a.dtype), ([], []))
        avs.append(a)
        xs.append(x)
    with torch.no_grad():
        for (device, dtype), (avs, xs) in groups.items():
            _lerp(avs, xs, weight, gated)
    return rest


def _lerp(averages, values, weight, gated):
    """``torch._foreach_lerp_`` of one device and dtype with ``weight``
    (the strategy's ``1 - d``: a 0-dim tensor in float32 or float64, or a
    Python float, ``Averaging.constant_weights``, which reads nothing).

    torch's ``_foreach_lerp_`` takes its weight as a number: it has no
    overload for a tensor weight, and reads a 0-dim tensor with
    ``.item()`` in C++ (on CUDA a wait for the device's queued work, once
    a call; torch's own ``AveragedModel`` and timm pass a Python float).
    It mixes bfloat16 and float16 tensors in float32 with that number,
    so the weight is passed in its own float32: cast to the averages'
    16-bit dtype first, 0.1 became 0.10009765625 in bfloat16 and 0.01
    0.0099945 in float16, where the engine's rule (and the JAX and
    TensorFlow steps) mix with the float32 weight. The weight is read
    here once, in torch's place (on any device: the same one read torch
    would make), so that where ``gated`` 0 keeps the averages (without a
    pass: whatever ``values`` hold, a NaN too) and 1 copies them. Under
    ``torch.compile`` nothing is read on the host: the compiler takes the
    tensor."""
    if _compiling():
        torch._foreach_lerp_(averages, values, weight)
        return
    end = float(weight)
    if gated and end == 0.0:
        return  # kept, whatever the variables hold
    if gated and end == 1.0:
        torch._foreach_copy_(averages, values)
        return
    torch._foreach_lerp_(averages, values, end)


def executing_eagerly():
    """Always (PyTorch runs eagerly)."""
    return True
