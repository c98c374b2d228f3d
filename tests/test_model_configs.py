"""Keras 2 model configs become Keras 3 models that compute the same.

Models over the layers whose config or weights changed between Keras 2 and
3 (``InputLayer``'s ``batch_input_shape``, convolutions, depthwise and
separable ones, BatchNormalization fused and not, recurrent layers with
masks, Bidirectional, TimeDistributed, MultiHeadAttention's tensor
arguments, nested models as outputs, dtype policies, ConvLSTM, Keras 2's
``hard_sigmoid`` and Attention's ``score_mode="dot"``) are made by real
tf_keras (``tests/scripts/make_layer_artifacts.py``, in a subprocess),
saved as ``.h5`` and SavedModel; migrated, each must predict what tf_keras
predicted, with every weight placed.
"""

import json
import os

import h5py
import keras
import numpy as np
import pytest

from keras_ema_opt.compat.model_configs import upgrade_model_config
from keras_ema_opt.errors import LegacyConfigError
from keras_ema_opt.savedmodel import load_legacy
from keras_ema_opt.savedmodel import model_from_config
from conftest import ROOT
from conftest import made_by_script
from conftest import only_on
from conftest import run_python
from conftest import to_numpy
import old_tf

pytest.importorskip("tf_keras")

SCRIPT = os.path.join(ROOT, "tests", "scripts", "make_layer_artifacts.py")
MODELS = ["batch_input_shape", "convolutions", "normalization", "recurrent",
          "attention", "nested_outputs", "mixed_precision",
          "changed_meanings"]
FORMATS = {"h5": "model.h5", "savedmodel": "savedmodel"}


@pytest.fixture(scope="session")
def layer_artifacts():
    return made_by_script(SCRIPT, MODELS)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", MODELS)
def test_migrated_model_predicts_like_tf_keras(layer_artifacts, name, fmt):
    folder = os.path.join(layer_artifacts, name)
    io = np.load(os.path.join(folder, "io.npz"))
    model = load_legacy(os.path.join(folder, FORMATS[fmt]))
    assert len(model.weights) == int(io["n_weights"])
    outputs = model.predict(io["x"], verbose=0)
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    expected = [io[k] for k in sorted(io.files) if k.startswith("y")]
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        np.testing.assert_allclose(to_numpy(got).astype("float32"), want,
                                   **_tolerance(name, want))


def _tolerance(name, want):
    """float32 models must agree to round-off. A bfloat16 model's layers
    round their activations to 8 significant bits, and how a backend's CPU
    kernels accumulate and round in bfloat16 differs between CPUs (native
    AVX512-BF16 or not): outputs may differ by a few bfloat16 units in the
    last place of the largest term, 2**-8 relative, so allow 2**-5 of the
    output's scale. Wrong or misplaced weights move outputs by about their
    whole scale."""
    if name != "mixed_precision":
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 2.0 ** -6, "atol": 2.0 ** -5 * float(np.abs(want).max())}


def test_changed_meanings_survive_a_keras3_save(layer_artifacts, tmp_path):
    """Keras 2's ``hard_sigmoid`` (slope 0.2; Keras 3's is 1/6) stays
    Keras 2's in the migrated model and in its ``.keras`` file, and
    ``score_mode`` stays the string ``"dot"``."""
    import keras

    folder = os.path.join(layer_artifacts, "changed_meanings")
    io = np.load(os.path.join(folder, "io.npz"))
    model = load_legacy(os.path.join(folder, "model.h5"))
    path = str(tmp_path / "model.keras")
    model.save(path)
    reloaded = keras.saving.load_model(path)
    np.testing.assert_allclose(
        to_numpy(reloaded.predict(io["x"], verbose=0)), io["y0"],
        rtol=1e-5, atol=1e-5)
    attention = next(layer for layer in reloaded.layers
                     if type(layer).__name__ == "Attention")
    assert attention.score_mode == "dot"
    x = np.array([-3.0, -1.0, 0.0, 1.0, 3.0], "float32")
    np.testing.assert_allclose(
        to_numpy(reloaded.layers[2].activation(x)),
        np.clip(0.2 * x + 0.5, 0.0, 1.0), rtol=1e-6)


