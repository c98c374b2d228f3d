"""A :class:`LegacyRecord` into a compiled Keras 3 model that resumes
training: the model from its Keras 2 config, the weights placed by name
and shape, the optimizer through ``keras_ema_opt.compat`` with every slot,
the iteration count, the learning rate and the EMA averages assigned."""

import collections.abc
import json
import re
import warnings

import keras
import numpy as np

from keras_ema_opt.compat import configs
from keras_ema_opt.compat import legacy_rules
from keras_ema_opt.compat import losses as compat_losses
from keras_ema_opt.compat import slots as slot_tables
from keras_ema_opt.errors import LegacyConfigError
from keras_ema_opt.errors import LegacyFormatError
from keras_ema_opt.errors import LegacyStateError
from keras_ema_opt.savedmodel.readers import LOOKUP_LAYERS as _LOOKUPS


def _contains_lambda(config):
    if isinstance(config, dict):
        if config.get("class_name") == "Lambda":
            return True
        return any(_contains_lambda(v) for v in config.values())
    if isinstance(config, list):
        return any(_contains_lambda(v) for v in config)
    return False


def build_model(record, custom_objects=None, safe_mode=True):
    """The Keras 3 model of a record's Keras 2 model config.

    Raises:
        LegacyConfigError: no config, a Lambda layer under ``safe_mode``, or
            a class Keras 3 does not know (named).
    """
    config = record.model_config
    if not isinstance(config, dict) or "config" not in config:
        raise LegacyConfigError(
            f"{record.path} holds no model config ({record.format}): build "
            "the model yourself and pass it (`model=` / `--model "
            "module:function`).")
    if safe_mode and _contains_lambda(config):
        raise LegacyConfigError(
            f"{record.path}: the model has a Lambda layer, whose function "
            "is stored as marshalled Python bytecode; loading it can run "
            "arbitrary code. Pass `safe_mode=False` (`--unsafe` on the "
            "command line) if you trust the file (Keras 3 refuses it the "
            "same way).")
    from keras.src.legacy.saving import saving_utils
    from keras.src.saving.serialization_lib import SafeModeScope

    from keras_ema_opt.compat import model_configs

    config = model_configs.upgrade_model_config(
        json.loads(json.dumps(config)))
    _vocabularies_from_tables(config, record.vocabularies)
    custom_objects = {**model_configs.kept_strings(config),
                      **(custom_objects or {})}
    try:
        with keras.saving.custom_object_scope(custom_objects), \
                SafeModeScope(safe_mode), warnings.catch_warnings():
            # A Keras 2 config keeps its first layer's `input_shape`: Keras
            # 3's advice not to pass one is for code, not a stored config.
            warnings.filterwarnings(
                "ignore", message="Do not pass an `input_shape`",
                category=UserWarning)
            model = saving_utils.model_from_config(
                config, custom_objects=custom_objects)
    except ImportError as e:
        # A layer that needs a package not installed (Keras 3's lookup
        # layers run on TensorFlow, whatever the backend).
        raise LegacyConfigError(
            f"{record.path}: Keras 3 cannot build the Keras 2 model config "
            f"without a package it needs ({_first_line(e)})") from e
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        # Keras wraps what a layer refused as "Error when deserializing
        # class ... Exception encountered: <the reason>".
        reason = str(e).partition("Exception encountered:")[2].strip()
        reason = reason.split("\n\n")[0] if reason else _first_line(e)
        advice = (
            "Pass `safe_mode=False` (`--unsafe` on the command line) if "
            "you trust the file." if "safe_mode" in reason else
            "A custom class comes in through `custom_objects` / "
            "`--custom-objects module`; a subclassed model, which your "
            "code builds, through `model=` / `--model module:function`.")
        raise LegacyConfigError(
            f"{record.path}: Keras 3 cannot build the Keras 2 model config "
            f"({type(e).__name__}: {reason}). {advice}") from e
    if record.format == "config":
        check_vocabularies(record, model)
    return model


def _vocabularies_from_tables(config, tables):
    """A lookup layer whose vocabulary the file's tables give
    (``record.vocabularies``) is built without the file path its config
    may name: a nested model's config keeps the path the vocabulary was
    read from on the machine that saved it, which Keras 3 would read (or
    refuse to, in safe mode), where the SavedModel's own copy in its
    ``assets/`` is the one read."""
    for inner in _lookup_configs(config):
        if isinstance(inner.get("vocabulary"), str) and tables.get(
                inner.get("name")) is not None:
            inner["vocabulary"] = None


def _lookup_configs(config):
    """The configs (``"config"``) of the lookup layers anywhere in a
    Keras 2 model config, nested models' included."""
    if isinstance(config, list):
        for item in config:
            yield from _lookup_configs(item)
    elif isinstance(config, dict):
        inner = config.get("config")
        if config.get("class_name") in _LOOKUPS and isinstance(inner, dict):
            yield inner
        for value in config.values():
            yield from _lookup_configs(value)


def _adapted_sizes(config):
    """``{layer name: (vocabulary size, from a file)}`` of the lookup
    layers in a Keras 2 model config whose vocabulary is not in it:
    ``adapt`` made it, or it was read from a file (a SavedModel's config
    holds None for a file's vocabulary, and ``has_input_vocabulary``)."""
    return {inner.get("name"): (inner["vocabulary_size"],
                                inner.get("has_input_vocabulary") is True)
            for inner in _lookup_configs(config)
            if inner.get("vocabulary") is None
            and isinstance(inner.get("vocabulary_size"), int)}


def set_vocabularies(record, model):
    """The vocabularies of a SavedModel's adapted lookup layers
    (``record.vocabularies``: each one's lookup table) into the model's
    lookup layers of the same names, each token at the index the table
    gave it: checked after, and refused where the layer cannot hold them
    so (its mask or out-of-vocabulary settings differ)."""
    if not record.vocabularies:
        return
    layers = {}
    for layer in _lookup_layers(model):
        layers.setdefault(layer.name, []).append(layer)
    # The model's lookup layers without a vocabulary that no table of the
    # file is named for (one with its own is not the file's, renamed).
    unnamed = sorted(
        name for name in set(layers) - set(record.vocabularies)
        if not any(_own_vocabulary(layer) for layer in layers[name]))
    for name, table in record.vocabularies.items():
        found = layers.get(name, [])
        if table is None or len(found) > 1:
            raise LegacyConfigError(
                f"{record.path}: two lookup layers are named {name!r} (in "
                "nested models): their vocabularies cannot be placed by "
                "name. Give the layers distinct names.")
        if found:
            _set_vocabulary(record, found[0], *table)
            continue
        message = (
            f"{record.path}: the vocabulary of its lookup layer {name!r} "
            f"({len(table[0])} entries) has no layer of that name in the "
            "Keras 3 model")
        if unnamed:  # named otherwise there, as it seems
            raise LegacyConfigError(
                f"{message}, whose lookup layers {unnamed} have no "
                "vocabulary of the file named for them. Name the layers as "
                "in the file.")
        # A model given without this layer (its preprocessing left out):
        # said, not refused.
        warnings.warn(f"{message}, and no lookup layer there lacks a "
                      "vocabulary: it is not migrated.", stacklevel=3)


