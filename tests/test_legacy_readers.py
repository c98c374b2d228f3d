"""The numpy-only tensor-bundle reader and protobuf decoder
(``keras_ema_opt.savedmodel.bundle`` / ``.wire``) against TensorFlow's own
readers, on checkpoints and SavedModels that tf_keras writes during the run.
"""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("tf_keras")

from keras_ema_opt.errors import LegacyFormatError  # noqa: E402
from keras_ema_opt.savedmodel import bundle  # noqa: E402
from keras_ema_opt.savedmodel import wire  # noqa: E402
from keras_ema_opt.savedmodel.bundle import BundleReader  # noqa: E402
from conftest import last_json  # noqa: E402
from conftest import only_on  # noqa: E402
from conftest import run_python  # noqa: E402

# The readers are numpy only, the same whatever Keras backend is active
# (TensorFlow, their oracle, is imported by the tests alone): the module
# runs once, in the PyTorch backend's suite, the shortest of the three.
# test_reads_without_tensorflow runs them where TensorFlow cannot import.
pytestmark = only_on("torch")


# ---------------------------------------------------------------------------
# Artifacts, written once per module.


def _train(model, optimizer, x, y):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 2 steps


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    import tensorflow as tf
    import tf_keras

    root = tmp_path_factory.mktemp("legacy")
    tf_keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    out = {}

    # New optimizer with EMA on Dense + BatchNormalization.
    dense = tf_keras.Sequential(
        [
            tf_keras.Input((4,)),
            tf_keras.layers.Dense(8, name="d1"),
            tf_keras.layers.BatchNormalization(name="bn"),
            tf_keras.layers.Dense(1, name="d2"),
        ]
    )
    _train(
        dense,
        tf_keras.optimizers.Adam(use_ema=True),
        rng.normal(size=(8, 4)).astype("float32"),
        rng.normal(size=(8, 1)).astype("float32"),
    )
    # Legacy optimizer (slot_variables) on Embedding + Dense.
    embed = tf_keras.Sequential(
        [
            tf_keras.Input((3,), dtype="int32"),
            tf_keras.layers.Embedding(300, 8, name="emb"),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(1, name="out"),
        ]
    )
    _train(
        embed,
        tf_keras.optimizers.legacy.Adam(),
        rng.integers(0, 300, size=(8, 3)).astype("int32"),
        rng.normal(size=(8, 1)).astype("float32"),
    )
    for name, model in (("new", dense), ("legacy", embed)):
        ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        out[f"{name}_ckpt"] = ckpt.save(str(root / f"{name}_ckpt" / "ckpt"))
        weights = str(root / f"{name}_weights" / "weights")
        model.save_weights(weights, save_format="tf")
        out[f"{name}_weights"] = weights
        savedmodel = str(root / f"{name}_savedmodel")
        model.save(savedmodel, save_format="tf")
        out[f"{name}_savedmodel_dir"] = savedmodel
        out[f"{name}_savedmodel"] = os.path.join(savedmodel, "variables", "variables")

    # Every dtype we map, strings, a scalar, an empty and a 1 MiB tensor.
    variables = {
        "f32": tf.Variable(rng.normal(size=(512, 512)).astype("float32")),
        "f64": tf.Variable(rng.normal(size=(3,))),
        "f16": tf.Variable(np.array([1.5, -2.25, 65504.0], "float16")),
        "bf16": tf.Variable(tf.constant([1.0, -3.5, 1e30, 7.0], tf.bfloat16)),
        "i8": tf.Variable(np.array([-128, 0, 127], "int8")),
        "u8": tf.Variable(np.array([0, 200, 255], "uint8")),
        "i16": tf.Variable(np.array([-30000, 5], "int16")),
        "u16": tf.Variable(np.array([65535, 1], "uint16")),
        "i32": tf.Variable(np.array([[1, -2], [3, 2**31 - 1]], "int32")),
        "u32": tf.Variable(np.array([2**32 - 1, 7], "uint32")),
        "i64": tf.Variable(np.array([2**62, -(2**40), 0], "int64")),
        "u64": tf.Variable(np.array([2**64 - 1, 3], "uint64")),
        "b": tf.Variable([True, False, True]),
        "s": tf.Variable([b"abc", b"", b"\x00\xffxyz" * 50]),
        "s2": tf.Variable([["a", "bc"], ["def", "ghij"]]),
        "s0": tf.Variable(b"a scalar string"),
        "scalar": tf.Variable(3.25),
        "empty": tf.Variable(np.zeros((0, 3), "float32")),
    }
    out["dtypes"] = tf.train.Checkpoint(**variables).save(str(root / "dtypes" / "ckpt"))
    out["tiny"] = tf.train.Checkpoint(
        v=tf.Variable([1.0, 2.0]), s=tf.Variable(["ab", "c"])
    ).save(str(root / "tiny" / "ckpt"))
    # 2000 variables: an index with more than one data block.
    many = {
        hashlib.md5(str(i).encode()).hexdigest() * 3: tf.Variable(np.float32(i))
        for i in range(2000)
    }
    out["many"] = tf.train.Checkpoint(v=many).save(str(root / "many" / "ckpt"))
    # A sharding policy: several data shards, tensors stored as slices.
    policy = getattr(tf.train.experimental, "MaxShardSizePolicy", None)
    if policy is not None:
        options = tf.train.CheckpointOptions(
            experimental_sharding_callback=policy(max_shard_size=500)
        )
        out["sharded"] = tf.train.Checkpoint(
            m=tf.Variable(np.arange(300, dtype="float32").reshape(20, 15)),
            b=tf.Variable(np.arange(200) % 3 == 0),
            i=tf.Variable(np.arange(150, dtype="int64")),
        ).save(str(root / "sharded" / "ckpt"), options=options)
        # (TF's policy never returns if one string exceeds max_shard_size.)
        options = tf.train.CheckpointOptions(
            experimental_sharding_callback=policy(max_shard_size=1000)
        )
        out["sharded_strings"] = tf.train.Checkpoint(
            s=tf.Variable([b"x" * 300, b"y" * 900, b"z"])
        ).save(str(root / "sharded_strings" / "ckpt"), options=options)
    out["root"] = str(root)
    return out