def test_dtype_policy_comes_through(layer_artifacts):
    model = load_legacy(os.path.join(layer_artifacts, "mixed_precision",
                                     "model.h5"))
    policies = [layer.dtype_policy.name for layer in model.layers[1:]]
    assert policies == ["mixed_bfloat16", "mixed_bfloat16", "float32"]
    assert model.layers[1].kernel.dtype == "float32"


def _config(layer_artifacts, name):
    with h5py.File(os.path.join(layer_artifacts, name, "model.h5"),
                   "r") as f:
        return json.loads(f.attrs["model_config"])


def _layer(config, class_name):
    return next(layer for layer in config["config"]["layers"]
                if layer["class_name"] == class_name)


@pytest.mark.parametrize("class_name,key,value,text", [
    ("LSTM", "time_major", True, "'lstm' (LSTM) has time_major=True"),
    ("BatchNormalization", "virtual_batch_size", 4,
     "has virtual_batch_size=4"),
])
def test_removed_argument_that_matters_is_refused(layer_artifacts, class_name,
                                                  key, value, text):
    model = "recurrent" if class_name == "LSTM" else "normalization"
    config = _config(layer_artifacts, model)
    _layer(config, class_name)["config"][key] = value
    with pytest.raises(LegacyConfigError, match=text.replace("(", r"\(")
                       .replace(")", r"\)")):
        model_from_config(config)


def test_removed_arguments_with_no_effect_are_dropped(layer_artifacts):
    """``fused``, ``virtual_batch_size=None`` and ``adjustment=None``, as
    Keras 2 versions wrote them, are dropped; the model still builds.
    ``renorm`` and its companions, which the installed Keras takes (3.15),
    are kept as they were: ``renorm_momentum`` was dropped, and a
    renormalizing layer would have run with Keras' default."""
    config = _config(layer_artifacts, "normalization")
    removed = {"fused": True, "virtual_batch_size": None,
               "adjustment": None}
    kept = {"renorm": True, "renorm_clipping": {"rmax": 2.0},
            "renorm_momentum": 0.5}
    _layer(config, "BatchNormalization")["config"].update(
        {**removed, **kept})
    upgraded = _layer(upgrade_model_config(config),
                      "BatchNormalization")["config"]
    assert not set(removed) & set(upgraded)
    assert {key: upgraded[key] for key in kept} == kept
    assert _layer(config, "BatchNormalization")["config"]["fused"] is True
    model = model_from_config(config)
    bn = next(layer for layer in model.layers
              if isinstance(layer, keras.layers.BatchNormalization))
    assert bn.renorm and bn.renorm_momentum == 0.5


def test_tensor_call_arguments_become_keras3_references(layer_artifacts):
    config = _config(layer_artifacts, "attention")
    mha = _layer(config, "MultiHeadAttention")
    ((entry,),) = mha["inbound_nodes"]
    assert entry[3]["value"][0] == entry[0]  # Keras 2: [layer, node, tensor]
    (node,) = _layer(upgrade_model_config(config),
                     "MultiHeadAttention")["inbound_nodes"]
    value = node["kwargs"]["value"]
    assert value["class_name"] == "__keras_tensor__"
    assert value["config"]["keras_history"] == entry[3]["value"][:3]
    assert node["args"][0]["config"]["keras_history"] == entry[:3]


def test_damaged_nested_node_reference_is_named(layer_artifacts):
    config = _config(layer_artifacts, "nested_outputs")
    config = json.loads(json.dumps(config).replace('["sub", 1, 0', '["sub", 0, 0'))
    with pytest.raises(LegacyConfigError, match="nested model 'sub'"):
        upgrade_model_config(config)


TEXT_MODEL = r"""
import json, os, sys
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import numpy as np
import tf_keras as k2

corpus = np.array(["the cat sat", "the dog ran far", "a cat ran"])
tv = k2.layers.TextVectorization(max_tokens=20, output_sequence_length=4,
                                 name="tv")
tv.adapt(corpus)
inputs = k2.Input((1,), dtype="string")
x = k2.layers.Embedding(20, 3, name="emb")(tv(inputs))
net = k2.Model(inputs, k2.layers.Dense(1, name="out")(
    k2.layers.GlobalAveragePooling1D()(x)))
net.compile(optimizer="adam", loss="mse")
net.save(os.path.join(sys.argv[1], "model.keras"))
print(json.dumps({"vocabulary": tv.get_vocabulary(),
                  "ids": tv(np.array([["the cat sat"]])).numpy().tolist()}))
"""


