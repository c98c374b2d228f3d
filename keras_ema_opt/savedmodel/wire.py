"""A minimal protobuf wire-format decoder and parsers for the few messages
that Keras 2 artifacts store: ``TrackableObjectGraph`` (object checkpoints),
``SavedModel`` (``saved_model.pb``) and ``SavedMetadata``
(``keras_metadata.pb``).

The parsers return plain Python dicts, lists and tuples and never import
TensorFlow or protobuf. Every malformed input (truncation, invalid wire type,
overlong varint, a known field with the wrong wire type, invalid UTF-8)
raises :class:`keras_ema_opt.errors.LegacyFormatError`.

Field numbers were checked against the ``_pb2`` descriptors of TensorFlow
2.21 (``tensorflow/core/protobuf/trackable_object_graph.proto``,
``saved_model.proto``, ``meta_graph.proto``, ``saved_object_graph.proto``,
``tensor_bundle.proto``, ``tensor_shape.proto``) and tf_keras 2.21
(``tf_keras/protobuf/saved_metadata.proto``).

Semantics follow protobuf: for a singular scalar field the last occurrence
wins; the occurrences of a singular message field are merged (their bytes
concatenated and parsed as one message); repeated message fields keep each
occurrence. Unknown fields are skipped.
"""

from keras_ema_opt.errors import LegacyFormatError

VARINT = 0
FIXED64 = 1
LENGTH_DELIMITED = 2
FIXED32 = 5

_MASK64 = (1 << 64) - 1
_MAX_VARINT_BYTES = 10


def _error(message, path=None, key=None):
    where = f"{path}: " if path is not None else ""
    return LegacyFormatError(f"{where}{message}", path=path, key=key)


def _as_bytes(data, path=None):
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise _error(
        f"expected serialized protobuf bytes, got {type(data).__name__}", path
    )


def read_varint(data, pos, end=None, max_bytes=_MAX_VARINT_BYTES, path=None):
    """Decode a base-128 varint from ``data`` at ``pos``.

    Args:
        data: ``bytes``.
        pos: Offset of the first byte.
        end: Offset one past the last readable byte (default ``len(data)``).
        max_bytes: At most this many bytes (10 for 64-bit, 5 for 32-bit
            varints).
        path: File name used in error messages.

    Returns:
        ``(value, new_pos)``; ``value`` is an unsigned int that fits in
        ``7 * max_bytes`` bits, masked to 64 bits.

    Raises:
        LegacyFormatError: Truncated or overlong varint.
    """
    if end is None:
        end = len(data)
    result = 0
    shift = 0
    for i in range(max_bytes):
        if pos >= end:
            raise _error("truncated varint", path)
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            if max_bytes == _MAX_VARINT_BYTES and i == 9 and b > 1:
                raise _error("varint overflows 64 bits", path)
            if max_bytes < _MAX_VARINT_BYTES and result >> 32:
                raise _error("varint32 overflows 32 bits", path)
            return result & _MASK64, pos
        shift += 7
    raise _error(f"overlong varint (more than {max_bytes} bytes)", path)


def fields(data, path=None):
    """Split one serialized protobuf message into its fields.

    Args:
        data: The serialized message (``bytes``, ``bytearray`` or
            ``memoryview``).
        path: Optional file name used in error messages.

    Returns:
        A list of ``(field_number, wire_type, value)`` tuples in wire order.
        ``value`` is an ``int`` for varints (wire type 0, unsigned, 64-bit),
        ``bytes`` of length 8 for fixed64 (1), ``bytes`` for
        length-delimited fields (2) and ``bytes`` of length 4 for fixed32
        (5).

    Raises:
        LegacyFormatError: Truncated data, an overlong varint, field number
            0, or a wire type other than 0, 1, 2 or 5 (groups included).
    """
    data = _as_bytes(data, path)
    out = []
    pos = 0
    end = len(data)
    while pos < end:  # every iteration consumes at least one byte
        tag, pos = read_varint(data, pos, end, path=path)
        number = tag >> 3
        wire_type = tag & 7
        if number == 0 or number > 0x1FFFFFFF:
            raise _error(f"invalid field number {number}", path)
        if wire_type == VARINT:
            value, pos = read_varint(data, pos, end, path=path)
        elif wire_type == FIXED64:
            if pos + 8 > end:
                raise _error(f"truncated fixed64 field {number}", path)
            value = data[pos : pos + 8]
            pos += 8
        elif wire_type == LENGTH_DELIMITED:
            length, pos = read_varint(data, pos, end, path=path)
            if length > end - pos:
                raise _error(
                    f"truncated length-delimited field {number} "
                    f"({length} bytes, {end - pos} left)",
                    path,
                )
            value = data[pos : pos + length]
            pos += length
        elif wire_type == FIXED32:
            if pos + 4 > end:
                raise _error(f"truncated fixed32 field {number}", path)
            value = data[pos : pos + 4]
            pos += 4
        else:
            raise _error(
                f"unsupported wire type {wire_type} for field {number}", path
            )
        out.append((number, wire_type, value))
    return out


