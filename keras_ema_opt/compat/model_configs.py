"""Keras 2 layer configs that Keras 3 rejects, made acceptable.

Keras 3 builds most Keras 2 model configs itself
(``keras.src.legacy.saving.saving_utils.model_from_config`` handles
``batch_input_shape``, dtype policies and the Keras 2 serialization
format), but refuses arguments that were removed. Each entry below names a
removed argument and the values under which dropping it changes nothing;
any other value is refused with an error naming the layer, the argument and
its value, never dropped silently.
"""

from keras_ema_opt.errors import LegacyConfigError

_ANY = object()
_RNN = {"time_major": (False,)}
_GROUPLESS = {"groups": (1, None)}

# class name -> {removed argument: values that are safe to drop}
REMOVED_ARGUMENTS = {
    "LSTM": _RNN,
    "GRU": _RNN,
    "SimpleRNN": _RNN,
    "CuDNNLSTM": _RNN,
    "CuDNNGRU": _RNN,
    "DepthwiseConv1D": _GROUPLESS,
    "DepthwiseConv2D": _GROUPLESS,
    "Conv1DTranspose": _GROUPLESS,
    "Conv2DTranspose": _GROUPLESS,
    "Conv3DTranspose": _GROUPLESS,
    "SeparableConv1D": {**_GROUPLESS, "kernel_initializer": _ANY,
                        "kernel_regularizer": _ANY,
                        "kernel_constraint": _ANY},
    "SeparableConv2D": {**_GROUPLESS, "kernel_initializer": _ANY,
                        "kernel_regularizer": _ANY,
                        "kernel_constraint": _ANY},
    # Shapes recorded for building; Keras 3 builds from the first call.
    "MultiHeadAttention": {"query_shape": _ANY, "key_shape": _ANY,
                           "value_shape": _ANY,
                           "softmax_robust_masking": (False,)},
    "BatchNormalization": {"fused": _ANY, "renorm": (False,),
                           "renorm_clipping": (None,),
                           "renorm_momentum": _ANY,
                           "virtual_batch_size": (None,),
                           "adjustment": (None,)},
}


def upgrade_model_config(config):
    """A copy of a Keras 2 model config that Keras 3 accepts.

    Raises:
        LegacyConfigError: a removed argument with a value that mattered
            (``time_major=True``, ``renorm=True``, ...), naming the layer.
    """
    if isinstance(config, list):
        return [upgrade_model_config(c) for c in config]
    if not isinstance(config, dict):
        return config
    out = {k: upgrade_model_config(v) for k, v in config.items()}
    class_name = out.get("class_name")
    inner = out.get("config")
    removed = REMOVED_ARGUMENTS.get(class_name)
    if removed and isinstance(inner, dict):
        for key, safe in removed.items():
            if key not in inner:
                continue
            value = inner[key]
            if safe is not _ANY and value not in safe:
                raise LegacyConfigError(
                    f"Layer {inner.get('name')!r} ({class_name}) has "
                    f"{key}={value!r}, which Keras 3 removed; only "
                    f"{key} in {list(safe)} can be migrated.")
            del inner[key]
    return out
