"""PyTorch hooks: Keras' multi-tensor update rules, autograd, torch.distributed."""

import importlib

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
    return getattr(module, name, None) or _common.keras_optimizer_class(name)


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

