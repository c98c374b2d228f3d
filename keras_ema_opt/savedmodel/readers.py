"""Readers of Keras 2 artifacts into one :class:`LegacyRecord`.

numpy and h5py only: TF checkpoints through our own tensor-bundle reader
(``bundle.py``) and protobuf decoder (``wire.py``), never TensorFlow.
Layouts: ``docs/legacy.md`` and reference ``legacy-formats.md`` §2.
"""

import json
import os
import re
import zipfile

import numpy as np

from keras_ema_opt.compat import slots as slot_tables
from keras_ema_opt.errors import LegacyFormatError
from keras_ema_opt.errors import LegacyStateError
from keras_ema_opt.savedmodel.record import LegacyRecord
from keras_ema_opt.savedmodel.record import OptimizerState
from keras_ema_opt.savedmodel.record import Slot

_VALUE = "VARIABLE_VALUE"
# Every Keras 2 slot name (both spellings) and the EMA's.
_SLOT_NAMES = {
    name for table in slot_tables.SLOT_ATTRIBUTES.values() for name in table
} | {"average", "accumulated_grad", "accumulated_delta_var", "velocity",
     "average_gradient"}
# New-optimizer list attributes that hold per-variable state.
_NEW_LISTS = set(slot_tables.NEW_LIST_SLOTS) | {
    "_model_variables_moving_average"}
_LOSS_SCALE = ("current_loss_scale", "good_steps")


def read(path):
    """Read any supported Keras 2 artifact at ``path``.

    Accepted: a SavedModel directory, a full ``.h5`` file, a TF checkpoint
    prefix (``tf.train.Checkpoint`` or ``save_weights`` TF format; the
    ``.index`` file or a folder with a ``checkpoint`` file also do), and a
    tf_keras ``.keras`` file.

    Raises:
        LegacyFormatError: naming the path, when it is none of these or is
            damaged.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "saved_model.pb")):
            return read_savedmodel(path)
        prefix = _latest_checkpoint(path)
        if prefix is not None:
            return read_checkpoint(prefix)
        raise LegacyFormatError(
            f"{path} is a directory without saved_model.pb or a TF "
            "checkpoint: expected a Keras 2 SavedModel directory or a "
            "checkpoint folder.", path=path)
    if path.endswith(".index") and os.path.isfile(path):
        return read_checkpoint(path[: -len(".index")])
    if os.path.isfile(path + ".index"):
        return read_checkpoint(path)
    if not os.path.exists(path):
        raise LegacyFormatError(f"{path} does not exist.", path=path)
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return read_h5(path)
    if head.startswith(b"PK"):
        return read_keras_zip(path)
    raise LegacyFormatError(
        f"{path} is not a Keras 2 artifact this reader knows: expected a "
        "SavedModel directory, an .h5 file (HDF5 signature), a TF "
        f"checkpoint prefix (<prefix>.index) or a .keras zip. Read the "
        f"first bytes {head!r}.", path=path)


def _latest_checkpoint(directory):
    """The prefix named by a ``checkpoint`` state file, or the only one."""
    state = os.path.join(directory, "checkpoint")
    match = None
    if os.path.isfile(state):
        with open(state, encoding="utf-8", errors="replace") as f:
            match = re.search(r'model_checkpoint_path:\s*"([^"]+)"', f.read())
    indexes = sorted(n for n in os.listdir(directory) if n.endswith(".index"))
    if match:
        prefix = match.group(1)
        if not os.path.isabs(prefix):
            prefix = os.path.join(directory, prefix)
        if not os.path.isfile(prefix + ".index"):
            present = [n[: -len(".index")] for n in indexes]
            raise LegacyFormatError(
                f"{state} names the checkpoint {match.group(1)!r} as the "
                f"latest, but {prefix}.index does not exist (deleted, or "
                f"the folder was copied in part). Checkpoints in the "
                f"folder: {present or 'none'}; pass the prefix of one "
                f"(e.g. {os.path.join(directory, '<name>')}) to migrate "
                "it.", path=state)
        return prefix
    if len(indexes) == 1:
        return os.path.join(directory, indexes[0][: -len(".index")])
    if indexes:
        present = [n[: -len(".index")] for n in indexes]
        raise LegacyFormatError(
            f"{directory} holds {len(present)} checkpoints, {present}, and "
            "no `checkpoint` file naming the latest: pass the prefix of "
            f"one (e.g. {os.path.join(directory, present[-1])}) to migrate "
            "it.", path=directory)
    return None


# ---------------------------------------------------------------------------
# TF object checkpoints (and SavedModel variables/)
# ---------------------------------------------------------------------------


class _Graph:
    """The checkpoint's object graph with values read on demand."""

    def __init__(self, reader, path):
        self.reader = reader
        self.path = path
        self.nodes = reader.object_graph()

    def children(self, node):
        try:
            return {name: nid for nid, name in self.nodes[node]["children"]}
        except (IndexError, KeyError, TypeError) as e:
            raise LegacyFormatError(
                f"{self.path}: the object graph has no node {node}.",
                path=self.path, key=str(node)) from e

    def attribute(self, node):
        for attribute in self.nodes[node]["attributes"]:
            if attribute["name"] == _VALUE:
                return attribute
        return None

    def value(self, node):
        attribute = self.attribute(node)
        if attribute is None:
            return None
        return self.reader.get_tensor(attribute["checkpoint_key"])

    def name(self, node):
        attribute = self.attribute(node)
        return None if attribute is None else _strip(attribute["full_name"])


