"""aggregate_gradients / apply_gradients across two torch.distributed (gloo)
processes on localhost. Rank r's gradient is r + 1: the mean over the ranks is 1.5.

Usage: torch_gloo_aggregation.py PORT OUTDIR. Writes OUTDIR/rank<r>.json.
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distributed_common as common  # noqa: E402


def worker(rank, port, outdir):
    common.torch_group(rank, port)
    import keras
    import numpy as np

    import keras_ema_opt

    out = {"rank": rank}
    for label, skip in (("default", False), ("skip", True)):
        w = keras.Variable(np.zeros(2, "float32"))
        opt = keras_ema_opt.SGD(learning_rate=1.0)
        g = keras.ops.full((2,), float(rank + 1))
        (agg, _), = opt.aggregate_gradients([(g, w)])
        opt.apply_gradients([(g, w)], skip_gradients_aggregation=skip)
        out[label] = keras.ops.convert_to_numpy(w).tolist()
        out[label + "_aggregate"] = keras.ops.convert_to_numpy(agg).tolist()
        # The caller's gradient is left as it was.
        out[label + "_input"] = keras.ops.convert_to_numpy(g).tolist()
    # fit()'s path (apply: the step takes the mean over the ranks itself)
    # with global_clipnorm: the mean, which only the step holds, is
    # clipped in place; the caller's gradient is left as it was.
    from keras_ema_opt.backend import torch as torch_backend

    calls = []
    torch_backend._CLIP_RULES = common.clipping_spies(calls)

    def apply_by_fit(opt, g, w):
        opt.apply([g], [w])

    def apply_gradients(opt, g, w):
        opt.apply_gradients([(g, w)])

    def apply_held_mean(opt, g, w):
        pairs = opt.aggregate_gradients([(g, w)])
        opt.apply_gradients(pairs, skip_gradients_aggregation=True)
        out["held_mean"] = keras.ops.convert_to_numpy(pairs[0][0]).tolist()

    # fit()'s path (apply: the step takes the mean itself) and
    # apply_gradients' own aggregation: the mean is held by no caller, and
    # is clipped in place. A mean the caller holds (aggregated by the
    # caller, then applied with skip_gradients_aggregation) is clipped
    # into new tensors and left as it was.
    for label, step in (("clipped", apply_by_fit),
                        ("applied", apply_gradients),
                        ("held", apply_held_mean)):
        calls.clear()
        w = keras.Variable(np.zeros(2, "float32"))
        opt = keras_ema_opt.SGD(learning_rate=1.0, global_clipnorm=1.0)
        g = keras.ops.full((2,), float(rank + 1))
        step(opt, g, w)
        out[label] = keras.ops.convert_to_numpy(w).tolist()
        out[label + "_input"] = keras.ops.convert_to_numpy(g).tolist()
        out[label + "_in_place"] = list(calls)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    common.leave_torch_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2,
             join=True)
