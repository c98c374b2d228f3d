"""The model, data and state shared by the distributed tests (and their
single-process references): a global batch of 8 split across replicas,
Adam with a power-warm-up EMA, 4 steps, a save after step 2."""

import json

import numpy as np

GLOBAL_BATCH = 8
STEPS = 4
MID = 2


def batches():
    rng = np.random.RandomState(3)
    return [(rng.randn(GLOBAL_BATCH, 6).astype("float32"),
             rng.randn(GLOBAL_BATCH, 2).astype("float32"))
            for _ in range(STEPS)]


def local(replica, replicas, steps):
    """Replica ``replica``'s share of each global batch in ``steps``, one
    after the other (a contiguous slice of each)."""
    size = GLOBAL_BATCH // replicas
    part = slice(replica * size, (replica + 1) * size)
    data = [batches()[s] for s in steps]
    return (np.concatenate([x[part] for x, _ in data]),
            np.concatenate([y[part] for _, y in data]))


def make_model(seed=0, layout=None):
    """The MLP, compiled. ``seed`` sets its initial weights: replicas given
    different seeds must still start from rank 0's (the shims' job)."""
    import keras

    import keras_ema_opt

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="relu", name="d1"),
        keras.layers.Dense(2, name="d2"),
    ], name="mlp")
    model.compile(optimizer=keras_ema_opt.Adam(
        learning_rate=0.01,
        averaging=keras_ema_opt.EMA(0.9, warmup="power", finalize=False)),
        loss="mse")
    return model


def fit_steps(model, steps, replica=0, replicas=1):
    """``fit`` over ``steps`` (global batch indices), this replica's share."""
    x, y = local(replica, replicas, steps)
    model.fit(x, y, batch_size=GLOBAL_BATCH // replicas, epochs=1,
              shuffle=False, verbose=0)


def state(model):
    import keras

    def array(v):
        return np.asarray(keras.ops.convert_to_numpy(v), "float64").tolist()

    opt = model.optimizer
    return {
        "weights": [array(v) for v in model.trainable_weights],
        "averages": [array(opt.average_of(v))
                     for v in model.trainable_weights],
        "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
    }


def write(path, data):
    with open(path, "w") as f:
        json.dump(data, f)


def read(path):
    with open(path) as f:
        return json.load(f)