def test_adapted_vocabulary_of_a_tf_keras_keras_file_migrates(tmp_path):
    """A tf_keras `.keras` file keeps an adapted `TextVectorization`'s
    vocabulary in its assets: the layer built from the config had none
    (every token out of vocabulary), without a word. Its assets now load
    where Keras 3's loader puts them, and the written file's check
    compares the vocabularies and, where the backend feeds a model
    strings (TensorFlow), runs the model on an empty string."""
    from keras_ema_opt.savedmodel import migrate

    theirs = json.loads(run_python("-c", TEXT_MODEL, str(tmp_path))
                        .stdout.strip().splitlines()[-1])
    out = str(tmp_path / "new.keras")
    with pytest.warns(UserWarning, match="optimizer state is not migrated"):
        migrate(str(tmp_path / "model.keras"), out)
    layer = keras.saving.load_model(out).get_layer("tv")
    assert [str(t) for t in layer.get_vocabulary()] == theirs["vocabulary"]
    np.testing.assert_array_equal(
        to_numpy(layer(np.array([["the cat sat"]]))), theirs["ids"])


LOOKUP_SCRIPT = os.path.join(ROOT, "tests", "scripts",
                             "make_lookup_artifacts.py")


@pytest.fixture(scope="module")
def lookup_artifacts():
    folder = made_by_script(LOOKUP_SCRIPT, [])
    with open(os.path.join(folder, "oracle.json")) as f:
        return folder, json.load(f)


def _entries(values):
    return [t.decode() if isinstance(t, bytes) else
            int(t) if isinstance(t, np.integer) else
            t if isinstance(t, int) else str(t) for t in values]


def _assert_lookups_like(model, oracle, layers):
    """Each of ``layers`` (``{name: input key}``) holds the oracle's
    vocabulary and gives its output on the oracle's inputs."""
    for name, key in layers.items():
        layer = model.get_layer(name)
        assert _entries(layer.get_vocabulary()) == oracle[name][
            "vocabulary"], name
        np.testing.assert_allclose(
            to_numpy(layer(np.array(oracle["inputs"][key]))),
            oracle[name]["output"], rtol=1e-6, err_msg=name)


# Keras 2 releases whose SavedModels of the same layers are made in the
# run beside tf_keras' (``tests/old_tf.py``).
OLD_LOOKUPS = sorted(old_tf.RELEASES)