# ---------------------------------------------------------------------------
# Typed accessors.


def _expect(number, wire_type, expected, message, path):
    if wire_type != expected:
        raise _error(
            f"{message} field {number} has wire type {wire_type}, "
            f"expected {expected}",
            path,
        )


def _int32(value):
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def _int64(value):
    value &= _MASK64
    return value - (1 << 64) if value & (1 << 63) else value


def _string(value, what, path):
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _error(f"{what} is not valid UTF-8 ({e})", path) from None


def _message_fields(data, spec, message, path=None):
    """Parse ``data`` by ``spec``: {number: (name, kind)}.

    ``kind`` is one of 'int32', 'int64', 'uint64', 'bool', 'string',
    'bytes', 'fixed32', 'message' (singular, occurrences merged) or
    'repeated' (repeated message, a list of bytes). Returns a dict with an
    entry for each field present.
    """
    result = {}
    for number, wire_type, value in fields(data, path):
        entry = spec.get(number)
        if entry is None:
            continue
        name, kind = entry
        if kind in ("int32", "int64", "uint64", "bool"):
            _expect(number, wire_type, VARINT, message, path)
            if kind == "int32":
                value = _int32(value)
            elif kind == "int64":
                value = _int64(value)
            elif kind == "bool":
                value = value != 0
            result[name] = value
        elif kind == "fixed32":
            _expect(number, wire_type, FIXED32, message, path)
            result[name] = int.from_bytes(value, "little")
        elif kind == "string":
            _expect(number, wire_type, LENGTH_DELIMITED, message, path)
            result[name] = _string(value, f"{message}.{name}", path)
        elif kind == "bytes":
            _expect(number, wire_type, LENGTH_DELIMITED, message, path)
            result[name] = value
        elif kind == "message":
            _expect(number, wire_type, LENGTH_DELIMITED, message, path)
            result[name] = result.get(name, b"") + value
        elif kind == "repeated":
            _expect(number, wire_type, LENGTH_DELIMITED, message, path)
            result.setdefault(name, []).append(value)
        else:  # pragma: no cover - programming error
            raise AssertionError(kind)
    return result


_OBJECT_REFERENCE = {1: ("node_id", "int32"), 2: ("local_name", "string")}
_SLOT_VARIABLE_REFERENCE = {
    1: ("original_variable_node_id", "int32"),
    2: ("slot_name", "string"),
    3: ("slot_variable_node_id", "int32"),
}


def _children(raw, path):
    out = []
    for item in raw.get("children", ()):
        ref = _message_fields(item, _OBJECT_REFERENCE, "ObjectReference", path)
        out.append((ref.get("node_id", 0), ref.get("local_name", "")))
    return out


def _slot_variables(raw, path):
    out = []
    for item in raw.get("slot_variables", ()):
        ref = _message_fields(
            item, _SLOT_VARIABLE_REFERENCE, "SlotVariableReference", path
        )
        out.append(
            (
                ref.get("original_variable_node_id", 0),
                ref.get("slot_name", ""),
                ref.get("slot_variable_node_id", 0),
            )
        )
    return out


# ---------------------------------------------------------------------------
# TrackableObjectGraph (the _CHECKPOINTABLE_OBJECT_GRAPH tensor).

_TRACKABLE_OBJECT_GRAPH = {1: ("nodes", "repeated")}
_TRACKABLE_OBJECT = {
    1: ("children", "repeated"),
    2: ("attributes", "repeated"),
    3: ("slot_variables", "repeated"),
}
_SERIALIZED_TENSOR = {
    1: ("name", "string"),
    2: ("full_name", "string"),
    3: ("checkpoint_key", "string"),
}


