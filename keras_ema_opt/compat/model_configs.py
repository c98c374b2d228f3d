"""Keras 2 layer configs that Keras 3 rejects, made acceptable.

Keras 3 builds most Keras 2 model configs itself
(``keras.src.legacy.saving.saving_utils.model_from_config`` handles
``batch_input_shape``, dtype policies and the Keras 2 serialization
format), but refuses arguments that were removed. Each entry below names a
removed argument and the values under which dropping it changes nothing;
any other value is refused with an error naming the layer, the argument and
its value, never dropped silently.
"""

import functools
import inspect

from keras_ema_opt.compat.activations import CHANGED_ACTIVATIONS
from keras_ema_opt.errors import LegacyConfigError

_ANY = object()
_RNN = {"time_major": (False,)}
_GROUPLESS = {"groups": (1, None)}
# Layer config keys that name an activation function.
_ACTIVATION_KEYS = ("activation", "recurrent_activation")

# class name -> {removed argument: values that are safe to drop}
REMOVED_ARGUMENTS = {
    "LSTM": _RNN,
    "GRU": _RNN,
    "SimpleRNN": _RNN,
    "CuDNNLSTM": _RNN,
    "CuDNNGRU": _RNN,
    "ConvLSTM1D": _RNN,
    "ConvLSTM2D": _RNN,
    "ConvLSTM3D": _RNN,
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
    # tf_keras' choice of random generator; Keras 3 layers draw from
    # their own SeedGenerator (no augmentation stream is carried over).
    **{name: {"rng_type": _ANY} for name in (
        "RandomFlip", "RandomRotation", "RandomZoom", "RandomTranslation",
        "RandomContrast", "RandomCrop", "RandomHeight", "RandomWidth",
        "RandomBrightness")},
    # What tf_keras' lookup layers record of how they were made: the
    # vocabulary itself comes from the artifact (a SavedModel's lookup
    # table, a `.keras` file's assets), checked against its size there.
    **{name: {"batch_input_shape": _ANY, "vocabulary_size": _ANY,
              "has_input_vocabulary": _ANY}
       for name in ("StringLookup", "IntegerLookup")},
    "BatchNormalization": {"fused": _ANY, "renorm": (False,),
                           "renorm_clipping": (None,),
                           "renorm_momentum": _ANY,
                           "virtual_batch_size": (None,),
                           "adjustment": (None,)},
}


# class name -> string arguments whose Keras 2 values are also the names of
# functions of `keras.layers`. Keras 3's legacy reader turns any string of
# a config that names such a function into the function (`score_mode="dot"`
# became `keras.layers.dot`, which Attention refuses).
STRING_ARGUMENTS = {"Attention": ("score_mode",)}

# Keys under which a layer's config holds the config of another layer (or
# cell) that Keras 3 deserializes with its new-style deserializer, which
# needs a "module"; Keras 2 SavedModel metadata records none.
_SUBLAYER_KEYS = ("layer", "backward_layer", "cell", "cells")

# Keras 3 class name -> {Keras 2 weight name: Keras 3 weight name}, for the
# weights Keras 3 renamed (used when placing Keras 2 weights by name).
RENAMED_WEIGHTS = {
    "DepthwiseConv1D": {"depthwise_kernel": "kernel"},
    "DepthwiseConv2D": {"depthwise_kernel": "kernel"},
}


@functools.lru_cache(maxsize=None)
def _accepts(class_name, argument):
    """Whether the installed Keras' layer of that name takes the argument
    (Keras 3.15's BatchNormalization takes `renorm` again, with tf_keras'
    rule and weights): kept then, neither refused nor dropped."""
    import keras

    layer = getattr(keras.layers, class_name, None)
    if layer is None:
        return False
    return argument in inspect.signature(layer).parameters


