"""fit() with a LossScaleOptimizer around an averaged optimizer across two
torch.distributed (gloo) processes on localhost, where only rank 1's
scaled gradients overflow at first; or, with ``peer``, the same in plain
PyTorch: DDP and ``torch.amp.GradScaler`` with the same scale rule.

Usage: torch_gloo_loss_scale.py [peer] PORT OUTDIR. Writes
OUTDIR/rank<r>.json (or peer<r>.json): the step count, the loss scale,
the weights (and ours, their averages).
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distributed_common as common  # noqa: E402

EPOCHS = 12


def build():
    import keras

    import keras_ema_opt

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    # Rank 1's gradients (its inputs 1000 times larger) overflow float32
    # at a scale of 2^112 until it has halved a few times; rank 0's never.
    optimizer = keras_ema_opt.averaged(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1e-7), initial_scale=2.0 ** 112),
        keras_ema_opt.EMA(0.5, finalize=False))
    model.compile(optimizer=optimizer, loss="mse")
    return model


def data(rank):
    import numpy as np

    rng = np.random.RandomState(rank)
    x = rng.randn(4, 2).astype("float32") * (1 + 999 * rank)
    y = rng.randn(4, 1).astype("float32")
    return x, y


def state(model):
    import keras

    opt = model.optimizer
    return {
        "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
        "scale": float(keras.ops.convert_to_numpy(opt.dynamic_scale)),
        "weights": [keras.ops.convert_to_numpy(v).tolist()
                    for v in model.trainable_variables],
        "averages": [keras.ops.convert_to_numpy(opt.average_of(v)).tolist()
                     for v in model.trainable_variables],
    }


def worker(rank, port, outdir):
    common.torch_group(rank, port)
    model = build()
    x, y = data(rank)
    model.fit(x, y, batch_size=4, epochs=EPOCHS, shuffle=False, verbose=0)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(state(model), f)
    common.leave_torch_group()


def peer(rank, port, outdir):
    import keras
    import torch

    dist = common.torch_group(rank, port)
    kernel, bias = (keras.ops.convert_to_numpy(v)
                    for v in build().trainable_variables)
    linear = torch.nn.Linear(2, 1)
    with torch.no_grad():
        linear.weight.copy_(torch.as_tensor(kernel.T))
        linear.bias.copy_(torch.as_tensor(bias))
    model = torch.nn.parallel.DistributedDataParallel(linear)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-7)
    # Keras' LossScaleOptimizer rule: halve on a non-finite step, double
    # after 2000 finite ones.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 112,
                                  growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=2000)
    x, y = (torch.as_tensor(a) for a in data(rank))
    steps = 0
    for _ in range(EPOCHS):
        optimizer.zero_grad()
        loss = torch.mean((model(x) - y) ** 2)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        steps += scaler.get_scale() >= before  # not halved: applied
    with open(os.path.join(outdir, f"peer{rank}.json"), "w") as f:
        json.dump({"iterations": int(steps), "scale": scaler.get_scale(),
                   "weights": [linear.weight.detach().numpy().T.tolist(),
                               linear.bias.detach().numpy().tolist()]}, f)
    del model, loss  # DDP's reducer holds the group until it is freed
    common.leave_torch_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    target, args = (peer, sys.argv[2:]) if sys.argv[1] == "peer" else (
        worker, sys.argv[1:])
    mp.spawn(target, args=(int(args[0]), args[1]), nprocs=2, join=True)
