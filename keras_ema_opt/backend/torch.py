"""PyTorch hooks: Keras' multi-tensor update rules, autograd, torch.distributed."""

import functools
import importlib
import math

import torch

from keras_ema_opt.backend import _common

colocate_with = _common.no_placement
on_create = _common.on_create
chief_only_scope = _common.chief_only_scope
assign_copy = _common.assign_copy
value_visible = _common.value_visible
current_value = _common.current_value
attach_model = _common.attach_model
prepare_gradients = _common.prepare_gradients
sync_training_state = _common.sync_training_state

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
    fused = _FUSED.get(name)
    if fused is not None and hasattr(cls, "_parallel_update_step"):
        return _with_fused_step(fused, cls)
    return cls


@functools.lru_cache(maxsize=None)  # one class per rule: identity holds
def _with_fused_step(fused, cls):
    return type(cls.__name__, (fused, cls), {"__module__": cls.__module__})


class _FusedAdamStep:
    """Keras' Adam update (``AdamW``: its decoupled decay is applied before,
    by Keras) as torch's fused kernel: one pass over each tensor instead of
    Keras' ten ``torch._foreach`` passes and four temporaries.

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
        groups = _fusable_groups(grads, variables)
        if groups is None or not hasattr(torch, "_fused_adam_") or (
                _compiling()):
            # Under torch.compile (`model.compile(jit_compile=True)`) the
            # compiler fuses Keras' own step; its host-side step size would
            # break the graph.
            return super()._parallel_update_step(grads, variables,
                                                 learning_rate)
        lr = learning_rate.value if hasattr(learning_rate, "value") else (
            learning_rate)
        alpha = _keras_adam_alpha(float(lr), self.beta_1, self.beta_2,
                                  int(self.iterations.value.item()) + 1)
        for (device, _), (grad_list, var_list) in groups.items():
            index = [self._get_variable_index(v) for v in var_list]
            steps = [_no_bias_correction(device)] * len(var_list)
            torch._fused_adam_(
                [v.value for v in var_list], grad_list,
                [self._momentums[i].value for i in index],
                [self._velocities[i].value for i in index],
                [self._velocity_hats[i].value for i in index]
                if self.amsgrad else [],
                steps, lr=alpha, beta1=float(self.beta_1),
                beta2=float(self.beta_2), weight_decay=0.0,
                eps=float(self.epsilon), amsgrad=bool(self.amsgrad),
                maximize=False)


def _compiling():
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _keras_adam_alpha(lr, beta_1, beta_2, step):
    """``lr sqrt(1 - b2^t) / (1 - b1^t)`` in float32, operation by
    operation as ``keras/src/backend/torch/optimizers/torch_adam.py``."""
    import numpy as np

    f = np.float32
    t = f(step)
    b1_power = np.power(f(beta_1), t)
    b2_power = np.power(f(beta_2), t)
    return float(f(lr) * np.sqrt(f(1) - b2_power) / (f(1) - b1_power))


_STEPS = {}


def _no_bias_correction(device):
    """A step count at which ``1 - beta^t`` is exactly 1 in torch's kernel
    (``beta < 1``): its bias corrections then change nothing."""
    step = _STEPS.get(device)
    if step is None:
        step = _STEPS[device] = torch.tensor(1e9, dtype=torch.float32,
                                             device=device)
    return step


def _fusable_groups(grads, variables):
    """``{(device, dtype): (grads, variables)}`` when every gradient is a
    dense tensor of its variable's dtype and device, on a device and dtype
    torch's fused optimizers take; else None."""
    groups = {}
    for g, v in zip(grads, variables):
        value = v.value
        if (not isinstance(g, torch.Tensor) or g.is_sparse
                or g.dtype != value.dtype or g.device != value.device
                or value.dtype not in _FUSED_DTYPES
                or value.device.type not in ("cpu", "cuda")):
            return None
        pair = groups.setdefault((value.device, value.dtype), ([], []))
        pair[0].append(g)
        pair[1].append(v)
    return groups


_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_FUSED = {"Adam": _FusedAdamStep, "AdamW": _FusedAdamStep}


class OptimizerHooks:
    """Nothing to override on PyTorch for the Keras 2 contract."""


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
    if _world_size() == 1 or getattr(optimizer, "_gradients_aggregated",
                                     False):
        return grads
    return _all_reduce_mean(grads)


def sync_initial_state(optimizer, variables):
    """Broadcast ``variables`` from rank 0 before the optimizer state (and
    the averages, which start as copies) is built, as DDP does when it
    wraps a module: every rank then starts from the same weights."""
    del optimizer
    if _world_size() == 1:
        return
    dist = torch.distributed
    with torch.no_grad():
        for var in variables:
            value = var.value
            dist.broadcast(value.data if hasattr(value, "data") else value,
                           src=0)


def is_chief():
    """Rank 0 of ``torch.distributed`` (always, without a group)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or (
        dist.get_rank() == 0)



def lerp_averages(pairs, weight, gated=False):
    """``a <- a + weight (x - a)`` as one ``torch._foreach_lerp_`` per
    device and dtype (one pass, no temporary; as torch's ``AveragedModel``
    and timm do), with ``weight`` a 0-dim tensor (no host sync). torch's
    lerp is exact at the ends: weight 1 copies, 0 keeps. Pairs whose
    average has another dtype than its variable (``average_dtype``) are
    returned, for the engine's own update."""
    del gated  # torch's lerp is exact at both ends
    groups = {}
    rest = []
    for slot, var in pairs:
        a, x = slot.value, var.value
        if (a.dtype != x.dtype or a.device != x.device
                or not a.is_floating_point()):
            rest.append((slot, var))
            continue
        avs, xs = groups.setdefault((a.device, a.dtype), ([], []))
        avs.append(a)
        xs.append(x)
    with torch.no_grad():
        for (device, dtype), (avs, xs) in groups.items():
            torch._foreach_lerp_(avs, xs, weight.to(device=device,
                                                    dtype=dtype))
    return rest