PREFIXES = [
    "new_ckpt",
    "new_weights",
    "new_savedmodel",
    "legacy_ckpt",
    "legacy_weights",
    "legacy_savedmodel",
    "dtypes",
    "many",
    "sharded",
]


@pytest.fixture(params=PREFIXES)
def prefix_name(request, artifacts):
    if request.param not in artifacts:
        pytest.skip("this TensorFlow has no MaxShardSizePolicy")
    return request.param


def _tf_values(prefix):
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    shapes = reader.get_variable_to_shape_map()
    return reader, dtypes, shapes


def _digest(value):
    """A comparable digest of an array: dtype, shape and exact contents."""
    value = np.asarray(value)
    if value.dtype == object:
        body = repr([bytes(v) for v in value.reshape(-1)]).encode()
    else:
        body = value.tobytes()
    return [str(value.dtype), list(value.shape), hashlib.sha256(body).hexdigest()]


def _tf_digest(tf_value, np_dtype):
    value = np.asarray(tf_value, dtype=object if np_dtype == object else None)
    if np_dtype != object:
        value = value.astype(np_dtype, copy=False)
    return _digest(value)


# ---------------------------------------------------------------------------
# Tensors.


def test_every_tensor_matches_tensorflow(artifacts, prefix_name):
    prefix = artifacts[prefix_name]
    tf_reader, tf_dtypes, tf_shapes = _tf_values(prefix)
    reader = BundleReader(prefix)
    assert reader.keys() == sorted(tf_shapes)
    assert len(reader) == len(tf_shapes)
    for key in reader.keys():
        expected_dtype = np.dtype(tf_dtypes[key].as_numpy_dtype)
        assert reader.dtype(key) == expected_dtype, key
        assert reader.shape(key) == tuple(tf_shapes[key]), key
        value = reader.get_tensor(key)
        assert isinstance(value, np.ndarray)
        assert value.dtype == expected_dtype and value.shape == reader.shape(key)
        assert _digest(value) == _tf_digest(tf_reader.get_tensor(key), expected_dtype), key


