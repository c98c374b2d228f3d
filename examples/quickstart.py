"""keras-ema-opt quick start: the runnable example for every backend.

Trains a small regression model with ``keras_ema_opt.AdamW(use_ema=True)``
through ``fit()``, then the same kind of model in a custom loop with
``minimize``, saves it as ``.keras``, reloads it and checks that training
resumes in lockstep. Run with KERAS_BACKEND=jax|tensorflow|torch.
"""

import argparse
import os
import tempfile

import keras
import numpy as np

import keras_ema_opt


def data(n=512, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    w = rng.normal(size=(8, 1)).astype("float32")
    y = x @ w + 0.1 * rng.normal(size=(n, 1)).astype("float32")
    return x, y


def model():
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def main(epochs):
    keras.utils.set_random_seed(0)
    x, y = data()
    net = model()
    net.compile(
        optimizer=keras_ema_opt.AdamW(
            learning_rate=3e-3, use_ema=True, ema_momentum=0.95
        ),
        loss="mse",
    )
    history = net.fit(x, y, batch_size=32, epochs=epochs, verbose=0)
    print(f"[{keras.backend.backend()}] fit: loss {history.history['loss'][0]:.4f}"
          f" -> {history.history['loss'][-1]:.4f}; averaged weights: "
          f"eval mse {net.evaluate(x, y, verbose=0):.4f}")

    # Keras 2 style custom loop: minimize() with a callable loss.
    loop = model()
    optimizer = keras_ema_opt.Adam(learning_rate=3e-3)
    xt, yt = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)

    def loss():
        return keras.ops.mean(keras.ops.square(loop(xt) - yt))

    start = float(keras.ops.convert_to_numpy(loss()))
    for _ in range(100):
        optimizer.minimize(loss, loop.trainable_variables)
    end = float(keras.ops.convert_to_numpy(loss()))
    print(f"[{keras.backend.backend()}] minimize: loss {start:.4f} -> {end:.4f}"
          f" in {int(keras.ops.convert_to_numpy(optimizer.iterations))} steps")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        net.save(path)
        again = keras.saving.load_model(path)
    assert type(again.optimizer) is keras_ema_opt.AdamW
    a = net.train_on_batch(x[:32], y[:32])
    b = again.train_on_batch(x[:32], y[:32])
    print(f"[{keras.backend.backend()}] .keras reload: optimizer "
          f"{type(again.optimizer).__name__}, next-step loss {a:.6f} vs {b:.6f}")
    if end >= start or not np.isclose(a, b, rtol=1e-5):
        raise SystemExit("quick start did not behave as expected")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    main(parser.parse_args().epochs)
