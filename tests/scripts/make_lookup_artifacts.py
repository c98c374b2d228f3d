"""Keras 2 models with adapted lookup layers, saved by real tf_keras as
SavedModels, with tf_keras' own vocabularies and outputs (the oracle of
``tests/test_model_configs.py``). An adapted layer keeps its vocabulary
in a lookup table of the SavedModel's graph, not in a variable.

Usage: make_lookup_artifacts.py OUT_DIR. Writes OUT_DIR/
- ``lookups/``: a compiled, once-trained model over an int
  ``TextVectorization``, a ``"tf_idf"`` one, a ``StringLookup`` with a
  mask token and two out-of-vocabulary indices, and an ``IntegerLookup``;
- but with tf.keras 2.12, ``lookups.keras`` (the ``.keras`` format, which
  keeps the vocabularies in its assets), and ``words.keras``, the same
  without its text layers;
- ``padded/``: a ``"tf_idf"`` ``TextVectorization`` padded to its
  ``max_tokens`` alone;
- ``inverse/``: an adapted ``StringLookup(invert=True)`` alone;
- ``same_names/``: two nested models, each with a ``StringLookup`` named
  ``"lookup"``;
- the models ``_odd_cases`` names;
- ``oracle.json``: each layer's vocabulary and its output on ``INPUTS``,
  and the first model's prediction.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
try:
    import tf_keras as k2  # noqa: E402
except ImportError:  # TensorFlow 2.15 and before: tf.keras is Keras 2
    k2 = tf.keras

L = k2.layers
CORPUS = np.array(["the cat sat", "the dog ran far", "a cat ran",
                   "the end"])
WORDS = np.array(["y", "z", "y", "x", "y", "z"])
NUMBERS = np.array([7, 9, 9, 5, 9, 7, 11])
INPUTS = {"text": [["the cat sat far"], ["a dog"], [""]],
          "document": ["the cat sat far", "a dog", ""],
          "word": [["y"], ["q"], ["x"]],
          "number": [[9], [5], [4]],
          "index": [[0], [1], [2], [3], [4]]}


def _vocabulary(layer):
    return [t.decode() if isinstance(t, bytes) else
            int(t) if isinstance(t, np.integer) else str(t)
            for t in layer.get_vocabulary()]


def _plain(x):
    x = np.asarray(x)
    return [[t.decode() for t in row] for row in x.tolist()] \
        if x.dtype.kind in "OSU" else x.tolist()


def make(out):
    tokens = L.TextVectorization(max_tokens=20, output_sequence_length=5,
                                 name="tokens")
    tokens.adapt(CORPUS)
    tf_idf = L.TextVectorization(max_tokens=12, output_mode="tf_idf",
                                 name="tf_idf")
    tf_idf.adapt(CORPUS)
    words = L.StringLookup(mask_token="<m>", num_oov_indices=2,
                           name="words")
    words.adapt(WORDS)
    numbers = L.IntegerLookup(name="numbers")
    numbers.adapt(NUMBERS)
    text = k2.Input((1,), dtype="string", name="text")
    word = k2.Input((1,), dtype="string", name="word")
    number = k2.Input((1,), dtype="int64", name="number")
    document = k2.Input((), dtype="string", name="document")
    x = L.Concatenate()([
        L.GlobalAveragePooling1D()(L.Embedding(20, 3)(tokens(text))),
        tf_idf(document),
        L.Flatten()(L.Embedding(8, 2)(words(word))),
        L.Flatten()(L.Embedding(6, 2)(numbers(number)))])
    net = k2.Model([text, word, number, document],
                   L.Dense(1, name="out")(x))
    net.compile(optimizer=k2.optimizers.Adam(0.01), loss="mse")
    feed = [np.array(INPUTS[k])
            for k in ("text", "word", "number", "document")]
    net.train_on_batch(feed, np.ones((3, 1), "float32"))
    net.save(os.path.join(out, "lookups"), save_format="tf")
    # `.keras` files (tf.keras 2.12 writes none of these layers).
    if not tf.__version__.startswith("2.12."):
        net.save(os.path.join(out, "lookups.keras"))
        # The same without its "tf_idf" layer, which Keras 3 cannot lay
        # out before it has a vocabulary.
        k2.Model([word, number], L.Dense(1, name="out")(L.Concatenate()([
            L.Flatten()(L.Embedding(8, 2)(words(word))),
            L.Flatten()(L.Embedding(6, 2)(numbers(number)))]))).save(
                os.path.join(out, "words.keras"))

    padded = L.TextVectorization(max_tokens=12, output_mode="tf_idf",
                                 pad_to_max_tokens=True, name="padded")
    padded.adapt(CORPUS)
    inputs = k2.Input((), dtype="string")
    k2.Model(inputs, padded(inputs)).save(os.path.join(out, "padded"),
                                          save_format="tf")

    inverse = L.StringLookup(invert=True, name="inverse")
    inverse.adapt(WORDS)
    index = k2.Input((1,), dtype="int64")
    k2.Model(index, inverse(index)).save(os.path.join(out, "inverse"),
                                         save_format="tf")

    def nested(name):
        lookup = L.StringLookup(name="lookup")
        lookup.adapt(WORDS)
        inputs = k2.Input((1,), dtype="string")
        return k2.Model(inputs, lookup(inputs), name=name)

    inputs = k2.Input((1,), dtype="string")
    k2.Model(inputs, L.Concatenate()([nested("a")(inputs),
                                      nested("b")(inputs)])).save(
        os.path.join(out, "same_names"), save_format="tf")

    odd = _odd_cases(out)

    layers = {"tokens": (tokens, "text"), "tf_idf": (tf_idf, "document"),
              "padded": (padded, "document"),
              "words": (words, "word"), "numbers": (numbers, "number"),
              "inverse": (inverse, "index")}
    oracle = {
        name: {"vocabulary": _vocabulary(layer),
               "output": _plain(layer(np.array(INPUTS[key])))}
        for name, (layer, key) in layers.items()}
    oracle["prediction"] = net.predict(feed, verbose=0).tolist()
    oracle.update(odd)
    oracle["inputs"] = INPUTS
    with open(os.path.join(out, "oracle.json"), "w") as f:
        json.dump(oracle, f)


class Scores(L.Layer):
    """A layer of the user's holding a table of floats."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(["y", "z"]), tf.constant([0.5, 2.0])), -1.0)

    def call(self, x):
        return self.table.lookup(x)