def _strip(name):
    return re.sub(r":\d+$", "", str(name))


def read_checkpoint(prefix, _record=None):
    """Read a TF object checkpoint (``tf.train.Checkpoint`` or
    ``save_weights``) at ``prefix`` into a record."""
    from keras_ema_opt.savedmodel.bundle import BundleReader

    reader = BundleReader(prefix)
    graph = _Graph(reader, prefix)
    record = _record or LegacyRecord(path=str(prefix), format="checkpoint")
    root = graph.children(0)
    model = _model_node(graph, root)
    optimizer = root.get("optimizer")
    if optimizer is None:
        optimizer = graph.children(model).get("optimizer")
    if optimizer is None and record.format == "checkpoint":
        optimizer = _optimizer_by_structure(graph, root, model)
    paths = _read_model_weights(graph, model, optimizer, record)
    if optimizer is not None and not graph.children(optimizer) and not (
            graph.nodes[optimizer]["slot_variables"]):
        # An OptimizerV2 creates its variables at its first step.
        record.warnings.append(
            "The optimizer has no state yet (it had not taken a step).")
        optimizer = None
    elif optimizer is not None:
        record.optimizer = _read_optimizer(graph, optimizer, record, paths)
    elif record.format == "checkpoint":
        record.warnings.append("The checkpoint holds no optimizer.")
    return record


def _is_optimizer(graph, node):
    children = graph.children(node)
    if any(name in children for name in ("_iterations", "iter")):
        return True
    # A LossScaleOptimizer: its inner optimizer holds the iterations.
    return any(name in children and _is_optimizer(graph, children[name])
               for name in ("inner_optimizer", "base_optimizer",
                            "_optimizer"))


def _optimizer_by_structure(graph, root, model):
    """A ``tf.train.Checkpoint(net=model, opt=optimizer)`` names the
    optimizer as its writer chose: the child of the root that is one (its
    iteration count tells it), when there is one."""
    found = sorted(name for name, node in root.items()
                   if node != model and _is_optimizer(graph, node))
    if len(found) > 1:
        raise LegacyFormatError(
            f"{graph.path}: the checkpoint holds several optimizers "
            f"({found}): expected one, under `optimizer` or as the only "
            "one.", path=graph.path, key=",".join(found))
    return root[found[0]] if found else None


def _has_layers(graph, node):
    return any(name.startswith(("layer_with_weights-", "layer-"))
               for name in graph.children(node))


def _model_node(graph, root):
    """The node of the model: ``model`` (Keras' own checkpoints), the root
    (``save_weights``, SavedModels), or the one child of the root holding
    layers (``tf.train.Checkpoint(net=model, ...)``)."""
    if "model" in root or _has_layers(graph, 0):
        return root.get("model", 0)
    holders = sorted(name for name, node in root.items()
                     if name != "optimizer" and _has_layers(graph, node))
    if not holders and "save_counter" in root:
        # The root is a `tf.train.Checkpoint` (its own `save_counter`),
        # not a model: a subclassed model under a name of the writer's
        # choosing (`Checkpoint(step=..., optimizer=..., net=Net())`, the
        # TensorFlow guide's layout) is the one child that is neither a
        # variable nor an optimizer and holds variables; the root's own
        # variables (`step`, `save_counter`) are not the model's.
        holders = sorted(
            name for name, node in root.items()
            if name != "optimizer" and graph.children(node)
            and not _is_optimizer(graph, node)
            and _holds_variables(graph, node))
        if len(holders) != 1:
            # Beside a metric or a tf.Module: the root, whose child the
            # model given finds by its object paths
            # (`convert._model_prefix`).
            return 0
    if len(holders) == 1:
        return root[holders[0]]
    if holders:
        raise LegacyFormatError(
            f"{graph.path}: the checkpoint holds several models "
            f"({holders}): expected one, under `model` or as the root.",
            path=graph.path, key=",".join(holders))
    return 0