def parse_trackable_object_graph(data, path=None):
    """Parse a serialized ``tensorflow.TrackableObjectGraph``.

    This is the value of the ``_CHECKPOINTABLE_OBJECT_GRAPH`` tensor of an
    object-based checkpoint.

    Args:
        data: The serialized message.
        path: Optional file name used in error messages.

    Returns:
        A list with one dict per node, indexed by node id::

            {"children": [(node_id, local_name), ...],
             "attributes": [{"name": str, "full_name": str,
                             "checkpoint_key": str}, ...],
             "slot_variables": [(original_variable_node_id, slot_name,
                                 slot_variable_node_id), ...]}

    Raises:
        LegacyFormatError: The bytes are not a valid message.
    """
    graph = _message_fields(
        data, _TRACKABLE_OBJECT_GRAPH, "TrackableObjectGraph", path
    )
    nodes = []
    for node_bytes in graph.get("nodes", ()):
        raw = _message_fields(node_bytes, _TRACKABLE_OBJECT, "TrackableObject", path)
        attributes = []
        for item in raw.get("attributes", ()):
            t = _message_fields(item, _SERIALIZED_TENSOR, "SerializedTensor", path)
            attributes.append(
                {
                    "name": t.get("name", ""),
                    "full_name": t.get("full_name", ""),
                    "checkpoint_key": t.get("checkpoint_key", ""),
                }
            )
        nodes.append(
            {
                "children": _children(raw, path),
                "attributes": attributes,
                "slot_variables": _slot_variables(raw, path),
            }
        )
    return nodes


# ---------------------------------------------------------------------------
# SavedModel (saved_model.pb).

_SAVED_MODEL = {2: ("meta_graphs", "repeated")}
_META_GRAPH_DEF = {7: ("object_graph_def", "message")}
_SAVED_OBJECT_GRAPH = {1: ("nodes", "repeated")}
# The oneof ``kind`` of SavedObject, by field number.
_SAVED_OBJECT_KINDS = {
    4: "user_object",
    5: "asset",
    6: "function",
    7: "variable",
    8: "bare_concrete_function",
    9: "constant",
    10: "resource",
    12: "captured_tensor",
}
_SAVED_OBJECT = {
    1: ("children", "repeated"),
    3: ("slot_variables", "repeated"),
    4: ("user_object", "message"),
    7: ("variable", "message"),
}
_SAVED_USER_OBJECT = {1: ("identifier", "string"), 3: ("metadata", "string")}
_SAVED_VARIABLE = {
    1: ("dtype", "int32"),
    2: ("shape", "message"),
    3: ("trainable", "bool"),
    4: ("synchronization", "int32"),
    5: ("aggregation", "int32"),
    6: ("name", "string"),
    7: ("device", "string"),
}
_TENSOR_SHAPE = {2: ("dim", "repeated"), 3: ("unknown_rank", "bool")}
_TENSOR_SHAPE_DIM = {1: ("size", "int64")}


def parse_tensor_shape(data, path=None):
    """Parse a serialized ``tensorflow.TensorShapeProto``.

    Args:
        data: The serialized message.
        path: Optional file name used in error messages.

    Returns:
        A tuple of ints (``-1`` for an unknown dimension), or ``None`` when
        the rank is unknown.

    Raises:
        LegacyFormatError: The bytes are not a valid message.
    """
    raw = _message_fields(data, _TENSOR_SHAPE, "TensorShapeProto", path)
    if raw.get("unknown_rank", False):
        return None
    dims = []
    for item in raw.get("dim", ()):
        dim = _message_fields(item, _TENSOR_SHAPE_DIM, "TensorShapeProto.Dim", path)
        dims.append(dim.get("size", 0))
    return tuple(dims)


def _object_kind(node_bytes, path):
    kind = None
    for number, _, _ in fields(node_bytes, path):
        if number in _SAVED_OBJECT_KINDS:
            kind = _SAVED_OBJECT_KINDS[number]  # oneof: the last one wins
    return kind