@pytest.mark.parametrize("source", ["tf_keras", *OLD_LOOKUPS])
def test_adapted_vocabularies_of_a_savedmodel_migrate(lookup_artifacts,
                                                      tmp_path, source):
    """An adapted `TextVectorization` / `StringLookup` / `IntegerLookup`
    keeps its vocabulary in a lookup table of the SavedModel's graph,
    which was refused (before that, lost without a word: every token out
    of vocabulary). The tables are read from `saved_model.pb` and each
    token keeps its Keras 2 index, the special tokens, a `"tf_idf"`
    layer's idf weights and an inverted layer included: the vocabularies
    and the layers' outputs equal those of the Keras 2 that wrote them
    (tf_keras here, or tf.keras 2.12 and Keras 2.15), and on TensorFlow,
    which feeds a model strings, so does the model's prediction."""
    from keras_ema_opt.savedmodel import inspect
    from keras_ema_opt.savedmodel import migrate

    folder, oracle = lookup_artifacts
    if source in OLD_LOOKUPS:
        folder = old_tf.lookups(source)
        with open(os.path.join(folder, "TENSORFLOW_VERSION")) as f:
            assert f.read().strip() == old_tf.RELEASES[source]
        with open(os.path.join(folder, "oracle.json")) as f:
            oracle = json.load(f)
    record = inspect(os.path.join(folder, "lookups"))
    assert record.summary()["vocabularies"] == {
        "tokens": 8, "tf_idf": 8, "words": 3, "numbers": 4}
    # The idf weights go with the table, not among the weights to place.
    assert not [k for k in record.weights if "idf" in k or "documents" in k]
    out = str(tmp_path / "new.keras")
    migrate(os.path.join(folder, "lookups"), out)
    model = keras.saving.load_model(out)
    assert int(model.optimizer.iterations) == 1
    _assert_lookups_like(model, oracle, {
        "tokens": "text", "tf_idf": "document", "words": "word",
        "numbers": "number"})
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        feed = [tf.constant(oracle["inputs"]["text"]),
                tf.constant(oracle["inputs"]["word"]),
                tf.constant(oracle["inputs"]["number"], tf.int64),
                tf.constant(oracle["inputs"]["document"])]
        np.testing.assert_allclose(model.predict(feed, verbose=0),
                                   oracle["prediction"], rtol=1e-6)

    out = str(tmp_path / "inverse.keras")
    with pytest.warns(UserWarning, match="not compiled"):
        migrate(os.path.join(folder, "inverse"), out)
    layer = keras.saving.load_model(out).get_layer("inverse")
    assert _entries(layer.get_vocabulary()) == oracle["inverse"][
        "vocabulary"]
    if keras.backend.backend() == "tensorflow":
        # (Its tokens are strings, which only TensorFlow's tensors hold.)
        got = np.asarray(layer(np.array(oracle["inputs"]["index"])))
        assert [_entries(row) for row in got.tolist()] == oracle[
            "inverse"]["output"]


def test_adapted_lookups_of_a_tf_keras_keras_file_migrate(lookup_artifacts,
                                                          tmp_path):
    """A tf_keras `.keras` file of an adapted `StringLookup` and
    `IntegerLookup`: Keras 3 could not build their tf_keras configs
    (`vocabulary_size`, `has_input_vocabulary`, `batch_input_shape`), so
    the model had to be given. Built now, their vocabularies come from the
    file's assets. A `"tf_idf"` layer, whose weights Keras 3 cannot lay
    out before it has a vocabulary, is a typed error naming it (it was an
    AttributeError from Keras), and migrates into a model given with the
    layer given a vocabulary of that size, which the file's replaces. A
    layer built with a vocabulary, which Keras' loader keeps over the
    file's, is named (it kept its own without a word)."""
    from keras_ema_opt.errors import LegacyConfigError
    from keras_ema_opt.errors import LegacyStateError
    from keras_ema_opt.savedmodel import migrate

    folder, oracle = lookup_artifacts
    out = str(tmp_path / "words.keras")
    with pytest.warns(UserWarning, match="not compiled"):
        migrate(os.path.join(folder, "words.keras"), out)
    model = keras.saving.load_model(out)
    _assert_lookups_like(model, oracle, {"words": "word",
                                         "numbers": "number"})
    path = os.path.join(folder, "lookups.keras")
    with pytest.raises(LegacyConfigError, match=r"the 'tf_idf' lookup "
                       r"layers \['tf_idf'\] before they have a "
                       "vocabulary"):
        load_legacy(path)

    def given(vocabulary=None):
        L = keras.layers
        tokens = L.TextVectorization(max_tokens=20, output_sequence_length=5,
                                     name="tokens", vocabulary=vocabulary)
        tf_idf = L.TextVectorization(max_tokens=12, output_mode="tf_idf",
                                     name="tf_idf")
        size = len(oracle["tf_idf"]["vocabulary"]) - 1
        tf_idf.set_vocabulary([f"t{i}" for i in range(size)],
                              idf_weights=np.ones(size))
        words = L.StringLookup(mask_token="<m>", num_oov_indices=2,
                               name="words")
        numbers = L.IntegerLookup(name="numbers")
        text = keras.Input((1,), dtype="string")
        word = keras.Input((1,), dtype="string")
        number = keras.Input((1,), dtype="int64")
        document = keras.Input((), dtype="string")
        x = L.Concatenate()([
            L.GlobalAveragePooling1D()(L.Embedding(20, 3)(tokens(text))),
            tf_idf(document),
            L.Flatten()(L.Embedding(8, 2)(words(word))),
            L.Flatten()(L.Embedding(6, 2)(numbers(number)))])
        return keras.Model([text, word, number, document],
                           L.Dense(1, name="out")(x))

    # Its vocabulary and idf weights come from the file's assets and
    # weights, in place of those it was given.
    model = load_legacy(path, model=given)
    _assert_lookups_like(model, oracle, {"tokens": "text",
                                         "tf_idf": "document"})
    # A layer built with a vocabulary keeps it when Keras loads assets:
    # named, where before it kept its own without a word.
    with pytest.raises(LegacyStateError, match="its asset layers/"
                       "text_vectorization/_lookup_layer/vocabulary.txt did "
                       "not go into the Keras 3 model"):
        load_legacy(path, model=lambda: given(vocabulary=[
            str(t) for t in oracle["tokens"]["vocabulary"][2:]]))