def _holds_variables(graph, node):
    """Whether a variable lies anywhere under ``node``."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if graph.attribute(current) is not None:
            return True
        stack.extend(graph.children(current).values())
    return False


def _natural(path):
    return [int(p) if p.isdigit() else p
            for p in re.split(r"(\d+)", path)]


# Children of a SavedModel's layers that list variables found elsewhere
# (reference legacy-formats.md §2c): their paths are not the variables'
# own, and they would not be unique in a nested model.
_ALIASES = frozenset({
    "keras_api", "variables", "trainable_variables",
    "non_trainable_variables", "trainable_weights", "non_trainable_weights",
    "weights", "regularization_losses", "signatures", "__call__",
    "call_and_return_all_conditional_losses",
    "call_and_return_conditional_losses", "_default_save_signature",
    "train_function", "train_tf_function", "test_function",
    "predict_function"})


def _read_model_weights(graph, model, optimizer, record):
    """Variables under the model's layers, keyed by object path, into
    ``record``; returns ``{node id: object path}``. Each variable is keyed
    by its own path (``layer_with_weights-1/layer_with_weights-0/kernel``),
    not by an alias list that also reaches it; a variable only an alias
    reaches keeps the alias path. A subclassed model (no ``layer-N``
    children: its layers are attributes, ``d1/kernel``) is read under its
    attribute names."""
    layered = _has_layers(graph, model)

    def top_level(name):
        if layered:
            return name.startswith(("layer_with_weights-", "layer-"))
        return name not in _ALIASES and name != "optimizer"

    found, taken, generators = {}, set(), set()
    for aliases in (False, True):
        stack = [(model, "")]
        walked = {model, optimizer}
        while stack:
            node, path = stack.pop()
            for name, child in graph.children(node).items():
                if child in walked or (name in _ALIASES and not aliases):
                    continue
                top = (path + "/" + name).lstrip("/")
                if not top_level(top.split("/")[0]):
                    continue
                walked.add(child)
                if name == "_random_generator":
                    # tf_keras' augmentation RNG state: Keras 3 layers
                    # keep none in their weights (a SeedGenerator).
                    generators.add(path)
                    continue
                if graph.attribute(child) is None:
                    stack.append((child, top))
                elif child not in taken:
                    taken.add(child)
                    found[top] = child
    if generators:
        record.warnings.append(
            "The random generator state of the layers "
            f"{sorted(generators, key=_natural)} is not migrated: Keras 3 "
            "layers draw from a seed generator of their own.")
    names = {path: graph.name(node) or path for path, node in found.items()}
    if not layered:
        # A subclassed Keras 2 model's variables are named under the
        # model's own name (`k2_net/d1/kernel`), which the Keras 3 model
        # that takes them has not: the layers' names are what they share.
        heads = {name.split("/")[0] for name in names.values()}
        if len(heads) == 1 and all(name.count("/") >= 2
                                   for name in names.values()):
            names = {path: name.split("/", 1)[1]
                     for path, name in names.items()}
    for path in sorted(found, key=_natural):
        record.weights[path] = graph.value(found[path])
        record.names[path] = names[path]
    return {node: path for path, node in found.items()}


def _read_optimizer(graph, node, record, paths):
    children = graph.children(node)
    wrapper_scalars = {}
    if "loss_scale" in children:
        ls = graph.children(children["loss_scale"])
        for name in _LOSS_SCALE:
            if name in ls:
                wrapper_scalars[name] = _scalar(graph.value(ls[name]))
    for inner in ("base_optimizer", "inner_optimizer", "_optimizer"):
        if inner in children and "_iterations" not in children and (
                "iter" not in children):
            node = children[inner]
            children = graph.children(node)
    if "_iterations" in children:
        state = _read_new(graph, node, children, record, paths)
    elif "iter" in children or graph.nodes[node]["slot_variables"]:
        state = _read_v2(graph, node, children, record, paths)
    else:
        raise LegacyFormatError(
            f"{graph.path}: the optimizer node has neither `_iterations` "
            "(Keras 2 optimizer) nor `iter` (OptimizerV2). Its children: "
            f"{sorted(children)}", path=graph.path, key="optimizer")
    state.hyperparameters.update(wrapper_scalars)
    return state


def _scalar(value):
    if value is None:
        return None
    value = np.asarray(value)
    return value.item() if value.size == 1 else value


def _read_new(graph, node, children, record, paths):
    state = OptimizerState(kind="new")
    state.iterations = int(_scalar(graph.value(children["_iterations"])))
    for key in ("_learning_rate", "_current_learning_rate"):
        if key in children and state.learning_rate is None:
            state.learning_rate = _scalar(graph.value(children[key]))
            # tf_keras keeps a schedule's rate as `_current_learning_rate`
            # and a constant one as `_learning_rate`.
            state.learning_rate_schedule = key == "_current_learning_rate"
    if "_u_product" in children:
        state.hyperparameters["_u_product"] = _scalar(
            graph.value(children["_u_product"]))
    placer = _Placer(record, graph.path, _trainable_at_save(graph, paths))
    prefix = None
    for attr in sorted(children, key=_natural):
        if attr not in _NEW_LISTS:
            continue
        members = graph.children(children[attr])
        entries = []
        for index in sorted((k for k in members if k.isdigit()), key=int):
            var = members[index]
            full = graph.name(var) or ""
            value = graph.value(var)
            slot, model_name, head = _split_new(full)
            if slot is None:
                raise LegacyFormatError(
                    f"{graph.path}: cannot tell the slot of optimizer "
                    f"variable {full!r} in {attr}.", path=graph.path,
                    key=full)
            prefix = prefix or head
            if value.dtype.kind in "iu" and value.ndim == 0:
                continue  # Adafactor's rank < 2 placeholders
            entries.append((slot, model_name, value, full))
        state.slots.extend(placer.place(entries))
    state.class_name = prefix
    return state


def _trainable_at_save(graph, paths):
    """The record keys of the SavedModel's ``root.trainable_variables``
    (the model's trainable variables when it was saved), or None where
    the artifact does not list them (checkpoints)."""
    listed = graph.children(0).get("trainable_variables")
    if listed is None:
        return None
    return {paths[member] for member in graph.children(listed).values()
            if member in paths}


def _split_new(full):
    """``Adam/m/d1/kernel`` -> (``m``, ``d1/kernel``, ``Adam``)."""
    parts = full.split("/")
    for i, part in enumerate(parts[:-1]):
        if part in _SLOT_NAMES:
            return part, "/".join(parts[i + 1:]), "/".join(parts[:i]) or None
    return None, None, None


def _weights_by_name(record):
    """Keras 2 variable name -> weight keys in model order."""
    out = {}
    for key in record.weights:
        out.setdefault(record.names.get(key, key), []).append(key)
    return out


class _Placer:
    """Ties one list of new-optimizer state to model weights by Keras 2
    variable name.

    Element *i* of the list belongs to the *i*-th variable the optimizer
    was built on, which is not stored; the names are. Where several model
    weights share a name (same-named layers in sub-models), the list's
    elements of that name are taken in model order when there are as many
    of them as weights of that name. When there are fewer (some of those
    layers were frozen when the optimizer was built), the model's
    trainable variables at save time decide if they are as many (a
    SavedModel lists them; an h5 file's model config marks each layer
    trainable or not); otherwise
    which weights the state belongs to cannot be told, and a
    ``LegacyStateError`` says so rather than guess.
    """

    def __init__(self, record, path, trainable=None):
        self.record = record
        self.path = path
        self.trainable = trainable

    def place(self, entries):
        """``[(slot, model name, value, full name)]`` of one list, in list
        order -> ``[Slot]``."""
        by_name = _weights_by_name(self.record)
        wanted = {}
        for _, model_name, _, _ in entries:
            wanted[model_name] = wanted.get(model_name, 0) + 1
        queues = {}
        out = []
        for slot, model_name, value, full in entries:
            if model_name not in queues:
                queues[model_name] = self._candidates(
                    by_name, model_name, wanted[model_name], full)
            queue = queues[model_name]
            if not queue:
                raise LegacyFormatError(
                    f"{self.path}: optimizer state {full!r} belongs to model "
                    f"variable {model_name!r}, which the artifact's model "
                    "does not have (or has fewer times). Model variables: "
                    f"{sorted(by_name)[:8]}", path=self.path, key=full)
            out.append(Slot(slot, queue.pop(0), value, full))
        return out

    def _candidates(self, by_name, model_name, wanted, full):
        queue = list(by_name.get(model_name) or ())
        if not queue:
            # Names may carry an outer scope the weights lack (or the
            # reverse).
            queue = list(next((q for known, q in by_name.items() if q and (
                known.endswith("/" + model_name)
                or model_name.endswith("/" + known))), ()))
        if len(queue) <= max(wanted, 1):
            return queue
        if self.trainable is not None:
            trained = [key for key in queue if key in self.trainable]
            if len(trained) == wanted:
                return trained
        raise LegacyStateError(
            f"{self.path}: the optimizer holds state ({full!r} ...) for "
            f"{wanted} of the {len(queue)} model weights named "
            f"{model_name!r} ({queue}): the other layers of that name were "
            "frozen when the optimizer was built, and the artifact does not "
            "say which ones (Keras 2 does not store the optimizer's variable "
            "list). Save the Keras 2 model with those layers frozen as they "
            "were in training (a SavedModel lists its trainable variables, "
            "an h5 file's config marks its frozen layers), or give the "
            "layers distinct names.")
def _read_v2(graph, node, children, record, paths):
    state = OptimizerState(kind="legacy")
    state.iterations = int(_scalar(graph.value(children["iter"])))
    for name, child in children.items():
        if name == "iter" or graph.attribute(child) is None:
            continue
        state.hyperparameters[name] = _scalar(graph.value(child))
    state.learning_rate = state.hyperparameters.pop("learning_rate", None)
    for original, slot, slot_node in graph.nodes[node]["slot_variables"]:
        if original not in paths:
            raise LegacyFormatError(
                f"{graph.path}: slot {slot!r} belongs to object {original}, "
                "which is not a model variable.", path=graph.path, key=slot)
        full = graph.name(slot_node) or slot
        state.slots.append(
            Slot(slot, paths[original], graph.value(slot_node), full))
    prefixes = {s.name.split("/")[0] for s in state.slots if "/" in s.name}
    if len(prefixes) == 1:
        state.class_name = prefixes.pop()
    return state


# ---------------------------------------------------------------------------
# SavedModel
# ---------------------------------------------------------------------------


def read_savedmodel(directory):
    """Read a tf.keras SavedModel directory: ``keras_metadata.pb`` (model
    and training config) and ``variables/`` (every variable, the optimizer
    state included)."""
    from keras_ema_opt.savedmodel import wire

    record = LegacyRecord(path=str(directory), format="savedmodel")
    metadata = os.path.join(directory, "keras_metadata.pb")
    if os.path.exists(metadata):
        with open(metadata, "rb") as f:
            nodes = wire.parse_saved_metadata(f.read(), path=metadata)
        root = next((n for n in nodes if n["node_path"] == "root"), None)
        if root is not None:
            meta = _json(root["metadata"], metadata, "root")
            record.keras_version = meta.get("keras_version")
            config = meta.get("model_config")
            if config is None and "class_name" in meta:
                config = {"class_name": meta["class_name"],
                          "config": meta.get("config")}
            record.model_config = config
            record.training_config = meta.get("training_config")
    else:
        nodes = None
        record.warnings.append(
            "No keras_metadata.pb: the model config is unknown (pass a "
            "model builder).")
    prefix = os.path.join(directory, "variables", "variables")
    read_checkpoint(prefix, _record=record)
    _attach_config(record)
    if nodes:
        record.vocabularies = _lookup_tables(directory, nodes, metadata,
                                             record)
    return record


# The Keras 2 (and 3) layers whose vocabulary is a lookup table.
LOOKUP_LAYERS = ("TextVectorization", "StringLookup", "IntegerLookup")


def _lookup_tables(directory, nodes, metadata, record):
    """``{layer name: (keys, values, idf weights or None, class name)}``:
    the lookup tables of the SavedModel's lookup layers (an adapted
    layer's vocabulary lives there, not in a variable or the config), by
    the layer whose object holds each: a ``TextVectorization``'s table is
    held by its inner ``_lookup_layer``. A ``"tf_idf"`` layer's ``idf_weights``
    variable goes with its table, out of ``record.weights``, with its
    ``num_documents`` (what ``adapt`` counted, which Keras 3 layers do
    not keep)."""
    from keras_ema_opt.savedmodel import wire

    layers = {}
    for node in nodes:
        if node["identifier"] != "_tf_keras_layer":
            continue
        meta = _json(node["metadata"], metadata, node["node_path"])
        if meta.get("class_name") in LOOKUP_LAYERS:
            layers[node["node_id"]] = (node["node_path"], meta.get("name"),
                                       meta.get("class_name"))
    if not layers:
        return {}
    by_path = {path: (name, class_name)
               for path, name, class_name in layers.values()}
    saved_model = os.path.join(directory, "saved_model.pb")
    with open(saved_model, "rb") as f:
        tables = wire.parse_lookup_tables(f.read(), path=saved_model,
                                          owners=set(layers))
    out = {}
    for table in tables:
        if table["owner"] not in layers or table["name"] != "lookup_table":
            continue
        path, name, class_name = layers[table["owner"]]
        numbers = class_name == "IntegerLookup"
        outer, _, attribute = path.rpartition(".")
        if attribute == "_lookup_layer" and outer in by_path:
            name, class_name = by_path[outer]
        if "file" in table:
            table.update(_file_table(directory, table, name, numbers))
        key = path.partition(".")[2].replace(".", "/")
        idf = record.weights.get(f"{key}/idf_weights")
        for taken in (f"{key}/idf_weights", f"{key}/num_documents"):
            record.weights.pop(taken, None)
            record.names.pop(taken, None)
        # Two lookup layers of one name (in two nested models): neither is
        # placed by name (None: ``convert.set_vocabularies`` refuses).
        out[name] = None if name in out else (
            table["keys"], table["values"], idf, class_name)
    return out


def _file_table(directory, table, layer, numbers):
    """``{"keys", "values"}`` of a lookup table initialized from a file of
    the SavedModel's ``assets/`` (a layer given ``vocabulary="vocab.txt"``
    when it was built), read as ``tf.lookup.TextFileInitializer`` reads
    it: a token a line (a ``\\r`` before the ``\\n`` dropped), at its
    line number plus ``offset`` (the other way round for an inverted
    layer); ``numbers``: tokens that are integers (``IntegerLookup``)."""
    whole, number = -2, -1  # tf.lookup.TextFileIndex
    path = os.path.join(directory, "assets", table["file"])
    where = (f"{directory}: the vocabulary of layer {layer!r}, its asset "
             f"{table['file']!r}")
    if (table["key_index"], table["value_index"]) not in (
            (whole, number), (number, whole)):
        raise LegacyFormatError(
            f"{where}, is read by columns (key_index "
            f"{table['key_index']}, value_index {table['value_index']}); "
            "accepted: a token a line, as Keras 2's lookup layers read "
            "it.", path=directory, key=table["file"])
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as e:
        raise LegacyFormatError(f"{where}, cannot be read ({e}).",
                                path=directory, key=table["file"]) from e
    if lines and not lines[-1]:
        lines.pop()
    lines = [line[:-1] if line.endswith(b"\r") else line for line in lines]
    if table["vocab_size"] >= 0:
        lines = lines[:table["vocab_size"]]
    try:
        tokens = [int(line) for line in lines] if numbers else lines
    except ValueError as e:
        raise LegacyFormatError(f"{where}, holds a line that is no "
                                f"integer ({e}).", path=directory,
                                key=table["file"]) from e
    tokens = np.array(tokens, dtype=np.int64 if numbers else object)
    indices = np.arange(len(lines), dtype=np.int64) + table["offset"]
    if table["key_index"] == whole:
        return {"keys": tokens, "values": indices}
    return {"keys": indices, "values": tokens}


def _tuples(obj):
    # Keras 2 metadata writes tuples as {"class_name": "__tuple__", ...}.
    if obj.get("class_name") == "__tuple__" and "items" in obj:
        return list(obj["items"])
    return obj


def _json(text, path, key):
    try:
        return json.loads(text, object_hook=_tuples)
    except (TypeError, ValueError) as e:
        raise LegacyFormatError(
            f"{path}: the metadata of {key!r} is not JSON ({e}).", path=path,
            key=key) from e


def _attach_config(record):
    opt = record.optimizer
    training = record.training_config
    if opt is None or not isinstance(training, dict):
        return
    config = training.get("optimizer_config")
    if isinstance(config, dict):
        opt.config = config
        name = str(config.get("class_name", "")).split(">")[-1]
        opt.class_name = name or opt.class_name


# ---------------------------------------------------------------------------
# h5
# ---------------------------------------------------------------------------


def read_h5(path):
    """Read a full Keras 2 ``.h5`` file (model config, training config,
    ``model_weights`` and ``optimizer_weights``)."""
    import h5py

    record = LegacyRecord(path=str(path), format="h5")
    try:
        with h5py.File(path, "r") as f:
            _read_h5(f, record, path)
    except (OSError, KeyError, ValueError, TypeError) as e:
        if isinstance(e, (LegacyFormatError, LegacyStateError)):
            raise  # read, and named: not a file h5py cannot read
        raise LegacyFormatError(
            f"{path}: cannot read it as a Keras 2 h5 file ({e}).",
            path=path) from e
    return record


def _attr(obj, name):
    value = obj.attrs.get(name)
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    return value


def _names(obj, attr="weight_names"):
    return [n.decode("utf-8") if isinstance(n, bytes) else str(n)
            for n in obj.attrs.get(attr, [])]


def _read_h5(f, record, path):
    record.keras_version = _attr(f, "keras_version")
    config = _attr(f, "model_config")
    if config is not None:
        record.model_config = _json(config, path, "model_config")
    training = _attr(f, "training_config")
    if training is not None:
        record.training_config = _json(training, path, "training_config")
    weights = f["model_weights"] if "model_weights" in f else f
    for layer in _names(weights, "layer_names"):
        group = weights[layer]
        for name in _names(group):
            if name not in group:
                raise LegacyFormatError(
                    f"{path}: weight {name!r} of layer {layer!r} is listed "
                    "but missing.", path=path, key=name)
            key = f"{layer}/{_strip(name)}"
            if key in record.weights:
                key = f"{key}#{len(record.weights)}"
            record.weights[key] = np.asarray(group[name])
            record.names[key] = _strip(name)
    if "optimizer_weights" not in f:
        record.warnings.append("The h5 file holds no optimizer state.")
        return
    group = f["optimizer_weights"]
    names = _names(group)
    values = []
    for name in names:
        if name not in group:
            raise LegacyFormatError(
                f"{path}: optimizer weight {name!r} is listed but missing.",
                path=path, key=name)
        values.append((_strip(name), np.asarray(group[name])))
    record.optimizer = _h5_optimizer(values, record, path)
    _attach_config(record)


def _h5_optimizer(values, record, path):
    by_name = _weights_by_name(record)
    placer = _Placer(record, path, _trainable_in_config(record))
    if any(n.split("/")[-1] == "iter" for n, _ in values):
        state = OptimizerState(kind="legacy")
    else:
        state = OptimizerState(kind="new")
    entries = []
    for name, value in values:
        last = name.split("/")[-1]
        if last in ("iter", "iteration"):
            state.iterations = int(_scalar(value))
            continue
        if last == "momentum_cache":
            state.hyperparameters["momentum_cache"] = _scalar(value)
            continue
        if state.kind == "legacy":
            parts = name.split("/")
            # <opt>/<var name>/<slot>, possibly under a LossScale `cond_1/`.
            slot = parts[-1]
            model_name = _longest_known(parts[:-1], by_name)
        else:
            slot, model_name, _ = _split_new(name)
        if value.dtype.kind in "iu" and value.ndim == 0:
            continue  # Adafactor placeholders
        if slot is None or model_name is None:
            raise LegacyFormatError(
                f"{path}: cannot place optimizer weight {name!r} (no known "
                "slot name or model variable in it).", path=path, key=name)
        entries.append((slot, model_name, value, name))
    # One list per slot name, in file order (h5 files of same-named layers
    # cannot be written by tf_keras: their names collide).
    for slot in dict.fromkeys(entry[0] for entry in entries):
        state.slots.extend(placer.place(
            [entry for entry in entries if entry[0] == slot]))
    record.warnings.append(
        "h5 files do not store the learning-rate variable (the config value "
        "is used)" + (" nor Nadam's u_product (recomputed from the "
                      "iteration count)" if state.kind == "new" else ""))
    return state


def _trainable_in_config(record):
    """The record keys of the h5 weights whose layer, and every layer
    around it, the model config marks trainable: the model's trainable
    weights when it was saved (what a SavedModel lists), or None where
    the config does not tell (no config, or a weight of a layer it does
    not hold)."""
    config = (record.model_config or {}).get("config")
    layers = config.get("layers") if isinstance(config, dict) else None
    if not isinstance(layers, list):
        return None
    top = {_layer_name(layer): layer for layer in layers
           if isinstance(layer, dict)}
    trainable = set()
    for key in record.weights:
        layer = top.get(key.split("/", 1)[0])
        if layer is None:
            return None
        inner = record.names.get(key, key).split("/")[:-1]
        if not _frozen_in_config(layer, inner):
            trainable.add(key)
    return trainable


def _layer_name(layer):
    config = layer.get("config")
    name = config.get("name") if isinstance(config, dict) else None
    return name or layer.get("name")


def _frozen_in_config(layer, inner):
    """Whether ``layer``'s config (a model's, or a layer's), or that of the
    layer inside it named by the path ``inner``, is marked not
    trainable."""
    config = layer.get("config")
    if not isinstance(config, dict):
        return False
    if config.get("trainable") is False:
        return True
    children = config.get("layers")
    if not inner or not isinstance(children, list):
        return False
    for child in children:
        if isinstance(child, dict) and _layer_name(child) == inner[0]:
            return _frozen_in_config(child, inner[1:])
    return False


def _longest_known(parts, by_name):
    for start in range(len(parts)):
        candidate = "/".join(parts[start:])
        if candidate in by_name:
            return candidate
    return "/".join(parts[1:]) or None


# ---------------------------------------------------------------------------
# tf_keras .keras zip
# ---------------------------------------------------------------------------


def read_keras_zip(path):
    """Read a tf_keras ``.keras`` file: the model only, with a warning
    naming the optimizer state such files lack."""
    import io

    import h5py

    record = LegacyRecord(path=str(path), format="keras_v2_zip")
    try:
        with zipfile.ZipFile(path) as archive:
            config = _json(archive.read("config.json"), path, "config.json")
            meta = {}
            if "metadata.json" in archive.namelist():
                meta = _json(archive.read("metadata.json"), path,
                             "metadata.json")
            blob = archive.read("model.weights.h5")
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise LegacyFormatError(
            f"{path}: not a readable .keras zip ({e}).", path=path) from e
    record.keras_version = meta.get("keras_version")
    if str(record.keras_version or "").split(".")[0] not in ("", "2"):
        raise LegacyFormatError(
            f"{path} is a .keras file written by Keras "
            f"{record.keras_version}, not by Keras 2 (tf_keras): it needs "
            "no migration; load it with `keras.saving.load_model`.",
            path=path)
    record.model_config = {"class_name": config.get("class_name"),
                           "config": config.get("config")}
    record.training_config = config.get("compile_config")
    with h5py.File(io.BytesIO(blob), "r") as f:
        _collect_zip_weights(f, record)
        group = f.get("optimizer/vars")
        dropped = len(group) if group is not None else 0
    optimizer = (record.training_config or {}).get("optimizer") or {}
    name = optimizer.get("class_name", "optimizer") if isinstance(
        optimizer, dict) else str(optimizer)
    ema = isinstance(optimizer, dict) and (
        optimizer.get("config") or {}).get("use_ema")
    if dropped:
        kept = (
            f"it keeps the {name} optimizer's {dropped} variables "
            f"(iterations, learning rate, slots"
            f"{', EMA averages' if ema else ''}) by position only, with no "
            "names to place them by")
    else:
        kept = (
            f"it holds none of the {name} optimizer's variables (tf_keras "
            "writes none for a legacy optimizer, or for one that has not "
            "taken a step)")
    record.warnings.append(
        f"{path}: the optimizer state is not migrated from a tf_keras "
        f".keras file: {kept}. The model is "
        f"compiled with a fresh {name} from its config; to resume training "
        "exactly, migrate the SavedModel, h5 or a checkpoint of the same "
        "model.")
    return record


def _collect_zip_weights(f, record):
    # The model's weights by their place in Keras' file layout
    # (``layers/dense/vars/0``); the optimizer's and metrics' are not.
    def visit(name, obj):
        if hasattr(obj, "shape") and name.split("/")[0] not in (
                "optimizer", "metrics"):
            record.weights[name] = np.asarray(obj)
            record.names[name] = name
    f.visititems(visit)
