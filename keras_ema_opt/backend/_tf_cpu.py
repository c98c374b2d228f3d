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

import tensorflow as tf
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
    dense float32 gradients and float32 variables on a CPU, no strategy,
    not inside a function XLA compiles (the op has no XLA kernel), nor
    one traced to be saved (a SavedModel would need the op's library to
    load)."""
    if tf.distribute.has_strategy() or tf.config.list_logical_devices("GPU"):
        return False
    if control_flow_util.GraphOrParentsInXlaContext(
            tf_ops.get_default_graph()) or save_context.in_save_context():
        return False
    for grad, var in zip(grads, variables):
        value = tf_variable(var)
        if (not isinstance(grad, tf.Tensor) or grad.dtype != tf.float32
                or value.dtype != tf.float32
                or isinstance(value, tf.distribute.DistributedValues)
                or not _on_cpu(value)):
            return False
    return _kernel.serves()


def _on_cpu(variable):
    device = getattr(variable, "device", "") or ""
    return tf.DeviceSpec.from_string(device).device_type in (None, "CPU")


def apply(optimizer, scalars, members, averages, decay=False):
    """One fused step of ``members`` (``(grad, variable, index, slots)``,
    ``fused_adam_plan``'s) with ``averages`` averages each (``decay``:
    their weight decay first): the variables are updated in place."""
    handles, grads = [], []
    for grad, var, i, slots in members:
        handles += [tf_variable(v).handle for v in (
            var, optimizer._momentums[i], optimizer._velocities[i], *slots)]
        grads.append(grad)
    _kernel.ops.keras_ema_opt_adam_average(
        handles=handles, grads=grads, scalars=scalars, averages=averages,
        decay=bool(decay))


def tf_variable(variable):
    """The ``tf.Variable`` behind a Keras variable (or the variable)."""
    return variable.value if isinstance(variable, keras.Variable) else variable
