"""fit() across two torch.distributed (gloo) processes on localhost with a
frozen layer (trainable=False), each rank's model built from its own seed; or, with ``single``, the same training in one
process from rank 0's seed with the global batches.

Usage: torch_gloo_frozen.py PORT OUTDIR | torch_gloo_frozen.py single OUTDIR.
Writes OUTDIR/rank<r>.json (or single.json): every model variable, and the
average of each trainable one.
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distributed_common as common  # noqa: E402

BATCH, STEPS = 8, 4


def build(seed):
    import keras

    import keras_ema_opt

    keras.utils.set_random_seed(seed)
    frozen = keras.layers.Dense(4, name="frozen")
    frozen.trainable = False
    model = keras.Sequential([keras.Input((3,)), frozen,
                              keras.layers.Dense(1, name="head")])
    model.compile(optimizer=keras_ema_opt.SGD(
        0.1, averaging=keras_ema_opt.EMA(0.5, finalize=False)), loss="mse")
    return model


def data():
    import numpy as np

    rng = np.random.RandomState(5)
    return (rng.randn(BATCH * STEPS, 3).astype("float32"),
            rng.randn(BATCH * STEPS, 1).astype("float32"))


def state(model):
    import keras

    out = {}
    for v in model.variables:
        out[v.path] = keras.ops.convert_to_numpy(v).tolist()
        if v.trainable:
            out[v.path + "#avg"] = keras.ops.convert_to_numpy(
                model.optimizer.average_of(v)).tolist()
    return out


def worker(rank, port, outdir):
    common.torch_group(rank, port)
    model = build(seed=rank)
    x, y = data()
    # Rank r's share of global batch b: rows [8b + 4r, 8b + 4r + 4).
    rows = [i for b in range(STEPS)
            for i in range(BATCH * b + 4 * rank, BATCH * b + 4 * rank + 4)]
    model.fit(x[rows], y[rows], batch_size=BATCH // 2, shuffle=False,
              verbose=0)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(state(model), f)
    common.leave_torch_group()


if __name__ == "__main__":
    if sys.argv[1] == "single":
        model = build(seed=0)
        x, y = data()
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        with open(os.path.join(sys.argv[2], "single.json"), "w") as f:
            json.dump(state(model), f)
    else:
        import torch.multiprocessing as mp

        mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2,
                 join=True)