def _class_names(layer):
    """The names of the layer's class and of those it derives from."""
    return {c.__name__ for c in type(layer).__mro__}


def _own_vocabulary(layer):
    """The entries of a lookup layer's vocabulary, its special tokens left
    out; none where the layer cannot say (a user's layer with
    ``set_vocabulary`` only)."""
    get = getattr(layer, "get_vocabulary", None)
    if not callable(get):
        return []
    try:
        return list(get(include_special_tokens=False))
    except TypeError:  # a get_vocabulary of its own, without the argument
        return []


def _lookup_layers(model):
    """The model's lookup layers (``LOOKUP_LAYERS``, or any layer with
    ``set_vocabulary``), a ``TextVectorization``'s own inner lookup layer
    left out (Keras 3 names it ``string_lookup``, as a layer of the file
    may be named)."""
    layers = list(model._flatten_layers(include_self=False, recursive=True))
    inner = {id(getattr(layer, "_lookup_layer", None)) for layer in layers}
    return [layer for layer in layers if id(layer) not in inner and (
        type(layer).__name__ in _LOOKUPS
        or callable(getattr(layer, "set_vocabulary", None)))]


def _set_vocabulary(record, layer, keys, values, idf=None,
                    class_name=None):
    """One layer's vocabulary from its Keras 2 lookup table (token to
    index; index to token where the layer inverts), and a ``"tf_idf"``
    layer's idf weights, each at its Keras 2 index (the special tokens'
    included: Keras 3 would make up its own for them). ``class_name``:
    the Keras 2 layer's, which the layer's class (or one it derives from)
    must have."""
    invert = bool(getattr(layer, "invert", False))
    indices, tokens = (keys, values) if invert else (values, keys)
    where = (f"{record.path}: layer {layer.name!r} "
             f"({type(layer).__name__})")
    if class_name is not None and class_name not in _class_names(layer):
        raise LegacyConfigError(
            f"{where}: the file's layer of that name is a {class_name}, "
            "whose vocabulary this layer cannot take. Give the model's "
            f"layer the file's class, {class_name}.")
    if indices.dtype.kind not in "iu" or len(set(indices.tolist())) != len(
            indices):
        raise LegacyConfigError(
            f"{where}: its Keras 2 lookup table does not map "
            f"{'indices to tokens' if invert else 'tokens to indices'} one "
            f"to one, as this layer (invert={invert}) reads it: the "
            "layer's settings differ from the file's.")
    order = np.argsort(indices, kind="stable")
    indices = indices[order]
    tokens = [_token(t) for t in tokens[order]]
    _check_tokens(where, layer, tokens, indices)
    tf_idf = layer.get_config().get("output_mode") == "tf_idf"
    if tf_idf and idf is None:
        raise LegacyConfigError(
            f"{where}: the layer's output_mode is 'tf_idf', and the file "
            "holds no idf weights for it.")
    try:
        layer.set_vocabulary(tokens, **(
            {"idf_weights": np.ones(len(tokens), "float32")} if tf_idf
            else {}))
        if tf_idf:  # again, the special tokens with their Keras 2 weights
            full = [_token(t) for t in layer.get_vocabulary()]
            if len(idf) < len(full):
                raise ValueError(f"{len(idf)} idf weights for a vocabulary "
                                 f"of {len(full)}")
            layer.set_vocabulary(full, idf_weights=np.asarray(
                idf[:len(full)], "float32"))
    except (ValueError, TypeError) as e:
        advice = (" Build the layer with a max_tokens of at least "
                  f"{int(indices[-1]) + 1} and pass the model (`model=` / "
                  "`--model module:function`): Keras 2 kept a vocabulary "
                  "read from a file past its max_tokens."
                  if "max_tokens" in str(e) else "")
        raise LegacyConfigError(
            f"{where}: its vocabulary of {len(tokens)} entries does not go "
            f"into the Keras 3 layer ({type(e).__name__}: "
            f"{_first_line(e)}).{advice}") from e
    vocabulary = [_token(t) for t in layer.get_vocabulary()]
    wrong = next((
        (int(i), t) for i, t in zip(indices, tokens)
        if not 0 <= i < len(vocabulary) or vocabulary[i] != t), None)
    if wrong is not None:
        index, token = wrong
        got = vocabulary[index] if 0 <= index < len(vocabulary) else None
        raise LegacyConfigError(
            f"{where}: Keras 2 gave {token!r} index {index}, the Keras 3 "
            f"layer gives that index {got!r} (its mask token or "
            "out-of-vocabulary indices differ from the file's).")


def _check_tokens(where, layer, tokens, indices):
    """Refuse, naming it, a token the Keras 3 layer cannot hold at its
    Keras 2 index: bytes that are not UTF-8 (Keras 3's lookup layers take
    text), one that Keras 3's vocabulary file would not give back (it
    writes a token a line and reads them with ``str.splitlines``: a line
    break inside, an empty token last), or the layer's own mask or
    out-of-vocabulary token among the entries (Keras 3 takes those as its
    special tokens only, at the start)."""
    config = layer.get_config()
    mask, oov = config.get("mask_token"), config.get("oov_token")
    num_oov = config.get("num_oov_indices", 1)
    if "TextVectorization" in _class_names(layer):
        # (Its inner lookup layer's, which its config does not list.)
        mask = "" if config.get("output_mode") == "int" else None
        oov, num_oov = "[UNK]", 1
    # Keras 3 refuses its mask token among the entries, and its
    # out-of-vocabulary token where the layer inverts; where the entries
    # start as its special tokens do, it takes them for those.
    reserved = {mask} - {None}
    if config.get("invert"):
        reserved.add(oov)
    special = ([] if mask is None else [mask]) + [oov] * int(num_oov or 0)
    if special and list(tokens[:len(special)]) == special:
        raise LegacyConfigError(
            f"{where}: its Keras 2 vocabulary starts with the entries "
            f"{special}, which Keras 3 takes for the layer's own mask and "
            "out-of-vocabulary tokens, not as entries (a vocabulary file "
            "written from get_vocabulary(), say).")
    last = len(tokens) - 1
    for i, (token, index) in enumerate(zip(tokens, indices)):
        if isinstance(token, bytes):
            reason = ("is not UTF-8 text, and Keras 3's lookup layers take "
                      "text tokens only")
        elif isinstance(token, str) and (
                ("x" + token + "x").splitlines() != ["x" + token + "x"]):
            reason = ("holds a line break (Keras 3 writes a vocabulary a "
                      "token a line and reads it back with "
                      "str.splitlines), so it would not survive the .keras "
                      "file")
        elif token == "" and i == last:
            reason = ("is empty and last (Keras 3 drops the empty lines at "
                      "the end of its vocabulary file), so it would not "
                      "survive the .keras file")
        elif token in reserved:
            reason = ("is the layer's own mask token (or, as it inverts, "
                      "out-of-vocabulary token), which Keras 3 refuses as "
                      "an entry")
        else:
            continue
        raise LegacyConfigError(
            f"{where}: its Keras 2 vocabulary entry {token!r} at index "
            f"{int(index)} {reason}.")


