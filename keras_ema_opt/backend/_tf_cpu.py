"""TensorFlow on a CPU: Keras' Adam with the averages folded in, one op.

Keras' TensorFlow step runs about ten ops a variable for Adam, and the
averaging one or two more per average (``lerp_averages``); on a CPU,
without XLA (Keras' ``fit()`` turns it off there, as Keras 2 did), each
is a kernel launch through TensorFlow's executor, and under XLA the
runtime pays per resource variable (docs/performance.md).
``tf_kernels.cc`` (the rule: ``adam_average.h``) is one custom op for all
the variables of the step, built against TensorFlow's headers on first
use (``_native``). It has no XLA kernel: inside a function compiled by
XLA, under a ``tf.distribute`` strategy, without a compiler, or where the
build fails, Keras' own step runs (the same rule), and :func:`status`
says why.
"""

import platform
import threading
import weakref

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps
from tensorflow.python.framework import func_graph
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util
from tensorflow.python.saved_model import save_context

import keras
from keras_ema_opt.backend import _native

MAX_AVERAGES = _native.MAX_AVERAGES
RULE_SCALARS = _native.RULE_SCALARS


def _flags():
    flags = [*tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
    if platform.machine() in ("x86_64", "AMD64") and _native.accepts(
            "-mno-avx512fp16"):
        # Eigen's AVX512-FP16 code in TensorFlow's headers does not build
        # with GCC 12 where `-march=native` turns it on; the kernel has no
        # use for half precision (older compilers know neither).
        flags.append("-mno-avx512fp16")
    return tuple(flags)


def _load():
    def load(path):
        _kernel.ops = tf.load_op_library(str(path))

    _native.build("tf_adam_average", ("tf_kernels.cc", "adam_average.h"),
                  _flags(), (tf.__version__, tf.sysconfig.get_build_info()),
                  load, load_errors=(OSError, tf.errors.OpError))


_kernel = _native.Kernel("TensorFlow's Adam step on a CPU", _load)
status = _kernel.status


def serves(grads, variables):
    """Whether the op can update these variables with these gradients:
    dense float32 gradients and float32 variables on one CPU device, no
    strategy, not inside a function XLA compiles (the op has no XLA
    kernel), nor one traced to be saved (a SavedModel would need the op's
    library to load)."""
    if tf.distribute.has_strategy() or tf.config.list_logical_devices("GPU"):
        return False
    if control_flow_util.GraphOrParentsInXlaContext(
            tf_ops.get_default_graph()) or save_context.in_save_context():
        return False
    devices = set()
    for grad, var in zip(grads, variables):
        value = tf_variable(var)
        if (not isinstance(grad, tf.Tensor) or grad.dtype != tf.float32
                or value.dtype != tf.float32
                or isinstance(value, tf.distribute.DistributedValues)
                or not _on_cpu(value)):
            return False
        devices.add(value.device)
    # One op takes every handle: variables on two CPU devices (logical
    # devices of one CPU) cannot be placed together.
    return len(devices) <= 1 and _kernel.serves()


def _on_cpu(variable):
    device = getattr(variable, "device", "") or ""
    return tf.DeviceSpec.from_string(device).device_type in (None, "CPU")


def apply(optimizer, scalars, members, averages, decay=False):
    """One fused step of ``members`` (``(grad, variable, index, slots)``,
    ``fused_adam_plan``'s) with ``averages`` averages each (``decay``:
    their weight decay first): the variables are updated in place."""
    weights, slots, grads = [], [], []
    for grad, var, i, averaged in members:
        weights.append(tf_variable(var).handle)
        slots += [tf_variable(v) for v in (
            optimizer._momentums[i], optimizer._velocities[i], *averaged)]
        grads.append(grad)
    _kernel.ops.keras_ema_opt_adam_average(
        weights=weights, slots=_packed(optimizer, slots), grads=grads,
        scalars=scalars, averages=averages, decay=bool(decay))


# The slots' handles, packed into one tensor. A function pays for each
# resource it takes on every call (about 3.5 us a variable on this step:
# its capture's trace type hashed in the function cache's lookup, the
# handle passed through the call): the weights' handles a step's function
# takes anyway, for the forward pass, but its moments and averages only
# the op would use. Packed once, eagerly, they are one input of the
# function and of the op. Automatic control dependencies order a
# function's ops by the resource tensors they take, and the pack hides the
# slots from them: ``_order_around_packs`` tells them which variables an
# op taking a pack writes, so the function's other reads and writes of a
# moment or an average, before the step or after it, inside a ``tf.cond``
# or not, keep their order with it. A pack lives as long as the optimizer
# keeps it or a function graph that took it (automatic control
# dependencies run when a trace ends, and a trace may use more packs than
# the optimizer keeps).

_PACKS_ATTR = "_keras_ema_opt_tf_slot_packs"
_MAX_PACKS = 8  # an optimizer's packs kept (a step uses one to six)
# Kept across a reload of this module, as the resolver registered first is.
_LIVE_PACKS = globals().get("_LIVE_PACKS", weakref.WeakSet())
_LIVE_PACKS_LOCK = globals().get("_LIVE_PACKS_LOCK", threading.Lock())


class _Pack:
    """The slot variables of a step's group, their handles and the packed
    tensor of the handles (an eager tensor, captured by the functions that
    trace the step)."""

    __slots__ = ("variables", "handles", "packed", "__weakref__")

    def __init__(self, variables):
        self.variables = tuple(variables)
        with tf.init_scope():
            self.handles = tuple(v.handle for v in self.variables)
            self.packed = tf.stack(self.handles)


def _packed(owner, variables):
    """The packed handles of ``variables``, made once for ``owner`` (the
    optimizer: its latest ``_MAX_PACKS`` packs are kept, which keep their
    variables alive, so an ``id`` stays theirs)."""
    with _LIVE_PACKS_LOCK:
        packs = owner.__dict__.setdefault(_PACKS_ATTR, {})
        key = tuple(map(id, variables))
        pack = packs.pop(key, None)
        if pack is None:
            pack = _Pack(variables)
            _LIVE_PACKS.add(pack)
            while len(packs) >= _MAX_PACKS:
                packs.pop(next(iter(packs)))
        packs[key] = pack  # the most recently used last
    # The graphs tracing this step, and those around them, keep the pack
    # until they go (their automatic control dependencies need it).
    graph = tf_ops.get_default_graph()
    while isinstance(graph, func_graph.FuncGraph):
        kept = getattr(graph, _PACKS_ATTR, None)
        if kept is None:
            kept = set()
            setattr(graph, _PACKS_ATTR, kept)
        kept.add(pack)
        graph = graph.outer_graph
    return pack.packed


def _in_graph(graph, tensor):
    """The placeholder of function graph ``graph`` capturing eager
    ``tensor``, or None where the graph does not take it. Every function
    graph (a ``tf.cond`` branch's and a loop body's too) captures an eager
    tensor directly, keyed by its ``id``."""
    return graph._function_captures.by_val_internal.get(id(tensor))


def _order_around_packs(op, reads, writes):
    """Automatic control dependencies' resolver: an op that takes a pack
    (the fused step, or a ``tf.cond``, loop or call around it) writes each
    of its variables that the op's function takes."""
    graph = op.graph
    if not (_LIVE_PACKS and (reads or writes)
            and isinstance(graph, func_graph.FuncGraph)):
        return False
    with _LIVE_PACKS_LOCK:
        live = list(_LIVE_PACKS)
    updated = False
    for pack in live:
        packed = _in_graph(graph, pack.packed)
        if packed is None or not (packed in writes or packed in reads):
            continue
        for handle in pack.handles:
            inner = _in_graph(graph, handle)
            if inner is not None and inner not in writes:
                reads.discard(inner)
                writes.add(inner)
                updated = True
    return updated


if _order_around_packs.__name__ not in (
        auto_control_deps._acd_resource_resolvers_registry.list()):
    auto_control_deps.register_acd_resource_resolver(_order_around_packs)


def tf_variable(variable):
    """The ``tf.Variable`` behind a Keras variable (or the variable)."""
    return variable.value if isinstance(variable, keras.Variable) else variable
