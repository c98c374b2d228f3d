"""PyTorch hooks: Keras' multi-tensor update rules, autograd, torch.distributed."""

import importlib

import torch

from keras_ema_opt.backend import _common

colocate_with = _common.no_placement
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


def aggregate_gradients(optimizer, grads_and_vars):
    """Sum over the ranks of ``torch.distributed`` when a group is running."""
    del optimizer
    pairs = list(grads_and_vars)
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return pairs
    if dist.get_world_size() == 1:
        return pairs
    out = []
    for g, v in pairs:
        if g is not None:
            g = g.detach().clone()
            dist.all_reduce(g, op=dist.ReduceOp.SUM)
        out.append((g, v))
    return out