def _token(token):
    """A vocabulary entry as Keras 3 lookup layers take it: text for
    strings (``bytes`` that are not UTF-8 kept as bytes), int for ints."""
    if isinstance(token, bytes):
        try:
            return token.decode("utf-8")
        except UnicodeDecodeError:
            return token
    if isinstance(token, (np.integer, int)):
        return int(token)
    return str(token)


def check_vocabularies(record, model):
    """An adapted ``TextVectorization`` / ``StringLookup`` /
    ``IntegerLookup`` keeps its vocabulary in a lookup table of the
    SavedModel's graph, not in a variable or the config (a tf_keras
    ``.keras`` file keeps it in its assets, ``load_zip_assets``): the
    layer built from the config would map every token to the
    out-of-vocabulary index, without a word. Where the model's layer
    holds fewer entries than the file's had, refused, naming the layer (a
    warning where only the config was given, ``model_from_config``)."""
    sizes = _adapted_sizes(record.model_config)
    if not sizes:
        return
    for layer in _lookup_layers(model):
        wanted, from_file = sizes.get(layer.name, (None, False))
        size = getattr(layer, "vocabulary_size", None)
        if wanted is None or not callable(size) or int(size()) >= wanted:
            continue
        kept = ("is not in a config (a SavedModel keeps it in a lookup "
                "table of its graph, a .keras file in its assets)"
                if record.format == "config" else
                "is in the file's assets, which did not give it to the "
                "layer" if record.format == "keras_v2_zip" else
                "was read from a file when it was built, which the "
                "SavedModel keeps in its assets/ folder: it is not "
                "migrated" if from_file else
                "was kept in a lookup table of the Keras 2 graph, which "
                "was not found there")
        message = (
            f"{record.path}: layer {layer.name!r} ({type(layer).__name__}) "
            f"was {'given' if from_file else 'adapted'}: its vocabulary of "
            f"{wanted} entries {kept} (the model's layer has "
            f"{int(size())}).")
        if record.format == "config":
            # `model_from_config`: the caller has the model to adapt.
            warnings.warn(message + " Give it its vocabulary "
                          "(`set_vocabulary` or `adapt`).", stacklevel=3)
            continue
        raise LegacyConfigError(
            message + " Build the model with the layer's vocabulary "
            "(`vocabulary=` or `adapt`) and pass it (`model=` / `--model "
            "module:function`).")


def load_zip_assets(record, model):
    """The assets of a tf_keras ``.keras`` file (an adapted lookup layer's
    ``vocabulary.txt``) into ``model``, where Keras 3's own loader puts
    them: both name a layer's place by the same layout
    (``assets/layers/text_vectorization/``).

    Raises:
        LegacyStateError: the assets do not load, or one of them is not
            in the model after (a layer built with a vocabulary of its
            own, which Keras' loader keeps), naming its place.
    """
    import os
    import zipfile

    from keras.src.saving import saving_lib

    with zipfile.ZipFile(record.path) as archive:
        if not any(name.startswith("assets/")
                   for name in archive.namelist()):
            return
        store = saving_lib.DiskIOStore("assets", archive=archive, mode="r")
        try:
            saving_lib._load_state(model, weights_store=None,
                                   assets_store=store, inner_path="",
                                   visited_saveables=set())
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise LegacyStateError(
                f"{record.path}: its assets (the vocabularies of adapted "
                "lookup layers) do not load into the Keras 3 model "
                f"({type(e).__name__}: {_first_line(e)}).") from e
        finally:
            store.close()
        # Each asset back out of the model, path by path: Keras' loader
        # leaves a layer built with a vocabulary of its own (it is in its
        # config), and a file's vocabulary with no layer at its place.
        written = saving_lib.DiskIOStore("assets", mode="w")
        try:
            saving_lib._save_state(model, weights_store=None,
                                   assets_store=written, inner_path="",
                                   visited_saveables=set())
            for name in archive.namelist():
                if not name.startswith("assets/") or name.endswith("/"):
                    continue
                inner = name[len("assets/"):]
                try:
                    path = written.get(inner)
                except ValueError as e:  # a name out of the folder ("..")
                    raise LegacyFormatError(
                        f"{record.path}: its asset {name!r} names a place "
                        f"outside its assets ({_first_line(e)}).",
                        path=record.path, key=name) from e
                got = None
                if path is not None and os.path.isfile(path):
                    with open(path, "rb") as f:
                        got = _lines(f.read())
                want = _lines(archive.read(name))
                if got is None:
                    raise LegacyStateError(
                        f"{record.path}: its asset {inner} did not go into "
                        "the Keras 3 model, whose layer at that place keeps "
                        "no such asset (a layer built with a vocabulary, "
                        "`vocabulary=`, keeps its own: build it without "
                        "one).")
                if got != want:
                    raise LegacyStateError(
                        f"{record.path}: its asset {inner} is not what the "
                        "Keras 3 model holds after loading it: "
                        + first_difference(want, "in the file", got,
                                           "in the model") + ".")
        finally:
            written.close()


def first_difference(want, want_where, got, got_where):
    """Words for where two vocabularies first differ, and why Keras 3's
    vocabulary file can make them differ."""
    at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b),
              min(len(want), len(got)))

    def entry(tokens):
        return repr(tokens[at]) if at < len(tokens) else "past the end"

    return (f"entry {at} is {entry(want)} {want_where}, {entry(got)} "
            f"{got_where} ({len(want)} and {len(got)} entries). Keras 3 "
            "writes a vocabulary a token a line and reads it back with "
            "str.splitlines, so a token with a line break in it (\\r, "
            "\\x0b, \\x85, \\u2028, ...) or an empty token last does not "
            "survive it")


def _lines(data):
    """The entries of a vocabulary file's bytes as tf_keras and Keras 3
    write them, ``"\\n".join(tokens)``: split at each ``\\n`` only (a
    token may hold a ``\\r``), an empty last token kept."""
    return data.split(b"\n")


