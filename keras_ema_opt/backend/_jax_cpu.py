"""JAX on a CPU: Keras' Adam with the averages folded in, as one C++ kernel.

XLA's CPU code makes one loop per output of the Adam + average update (the
moments, the weight, each average), and each later loop reads back what an
earlier one wrote: 13 floats an element where 9 must move with one
average, so at best 0.69 of the memory bandwidth (docs/performance.md).
``jax_kernels.cc`` (the rule: ``adam_average.h``) makes one pass instead,
as an XLA FFI target built against jaxlib's headers on first use
(``_native``). Without a compiler, or where the build fails, JAX's own
step runs (the same rule, to the bit: tested), and :func:`status` says
why.
"""

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np

from keras_ema_opt.backend import _native

_TARGET = "keras_ema_opt_adam_average"
MAX_AVERAGES = _native.MAX_AVERAGES
RULE_SCALARS = _native.RULE_SCALARS


def _load():
    import jaxlib

    def register(path):
        library = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(
            _TARGET, jax.ffi.pycapsule(library.KeoAdamAverage),
            platform="cpu")
        _kernel.library = library  # kept loaded

    _native.build("jax_adam_average", ("jax_kernels.cc", "adam_average.h"),
                  (f"-I{jax.ffi.include_dir()}",),
                  (jax.__version__, getattr(jaxlib, "__version__", "")),
                  register, load_errors=(OSError, AttributeError))


_kernel = _native.Kernel("JAX's Adam step on a CPU", _load)
status = _kernel.status


def serves(grads, variables):
    """Whether the kernel can update these variables with these gradients:
    float32 arrays on a CPU, in a process with one JAX device (a sharded
    array would be gathered)."""
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    if any(not isinstance(g, jax.Array) or g.dtype != jnp.float32
           or v.dtype != "float32" for g, v in zip(grads, variables)):
        return False
    return _kernel.serves()


def apply(optimizer, scalars, members, averages, decay=False):
    """One fused step of ``members`` (``(grad, variable, index, slots)``,
    ``fused_adam_plan``'s) with ``averages`` averages each (``decay``:
    their weight decay first)."""
    tensors = [(grad, optimizer._momentums[i].value,
                optimizer._velocities[i].value, var.value,
                *(slot.value for slot in slots))
               for grad, var, i, slots in members]
    updated = adam_average(scalars, tensors, averages, decay)
    for (_, var, i, slots), values in zip(members, updated):
        optimizer._momentums[i].assign(values[0])
        optimizer._velocities[i].assign(values[1])
        var.assign(values[2])
        for slot, value in zip(slots, values[3:]):
            slot.assign(value)


def adam_average(scalars, tensors, averages, decay=False):
    """One Adam step with ``averages`` averages per tensor.

    Args:
        scalars: float32 ``[alpha, 1 - beta_1, 1 - beta_2, epsilon, wd,
            lr, u_1, ..., u_k]``, ``u_j`` the weight of the new value in
            average ``j`` (1 copies, 0 keeps); ``wd`` and ``lr`` are read
            where ``decay``.
        tensors: per variable ``(g, m, v, w, a_1, ..., a_k)``, float32
            arrays of one size.
        averages: ``k``, 0 to 2.
        decay: whether each weight decays first, ``w - w * wd * lr``
            (Keras' decoupled weight decay).

    Returns:
        Per variable ``(m, v, w, a_1, ..., a_k)`` after the step, each in
        its input's buffer (aliased).
    """
    return _adam_average(averages, bool(decay), scalars,
                         [tuple(t) for t in tensors])


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _adam_average(averages, decay, scalars, tensors):
    per_in, per_out = 4 + averages, 3 + averages
    operands = [scalars]
    shapes, aliases = [], {}
    for i, group in enumerate(tensors):
        operands.extend(group)
        for k, value in enumerate(group[1:]):
            aliases[1 + i * per_in + 1 + k] = len(shapes)
            shapes.append(jax.ShapeDtypeStruct(value.shape, value.dtype))
    # Under `jax.vmap` (an ensemble of optimizers), one call per member.
    outputs = jax.ffi.ffi_call(_TARGET, shapes, input_output_aliases=aliases,
                               vmap_method="sequential")(
        *operands, averages=np.int64(averages), decay=np.int64(decay))
    return [tuple(outputs[i * per_out:(i + 1) * per_out])
            for i in range(len(tensors))]


@_adam_average.defjvp
def _adam_average_jvp(averages, decay, primals, tangents):
    """Derivatives through the step (``jax.grad`` of a loss after it): those
    of the same rule written in ``jax.numpy``."""
    outputs = _adam_average(averages, decay, *primals)
    _, derivatives = jax.jvp(functools.partial(_rule, averages, decay),
                             primals, tangents)
    return outputs, derivatives


def _rule(averages, decay, scalars, tensors):
    """The kernel's rule in ``jax.numpy`` (see ``adam_average.h``)."""
    alpha, c1, c2, eps, wd, lr = (scalars[i] for i in range(RULE_SCALARS))
    updated = []
    for g, m, v, w, *avgs in tensors:
        if decay:
            w = w - w * wd * lr
        m = m + (g - m) * c1
        v = v + (g * g - v) * c2
        w = w - (m * alpha) / (jnp.sqrt(v) + eps)
        new = []
        for j, a in enumerate(avgs):
            u = scalars[RULE_SCALARS + j]
            near = u < 0.5
            mixed = jnp.where(near, a, w) + jnp.where(near, u, u - 1) * (
                w - a)
            new.append(jnp.where(u == 1, w, jnp.where(u == 0, a, mixed)))
        updated.append((m, v, w, *new))
    return updated