def test_dtypes_and_strings(artifacts):
    import ml_dtypes

    reader = BundleReader(artifacts["dtypes"])
    key = "{}/.ATTRIBUTES/VARIABLE_VALUE".format
    assert reader.dtype(key("bf16")) == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(
        reader.get_tensor(key("bf16")).astype("float32"),
        np.array([1.0, -3.5, 1e30, 7.0], ml_dtypes.bfloat16).astype("float32"),
    )
    assert reader.get_tensor(key("i64")).tolist() == [2**62, -(2**40), 0]
    assert reader.get_tensor(key("u64")).tolist() == [2**64 - 1, 3]
    assert reader.get_tensor(key("b")).tolist() == [True, False, True]
    assert reader.get_tensor(key("f16")).tolist() == [1.5, -2.25, 65504.0]
    strings = reader.get_tensor(key("s"))
    assert strings.dtype == object and strings.shape == (3,)
    assert strings.tolist() == [b"abc", b"", b"\x00\xffxyz" * 50]
    assert reader.get_tensor(key("s2")).tolist() == [[b"a", b"bc"], [b"def", b"ghij"]]
    scalar = reader.get_tensor(key("s0"))
    assert scalar.shape == () and scalar.item() == b"a scalar string"
    assert reader.get_tensor(key("scalar")).shape == ()
    assert reader.get_tensor(key("empty")).shape == (0, 3)
    value = reader.get_tensor(key("f32"))
    value[0, 0] = 1.0  # writable
    assert reader.entry(key("f32"))["size"] == 512 * 512 * 4


def test_sliced_tensors(artifacts):
    if "sharded" not in artifacts:
        pytest.skip("this TensorFlow has no MaxShardSizePolicy")
    reader = BundleReader(artifacts["sharded"])
    assert reader.num_shards > 1
    key = "m/.ATTRIBUTES/VARIABLE_VALUE"
    slices = reader.entry(key)["slices"]
    assert len(slices) > 1 and all(len(extents) == 2 for extents in slices)
    np.testing.assert_array_equal(
        reader.get_tensor(key), np.arange(300, dtype="float32").reshape(20, 15)
    )
    assert not any(k.startswith("\x00") for k in reader.keys())
    # TF's own CheckpointReader cannot read sliced string tensors; we can.
    reader = BundleReader(artifacts["sharded_strings"])
    key = "s/.ATTRIBUTES/VARIABLE_VALUE"
    assert len(reader.entry(key)["slices"]) > 1
    assert reader.get_tensor(key).tolist() == [b"x" * 300, b"y" * 900, b"z"]


def test_slice_key_encoding():
    # tensorflow/core/util/saved_tensor_slice_util.cc EncodeTensorNameSlice
    # with OrderedCode, as measured on checkpoints TF wrote.
    assert bundle._slice_key("v/s", [0], [1]) == b"\x00v/s\x00\x01\x01\x01\x80\x81"
    assert bundle._slice_key("v", [75], [13]) == b"\x00v\x00\x01\x01\x01\xc0K\x8d"
    assert bundle._slice_key("a\x00\xff", [0], [-1]).startswith(b"\x00a\x00\xff\xc3\xbf\x00\x01")
    encode = bundle._signed_num_increasing
    assert [encode(v).hex() for v in (0, 1, -1, 63, 64, -64, -65, 8192)] == [
        "80", "81", "7f", "bf", "c040", "40", "3fbf", "e02000"
    ]
    values = [-(2**63), -(2**40), -65, -1, 0, 1, 64, 2**40, 2**62, 2**63 - 1]
    encoded = [encode(v) for v in values]
    assert encoded == sorted(encoded)  # order-preserving