def parse_saved_model(data, path=None):
    """Parse the object graph of a serialized ``tensorflow.SavedModel``.

    Reads ``SavedModel.meta_graphs[0].object_graph_def`` (the
    ``SavedObjectGraph``) of ``saved_model.pb``. Node ids are the same as
    in the SavedModel's ``variables/variables`` checkpoint.

    Args:
        data: The contents of ``saved_model.pb``.
        path: Optional file name used in error messages.

    Returns:
        A list with one dict per node, indexed by node id::

            {"children": [(node_id, local_name), ...],
             "slot_variables": [(original_variable_node_id, slot_name,
                                 slot_variable_node_id), ...],
             "kind": "user_object" | "variable" | "function" | ... | None,
             "identifier": str or None,   # user_object.identifier
             "metadata": str or None,     # user_object.metadata
             "variable": {"name": str, "dtype": int (DataType enum),
                          "shape": tuple or None, "trainable": bool,
                          "synchronization": int, "aggregation": int,
                          "device": str} or None}

        ``identifier`` and ``metadata`` are ``None`` unless the node is a
        user object; ``variable`` is ``None`` unless it is a variable.

    Raises:
        LegacyFormatError: The bytes are not a valid message, or there is
            no meta graph or no object graph.
    """
    saved_model = _message_fields(data, _SAVED_MODEL, "SavedModel", path)
    meta_graphs = saved_model.get("meta_graphs", ())
    if not meta_graphs:
        raise _error("SavedModel has no meta graph", path)
    meta_graph = _message_fields(
        meta_graphs[0], _META_GRAPH_DEF, "MetaGraphDef", path
    )
    if "object_graph_def" not in meta_graph:
        raise _error("SavedModel meta graph has no object graph", path)
    graph = _message_fields(
        meta_graph["object_graph_def"], _SAVED_OBJECT_GRAPH, "SavedObjectGraph", path
    )
    nodes = []
    for node_bytes in graph.get("nodes", ()):
        raw = _message_fields(node_bytes, _SAVED_OBJECT, "SavedObject", path)
        kind = _object_kind(node_bytes, path)
        identifier = metadata = None
        if "user_object" in raw:
            user = _message_fields(
                raw["user_object"], _SAVED_USER_OBJECT, "SavedUserObject", path
            )
            identifier = user.get("identifier", "")
            metadata = user.get("metadata", "")
        variable = None
        if "variable" in raw:
            var = _message_fields(
                raw["variable"], _SAVED_VARIABLE, "SavedVariable", path
            )
            shape = var.get("shape")
            variable = {
                "name": var.get("name", ""),
                "dtype": var.get("dtype", 0),
                "shape": () if shape is None else parse_tensor_shape(shape, path),
                "trainable": var.get("trainable", False),
                "synchronization": var.get("synchronization", 0),
                "aggregation": var.get("aggregation", 0),
                "device": var.get("device", ""),
            }
        nodes.append(
            {
                "children": _children(raw, path),
                "slot_variables": _slot_variables(raw, path),
                "kind": kind,
                "identifier": identifier,
                "metadata": metadata,
                "variable": variable,
            }
        )
    return nodes


# ---------------------------------------------------------------------------
# SavedMetadata (keras_metadata.pb).

_SAVED_METADATA = {1: ("nodes", "repeated")}
_METADATA_OBJECT = {
    2: ("node_id", "int32"),
    3: ("node_path", "string"),
    4: ("identifier", "string"),
    5: ("metadata", "string"),
}


def parse_saved_metadata(data, path=None):
    """Parse a serialized tf_keras ``SavedMetadata`` (``keras_metadata.pb``).

    Args:
        data: The contents of ``keras_metadata.pb``.
        path: Optional file name used in error messages.

    Returns:
        A list of dicts in file order::

            {"node_id": int, "node_path": str, "identifier": str,
             "metadata": str}

        ``metadata`` is the JSON string as stored (not decoded).

    Raises:
        LegacyFormatError: The bytes are not a valid message.
    """
    raw = _message_fields(data, _SAVED_METADATA, "SavedMetadata", path)
    out = []
    for item in raw.get("nodes", ()):
        obj = _message_fields(item, _METADATA_OBJECT, "SavedObject", path)
        out.append(
            {
                "node_id": obj.get("node_id", 0),
                "node_path": obj.get("node_path", ""),
                "identifier": obj.get("identifier", ""),
                "metadata": obj.get("metadata", ""),
            }
        )
    return out


# ---------------------------------------------------------------------------
# Lookup tables (saved_model.pb): the keys and values a tf_keras
# ``StringLookup`` / ``IntegerLookup`` / ``TextVectorization`` adapted into
# its ``StaticHashTable``. They are not variables: the table's
# ``_initialize`` function imports them from constants of the graph.