def _odd_cases(out):
    """Models the bridge must refuse or read around, each a SavedModel:
    ``carriage`` (a token with a ``\\r``: Keras 3 reads vocabularies by
    lines; with tf_keras, also a ``.keras`` file), ``default_names`` (a
    ``StringLookup`` named ``string_lookup``, as Keras 3 names a
    ``TextVectorization``'s inner one), ``float_table`` (an adapted
    ``StringLookup`` beside a user's layer holding a table of floats),
    ``from_file`` (vocabularies read from files when the layers were
    built, which the SavedModel keeps in its ``assets/``; ``nested_file``
    in a nested model, whose config keeps the file's path),
    ``unk_entries`` (the out-of-vocabulary token as an entry of a list,
    which is no special token there), ``empty_last`` (an empty token last, which Keras 3's vocabulary file
    drops; with tf_keras, also a ``.keras`` file), ``special_top`` (a
    vocabulary file that holds the out-of-vocabulary token), ``not_utf8``
    (bytes that are no text), ``past_max_tokens`` (a vocabulary file
    longer than ``max_tokens``, which tf_keras took), ``first_in_sequential`` (a ``Sequential`` whose first layer is
    a ``StringLookup``, which tf_keras builds for an int64 input).
    Returns the vocabularies of ``default_names``' and ``from_file``'s
    layers, by model and layer."""
    def save(name, model, keras_file=False):
        model.save(os.path.join(out, name), save_format="tf")
        if keras_file and not tf.__version__.startswith("2.12."):
            model.save(os.path.join(out, name + ".keras"))

    text = k2.Input((1,), dtype="string")
    carriage = L.StringLookup(name="carriage")
    carriage.adapt(np.array(["cat\r", "dog", "cat\r"]))
    save("carriage", k2.Model(text, carriage(text)), keras_file=True)

    words = L.StringLookup(name="string_lookup")  # as tf_keras names one
    words.adapt(WORDS)
    tokens = L.TextVectorization(output_sequence_length=3)
    tokens.adapt(CORPUS)
    document = k2.Input((1,), dtype="string")
    save("default_names", k2.Model([text, document],
                                   [words(text), tokens(document)]))
    named = {"default_names": {words.name: _vocabulary(words),
                               tokens.name: _vocabulary(tokens)}}

    words = L.StringLookup(name="words")
    words.adapt(WORDS)
    save("float_table", k2.Model(text, [words(text), Scores()(text)]))

    path = os.path.join(out, "vocabulary.txt")
    with open(path, "wb") as f:
        f.write(b"x\ny\r\nz\n")  # a Windows line end in the middle
    numbers_path = os.path.join(out, "numbers.txt")
    with open(numbers_path, "w") as f:
        f.write("7\n-3\n11\n")
    from_file = L.StringLookup(name="from_file", vocabulary=path)
    numbers = L.IntegerLookup(name="numbers_from_file",
                              vocabulary=numbers_path)
    inverse = L.StringLookup(name="inverse_from_file", vocabulary=path,
                             invert=True)
    number = k2.Input((1,), dtype="int64")
    index = k2.Input((1,), dtype="int64")
    save("from_file", k2.Model([text, number, index], [
        from_file(text), numbers(number), inverse(index)]))
    named["from_file"] = {layer.name: _vocabulary(layer)
                          for layer in (from_file, numbers, inverse)}

    # A nested model's config keeps the path its vocabulary was read from.
    inner = k2.Input((1,), dtype="string")
    nested = k2.Model(inner, L.StringLookup(name="nested_file",
                                            vocabulary=path)(inner))
    save("nested_file", k2.Model(text, nested(text)))
    named["nested_file"] = _vocabulary(nested.layers[-1])

    # The out-of-vocabulary token as an ordinary entry of a list, which
    # both Keras take where the layer does not invert.
    unk_words = L.StringLookup(name="unk_words", vocabulary=["a", "[UNK]",
                                                             "b"])
    unk_numbers = L.IntegerLookup(name="unk_numbers", vocabulary=[5, -1, 7])
    number = k2.Input((1,), dtype="int64")
    save("unk_entries", k2.Model([text, number], [unk_words(text),
                                                  unk_numbers(number)]))
    named["unk_entries"] = {layer.name: _vocabulary(layer)
                            for layer in (unk_words, unk_numbers)}

    # Vocabularies Keras 3 cannot hold as Keras 2 did, one model each.
    empty_last = L.StringLookup(name="empty_last")
    empty_last.adapt(np.array(["a", "a", "b", "b", ""], dtype=object))
    save("empty_last", k2.Model(text, empty_last(text)), keras_file=True)
    for name, lines, kwargs in (
            ("special_top", b"[UNK]\na\nb\n", {}),
            ("not_utf8", b"a\n\xff\xfe\n", {}),
            ("past_max_tokens", b"a\nb\nc\nd\n", {"max_tokens": 3})):
        file = os.path.join(out, name + ".txt")
        with open(file, "wb") as f:
            f.write(lines)
        layer = L.StringLookup(name=name, vocabulary=file, **kwargs)
        save(name, k2.Model(text, layer(text)))

    first = L.StringLookup(name="first", input_shape=(1,))
    first.adapt(WORDS)
    save("first_in_sequential", k2.Sequential([
        first, L.Embedding(6, 2), L.Flatten()]))
    return named


if __name__ == "__main__":
    make(sys.argv[1])