def test_crc32c():
    assert bundle.crc32c(b"") == 0
    assert bundle.crc32c(b"123456789") == 0xE3069283
    assert bundle.crc32c(b"\x00" * 32) == 0x8A9136AA
    assert bundle.crc32c(b"9", bundle.crc32c(b"12345678")) == 0xE3069283
    rng = np.random.default_rng(1)
    for n in (1, 63, 64, 1000, 1 << 14, (1 << 14) + 1, 100_003):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        expected = bundle._raw_py(0xFFFFFFFF, data) ^ 0xFFFFFFFF
        assert bundle._crc32c_builtin(data) == expected, n
        head = bundle._crc32c_builtin(data[: n // 3])
        assert bundle._crc32c_builtin(data[n // 3 :], head) == expected
        assert bundle.crc32c(data) == expected
    for crc in (0, 1, 0xE3069283, 0xFFFFFFFF):
        assert bundle.unmask_crc(bundle.mask_crc(crc)) == crc


# ---------------------------------------------------------------------------
# Protobuf messages.


def _pb_refs(refs):
    return [(r.node_id, r.local_name) for r in refs]


def _pb_slots(slots):
    return [
        (s.original_variable_node_id, s.slot_name, s.slot_variable_node_id)
        for s in slots
    ]


def test_object_graph_matches_protobuf(artifacts, prefix_name):
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    tf_reader, _, _ = _tf_values(artifacts[prefix_name])
    data = tf_reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")
    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(data)
    expected = [
        {
            "children": _pb_refs(n.children),
            "attributes": [
                {"name": a.name, "full_name": a.full_name, "checkpoint_key": a.checkpoint_key}
                for a in n.attributes
            ],
            "slot_variables": _pb_slots(n.slot_variables),
        }
        for n in graph.nodes
    ]
    nodes = BundleReader(artifacts[prefix_name]).object_graph()
    assert nodes == expected
    assert wire.parse_trackable_object_graph(data) == expected
    if prefix_name.startswith("legacy"):
        assert any(n["slot_variables"] for n in nodes)
    if prefix_name.endswith("ckpt"):
        names = [name for _, name in nodes[0]["children"]]
        assert {"model", "optimizer", "save_counter"} <= set(names)


@pytest.mark.parametrize("name", ["new", "legacy"])
def test_saved_model_and_metadata_match_protobuf(artifacts, name):
    from tensorflow.core.protobuf import saved_model_pb2
    from tf_keras.protobuf import saved_metadata_pb2

    directory = artifacts[f"{name}_savedmodel_dir"]
    with open(os.path.join(directory, "saved_model.pb"), "rb") as f:
        data = f.read()
    graph = saved_model_pb2.SavedModel.FromString(data).meta_graphs[0].object_graph_def
    expected = []
    for n in graph.nodes:
        kind = n.WhichOneof("kind")
        variable = None
        if kind == "variable":
            v = n.variable
            variable = {
                "name": v.name,
                "dtype": v.dtype,
                "shape": None if v.shape.unknown_rank else tuple(d.size for d in v.shape.dim),
                "trainable": v.trainable,
                "synchronization": v.synchronization,
                "aggregation": v.aggregation,
                "device": v.device,
            }
        user = kind == "user_object"
        expected.append(
            {
                "children": _pb_refs(n.children),
                "slot_variables": _pb_slots(n.slot_variables),
                "kind": kind,
                "identifier": n.user_object.identifier if user else None,
                "metadata": n.user_object.metadata if user else None,
                "variable": variable,
            }
        )
    nodes = wire.parse_saved_model(data)
    assert nodes == expected
    optimizer = {name: i for i, name in nodes[0]["children"]}["optimizer"]
    assert nodes[optimizer]["identifier"] == (
        "experimentalOptimizer" if name == "new" else "optimizer"
    )
    # The variables/ checkpoint shares the SavedModel's node ids.
    ckpt_nodes = BundleReader(artifacts[f"{name}_savedmodel"]).object_graph()
    for node_id, node in enumerate(ckpt_nodes):
        if any(a["name"] == "VARIABLE_VALUE" for a in node["attributes"]):
            assert nodes[node_id]["kind"] == "variable"

    with open(os.path.join(directory, "keras_metadata.pb"), "rb") as f:
        metadata = f.read()
    expected_meta = [
        {
            "node_id": n.node_id,
            "node_path": n.node_path,
            "identifier": n.identifier,
            "metadata": n.metadata,
        }
        for n in saved_metadata_pb2.SavedMetadata.FromString(metadata).nodes
    ]
    parsed = wire.parse_saved_metadata(metadata)
    assert parsed == expected_meta
    root = next(n for n in parsed if n["node_path"] == "root")
    config = json.loads(root["metadata"])["training_config"]["optimizer_config"]
    assert config["config"]["name"] == "Adam"


def test_wire_fields():
    # field 1 varint 150, field 2 "testing", field 3 fixed64, field 4 fixed32
    data = (
        b"\x08\x96\x01"
        + b"\x12\x07testing"
        + b"\x19" + bytes(range(8))
        + b"\x25" + b"\x01\x02\x03\x04"
    )
    assert wire.fields(data) == [
        (1, 0, 150),
        (2, 2, b"testing"),
        (3, 1, bytes(range(8))),
        (4, 5, b"\x01\x02\x03\x04"),
    ]
    assert wire.fields(bytearray(b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")) == [
        (1, 0, 2**64 - 1)
    ]
    assert wire.fields(b"") == []
    bad = [
        b"\x08",  # truncated varint
        b"\x08\x96",  # truncated varint
        b"\x12\x07test",  # truncated length-delimited
        b"\x19\x00\x00",  # truncated fixed64
        b"\x25\x00",  # truncated fixed32
        b"\x0b",  # start group
        b"\x0c",  # end group
        b"\x0e",  # wire type 6
        b"\x00\x00",  # field number 0
        b"\x08" + b"\xff" * 10 + b"\x01",  # overlong varint
        b"\x08" + b"\xff" * 9 + b"\x02",  # overflows 64 bits
    ]
    for data in bad:
        with pytest.raises(LegacyFormatError):
            wire.fields(data)
    with pytest.raises(LegacyFormatError, match="some.pb"):
        wire.parse_saved_metadata(b"\x0a\x05\x10", path="some.pb")
    # A known field with the wrong wire type, invalid UTF-8.
    with pytest.raises(LegacyFormatError):
        wire.parse_trackable_object_graph(b"\x08\x01")
    with pytest.raises(LegacyFormatError):
        wire.parse_trackable_object_graph(b"\x0a\x04\x0a\x02\x12\xff")
    with pytest.raises(LegacyFormatError):
        wire.parse_saved_model(b"")
    assert wire.parse_trackable_object_graph(b"") == []


# ---------------------------------------------------------------------------
# Damaged input.


def _copy_checkpoint(prefix, directory):
    os.makedirs(directory, exist_ok=True)
    base = os.path.basename(prefix)
    for name in os.listdir(os.path.dirname(prefix)):
        if name.startswith(base + "."):
            shutil.copy(os.path.join(os.path.dirname(prefix), name), directory)
    return os.path.join(directory, base)


def _data_file(prefix):
    return prefix + ".data-00000-of-00001"


def test_damaged_index(artifacts, tmp_path):
    prefix = _copy_checkpoint(artifacts["legacy_ckpt"], tmp_path)
    index = prefix + ".index"
    with open(index, "rb") as f:
        original = f.read()

    def check(data, match=None):
        with open(index, "wb") as f:
            f.write(data)
        with pytest.raises(LegacyFormatError, match=match) as info:
            reader = BundleReader(prefix)
            for key in reader.keys():
                reader.get_tensor(key)
        assert os.path.basename(index) in str(info.value)
        assert info.value.path == index
        return info.value

    check(original[: len(original) // 2])  # truncated
    check(original[:-1])
    check(original[:20], "too short")
    check(original[:-8] + b"\x00" * 8, "magic")
    rng = np.random.default_rng(3)
    check(rng.integers(0, 256, 1000, dtype=np.uint8).tobytes())
    check(b"")
    flipped = bytearray(original)
    flipped[10] ^= 0x40
    check(bytes(flipped), "checksum")
    os.remove(index)
    with pytest.raises(LegacyFormatError, match="ckpt-1.index") as info:
        BundleReader(prefix)
    assert info.value.path == index


def test_damaged_data_shard(artifacts, tmp_path):
    prefix = _copy_checkpoint(artifacts["dtypes"], tmp_path)
    reader = BundleReader(prefix)
    key = "f32/.ATTRIBUTES/VARIABLE_VALUE"
    expected = reader.get_tensor(key).copy()
    entry = reader.entry(key)
    data_file = _data_file(prefix)
    with open(data_file, "r+b") as f:
        f.seek(entry["offset"] + 1234)
        byte = f.read(1)
        f.seek(entry["offset"] + 1234)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(LegacyFormatError, match="crc32c mismatch") as info:
        reader.get_tensor(key)
    assert data_file in str(info.value) and key in str(info.value)
    assert info.value.key == key and info.value.path == data_file
    # Without verification the flipped value comes back.
    changed = BundleReader(prefix, verify_checksums=False).get_tensor(key)
    assert (changed != expected).sum() == 1
    # A string tensor's lengths and bytes are checked too.
    skey = "s/.ATTRIBUTES/VARIABLE_VALUE"
    sentry = reader.entry(skey)
    with open(data_file, "r+b") as f:
        f.seek(sentry["offset"] + sentry["size"] - 1)
        f.write(b"!")
    with pytest.raises(LegacyFormatError, match="crc32c mismatch"):
        reader.get_tensor(skey)
    # Truncated shard: offsets beyond its end.
    with open(data_file, "r+b") as f:
        f.truncate(entry["offset"] + 10)
    with pytest.raises(LegacyFormatError, match="beyond the end") as info:
        reader.get_tensor(key)
    assert info.value.path == data_file
    # Missing shard.
    os.remove(data_file)
    reader = BundleReader(prefix)
    with pytest.raises(LegacyFormatError, match="data-00000-of-00001") as info:
        reader.get_tensor(key)
    assert info.value.key == key


def test_damaged_sliced_checkpoint(artifacts, tmp_path):
    if "sharded" not in artifacts:
        pytest.skip("this TensorFlow has no MaxShardSizePolicy")
    prefix = _copy_checkpoint(artifacts["sharded"], tmp_path)
    reader = BundleReader(prefix)
    key = "m/.ATTRIBUTES/VARIABLE_VALUE"
    shards = sorted(n for n in os.listdir(tmp_path) if ".data-" in n)
    assert len(shards) == reader.num_shards > 1
    os.remove(tmp_path / shards[-1])
    with pytest.raises(LegacyFormatError, match=shards[-1]) as info:
        for k in reader.keys():
            reader.get_tensor(k)
    assert info.value.path == str(tmp_path / shards[-1])


def test_missing_key_and_not_a_checkpoint(artifacts, tmp_path):
    reader = BundleReader(artifacts["tiny"])
    with pytest.raises(LegacyFormatError, match="no/such/key") as info:
        reader.get_tensor("no/such/key")
    assert info.value.key == "no/such/key"
    assert info.value.path.endswith(".index")
    with pytest.raises(LegacyFormatError):
        reader.shape("")
    assert "no/such/key" not in reader
    with pytest.raises(LegacyFormatError, match="directory"):
        BundleReader(tmp_path)
    with pytest.raises(LegacyFormatError, match="nothing.index"):
        BundleReader(tmp_path / "nothing")


# ---------------------------------------------------------------------------
# No TensorFlow.


def test_reads_without_tensorflow(artifacts):
    prefix = artifacts["legacy_savedmodel"]
    tf_reader, tf_dtypes, _ = _tf_values(prefix)
    expected = {
        key: _tf_digest(tf_reader.get_tensor(key), np.dtype(dt.as_numpy_dtype))
        for key, dt in tf_dtypes.items()
    }
    code = f"""
import hashlib, json, sys
sys.modules["tensorflow"] = None
sys.modules["tf_keras"] = None
import numpy as np
from keras_ema_opt.savedmodel.bundle import BundleReader
from keras_ema_opt.savedmodel import wire

def digest(value):
    if value.dtype == object:
        body = repr([bytes(v) for v in value.reshape(-1)]).encode()
    else:
        body = value.tobytes()
    return [str(value.dtype), list(value.shape), hashlib.sha256(body).hexdigest()]

reader = BundleReader({prefix!r})
out = {{key: digest(reader.get_tensor(key)) for key in reader.keys()}}
nodes = reader.object_graph()
saved_model = {os.path.join(artifacts["legacy_savedmodel_dir"], "saved_model.pb")!r}
wire.parse_saved_model(open(saved_model, "rb").read())
assert sys.modules["tensorflow"] is None
print(json.dumps({{"tensors": out, "nodes": len(nodes)}}))
"""
    got = last_json(run_python("-c", code, backend="jax", timeout=300))
    assert got["tensors"] == expected
    assert got["nodes"] == len(BundleReader(prefix).object_graph())


def test_modules_do_not_import_tensorflow():
    import keras_ema_opt.savedmodel.bundle as b
    import keras_ema_opt.savedmodel.wire as w

    for module in (b, w):
        with open(module.__file__) as f:
            source = f.read()
        assert "import tensorflow" not in source and "from tensorflow" not in source


# ---------------------------------------------------------------------------
# Fuzz: mutated inputs raise LegacyFormatError or succeed, nothing else.


def _mutations():
    from hypothesis import strategies as st

    position = st.integers(0, 1 << 20)
    one = st.one_of(
        st.tuples(st.just("flip"), position, st.integers(0, 7)),
        st.tuples(st.just("truncate"), position),
        st.tuples(st.just("insert"), position, st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("delete"), position, st.integers(1, 16)),
        st.tuples(st.just("set"), position, st.integers(0, 255)),
    )
    return st.lists(one, min_size=1, max_size=4)


def _mutate(data, mutations):
    data = bytearray(data)
    for mutation in mutations:
        op, pos = mutation[0], mutation[1] % (len(data) + 1)
        if op == "flip" and pos < len(data):
            data[pos] ^= 1 << mutation[2]
        elif op == "set" and pos < len(data):
            data[pos] = mutation[2]
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = mutation[2]
        elif op == "delete":
            del data[pos : pos + mutation[2]]
    return bytes(data)


def _fuzz_settings():
    hypothesis = pytest.importorskip("hypothesis")
    return hypothesis.settings(
        max_examples=200,
        deadline=2000,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )


def test_fuzz_index(artifacts, tmp_path):
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    checkpoints = {}  # prefix -> {file: original bytes}
    for which in ("tiny", "sharded"):
        if which not in artifacts:
            continue
        prefix = _copy_checkpoint(artifacts[which], tmp_path / which)
        checkpoints[prefix] = {}
        for name in os.listdir(tmp_path / which):
            if name.startswith(os.path.basename(prefix) + "."):
                with open(tmp_path / which / name, "rb") as f:
                    checkpoints[prefix][str(tmp_path / which / name)] = f.read()
    outcomes = {"ok": 0, "error": 0}

    @_fuzz_settings()
    @hypothesis.given(
        mutations=_mutations(),
        verify=st.booleans(),
        prefix=st.sampled_from(sorted(checkpoints)),
        target=st.integers(0, 7),
    )
    def run(mutations, verify, prefix, target):
        files = sorted(checkpoints[prefix])
        index = prefix + ".index"
        data_files = [f for f in files if f != index]
        # Mostly the index, sometimes a data shard.
        target = index if target < 5 else data_files[target % len(data_files)]
        for name, data in checkpoints[prefix].items():
            with open(name, "wb") as f:
                f.write(_mutate(data, mutations) if name == target else data)
        try:
            reader = BundleReader(prefix, verify_checksums=verify)
            for key in reader.keys():
                reader.shape(key)
                reader.dtype(key)
                reader.get_tensor(key)
            reader.object_graph()
            outcomes["ok"] += 1
        except LegacyFormatError as e:
            assert e.path is not None and e.path in str(e)
            outcomes["error"] += 1

    run()
    assert outcomes["error"] > 0


def test_fuzz_object_graph(artifacts):
    hypothesis = pytest.importorskip("hypothesis")

    original = BundleReader(artifacts["legacy_ckpt"]).get_tensor(
        "_CHECKPOINTABLE_OBJECT_GRAPH"
    ).item()
    with open(os.path.join(artifacts["legacy_savedmodel_dir"], "keras_metadata.pb"), "rb") as f:
        metadata = f.read()

    @_fuzz_settings()
    @hypothesis.given(mutations=_mutations())
    def run(mutations):
        for parse, data in (
            (wire.parse_trackable_object_graph, original),
            (wire.parse_saved_metadata, metadata),
            (wire.parse_saved_model, original),
        ):
            try:
                parse(_mutate(data, mutations))
            except LegacyFormatError:
                pass

    run()


@pytest.mark.parametrize("values", [
    np.array([b"the", b"", "caf\u00e9".encode(), b"\xff\xfe"], dtype=object),
    np.array([7, -1, 2**40], dtype=np.int64),
    np.array([3, -5], dtype=np.int32),
    np.array([b"same"] * 3, dtype=object),  # TF writes one value
    np.array([], dtype=np.int64),
])
def test_tensor_proto_reads_what_tensorflow_writes(values):
    """The constants a lookup table imports, as TensorFlow serializes
    them (strings, int64 and int32, in its packed and raw forms)."""
    import tensorflow as tf

    proto = tf.make_tensor_proto(values)
    got = wire.parse_tensor_proto(proto.SerializeToString())
    assert got.tolist() == values.tolist()
    if values.dtype.kind == "i" and len(values):
        # The raw form (`tensor_content`) of the same values.
        raw = tf.make_tensor_proto(tf.constant(values))
        raw.ClearField("int64_val")
        raw.ClearField("int_val")
        raw.tensor_content = values.astype(values.dtype.newbyteorder(
            "<")).tobytes()
        assert wire.parse_tensor_proto(
            raw.SerializeToString()).tolist() == values.tolist()


def test_fuzz_lookup_tables():
    """A damaged saved_model.pb with a lookup table: a LegacyFormatError,
    or tables read; never another exception."""
    hypothesis = pytest.importorskip("hypothesis")
    from conftest import ROOT
    from conftest import made_by_script

    folder = made_by_script(os.path.join(
        ROOT, "tests", "scripts", "make_lookup_artifacts.py"), [])
    originals = []
    # Tables of constants, and of files of the SavedModel's assets.
    for name, kinds in (("inverse", ["keys"]),
                        ("from_file", ["file", "file", "file"])):
        with open(os.path.join(folder, name, "saved_model.pb"), "rb") as f:
            originals.append(f.read())
        assert [next(k for k in ("keys", "file") if k in t)
                for t in wire.parse_lookup_tables(originals[-1])] == kinds

    @_fuzz_settings()
    @hypothesis.given(mutations=_mutations())
    def run(mutations):
        for original in originals:
            try:
                wire.parse_lookup_tables(_mutate(original, mutations))
            except LegacyFormatError:
                pass

    run()