def _first_line(error):
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def assign_weights(record, model, given=False):
    """Put the record's weights into ``model``; returns ``{key: variable}``.

    For a model the user gave (``given``; a checkpoint keeps no config to
    build one from), each weight of a SavedModel or checkpoint goes first
    where its object path leads, as Keras 2's own restore placed it
    (``layer_with_weights-1/bias``: the bias of the model's second layer
    with weights; ``d1/kernel``: the ``d1`` attribute's kernel): the
    names Keras 2 made up (``dense_3``) count layers per process, and
    differ between a model built first in its process and one built
    after another, where the structure does not. Then, and for a model
    built from the record's config (whose layer names are the record's),
    each Keras 2 weight goes to an unused Keras 3 variable of the same
    shape, found by name, in passes from the strictest on (within a pass,
    colliding names are taken in model order):

    1. the Keras 3 path ends with the Keras 2 name (``d1/kernel`` ->
       ``seq/d1/kernel``);
    2. the same, with the numeric suffixes of the path parts below the
       layer set aside: Keras 2 numbered the names it made up itself (an
       RNN's cell, ``lstm/lstm_cell_1/kernel``) per process, so they
       depend on what else that process built, while layer names come
       from the config;
    3. the same, with the weights Keras 3 renamed
       (``compat.model_configs.RENAMED_WEIGHTS``: a depthwise
       convolution's ``depthwise_kernel`` is its ``kernel``);
    4. the same top-level layer of the model and weight name: wrappers
       whose inner layer's weights Keras 2 named after the wrapper
       (``time_distributed/kernel``; Keras 3 names them after the inner
       layer, ``dense_4/kernel``).

    An ``.h5`` file into a model the user gave goes first by layer order,
    as Keras 2's and Keras 3's own ``load_weights`` place it
    (``_by_layer_order``), where the two models' layers agree weight by
    weight.

    Raises:
        LegacyStateError: a weight with no place, or a model variable left
            without a value (both named, with shapes).
    """
    targets = list(model.weights)
    names = {key: record.names.get(key, key).split("/")
             for key in record.weights}
    paths = _weight_paths(model)
    used = set()
    mapping = {}
    if given and record.format == "h5":
        mapping.update(_by_layer_order(record, model))
        used.update(id(var) for var in mapping.values())
    weights = record.weights
    if given and record.format in ("savedmodel", "checkpoint"):
        prefix = ""
        if record.format == "checkpoint":
            prefix = _model_prefix(record, model)
            weights = {k: v for k, v in weights.items()
                       if k.startswith(prefix)}
            if prefix:
                _warn_not_the_model(record, prefix)
        mapping.update(_by_object_path(weights, model, prefix, used))
    for number in range(4):
        for key, value in weights.items():
            if key in mapping:
                continue
            var = _match(names[key], np.shape(value), targets, used,
                         paths[number])
            if var is not None:
                used.add(id(var))
                mapping[key] = var
    for key, value in weights.items():
        if key in mapping:
            continue
        name = record.names.get(key, key)
        candidates = [f"{v.path}{tuple(v.shape)}" for v in targets
                      if id(v) not in used and v.path.endswith(
                          "/" + name.split("/")[-1])]
        raise LegacyStateError(
            f"{record.path}: weight {key!r} ({name}, shape "
            f"{tuple(np.shape(value))}) has no place in the Keras 3 "
            f"model. Unused Keras 3 variables named "
            f"{name.split('/')[-1]!r}: {candidates[:6]}")
    missing = [f"{v.path}{tuple(v.shape)}" for v in targets
               if id(v) not in used]
    if missing:
        raise LegacyStateError(
            f"{record.path}: the artifact has no value for the Keras 3 "
            f"model variables {missing[:6]}"
            f"{'...' if len(missing) > 6 else ''}.")
    for key, var in mapping.items():
        var.assign(np.asarray(record.weights[key]).astype(
            keras.backend.standardize_dtype(var.dtype)))
    return mapping


def _model_prefix(record, model):
    """``"net/"`` where a checkpoint's root is a ``tf.train.Checkpoint``
    holding the model under a name of its writer's choosing beside other
    objects (``Checkpoint(step=tf.Variable(0), net=Net(), train_loss=
    Mean()).write(...)``, which keeps no ``save_counter`` to tell the root
    from a model, and a subclassed model no ``layer-N`` children): the one
    child of the root under which every variable of the given model is
    found by its object path. ``""`` otherwise (the root is the model)."""
    count = len(model.weights)

    def placed(prefix):
        return len(_by_object_path(record.weights, model, prefix,
                                   set())) == count

    if not count or placed(""):
        return ""
    heads = sorted({key.split("/")[0] for key in record.weights
                    if "/" in key})
    found = [head for head in heads if placed(head + "/")]
    return found[0] + "/" if len(found) == 1 else ""


def _by_object_path(weights, model, prefix, used):
    """``{key: variable}`` of the ``weights`` under ``prefix`` whose object
    path below it leads to an unused variable of ``model`` of their shape
    (``_at_object_path``); adds the variables to ``used``."""
    known = {id(v) for v in model.weights}
    mapping = {}
    for key, value in weights.items():
        if not key.startswith(prefix):
            continue
        var = _at_object_path(model, key[len(prefix):])
        if var is not None and id(var) in known and (
                id(var) not in used) and (
                tuple(var.shape) == tuple(np.shape(value))):
            used.add(id(var))
            mapping[key] = var
    return mapping


def _warn_not_the_model(record, prefix):
    others = sorted({key.split("/")[0] for key in record.weights
                     if not key.startswith(prefix)})
    if others:
        warnings.warn(
            f"{record.path}: the model is the checkpoint's "
            f"{prefix.rstrip('/')!r}; its other objects "
            f"({', '.join(repr(o) for o in others)}) are not migrated.",
            stacklevel=4)


def _legacy_weights(layer):
    return list(layer.trainable_weights) + list(layer.non_trainable_weights)


def _by_layer_order(record, model):
    """``{key: variable}`` of an ``.h5`` record placed as Keras' own
    ``load_weights`` places an ``.h5`` file, layer by layer: the i-th of
    the file's layers with weights into the i-th of the model's. Keras 2
    made up names such as ``dense_1`` by counting the layers its process
    had made, so a model built after another layer names them apart from
    the file's; the order does not change. Within a layer, each weight
    goes to the variable of its shape whose path ends with its name, the
    numbers of made-up names set aside (``dense_4/kernel`` in a nested
    model: ``sequential_1/dense_9/kernel``), and weights alike in both go
    in the order of those numbers, the order their layers were made in:
    not by position, which puts a layer frozen in the file after the
    others (Keras 2 wrote a layer's trainable weights first). Taken only
    where the whole file agrees with the model (as many layers, every
    weight placed) and the layer names differ (the same names place each
    layer, whatever the order); ``{}`` otherwise, and the weights go by
    name."""
    from keras_ema_opt.compat.model_configs import RENAMED_WEIGHTS

    renamed = {old: new for table in RENAMED_WEIGHTS.values()
               for old, new in table.items()}
    groups = {}
    for key in record.weights:
        groups.setdefault(key.split("/")[0], []).append(key)
    layers = [layer for layer in model.layers if _legacy_weights(layer)]
    if len(groups) != len(layers) or set(groups) == {
            layer.name for layer in layers}:
        return {}  # the same layer names: they place it
    mapping = {}
    for keys, layer in zip(groups.values(), layers):
        weights = _legacy_weights(layer)
        if len(keys) != len(weights):
            return {}
        alike = {}
        for key in keys:
            parts = record.names.get(key, key).split("/")
            parts[-1] = renamed.get(parts[-1], parts[-1])
            shape = tuple(np.shape(record.weights[key]))
            alike.setdefault((tuple(_unnumbered(p) for p in parts), shape),
                             []).append(key)
        taken = set()
        for (parts, shape), theirs in alike.items():
            ours = [v for v in weights if id(v) not in taken and tuple(
                v.shape) == shape and [
                _unnumbered(p) for p in v.path.split("/")[-len(parts):]
            ] == list(parts)]
            if len(ours) != len(theirs):
                return {}
            theirs = sorted(theirs, key=lambda k: _made_order(
                record.names.get(k, k)))
            ours = sorted(ours, key=lambda v: _made_order(v.path))
            for key, var in zip(theirs, ours):
                mapping[key] = var
                taken.add(id(var))
    return mapping