_META_GRAPH_PARTS = {2: ("graph_def", "message"),
                     6: ("asset_file_def", "repeated"),
                     7: ("object_graph_def", "message")}
_ASSET_FILE_DEF = {2: ("filename", "string")}
_SAVED_ASSET = {1: ("asset_file_def_index", "int32")}
_OBJECT_GRAPH_PARTS = {1: ("nodes", "repeated"),
                       2: ("concrete_functions", "repeated")}
_MAP_ENTRY = {1: ("key", "string"), 2: ("value", "message")}
_SAVED_OBJECT_PARTS = {1: ("children", "repeated"),
                       5: ("asset", "message"),
                       6: ("function", "message"),
                       9: ("constant", "message")}
_SAVED_FUNCTION = {1: ("concrete_functions", "repeated")}
_SAVED_CONSTANT = {1: ("operation", "string")}
_GRAPH_DEF = {1: ("node", "repeated"), 2: ("library", "message")}
_NODE_DEF = {1: ("name", "string"), 2: ("op", "string"),
             3: ("input", "repeated"), 5: ("attr", "repeated")}
_ATTR_VALUE = {2: ("s", "bytes"), 3: ("i", "int64"),
               8: ("tensor", "message")}
_LIBRARY = {1: ("function", "repeated")}
_FUNCTION_DEF = {1: ("signature", "message"), 3: ("node_def", "repeated")}
_OP_DEF = {1: ("name", "string"), 2: ("input_arg", "repeated")}
_ARG_DEF = {1: ("name", "string")}
_TENSOR_PROTO = {1: ("dtype", "int32"), 2: ("tensor_shape", "message")}
_DT_INT32, _DT_STRING, _DT_INT64 = 3, 7, 9
_IMPORT_OPS = ("LookupTableImportV2", "LookupTableImport")
_FILE_OPS = ("InitializeTableFromTextFileV2", "InitializeTableFromTextFile")
# What a text-file initializer's attributes are when not written.
_FILE_DEFAULTS = {"key_index": 0, "value_index": 0, "vocab_size": -1,
                  "offset": 0, "delimiter": "\t"}


def _varints(number, wire_type, value, path):
    """The integers of a repeated scalar field's occurrence, packed (wire
    type 2) or not (0)."""
    if wire_type == VARINT:
        return [value]
    _expect(number, wire_type, LENGTH_DELIMITED, "repeated scalar", path)
    out, pos = [], 0
    while pos < len(value):
        item, pos = read_varint(value, pos, path=path)
        out.append(item)
    return out


def parse_tensor_proto(data, path=None):
    """A serialized ``tensorflow.TensorProto`` of strings or integers
    (``DT_STRING``, ``DT_INT64``, ``DT_INT32``) as a 1-D numpy array:
    strings as ``bytes`` objects. Other dtypes raise ``LegacyFormatError``
    naming the dtype."""
    import numpy as np

    raw = _message_fields(data, _TENSOR_PROTO, "TensorProto", path)
    dtype = raw.get("dtype", 0)
    shape = parse_tensor_shape(raw.get("tensor_shape", b""), path) or ()
    count = int(np.prod(shape)) if shape else 1
    if dtype not in (_DT_INT32, _DT_STRING, _DT_INT64):
        raise _error(f"a lookup table's constant has dtype enum {dtype}; "
                     "accepted: string, int64, int32", path)
    strings, numbers, content = [], [], None
    for number, wire_type, value in fields(data, path):
        if number == 4:  # tensor_content
            _expect(number, wire_type, LENGTH_DELIMITED, "TensorProto", path)
            content = value
        elif number == 8 and dtype == _DT_STRING:  # string_val
            _expect(number, wire_type, LENGTH_DELIMITED, "TensorProto", path)
            strings.append(value)
        elif (number, dtype) in ((10, _DT_INT64), (7, _DT_INT32)):
            numbers.extend(_varints(number, wire_type, value, path))
    if dtype == _DT_STRING:
        values = np.empty(len(strings), dtype=object)
        values[:] = strings
    elif content is not None:
        width = 8 if dtype == _DT_INT64 else 4
        if len(content) % width:
            raise _error(f"a TensorProto's content of {len(content)} bytes "
                         f"is no whole number of {width}-byte integers",
                         path)
        values = np.frombuffer(
            content, "<i8" if width == 8 else "<i4").astype(np.int64)
    else:
        convert = _int64 if dtype == _DT_INT64 else _int32
        values = np.array([convert(v) for v in numbers], dtype=np.int64)
    if len(values) == 1 and count > 1:  # one value, repeated (TF's fill)
        values = np.repeat(values, count)
    if len(values) != count:
        raise _error(f"a TensorProto of shape {shape} holds {len(values)} "
                     "values", path)
    return values