def upgrade_model_config(config):
    """A copy of a Keras 2 model config that Keras 3 accepts.

    Besides dropping removed arguments (``REMOVED_ARGUMENTS``):

    - node indices of calls to a nested functional model, or to a nested
      ``Sequential`` that starts with an ``InputLayer``, are shifted down
      by one: Keras 2 counted such a model's own first node (its
      ``_should_skip_first_node``), Keras 3 models have none (where Keras
      3 reads the model's outputs, it takes the one off itself for a
      ``Functional``, so only ``Sequential`` references move there);
    - a Keras 2 dtype policy (``{"class_name": "Policy", ...}``) becomes
      its name (``"mixed_bfloat16"``), which Keras 3 reads as its own;
    - call arguments that are tensors (``MultiHeadAttention``'s
      ``value=``, a ``mask=``), which Keras 2 wrote as ``[layer, node,
      tensor]`` inside the kwargs of a node, become Keras 3 tensor
      references (its dict node format), as Keras 3's reader of the list
      format passes them on as plain lists;
    - the layers of a model, and the model, written by tf_keras' ``.keras``
      format with a Keras 2 ``"module"`` lose it, so that Keras 3 reads
      them as the Keras 2 configs they are (its legacy reader converts
      ``batch_input_shape`` and BatchNormalization's ``axis=[3]``);
    - wrapped layers and cells (``Bidirectional``, ``TimeDistributed``,
      ``RNN(cell=...)``) without a ``"module"`` get Keras' own, as the
      new-style deserializer needs;
    - activations whose name means another function in Keras 3
      (``"hard_sigmoid"``, ``activations.CHANGED_ACTIVATIONS``) name the
      Keras 2 function instead.

    Raises:
        LegacyConfigError: a removed argument with a value that mattered
            (``time_major=True``, ...), naming the layer. An argument the
            installed Keras takes is kept (``renorm=True``, which Keras
            3.15 took back).
    """
    return _upgrade(config, parent_key=None)


def kept_strings(config):
    """``custom_objects`` entries that keep the ``STRING_ARGUMENTS`` of a
    Keras 2 model config strings (``{"dot": "dot"}``) while Keras 3 builds
    it: its reader looks names up there first, and a string is no
    function."""
    found = {}

    def walk(item):
        if isinstance(item, list):
            for value in item:
                walk(value)
        elif isinstance(item, dict):
            inner = item.get("config")
            for key in STRING_ARGUMENTS.get(item.get("class_name"), ()):
                value = inner.get(key) if isinstance(inner, dict) else None
                if isinstance(value, str):
                    found[value] = value
            for value in item.values():
                walk(value)

    walk(config)
    return found


def _upgrade(config, parent_key):
    if isinstance(config, list):
        return [_upgrade(c, parent_key) for c in config]
    if not isinstance(config, dict):
        return config
    out = {k: _upgrade(v, k) for k, v in config.items()}
    class_name = out.get("class_name")
    inner = out.get("config")
    if parent_key in _SUBLAYER_KEYS and isinstance(inner, dict) and (
            "module" not in out) and _is_keras_layer(class_name):
        out["module"] = "keras.layers"
    if isinstance(inner, dict) and isinstance(inner.get("layers"), list):
        _shift_nested_model_nodes(inner)
        inner["layers"] = [_legacy_form(layer) for layer in inner["layers"]]
    if parent_key is None:
        out = _legacy_form(out)
    if isinstance(inner, dict):
        for key in _ACTIVATION_KEYS:
            value = inner.get(key)
            if isinstance(value, str) and value in CHANGED_ACTIVATIONS:
                inner[key] = CHANGED_ACTIVATIONS[value]
    if isinstance(inner, dict) and _is_policy(inner.get("dtype")):
        inner["dtype"] = inner["dtype"]["config"]["name"]
    if isinstance(out.get("inbound_nodes"), list):
        out["inbound_nodes"] = [_node_with_tensor_kwargs(node)
                                for node in out["inbound_nodes"]]
    removed = REMOVED_ARGUMENTS.get(class_name)
    if removed and isinstance(inner, dict):
        for key, safe in removed.items():
            if key not in inner or _accepts(class_name, key):
                continue
            value = inner[key]
            if safe is not _ANY and value not in safe:
                raise LegacyConfigError(
                    f"Layer {inner.get('name')!r} ({class_name}) has "
                    f"{key}={value!r}, which Keras 3 removed; only "
                    f"{key} in {list(safe)} can be migrated.")
            del inner[key]
    return out


def _is_keras_layer(class_name):
    import keras

    return isinstance(class_name, str) and isinstance(
        getattr(keras.layers, class_name, None), type)


