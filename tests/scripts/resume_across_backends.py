"""Save mid-training under one Keras backend, resume under another.

    resume_across_backends.py save DIR    # under backend A: 3 steps, save
                                          # DIR/mid.keras, 3 more steps,
                                          # write DIR/uninterrupted.npz
    resume_across_backends.py resume DIR  # under backend B: load, 3 steps,
                                          # write DIR/resumed.npz
"""

import sys

import keras
import numpy as np

import keras_ema_opt


def batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 2))).astype("float32")
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, 48, 8)]


def state(model):
    # Keyed by position: a loaded model's paths may carry another prefix.
    out = {}
    for i, v in enumerate(model.trainable_variables):
        out[f"w/{i}"] = keras.ops.convert_to_numpy(v)
        out[f"a/{i}"] = keras.ops.convert_to_numpy(
            model.optimizer.average_of(v))
    out["iterations"] = np.asarray(
        keras.ops.convert_to_numpy(model.optimizer.iterations))
    return out


def main(mode, folder):
    data = batches()
    if mode == "save":
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)),
                                  keras.layers.Dense(6, activation="tanh"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras_ema_opt.Adam(
            0.02, averaging=keras_ema_opt.EMA(
                0.9, warmup="num_updates", start_step=1, finalize=False)),
            loss="mse")
        for batch in data[:3]:
            model.train_on_batch(*batch)
        model.save(f"{folder}/mid.keras")
        name = "uninterrupted"
    else:
        model = keras.saving.load_model(f"{folder}/mid.keras")
        name = "resumed"
    for batch in data[3:]:
        model.train_on_batch(*batch)
    np.savez(f"{folder}/{name}.npz", **state(model))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
