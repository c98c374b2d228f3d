"""Keras 2 models over the layers whose config changed in Keras 3, saved
by real tf_keras as a full ``.h5`` and a SavedModel, with tf_keras' own
predictions (the oracle of ``tests/test_model_configs.py``).

Usage: make_layer_artifacts.py OUT_DIR NAME... ; NAME a key of MODELS.
Writes OUT_DIR/<name>/{model.h5, savedmodel/, io.npz}.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

try:
    import tf_keras as k2  # noqa: E402
except ImportError:  # tf.keras 2.12
    k2 = tf.keras

L = k2.layers


def _batch_input_shape():
    # `batch_input_shape` in the InputLayer config, activations by name.
    return k2.Sequential([
        L.InputLayer(batch_input_shape=(None, 6)),
        L.Dense(5, activation="selu", kernel_regularizer="l2",
                kernel_constraint=k2.constraints.MaxNorm(2.0)),
        L.LeakyReLU(0.2), L.Dense(3, activation="softmax"),
    ]), np.random.RandomState(0).randn(4, 6)


def _convolutions():
    inputs = k2.Input((8, 8, 2))
    x = L.Conv2D(4, 3, padding="same", strides=1, dilation_rate=1)(inputs)
    x = L.DepthwiseConv2D(3, depth_multiplier=2, padding="same")(x)
    x = L.SeparableConv2D(4, 3, padding="valid")(x)
    x = L.Conv2DTranspose(3, 3, strides=2, padding="same")(x)
    x = L.MaxPooling2D()(x)
    x = L.ZeroPadding2D(1)(x)
    x = L.Cropping2D(1)(x)
    x = L.UpSampling2D()(x)
    x = L.AveragePooling2D()(x)
    x = L.GlobalAveragePooling2D()(x)
    y = L.Reshape((4, 2))(L.Dense(8)(x))
    y = L.Conv1D(3, 2, padding="causal")(y)
    y = L.SeparableConv1D(2, 2)(y)
    y = L.Flatten()(y)
    return k2.Model(inputs, y), np.random.RandomState(1).randn(2, 8, 8, 2)


def _normalization():
    inputs = k2.Input((5, 5, 3))
    x = L.BatchNormalization()(inputs)  # fused: Keras 3 drops the flag
    x = L.Conv2D(4, 3)(x)
    x = L.BatchNormalization(axis=-1, momentum=0.9, epsilon=1e-3,
                             fused=False)(x)
    x = L.LayerNormalization()(L.Flatten()(x))
    x = L.Dropout(0.3)(x)
    x = L.GaussianNoise(0.1)(x)
    outputs = L.Dense(2)(x)
    model = k2.Model(inputs, outputs)
    # Moving statistics away from their initial values.
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            mean, var = layer.moving_mean, layer.moving_variance
            mean.assign(np.linspace(-1, 1, mean.shape[0]))
            var.assign(np.linspace(0.5, 2, var.shape[0]))
    return model, np.random.RandomState(2).randn(3, 5, 5, 3)


def _recurrent():
    inputs = k2.Input((6,), dtype="int32")
    x = L.Embedding(12, 4, mask_zero=True)(inputs)
    x = L.LSTM(5, return_sequences=True)(x)
    x = L.GRU(4, return_sequences=True, reset_after=False)(x)
    x = L.Bidirectional(L.LSTM(3, return_sequences=True),
                        merge_mode="sum")(x)
    x = L.TimeDistributed(L.Dense(2))(x)
    x = L.SimpleRNN(3)(x)
    tokens = np.random.RandomState(3).randint(1, 12, (4, 6))
    tokens[:, -2:] = 0  # masked tail
    return k2.Model(inputs, L.Dense(2)(x)), tokens.astype("int32")


def _attention():
    inputs = k2.Input((5, 8))
    attended = L.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    x = L.Add()([inputs, attended])
    x = L.Concatenate()([x, L.Permute((1, 2))(inputs)])
    x = L.Multiply()([x, x])
    x = L.PReLU()(L.Dense(4)(x))
    x = L.Softmax()(L.GlobalMaxPooling1D()(x))
    x = L.RepeatVector(2)(x)
    outputs = L.Activation("tanh")(L.Flatten()(x))
    return k2.Model(inputs, outputs), np.random.RandomState(4).randn(2, 5, 8)


def _changed_meanings():
    # Config values that read as something else in Keras 3: ConvLSTM's
    # `time_major=False`, its default recurrent_activation "hard_sigmoid"
    # (another slope in Keras 3), a Dense's "hard_sigmoid", and
    # Attention's default score_mode "dot" (a function's name there).
    inputs = k2.Input((3, 6, 2))
    x = L.ConvLSTM1D(4, 3)(inputs)
    query = L.Dense(4, activation="hard_sigmoid")(x)
    outputs = L.Flatten()(L.Attention()([query, x]))
    return k2.Model(inputs, outputs), np.random.RandomState(7).randn(
        2, 3, 6, 2)


def _nested_outputs():
    # Nested models as the outputs and in the middle (their node indices).
    head = k2.Sequential([L.Dense(3, activation="relu"), L.Dense(2)],
                         name="head")
    sub_in = k2.Input((4,))
    sub = k2.Model(sub_in, [L.Dense(2)(sub_in), L.Dense(1)(sub_in)],
                   name="sub")
    inputs = k2.Input((4,))
    first, second = sub(inputs)
    head.build((None, 2))
    return k2.Model(inputs, [head(first), second]), (
        np.random.RandomState(5).randn(3, 4))


def _mixed_precision():
    policy = k2.mixed_precision.Policy("mixed_bfloat16")
    inputs = k2.Input((6,))
    x = L.Dense(8, activation="relu", dtype=policy)(inputs)
    x = L.Dense(3, dtype=policy)(x)
    outputs = L.Activation("linear", dtype="float32")(x)
    return k2.Model(inputs, outputs), np.random.RandomState(6).randn(4, 6)


MODELS = {
    "batch_input_shape": _batch_input_shape,
    "convolutions": _convolutions,
    "normalization": _normalization,
    "recurrent": _recurrent,
    "attention": _attention,
    "nested_outputs": _nested_outputs,
    "changed_meanings": _changed_meanings,
    "mixed_precision": _mixed_precision,
}


def make(out, name):
    tf.random.set_seed(0)
    k2.utils.set_random_seed(0)
    model, x = MODELS[name]()
    x = x if x.dtype == np.int32 else x.astype("float32")
    y = model.predict(x, verbose=0)
    ys = y if isinstance(y, list) else [y]
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    model.save(os.path.join(folder, "model.h5"), save_format="h5")
    model.save(os.path.join(folder, "savedmodel"), save_format="tf")
    np.savez(os.path.join(folder, "io.npz"), x=x,
             **{f"y{i}": v for i, v in enumerate(ys)},
             n_weights=len(model.weights))


if __name__ == "__main__":
    for name in sys.argv[2:]:
        make(sys.argv[1], name)
    print("ok")