def _made_order(path):
    """The numbers Keras put on the names it made up (``dense`` 0,
    ``dense_1`` 1, ...), part by part: the order the layers were made."""
    return [int(match.group()[1:]) if match else 0 for match in (
        _NUMBERED.search(part) for part in path.split("/"))]


def assign_layout_weights(record, model):
    """Put a tf_keras ``.keras`` file's weights into ``model`` by their
    place in Keras' weights-file layout (``layers/dense/vars/0``), which
    Keras 3 shares: the layout of ``model`` must hold the same keys with
    the same shapes, and after loading every tensor is compared with the
    source.

    Raises:
        LegacyStateError: a key or shape that differs (named), or a tensor
            that did not arrive.
    """
    import os
    import tempfile

    import h5py

    def layout(path):
        out = {}

        def visit(name, obj):
            if hasattr(obj, "shape") and name.split("/")[0] not in (
                    "optimizer", "metrics"):
                out[name] = np.asarray(obj)
        with h5py.File(path, "r") as f:
            f.visititems(visit)
        return out

    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "layout.weights.h5")
        try:
            model.save_weights(probe)
        except AttributeError as e:
            # Keras 3.15 cannot save a "tf_idf" lookup layer that has no
            # vocabulary yet (its idf weights are made with it).
            unset = [layer.name for layer in _lookup_layers(model)
                     if layer.get_config().get("output_mode") == "tf_idf"]
            if not unset:
                raise
            raise LegacyConfigError(
                f"{record.path}: Keras 3 cannot lay out the weights of the "
                f"'tf_idf' lookup layers {unset} before they have a "
                "vocabulary, which this file's assets would give them "
                f"({type(e).__name__}: {_first_line(e)}). Pass the model "
                "(`model=` / `--model module:function`) with those layers "
                "given a vocabulary of the file's size by `set_vocabulary"
                "(tokens, idf_weights=...)` (not `vocabulary=`, which a "
                "layer keeps over the file's): the file's replace them.",
            ) from e
        wanted = layout(probe)
        extra = sorted(set(record.weights) - set(wanted))
        missing = sorted(set(wanted) - set(record.weights))
        if extra or missing:
            raise LegacyStateError(
                f"{record.path}: the weights do not fit the Keras 3 model's "
                f"layout: in the file only {extra[:4]}, in the model only "
                f"{missing[:4]}.")
        for key, value in wanted.items():
            if value.shape != np.shape(record.weights[key]):
                raise LegacyStateError(
                    f"{record.path}: shape mismatch for {key}: the Keras 3 "
                    f"model has {value.shape}, the file "
                    f"{np.shape(record.weights[key])}.")
        source = os.path.join(tmp, "source.weights.h5")
        with h5py.File(source, "w") as f:
            for key, value in record.weights.items():
                f.create_dataset(key, data=np.asarray(value))
        model.load_weights(source)
        model.save_weights(probe)
        for key, value in layout(probe).items():
            want = np.asarray(record.weights[key]).astype(value.dtype)
            if not np.array_equal(value, want):
                raise LegacyStateError(
                    f"{record.path}: {key} differs after loading.")