BLOCKED_LOOKUPS = r"""
import sys
sys.modules["tensorflow"] = None  # blocked: any import of it fails
from keras_ema_opt.errors import LegacyConfigError
from keras_ema_opt.savedmodel import load_legacy
try:
    load_legacy(sys.argv[1])
except LegacyConfigError as e:
    print("refused:", e)
"""


@only_on("torch")  # the checks are the same on every backend
def test_adapted_vocabularies_that_do_not_fit_are_refused(lookup_artifacts,
                                                          tmp_path):
    """Where a table's tokens cannot keep their Keras 2 indices, or cannot
    be placed by name, or the written file does not load, a typed error
    says so, and nothing is written."""
    import warnings

    from keras_ema_opt.errors import LegacyStateError
    from keras_ema_opt.savedmodel import migrate

    folder, oracle = lookup_artifacts
    with pytest.raises(LegacyConfigError, match="two lookup layers are "
                       "named 'lookup'"):
        load_legacy(os.path.join(folder, "same_names"))

    def inverse(**kwargs):
        index = keras.Input((1,), dtype="int64")
        return keras.Model(index, keras.layers.StringLookup(
            invert=True, name="inverse", **kwargs)(index))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not compiled, no optimizer
        # Another vocabulary: the file's replaces it, as weights do.
        model = load_legacy(os.path.join(folder, "inverse"),
                            model=inverse(vocabulary=["p", "q"]))
        assert _entries(model.get_layer("inverse").get_vocabulary()) == (
            oracle["inverse"]["vocabulary"])
        # Two out-of-vocabulary indices where Keras 2 had one: every token
        # would move by one.
        with pytest.raises(LegacyConfigError, match="Keras 2 gave 'y' "
                           "index 1, the Keras 3 layer gives that index "
                           "'\\[UNK\\]'"):
            load_legacy(os.path.join(folder, "inverse"),
                        model=inverse(num_oov_indices=2))

    # Keras 3.15 writes a padded "tf_idf" layer's idf weights at their
    # padded length, and refuses them when it loads the file: Keras' own
    # round trip is the oracle of what migrate must do.
    padded = keras.layers.TextVectorization(
        max_tokens=12, output_mode="tf_idf", pad_to_max_tokens=True)
    padded.adapt(np.array(["the cat sat", "the end"]))
    inputs = keras.Input((), dtype="string")
    own = str(tmp_path / "own.keras")
    keras.Model(inputs, padded(inputs)).save(own)
    try:
        keras.saving.load_model(own)
        keras_loads = True
    except ValueError:
        keras_loads = False
    out = tmp_path / "padded.keras"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not compiled, no optimizer
        if keras_loads:
            migrate(os.path.join(folder, "padded"), str(out))
            assert _entries(keras.saving.load_model(str(out)).get_layer(
                "padded").get_vocabulary()) == oracle["padded"]["vocabulary"]
        else:
            with pytest.raises(LegacyStateError, match="Keras 3 cannot "
                               "load the .keras file it wrote"):
                migrate(os.path.join(folder, "padded"), str(out))
            assert not os.path.exists(out)

    # Keras 3's lookup layers run on TensorFlow whatever the backend.
    proc = run_python("-c", BLOCKED_LOOKUPS,
                      os.path.join(folder, "lookups"), backend="jax")
    assert "refused:" in proc.stdout and "without a package it needs" in (
        proc.stdout), proc.stdout