def parse_lookup_tables(data, path=None, owners=None):
    """The keys and values each lookup table of a serialized
    ``tensorflow.SavedModel`` (``saved_model.pb``) is initialized with,
    where they are constants of the graph (an adapted tf_keras lookup
    layer's ``StaticHashTable``).

    Follows the object graph by path: a resource node, its ``_initialize``
    function, that function's ``LookupTableImportV2`` node, the function
    arguments it imports, the constants bound to them, and their ``Const``
    nodes in the graph. A table initialized from a file of the
    SavedModel's ``assets/`` (``InitializeTableFromTextFileV2``, a layer
    given ``vocabulary="vocab.txt"``) is followed to that file's name and
    the initializer's attributes. A table initialized otherwise is left
    out, and so is one not held by ``owners`` (node ids), where they are
    given: a model's own tables of other kinds (a custom layer's table of
    floats) are not read.

    Returns:
        A list of dicts, one per table::

            {"owner": node id of the object holding the table,
             "name": the table's name under it ("lookup_table"),
             "keys": 1-D numpy array, "values": 1-D numpy array}

        Strings are ``bytes`` objects (an ``object`` array), integers
        ``int64``. A table initialized from a file has, instead of
        ``keys`` and ``values``, ``"file"`` (its name in ``assets/``) and
        ``"key_index"``, ``"value_index"``, ``"vocab_size"``,
        ``"offset"``, ``"delimiter"`` (``tf.lookup.TextFileInitializer``'s
        arguments; -2 a whole line, -1 its line number).

    Raises:
        LegacyFormatError: The bytes are not a valid message, or a
            constant the table imports is not in the graph.
    """
    saved_model = _message_fields(data, _SAVED_MODEL, "SavedModel", path)
    meta_graphs = saved_model.get("meta_graphs", ())
    if not meta_graphs:
        raise _error("SavedModel has no meta graph", path)
    meta = _message_fields(meta_graphs[0], _META_GRAPH_PARTS, "MetaGraphDef",
                           path)
    objects = _message_fields(meta.get("object_graph_def", b""),
                              _OBJECT_GRAPH_PARTS, "SavedObjectGraph", path)
    nodes = [_message_fields(n, _SAVED_OBJECT_PARTS, "SavedObject", path)
             for n in objects.get("nodes", ())]
    children = [dict((name, nid) for nid, name in _children(n, path))
                for n in nodes]
    wanted = []  # (owner, name, function name)
    for owner, named in enumerate(children):
        if owners is not None and owner not in owners:
            continue
        for name, nid in named.items():
            if not 0 <= nid < len(nodes) or _object_kind(
                    objects["nodes"][nid], path) != "resource":
                continue
            init = children[nid].get("_initialize")
            if init is None or "function" not in nodes[init]:
                continue
            functions = _message_fields(nodes[init]["function"],
                                        _SAVED_FUNCTION, "SavedFunction",
                                        path).get("concrete_functions", ())
            if functions:
                wanted.append((owner, name,
                               _string(functions[0], "function name", path)))
    if not wanted:
        return []
    bound = {}
    for entry in objects.get("concrete_functions", ()):
        item = _message_fields(entry, _MAP_ENTRY, "concrete_functions", path)
        inputs = []
        for number, wire_type, value in fields(item.get("value", b""), path):
            if number == 2:  # SavedConcreteFunction.bound_inputs
                inputs.extend(_int32(v) for v in
                              _varints(number, wire_type, value, path))
        bound[item.get("key", "")] = inputs
    graph = _message_fields(meta.get("graph_def", b""), _GRAPH_DEF,
                            "GraphDef", path)
    imports = _imported_arguments(graph.get("library", b""),
                                  {w[2] for w in wanted}, path)
    constants, out = {}, []
    for owner, name, function in wanted:
        positions = imports.get(function)
        inputs = bound.get(function, [])
        if positions is None or max(positions[0]) >= len(inputs):
            continue
        positions, attributes = positions
        if attributes is not None:  # from a file of the assets
            node = nodes[inputs[positions[0]]] if 0 <= inputs[
                positions[0]] < len(nodes) else {}
            if "asset" in node:
                index = _message_fields(node["asset"], _SAVED_ASSET,
                                        "SavedAsset", path).get(
                    "asset_file_def_index", 0)
                files = meta.get("asset_file_def", ())
                if not 0 <= index < len(files):
                    raise _error(f"lookup table {name!r} reads asset "
                                 f"{index}, of {len(files)}", path)
                out.append({"owner": owner, "name": name, **attributes,
                            "file": _message_fields(
                                files[index], _ASSET_FILE_DEF,
                                "AssetFileDef", path).get("filename", "")})
            continue
        operations = []
        for position in positions:
            node = nodes[inputs[position]] if 0 <= inputs[
                position] < len(nodes) else {}
            if "constant" not in node:
                break
            operations.append(_message_fields(
                node["constant"], _SAVED_CONSTANT, "SavedConstant",
                path).get("operation", ""))
        else:
            out.append({"owner": owner, "name": name,
                        "operations": operations})
            constants.update(dict.fromkeys(operations))
    if constants:
        _graph_constants(graph.get("node", ()), constants, path)
    for table in out:
        if "file" in table:
            continue
        keys, values = (constants[op] for op in table.pop("operations"))
        if keys is None or values is None:
            raise _error(f"the constants of lookup table {table['name']!r} "
                         "are not in the graph", path)
        table["keys"], table["values"] = keys, values
    return out


