"""``keras-ema-opt demo``: raw weights vs EMA, SWA and a post-hoc EMA.

Trains a small convnet on scikit-learn's digits (8x8 images, shipped inside
scikit-learn: no download) under the active Keras backend, three times with
the same seed and batches, each run keeping one kind of average (the raw
weights are the same in all three: averaging never changes the trajectory).
Prints the validation accuracy of the raw weights, the EMA, the SWA and a
power EMA synthesized after training from snapshots, writes a PNG of the
curves, and saves the averaged model as ``.keras``.
"""

import json
import logging
import os
import shutil
import tempfile
import time

import keras
import numpy as np

import keras_ema_opt
from keras_ema_opt import _io
from keras_ema_opt.averaging import assign_by_path
from keras_ema_opt.callbacks import PowerEMASnapshots
from keras_ema_opt.errors import InvalidArgumentError

log = logging.getLogger(__name__)


def load_digits(seed=0, validation=0.3):
    """scikit-learn's digits as float32 images in [0, 1], split in two."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as e:
        raise InvalidArgumentError(
            "The demo needs scikit-learn (its digits data set ships inside "
            "it): pip install 'keras-ema-opt[demo]'"
        ) from e
    data = sklearn_digits()
    x = (data.images / 16.0).astype("float32")[..., None]
    y = data.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(len(x) * (1 - validation))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def build_model():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def _accuracy(model, x, y):
    logits = model.predict(x, verbose=0, batch_size=512)
    return float(np.mean(np.argmax(logits, axis=1) == y))


class _Curves(keras.callbacks.Callback):
    """Validation accuracy of the raw and the averaged weights per epoch."""

    def __init__(self, x, y, progbar, label):
        super().__init__()
        self.x, self.y = x, y
        self.raw, self.averaged = [], []
        self.progbar, self.label = progbar, label

    def on_epoch_end(self, epoch, logs=None):
        self.raw.append(_accuracy(self.model, self.x, self.y))
        with self.model.optimizer.swap_average(self.model):
            self.averaged.append(_accuracy(self.model, self.x, self.y))
        self.progbar.add(1, [(f"{self.label} raw", self.raw[-1]),
                             (f"{self.label} avg", self.averaged[-1])])


def _train(averaging, data, epochs, seed, progbar, label, callbacks=()):
    (x, y), (vx, vy) = data
    keras.utils.set_random_seed(seed)
    model = build_model()
    model.compile(
        optimizer=keras_ema_opt.Adam(learning_rate=3e-3, averaging=averaging),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    curves = _Curves(vx, vy, progbar, label)
    model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[curves, *callbacks])
    return model, curves


def run_demo(output_dir, epochs=12, seed=0, plot=True):
    """Run the demo; returns its results as a dict.

    Args:
        output_dir: Folder for ``demo.png``, ``averaged.keras`` and
            ``results.json`` (the power-EMA snapshots are written in a
            temporary folder in it, removed as the demo ends).
        epochs: Training epochs per run.
        seed: Seed of the split and of the initial weights.
        plot: Write the PNG (needs matplotlib).

    Returns:
        ``{"backend", "final": {name: accuracy}, "curves": {...},
        "files": {...}, "seconds"}``.

    Raises:
        InvalidArgumentError: ``epochs`` is not a positive integer, ``seed``
            not a non-negative one, ``output_dir`` is an existing file, or
            scikit-learn (or matplotlib, with ``plot``) is missing; all
            checked before anything is trained or written.

    Example:

    >>> result = run_demo("demo-out", epochs=2, plot=False)  # doctest: +SKIP
    >>> sorted(result["files"])  # doctest: +SKIP
    ['model', 'results']
    """
    _check_arguments(output_dir, epochs, seed, plot)
    start = time.monotonic()
    data = load_digits(seed)
    os.makedirs(output_dir, exist_ok=True)
    steps = int(np.ceil(len(data[0][0]) / 32)) * epochs
    # The power-EMA snapshots are the demo's scratch: removed as it ends,
    # also when it is stopped (they were left, a new folder each run).
    snapshots = tempfile.mkdtemp(prefix="phema-", dir=output_dir)
    try:
        return _run(data, epochs, seed, plot, output_dir, snapshots, steps,
                    start)
    finally:
        shutil.rmtree(snapshots, ignore_errors=True)


def _run(data, epochs, seed, plot, output_dir, snapshots, steps, start):
    names = [f"{run} {kind}" for run in ("EMA", "SWA", "PowerEMA")
             for kind in ("raw", "avg")]
    progbar = keras.utils.Progbar(3 * epochs, unit_name="epoch",
                                  stateful_metrics=names)
    ema_model, ema = _train(
        keras_ema_opt.EMA(0.99, warmup="num_updates", finalize=False),
        data, epochs, seed, progbar, "EMA")
    _, swa = _train(
        keras_ema_opt.SWA(start_step=steps // 2, finalize=False),
        data, epochs, seed, progbar, "SWA")
    power = keras_ema_opt.PowerEMA(
        sigma_rels=(0.05, 0.10), snapshot_every=max(steps // 20, 1),
        snapshot_dir=snapshots, finalize=False)
    power_model, _ = _train(power, data, epochs, seed, progbar, "PowerEMA",
                            callbacks=[PowerEMASnapshots()])
    vx, vy = data[1]

    raw_weights = [keras.ops.convert_to_numpy(v) for v in
                   power_model.trainable_variables]
    posthoc = {}
    for sigma in (0.05, 0.08, 0.10, 0.15):
        assign_by_path(power_model, power.synthesize(sigma))
        posthoc[sigma] = _accuracy(power_model, vx, vy)
    for v, w in zip(power_model.trainable_variables, raw_weights):
        v.assign(w)
    best_sigma = max(posthoc, key=posthoc.get)
    final = {
        "raw weights": ema.raw[-1],
        "EMA (0.99, num_updates warm-up)": ema.averaged[-1],
        f"SWA (last {steps - steps // 2} of {steps} steps)":
            swa.averaged[-1],
    }
    for sigma, value in posthoc.items():
        final[f"post-hoc power EMA, sigma_rel={sigma:.2f}"] = value

    files = {}
    with ema_model.optimizer.swap_average(ema_model):
        files["model"] = _save_atomically(ema_model, output_dir)
    if plot:
        files["plot"] = _plot(ema, swa, posthoc, best_sigma, output_dir)
    result = {
        "backend": keras.backend.backend(),
        "final": final,
        "curves": {"raw": ema.raw, "EMA": ema.averaged, "SWA": swa.averaged},
        "files": files,
        "seconds": round(time.monotonic() - start, 1),
    }
    files["results"] = os.path.join(output_dir, "results.json")
    _write_atomically(
        files["results"], ".json",
        lambda tmp: _write_text(tmp, json.dumps(result, indent=2)))
    return result


def _is_integer(value):
    return isinstance(value, (int, np.integer)) and not isinstance(
        value, bool)


def _check_arguments(output_dir, epochs, seed, plot):
    if not _is_integer(epochs) or epochs < 1:
        raise InvalidArgumentError(
            f"epochs must be a positive integer; received {epochs!r}")
    if not _is_integer(seed) or seed < 0:
        raise InvalidArgumentError(
            f"seed must be a non-negative integer; received {seed!r}")
    if not isinstance(output_dir, (str, os.PathLike)):
        raise InvalidArgumentError(
            "output_dir must be a folder path (str or os.PathLike); "
            f"received {type(output_dir).__name__}")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise InvalidArgumentError(
            f"output_dir {os.fspath(output_dir)!r} is an existing file; the "
            "demo writes a folder there: give a new path or a folder")
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise InvalidArgumentError(
                "The demo's plot needs matplotlib: pip install "
                "'keras-ema-opt[demo]', or run without the plot "
                "(--no-plot, plot=False)") from e


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def _write_atomically(path, suffix, write, verify=None):
    """``write(tmp)`` to a temporary file beside ``path``, ``verify(tmp)``,
    then rename it to ``path``: an interrupted run leaves no partial file
    under the final name."""
    with _io.temporary_beside(path, suffix) as tmp:
        write(tmp)
        if verify is not None:
            verify(tmp)
        _io.publish(tmp, path)
    return path


def _save_atomically(model, output_dir):
    # Verified by loading it back before it takes the name.
    return _write_atomically(
        os.path.join(output_dir, "averaged.keras"), ".keras", model.save,
        keras.saving.load_model)


def _plot(ema, swa, posthoc, best_sigma, output_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = np.arange(1, len(ema.raw) + 1)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(epochs, ema.raw, "o-", label="raw weights", color="0.4")
    ax.plot(epochs, ema.averaged, "s-", label="EMA")
    ax.plot(epochs, swa.averaged, "^-", label="SWA")
    ax.axhline(posthoc[best_sigma], ls="--", color="C3",
               label=f"post-hoc power EMA (sigma_rel={best_sigma:.2f})")
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"digits convnet, Keras backend: {keras.backend.backend()}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = os.path.join(output_dir, "demo.png")
    try:
        return _write_atomically(path, ".png", fig.savefig)
    finally:
        plt.close(fig)


def format_table(result):
    """The results as a small text table."""
    width = max(len(k) for k in result["final"]) + 2
    lines = [f"{'weights'.ljust(width)}val. accuracy",
             "-" * (width + 13)]
    for name, value in result["final"].items():
        lines.append(f"{name.ljust(width)}{value:.4f}")
    return "\n".join(lines)