@only_on("torch")  # the checks are the same on every backend
def test_lookup_tables_read_around_what_is_not_theirs(lookup_artifacts,
                                                      tmp_path):
    """From review: a user's table of floats beside an adapted layer made
    the SavedModel unreadable (its constants were parsed too); a layer of
    the file named as Keras 3 names a `TextVectorization`'s inner lookup
    layer (`string_lookup`) was refused as a second layer of that name; a
    table whose layer the model given does not have was dropped without a
    word (the layer had no vocabulary); a token with a `\\r` lost it in a
    `.keras` file, without a word (Keras 3 reads vocabulary files by
    lines, as the write-back check did). Vocabularies read from files
    when the layers were built migrate from the SavedModel's assets/ (they
    were refused, said to be adapted). An asset named out of its folder
    (`../`) is a LegacyFormatError."""
    import warnings

    from keras_ema_opt.errors import LegacyStateError
    from keras_ema_opt.savedmodel import inspect
    from keras_ema_opt.savedmodel import migrate

    folder, oracle = lookup_artifacts
    assert set(inspect(os.path.join(folder, "float_table")).vocabularies) \
        == {"words"}
    with pytest.warns(UserWarning, match="not compiled"):
        model = load_legacy(os.path.join(folder, "default_names"))
    for name, vocabulary in oracle["default_names"].items():
        assert _entries(model.get_layer(name).get_vocabulary()) == (
            vocabulary), name

    index = keras.Input((1,), dtype="int64")
    with pytest.raises(LegacyConfigError, match="the vocabulary of its "
                       "lookup layer 'inverse' .3 entries. has no layer of "
                       r"that name in the Keras 3 model, whose lookup layers "
                       r"\['renamed'\] have no vocabulary of the file"):
        load_legacy(os.path.join(folder, "inverse"), model=keras.Model(
            index, keras.layers.StringLookup(invert=True, name="renamed")(
                index)))
    # A model given without its preprocessing layers: said, not refused.
    with pytest.warns(UserWarning, match="lookup layer 'inverse' .3 "
                      "entries. has no layer of that name in the Keras 3 "
                      "model, and no lookup layer there lacks a "
                      "vocabulary: it is not migrated"):
        load_legacy(os.path.join(folder, "inverse"),
                    model=keras.Model(index, keras.layers.Identity()(index)))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not compiled, no optimizer
        for path, error, match in (
                ("carriage", LegacyConfigError,
                 r"entry 'cat\\r' at index 1 holds a line break"),
                ("carriage.keras", LegacyStateError,
                 r"entry 1 is b'cat\\r' in the file, b'cat' in the model")):
            out = tmp_path / "out.keras"
            with pytest.raises(error, match=match):
                migrate(os.path.join(folder, path), str(out))
            assert not out.exists()
        # Vocabularies read from files when the layers were built: the
        # SavedModel keeps the files in its assets/, whence they migrate
        # (they were refused; an inverted layer and integers included).
        model = load_legacy(os.path.join(folder, "from_file"))
        for name, vocabulary in oracle["from_file"].items():
            assert _entries(model.get_layer(name).get_vocabulary()) == (
                vocabulary), name
        import shutil

        from keras_ema_opt.errors import LegacyFormatError

        damaged = str(tmp_path / "from_file")
        shutil.copytree(os.path.join(folder, "from_file"), damaged)
        os.remove(os.path.join(damaged, "assets", "numbers.txt"))
        with pytest.raises(LegacyFormatError, match="the vocabulary of "
                           "layer 'numbers_from_file', its asset "
                           "'numbers.txt', cannot be read"):
            load_legacy(damaged)
        # An asset named out of its folder: the file's fault, named.
        import zipfile

        crafted = str(tmp_path / "crafted.keras")
        with zipfile.ZipFile(os.path.join(folder, "words.keras")) as a, \
                zipfile.ZipFile(crafted, "w") as b:
            for name in a.namelist():
                b.writestr(name, a.read(name))
            b.writestr("assets/../outside.txt", b"x\n")
        with pytest.raises(LegacyFormatError, match="its asset "
                           "'assets/../outside.txt' names a place outside"):
            load_legacy(crafted)