def _weight_paths(model):
    """Per pass of ``assign_weights``, a function: (Keras 2 name parts,
    variable) -> whether they match."""
    from keras_ema_opt.compat.model_configs import RENAMED_WEIGHTS

    owner, top = {}, {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        for var in (list(getattr(layer, "_trainable_variables", []))
                    + list(getattr(layer, "_non_trainable_variables", []))):
            owner.setdefault(id(var), type(layer).__name__)
    for layer in model.layers:
        for var in layer.weights:
            top.setdefault(id(var), layer.name)

    def parts(var, rename):
        path = var.path.split("/")
        table = RENAMED_WEIGHTS.get(owner.get(id(var)), {}) if rename else {}
        for old, new in table.items():
            if path[-1] == new:
                path = path[:-1] + [old]
        return path

    def exact(name, var):
        path = parts(var, False)
        return path[-len(name):] == name

    def numbered(rename):
        def match(name, var):
            path = parts(var, rename)
            if len(path) < len(name) or path[-len(name)] != name[0]:
                return False
            return [_unnumbered(p) for p in path[-len(name) + 1:]] == [
                _unnumbered(p) for p in name[1:]]
        return match

    def wrapped(name, var):
        return len(name) >= 2 and top.get(id(var)) == name[0] and (
            parts(var, True)[-1] == name[-1])

    return [exact, numbered(False), numbered(True), wrapped]


_NUMBERED = re.compile(r"_\d+$")


def _unnumbered(part):
    return _NUMBERED.sub("", part)


_LAYER_CHILD = re.compile(r"layer(_with_weights)?-([0-9]+)")


def _at_object_path(model, key):
    """The Keras 3 variable at a Keras 2 object path, or None: each part
    an attribute (``d1``, ``cell``, ``kernel``), an item of a list
    attribute (``blocks/0``) or of a dict attribute (``parts/proj``), or
    ``layer-i`` / ``layer_with_weights-i``, the i-th of the model's layers
    (of those with weights), as Keras 2's ``Functional`` and
    ``Sequential`` tracked them."""
    node = model
    for part in key.split("/"):
        match = _LAYER_CHILD.fullmatch(part)
        if match:
            layers = getattr(node, "layers", None)
            if not isinstance(layers, list):
                return None
            if match.group(1):
                layers = [layer for layer in layers if layer.weights]
            index = int(match.group(2))
            node = layers[index] if index < len(layers) else None
        elif isinstance(node, (list, tuple)):
            # A list attribute (`self.blocks = [...]`): Keras 2 tracked its
            # items by position (`blocks/0/kernel`).
            node = node[int(part)] if part.isdigit() and int(part) < len(
                node) else None
        elif isinstance(node, collections.abc.Mapping):
            # A dict attribute (`self.parts = {"proj": Dense(5)}`): by key
            # (`parts/proj/kernel`).
            node = node.get(part)
        else:
            try:
                node = getattr(node, part, None)
            except Exception:  # a property that fails: no path
                return None
        if node is None:
            return None
    return node if isinstance(node, keras.Variable) else None


def _match(name, shape, targets, used, matches):
    for var in targets:
        if id(var) in used or tuple(var.shape) != tuple(shape):
            continue
        if matches(name, var):
            return var
    return None


def optimizer_from_record(record, custom_objects=None):
    """The Keras 3 optimizer for the record's optimizer config; for a bare
    OptimizerV2 checkpoint, rebuilt from its hyperparameter variables.

    Raises:
        LegacyConfigError: a bare checkpoint of a Keras 2.11+ optimizer,
            which stores no hyperparameter but the learning rate.
    """
    state = record.optimizer
    if state.config is not None:
        return configs.from_legacy_config(state.config, custom_objects)
    name = state.class_name
    if state.kind != "legacy":
        raise LegacyConfigError(
            f"{record.path}: a bare checkpoint of a Keras 2.11+ optimizer "
            f"({name or 'class unknown'}) stores only its learning rate; "
            "its other hyperparameters (betas, momentum, epsilon, "
            "ema_momentum, ...) are in no file here. Compile the model with "
            "the optimizer it was trained with and pass it "
            "(`load_legacy(path, model=compiled_model)`), or use "
            "`restore_checkpoint(model, path, optimizer=...)`.")
    hypers = state.hyperparameters
    slot_set = set(state.slot_names())
    # The variable names' prefix tells the class (Adam and Adamax share
    # their slot names); the structure is the fallback.
    known = configs.CLASS_NAMES.get(str(name).lower()) if name else None
    name = known or slot_tables.legacy_class(slot_set, hypers) or name
    if state.learning_rate is None:
        # An OptimizerV2 keeps a constant rate as a variable: none is a
        # schedule (or a callable), which a checkpoint does not store.
        raise LegacyConfigError(
            f"{record.path}: a bare checkpoint of a {name or 'legacy'} "
            "optimizer with a learning-rate schedule (its rate is no "
            "variable of the checkpoint): the schedule is in no file here, "
            "and a default rate would resume at the wrong one. Pass the "
            "optimizer with its schedule (`restore_checkpoint(model, path, "
            "optimizer=...)`, or `load_legacy(path, model=compiled_model)`).")
    legacy = configs.legacy_config_from_state(
        name, hypers, slot_set, state.learning_rate)
    config = legacy["config"]
    scaled = "current_loss_scale" in hypers
    warnings.warn(
        f"{record.path}: {name} rebuilt from the checkpoint's "
        f"hyperparameter variables {sorted(config)}"
        f"{' in the LossScaleOptimizer it was wrapped in' if scaled else ''}"
        "; arguments a checkpoint does not store (epsilon, nesterov, ..."
        f"{'; the loss scale growth steps' if scaled else ''}) take their "
        "defaults. Pass the optimizer to be exact.", stacklevel=3)
    optimizer = configs.from_legacy_config(legacy, custom_objects)
    if scaled:
        # Its scale and good steps are filled in with the slots.
        optimizer = legacy_rules.LegacyLossScaleOptimizer(optimizer)
    return optimizer


def fill_optimizer(record, optimizer, mapping, model, placed=None):
    """Build ``optimizer`` on ``model``'s trainable variables and assign the
    record's optimizer state into it. ``placed``, a list, receives
    ``(what, variable, value)`` for every tensor taken from the record (for
    verifying a written file against the source)."""
    placed = [] if placed is None else placed
    state = record.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    _warn_other_class(record, inner)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    inner.iterations.assign(int(state.iterations))
    placed.append(("iterations", inner.iterations,
                   np.asarray(int(state.iterations))))
    lr = state.learning_rate
    if lr is not None and isinstance(inner._learning_rate, keras.Variable):
        if state.learning_rate_schedule:
            warnings.warn(
                f"{record.path}: the Keras 2 optimizer's learning rate was a "
                f"schedule, at {float(np.asarray(lr)):.6g} on its last step; "
                f"the {type(inner).__name__} given has a constant rate, which "
                "takes that value and keeps it. Compile the model with the "
                "schedule to resume exactly.", stacklevel=3)
        inner._learning_rate.assign(float(np.asarray(lr)))
        placed.append(("learning rate", inner._learning_rate,
                       np.asarray(lr, dtype="float32")))
    _warn_other_hyperparameters(record, inner)
    table = slot_tables.SLOT_ATTRIBUTES.get(type(inner).__name__, {})
    averages = _averages_of(inner)
    missed, frozen = [], []
    built_on = inner._trainable_variables_indices
    for slot in state.slots:
        var = mapping.get(slot.weight)
        what = f"{slot.slot} of {record.names.get(slot.weight, slot.weight)}"
        if var is not None and inner._var_key(var) not in built_on:
            # A layer frozen after training: Keras 3 builds the optimizer
            # on the trainable variables only (as the written file is
            # reloaded), so there is no place for its state.
            frozen.append(var.path)
            continue
        index = None if var is None else inner._get_variable_index(var)
        if slot.slot == "average":
            target = None if index is None else averages(index)
            if target is None:
                missed.append(what)
                continue
            _assign(target, slot.value, what, record)
            placed.append((what, target, slot.value))
            continue
        if _unused_buffer(inner, slot.slot, state):
            continue
        attribute = table.get(slot.slot)
        target = getattr(inner, attribute, None) if attribute else None
        if not target or index is None or index >= len(target) or (
                target[index] is None):
            if np.any(slot.value):
                missed.append(what)
            continue  # tf_keras' all-zero SGD `m` with momentum 0
        _assign(target[index], slot.value, what, record)
        placed.append((what, target[index], slot.value))
    if missed:
        hint = ""
        if any(m.startswith("average of ") for m in missed):
            hint = (" The Keras 2 optimizer kept moving averages of the "
                    "weights: the optimizer takes them with use_ema=True.")
        raise LegacyStateError(
            f"{record.path}: the {type(inner).__name__} the state is loaded "
            f"into has no place for the Keras 2 state {missed[:6]}"
            f"{'...' if len(missed) > 6 else ''}.{hint}")
    if frozen:
        frozen = list(dict.fromkeys(frozen))
        warnings.warn(
            f"{record.path}: the optimizer state of {frozen[:6]}"
            f"{'...' if len(frozen) > 6 else ''} is not migrated: these "
            "variables were trained, but their layers are frozen in the "
            "saved model, and a Keras 3 optimizer holds state for trainable "
            "variables only. Unfreeze them before saving the Keras 2 model "
            "to keep it.", stacklevel=3)
    if hasattr(inner, "_u_product"):
        inner._u_product.assign(
            legacy_rules.nadam_u_product(inner.beta_1, state.iterations))
    cache = state.hyperparameters.get("momentum_cache")
    if cache is not None and hasattr(inner, "_momentum_cache"):
        inner._momentum_cache.assign(float(cache))
    _fill_loss_scale(record, optimizer)
    return optimizer


def _fill_loss_scale(record, optimizer):
    """A Keras 2 ``LossScaleOptimizer``'s dynamic scale and its count of
    good steps, into the loss-scale optimizer given; a warning names what
    is not kept where that is none, or Keras 3's own (which does not count
    the steps it skips, as Keras 2's did)."""
    hypers = record.optimizer.hyperparameters
    scale = hypers.get("current_loss_scale")
    if scale is None:
        return
    good = int(hypers.get("good_steps") or 0)
    kept = (f"the Keras 2 optimizer was a LossScaleOptimizer, at a dynamic "
            f"loss scale of {float(scale):g} after {good} good steps")
    wrap = ("Wrap the optimizer in "
            "keras_ema_opt.compat.LegacyLossScaleOptimizer to resume as "
            "Keras 2 did.")
    if not hasattr(optimizer, "dynamic_scale"):
        warnings.warn(
            f"{record.path}: {kept}; the {type(optimizer).__name__} given is "
            "no loss-scale optimizer, so the scale is not migrated and "
            f"training goes on without loss scaling. {wrap}", stacklevel=4)
        return
    optimizer.dynamic_scale.assign(float(scale))
    optimizer.step_counter.assign(good)
    if not isinstance(optimizer, legacy_rules.LegacyLossScaleOptimizer):
        warnings.warn(
            f"{record.path}: {kept}, and the scale is migrated into Keras "
            f"3's {type(optimizer).__name__}, which does not count the "
            "steps it skips (non-finite gradients) in `iterations` as Keras "
            "2's did: after the next skipped step, the step count Adam's "
            "bias correction and schedules read is one behind Keras 2's. "
            f"{wrap}", stacklevel=4)


def _averages_of(optimizer):
    """A function giving the moving average of the built ``optimizer``'s
    variable of index ``i`` (None where it keeps none): ours
    (``_averager``), or Keras' own ``use_ema=True`` averages."""
    averager = getattr(optimizer, "_averager", None)
    if averager is not None:
        def ours(i):
            slots = averager.slots[i] if i < len(averager.slots) else None
            return slots[0] if slots else None
        return ours
    keras_own = getattr(optimizer, "_model_variables_moving_average", None)
    if not getattr(optimizer, "use_ema", False) or not keras_own:
        return lambda i: None
    return lambda i: keras_own[i] if i < len(keras_own) else None


def _class_of(name):
    return configs.CLASS_NAMES.get(str(name or "").lower())


def _warn_other_class(record, optimizer):
    """The state of one optimizer class loaded into another (a model
    compiled with Adam given for a Nadam checkpoint): their slots of the
    same names are loaded, and training goes on under the other rule."""
    saved = _class_of(record.optimizer.class_name)
    given = next((_class_of(cls.__name__) for cls in type(optimizer).__mro__
                  if _class_of(cls.__name__)), None)
    if saved and given and saved != given:
        warnings.warn(
            f"{record.path} holds the state of a {saved} optimizer, and the "
            f"model given is compiled with {given}: the slots of the same "
            f"names are loaded into the {given}, and training goes on under "
            f"its rule, not {saved}'s. Compile the model with {saved} to "
            "resume exactly.", stacklevel=4)


def _unused_buffer(optimizer, slot, state):
    """tf_keras' SGD keeps ``m = -lr * g`` even with ``momentum=0``, where
    no later step reads it (Keras 3 creates no buffer then). Not where the
    state stores a momentum other than 0 (an OptimizerV2's): its buffer
    was used, and an SGD without momentum has no place for it."""
    return (type(optimizer).__name__ == "SGD" and slot in ("m", "momentum")
            and not getattr(optimizer, "momentum", 0)
            and not state.hyperparameters.get("momentum"))


# OptimizerV2 hyperparameter variables that are not the Keras 3
# argument of the same name: Nadam's `decay` is its `schedule_decay`.
_OTHER_MEANING = {("Nadam", "decay")}


def _warn_other_hyperparameters(record, optimizer):
    """An OptimizerV2 stores its ``_set_hyper`` arguments as variables
    (``momentum``, ``beta_1``, ``rho``, Ftrl's strengths, ``decay``): where
    the optimizer given holds another value of one, training goes on under
    the given one, and a warning names each."""
    state = record.optimizer
    if state.kind != "legacy":
        return
    saved = _class_of(state.class_name)
    differ = []
    for name, value in sorted(state.hyperparameters.items()):
        if name.startswith("_") or name in configs.LEGACY_STATE_VARIABLES or (
                (saved, name) in _OTHER_MEANING) or np.ndim(value) != 0:
            continue
        given = getattr(optimizer, name, None)
        if isinstance(given, bool) or not isinstance(
                given, (int, float, np.floating, np.integer)):
            continue  # not an argument of the optimizer given
        stored = np.float32(value)
        if np.float32(given) != stored:
            differ.append(f"{name}={float(str(stored))} (given {given})")
    if differ:
        warnings.warn(
            f"{record.path}: the Keras 2 optimizer was trained with "
            f"{', '.join(differ)}; the {type(optimizer).__name__} given holds "
            "the values in parentheses, and training goes on under them. "
            "Compile the model with the checkpoint's to resume exactly.",
            stacklevel=4)


def _assign(variable, value, what, record):
    if tuple(variable.shape) != tuple(np.shape(value)):
        raise LegacyStateError(
            f"{record.path}: shape mismatch for the {what}: the Keras 3 "
            f"variable has {tuple(variable.shape)}, the Keras 2 state "
            f"{tuple(np.shape(value))}.")
    variable.assign(np.asarray(value).astype(
        keras.backend.standardize_dtype(variable.dtype)))


def compile_arguments(record, custom_objects=None):
    """Loss, metrics, weighted metrics and loss weights from the Keras 2
    training config, as Keras 3 objects.

    Keras 2 loss configs carry ``reduction="auto"`` (Keras 3:
    ``"sum_over_batch_size"``, what ``"auto"`` meant outside a
    ``tf.distribute`` strategy) and the wrapped function's name (``fn``),
    which Keras 3's loss classes do not take: both are translated. A
    ``Huber`` or ``CosineSimilarity`` loss is built as
    ``keras_ema_opt.compat.losses``' class of that name, whose config
    keeps its ``delta`` or ``axis`` (Keras 3.15's leaves it out). A single
    loss with a weight per output is repeated for each output, as Keras 2
    applied it (Keras 3 refuses one loss and several weights). A loss
    or metric stored by name is resolved now, through ``custom_objects``
    (a custom function), not at the first training step. A metric Keras 3
    cannot build is left out with a warning naming it (metrics hold no
    training state).

    Raises:
        LegacyConfigError: a loss Keras 3 cannot build, named.
    """
    training = record.training_config or {}
    out = {}
    loss = training.get("loss")
    if loss is not None:
        out["loss"] = _loss(loss, custom_objects, record)
    weights = training.get("loss_weights")
    if weights is not None:
        out["loss_weights"] = weights
        if "loss" in out:
            out["loss"] = _per_output(out["loss"], weights)
    dropped = []
    for key in ("metrics", "weighted_metrics"):
        value = training.get(key)
        if value is not None:
            metrics = _metrics(value, custom_objects, dropped,
                               outputs=_output_names(record))
            if metrics:
                out[key] = metrics
    if dropped:
        warnings.warn(
            f"{record.path}: Keras 3 cannot build the compile metric(s) "
            f"{dropped}; the model is compiled without them (metrics hold "
            "no training state). A custom metric comes in through "
            "`custom_objects`.", stacklevel=4)
    return out


def _per_output(loss, weights):
    """Keras 2 applied a single loss to every output of a model compiled
    with a weight per output; Keras 3 takes a loss per weight (it refuses
    one loss and two weights): the loss, repeated in the weights'
    structure."""
    if isinstance(loss, (list, tuple, dict)):
        return loss
    if isinstance(weights, dict) and len(weights) > 1:
        return {name: loss for name in weights}
    if isinstance(weights, (list, tuple)) and len(weights) > 1:
        return [loss] * len(weights)
    return loss


def _loss(loss, custom_objects, record):
    if isinstance(loss, dict) and loss.get("class_name") == "function":
        # tf_keras .keras files: a function, by name.
        return _loss(str(loss.get("config")), custom_objects, record)
    if isinstance(loss, dict) and "class_name" in loss:
        config = dict(loss.get("config") or {})
        config.pop("fn", None)  # Keras 2's LossFunctionWrapper subclasses
        if config.get("reduction") == "auto":
            config["reduction"] = "sum_over_batch_size"
        try:
            with keras.saving.custom_object_scope(custom_objects or {}):
                built = keras.losses.deserialize(
                    dict(loss, config=config), custom_objects)
        except (TypeError, ValueError) as e:
            raise LegacyConfigError(
                f"{record.path}: Keras 3 cannot build the Keras 2 loss "
                f"{loss.get('class_name')!r} with the config {config} "
                f"({_first_line(e)}). A custom loss comes in through "
                "`custom_objects`.") from e
        # Keras 3.15's Huber and CosineSimilarity configs leave out their
        # argument: the written file would train on the default.
        return compat_losses.keeping_arguments(built)
    if isinstance(loss, dict):
        return {k: _loss(v, custom_objects, record) for k, v in loss.items()}
    if isinstance(loss, list):
        return [_loss(v, custom_objects, record) for v in loss]
    if isinstance(loss, str):
        found = _custom(loss, custom_objects)
        if found is not None:
            return found
        try:
            return keras.losses.get(loss)
        except (TypeError, ValueError) as e:
            raise LegacyConfigError(
                f"{record.path}: the model was compiled with the loss "
                f"{loss!r}, which is no Keras 3 loss: pass the function in "
                f"`custom_objects` ({{{loss!r}: fn}}, or `--custom-objects "
                "module`).") from e
    return loss


def _metrics(value, custom_objects, dropped, outputs=(), prefix=None):
    """Keras 2's saved metrics (one list per output, of configs or names)
    as Keras 3 compile metrics; what cannot be built goes to ``dropped``.

    A model of several outputs named its metric objects after their output
    (``reg_mae``); Keras 3 puts the output's name before a metric's own, so
    that prefix is taken off (the logs kept ``reg_reg_mae``). ``outputs``:
    the model's output names, in order."""
    if isinstance(value, dict) and "class_name" not in value:
        out = {k: _metrics(v, custom_objects, dropped, prefix=k)
               for k, v in value.items()}
        return {k: v for k, v in out.items() if v}
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (list, tuple)) for v in value):
            # one list per output; a single output takes the flat list
            out = [_metrics(v, custom_objects, dropped,
                            prefix=outputs[i] if len(value) > 1 and i < len(
                                outputs) else None)
                   for i, v in enumerate(value)]
            return out[0] if len(out) == 1 else out
        out = [_metrics(v, custom_objects, dropped, prefix=prefix)
               for v in value]
        if out and all(isinstance(v, list) for v in out):
            return out[0] if len(out) == 1 else out
        return [v for v in out if v is not None]
    return _metric(value, custom_objects, dropped, prefix)