def _imported_arguments(library, names, path):
    """``{function name: (positions, attributes)}`` for the functions in
    ``names``: the positions among the function's arguments of what its
    lookup-table import reads (the keys and the values), attributes
    ``None``; or, for a table initialized from a text file, the position
    of the file's name and the initializer's attributes."""
    out = {}
    for item in _message_fields(library, _LIBRARY, "FunctionDefLibrary",
                                path).get("function", ()):
        function = _message_fields(item, _FUNCTION_DEF, "FunctionDef", path)
        signature = _message_fields(function.get("signature", b""), _OP_DEF,
                                    "OpDef", path)
        if signature.get("name") not in names:
            continue
        arguments = [_message_fields(a, _ARG_DEF, "ArgDef", path).get(
            "name", "") for a in signature.get("input_arg", ())]
        for node_bytes in function.get("node_def", ()):
            node = _message_fields(node_bytes, _NODE_DEF, "NodeDef", path)
            op = node.get("op")
            if op not in _IMPORT_OPS + _FILE_OPS:
                continue
            inputs = [_string(i, "NodeDef.input", path).split(":")[0]
                      for i in node.get("input", ())]
            read = inputs[1:3] if op in _IMPORT_OPS else inputs[1:2]
            if len(read) == (2 if op in _IMPORT_OPS else 1) and all(
                    i in arguments for i in read):
                out[signature["name"]] = (
                    tuple(arguments.index(i) for i in read),
                    None if op in _IMPORT_OPS else _file_attributes(
                        node, path))
    return out


def _file_attributes(node, path):
    """A text-file initializer's attributes (``_FILE_DEFAULTS``' keys)."""
    out = dict(_FILE_DEFAULTS)
    for entry in node.get("attr", ()):
        attr = _message_fields(entry, _MAP_ENTRY, "NodeDef.attr", path)
        key = attr.get("key")
        if key not in out:
            continue
        value = _message_fields(attr.get("value", b""), _ATTR_VALUE,
                                "AttrValue", path)
        out[key] = (_string(value.get("s", b""), key, path)
                    if key == "delimiter" else value.get("i", 0))
    return out


def _graph_constants(graph_nodes, constants, path):
    """Fill ``constants`` (``{Const node name: None}``) with the values of
    those ``Const`` nodes of the graph."""
    for node_bytes in graph_nodes:
        node = _message_fields(node_bytes, _NODE_DEF, "NodeDef", path)
        if node.get("name") not in constants or node.get("op") != "Const":
            continue
        for entry in node.get("attr", ()):
            attr = _message_fields(entry, _MAP_ENTRY, "NodeDef.attr", path)
            if attr.get("key") == "value":
                value = _message_fields(attr.get("value", b""), _ATTR_VALUE,
                                        "AttrValue", path)
                constants[node["name"]] = parse_tensor_proto(
                    value.get("tensor", b""), path)