@only_on("tensorflow")  # where the forward pass of this model fails
def test_a_forward_pass_that_fails_is_a_typed_error(lookup_artifacts,
                                                    tmp_path):
    """tf_keras builds a `Sequential` whose first layer is a `StringLookup`
    for an int64 input, and so does Keras 3: its forward pass on zeros
    fails in TensorFlow's graph. That was TensorFlow's own error out of
    `migrate`; now a `LegacyStateError`, and nothing is written."""
    import warnings

    from keras_ema_opt.errors import LegacyStateError
    from keras_ema_opt.savedmodel import migrate

    folder, _ = lookup_artifacts
    out = tmp_path / "out.keras"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not compiled, no optimizer
        with pytest.raises(LegacyStateError, match="fails its forward "
                           "pass on zeros"):
            migrate(os.path.join(folder, "first_in_sequential"), str(out))
    assert not out.exists()


@only_on("torch")  # the checks are the same on every backend
def test_vocabularies_keras_3_cannot_hold_are_named(lookup_artifacts,
                                                    tmp_path):
    """From the second review: a nested model's file vocabulary was read
    from the path its config keeps (refused in safe mode, with advice to
    turn it off), where the SavedModel's assets/ holds it; an empty token
    last was refused for a table "not found"; a file holding the
    out-of-vocabulary token, bytes that are no text, a vocabulary past
    `max_tokens` and a layer of another class were refused for reasons
    that were not theirs, or not at all (a `TextVectorization` given for
    a `StringLookup` took its vocabulary). Each is named now."""
    import warnings

    from keras_ema_opt.errors import LegacyStateError

    folder, oracle = lookup_artifacts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not compiled, no optimizer
        model = load_legacy(os.path.join(folder, "nested_file"))
        layer = next(layer for layer in model._flatten_layers()
                     if layer.name == "nested_file")
        assert _entries(layer.get_vocabulary()) == oracle["nested_file"]
        for path, match in (
                ("empty_last", "entry '' at index 3 is empty and last"),
                ("special_top", r"vocabulary starts with the entries "
                                r"\['\[UNK\]'\], which Keras 3 takes for "
                                "the layer's own"),
                ("not_utf8", r"entry b'\\xff\\xfe' at index 2 is not UTF-8 "
                             "text"),
                ("past_max_tokens", "Build the layer with a max_tokens of "
                                    "at least 5")):
            with pytest.raises(LegacyConfigError, match=match):
                load_legacy(os.path.join(folder, path))
        with pytest.raises(LegacyStateError, match="entry 3 is b'' in the "
                           "file, past the end in the model"):
            load_legacy(os.path.join(folder, "empty_last.keras"))
        # From the third review: the out-of-vocabulary token as an entry
        # of a list (no special token there) was refused as one.
        model = load_legacy(os.path.join(folder, "unk_entries"))
        for name, vocabulary in oracle["unk_entries"].items():
            assert _entries(model.get_layer(name).get_vocabulary()) == (
                vocabulary), name
        index = keras.Input((1,), dtype="int64")

        class OnlySets(keras.layers.Layer):  # a user's, no get_vocabulary
            def set_vocabulary(self, vocabulary):
                pass

            def call(self, x):
                return x

        # A user's layer with set_vocabulary only, beside the file's: its
        # vocabulary was asked for (AttributeError).
        model = load_legacy(os.path.join(folder, "inverse"), model=keras.Model(
            index, [keras.layers.StringLookup(invert=True, name="inverse")(
                index), OnlySets(name="own")(index)]))
        assert _entries(model.get_layer("inverse").get_vocabulary()) == (
            oracle["inverse"]["vocabulary"])
        with pytest.raises(LegacyConfigError, match="the file's layer of "
                           "that name is a StringLookup"):
            load_legacy(os.path.join(folder, "inverse"), model=keras.Model(
                index, keras.layers.IntegerLookup(invert=True,
                                                  name="inverse")(index)))