def _starts_with_input(layer_config):
    layers = (layer_config.get("config") or {}).get("layers") or []
    return bool(layers) and isinstance(layers[0], dict) and (
        layers[0].get("class_name") == "InputLayer")


def _shift_nested_model_nodes(graph):
    """In a functional config, re-index the calls of nested models that
    Keras 2 numbered from 1 (see ``upgrade_model_config``)."""
    sequential, functional = set(), set()
    for layer in graph["layers"]:
        if not isinstance(layer, dict):
            continue
        if layer.get("class_name") == "Sequential" and _starts_with_input(
                layer):
            sequential.add(layer.get("name"))
        elif layer.get("class_name") in ("Functional", "Model"):
            functional.add(layer.get("name"))
    if not sequential and not functional:
        return

    def fix(ref, names):
        if (isinstance(ref, list) and len(ref) >= 3
                and isinstance(ref[0], str) and isinstance(ref[1], int)):
            if ref[0] in names:
                if ref[1] < 1:
                    raise LegacyConfigError(
                        f"Node {ref[:3]} refers to the first node of the "
                        f"nested model {ref[0]!r}, which Keras 2 does not "
                        "save; the config is damaged.")
                ref = [ref[0], ref[1] - 1, *ref[2:]]
            return ref
        if isinstance(ref, list):
            return [fix(r, names) for r in ref]
        return ref

    for layer in graph["layers"]:
        if isinstance(layer, dict) and "inbound_nodes" in layer:
            layer["inbound_nodes"] = fix(layer["inbound_nodes"],
                                         sequential | functional)
    # Keras 3 itself takes one off for nested Functional models here.
    for key in ("input_layers", "output_layers"):
        if key in graph:
            graph[key] = fix(graph[key], sequential)


def _is_policy(dtype):
    return isinstance(dtype, dict) and dtype.get("class_name") in (
        "Policy", "DTypePolicy", "PolicyV1") and isinstance(
            dtype.get("config"), dict) and "name" in dtype["config"]


def _is_tensor_ref(value):
    return (isinstance(value, list) and len(value) in (3, 4)
            and isinstance(value[0], str) and isinstance(value[1], int)
            and isinstance(value[2], int)
            and (len(value) == 3 or isinstance(value[3], dict)))


def _has_tensor_ref(value):
    if _is_tensor_ref(value):
        return True
    if isinstance(value, dict):
        return any(_has_tensor_ref(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_tensor_ref(v) for v in value)
    return False


def _tensor(ref):
    # The shape and dtype are placeholders: Keras 3 replaces the tensor
    # by the output of the node its history names.
    return {"class_name": "__keras_tensor__",
            "config": {"shape": [], "dtype": "float32",
                       "keras_history": list(ref[:3])}}


def _tensors_in(value):
    if _is_tensor_ref(value):
        return _tensor(value)
    if isinstance(value, dict):
        return {k: _tensors_in(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tensors_in(v) for v in value]
    return value


def _node_with_tensor_kwargs(node):
    """A Keras 2 node ``[[layer, node, tensor, kwargs], ...]`` whose kwargs
    hold tensors, in Keras 3's ``{"args": ..., "kwargs": ...}`` form (the
    same call: the inbound tensors as the first argument, the kwargs of
    the last entry, as both Keras versions read them)."""
    if not (isinstance(node, list) and node
            and all(_is_tensor_ref(e) for e in node)):
        return node
    kwargs = node[-1][3] if len(node[-1]) == 4 else {}
    if not _has_tensor_ref(kwargs):
        return node
    tensors = [_tensor(e) for e in node]
    return {"args": [tensors[0] if len(tensors) == 1 else tensors],
            "kwargs": _tensors_in(kwargs)}


def _legacy_form(layer):
    """A layer config without the Keras 2 ``module`` / ``registered_name``
    of tf_keras' ``.keras`` format (custom classes keep theirs)."""
    if not isinstance(layer, dict):
        return layer
    module = layer.get("module")
    if not isinstance(module, str) or not module.split(".")[0] in (
            "keras", "tf_keras"):
        return layer
    out = dict(layer)
    out.pop("module")
    if out.get("registered_name") in (None, out.get("class_name")):
        out.pop("registered_name", None)
    return out