def _output_names(record):
    """The output layers' names of a functional Keras 2 model config (the
    names Keras 2 put before each output's metrics), else ()."""
    config = (record.model_config or {}).get("config")
    layers = config.get("output_layers") if isinstance(config, dict) else None
    if not isinstance(layers, list):
        return ()
    if layers and isinstance(layers[0], str):  # one output: [name, 0, 0]
        layers = [layers]
    return tuple(entry[0] for entry in layers
                 if isinstance(entry, list) and entry
                 and isinstance(entry[0], str))


# Names Keras 3's compile resolves by the model's outputs and labels,
# which `keras.metrics.get` does not know.
_OUTPUT_RESOLVED = ("accuracy", "acc", "crossentropy", "ce")


def _metric(value, custom_objects, dropped, prefix=None):
    if value is None:
        return None  # an output compiled without metrics
    if isinstance(value, dict) and value.get("class_name") == "function":
        # tf_keras .keras files: a metric function, by name.
        name = str(value.get("config"))
        fn = _metric_function(name, custom_objects)
        if fn is None:
            dropped.append(name)
        return fn
    if isinstance(value, str):
        found = _custom(value, custom_objects)
        if found is not None:
            return found
        if value.lower() in _OUTPUT_RESOLVED:
            return value
        try:
            keras.metrics.get(value)
        except (TypeError, ValueError):
            dropped.append(value)
            return None
        return value  # Keras 3 resolves names by the model's outputs
    if not isinstance(value, dict) or "class_name" not in value or (
            not isinstance(value.get("config") or {}, dict)):
        dropped.append(repr(value))
        return None
    config = dict(value.get("config") or {})
    name = config.get("name") or value["class_name"]
    if prefix and isinstance(name, str) and name.startswith(f"{prefix}_") \
            and len(name) > len(prefix) + 1:
        name = config["name"] = name[len(prefix) + 1:]
    try:
        with keras.saving.custom_object_scope(custom_objects or {}):
            if value["class_name"] == "MeanMetricWrapper":
                fn = config.pop("fn", None)
                if isinstance(fn, dict):  # tf_keras .keras: a serialized fn
                    fn = fn.get("config")
                fn = _metric_function(str(fn), custom_objects)
                if fn is None:
                    raise ValueError("no metric function")
                return keras.metrics.MeanMetricWrapper(
                    fn, name=name, dtype=config.get("dtype"))
            return keras.metrics.deserialize(dict(value, config=config),
                                             custom_objects)
    except (TypeError, ValueError, AttributeError):
        dropped.append(name)
        return None


def _metric_function(name, custom_objects):
    """The metric or loss function called ``name``, or None."""
    fn = _custom(name, custom_objects) or getattr(
        keras.metrics, name, None) or getattr(keras.losses, name, None)
    if not callable(fn) or isinstance(fn, type):
        return None
    return fn


def _custom(name, custom_objects):
    """``name`` in ``custom_objects`` or Keras' registered custom objects
    (Keras 3 looks a loss or metric given by name up among its own only)."""
    found = (custom_objects or {}).get(name)
    if found is None:
        found = keras.saving.get_custom_objects().get(name)
    return found
