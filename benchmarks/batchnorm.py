"""``keras_ema_opt.update_bn`` against a forward pass over the same data
(``model.predict``) and, on PyTorch, against ``torch.optim.swa_utils.
update_bn`` on the same network written in torch.

    KERAS_BACKEND=... python -m benchmarks.batchnorm [--batches N]
        [--batch-size B] [--rounds R]

The network is a 12-layer convnet (``Conv2D(32, 3)``, BatchNormalization,
ReLU), global pooling and a ``Dense(10)``, over ``--batches`` batches of
``--batch-size`` 32x32x3 images. Each round times every contender once,
in turn, in this process, after one warm-up call of each (which traces
and compiles); the printed figures are the medians over ``--rounds``, and
the ratios ours over each other contender.
"""

import argparse
import os
import statistics
import time

import numpy as np

from benchmarks import common

BACKEND = os.environ.get("KERAS_BACKEND", "jax")
LAYERS = 12
CHANNELS = 32


def _keras_model():
    import keras

    layers = [keras.Input((32, 32, 3))]
    for _ in range(LAYERS):
        layers += [keras.layers.Conv2D(CHANNELS, 3, padding="same"),
                   keras.layers.BatchNormalization(),
                   keras.layers.ReLU()]
    layers += [keras.layers.GlobalAveragePooling2D(),
               keras.layers.Dense(10)]
    return keras.Sequential(layers)


def _torch_peer(x, batch_size):
    """``swa_utils.update_bn`` over the same network and data in torch."""
    import torch
    from torch.optim import swa_utils

    layers, channels = [], 3
    for _ in range(LAYERS):
        layers += [torch.nn.Conv2d(channels, CHANNELS, 3, padding=1),
                   torch.nn.BatchNorm2d(CHANNELS, eps=1e-3),
                   torch.nn.ReLU()]
        channels = CHANNELS
    net = torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(CHANNELS, 10))
    data = torch.utils.data.TensorDataset(
        torch.tensor(x).permute(0, 3, 1, 2).contiguous())
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
    return lambda: swa_utils.update_bn(loader, net)


def run(batches, batch_size, rounds):
    import keras_ema_opt

    x = np.random.default_rng(0).random(
        (batches * batch_size, 32, 32, 3), dtype=np.float32)
    model = _keras_model()
    contenders = {
        "update_bn": lambda: keras_ema_opt.update_bn(
            model, x, batch_size=batch_size),
        "predict": lambda: model.predict(x, batch_size=batch_size,
                                         verbose=0),
    }
    if BACKEND == "torch":
        contenders["torch update_bn"] = _torch_peer(x, batch_size)
    times = {name: [] for name in contenders}
    for fn in contenders.values():
        fn()
    for _ in range(rounds):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "backend": BACKEND, "batches": batches, "batch_size": batch_size,
        "rounds": rounds,
        "seconds": medians,
        "ours_over": {name: medians["update_bn"] / medians[name]
                      for name in medians if name != "update_bn"},
    }
    rows = [[name, f"{seconds:.3f} s",
             "" if name == "update_bn"
             else f"{result['ours_over'][name]:.2f}"]
            for name, seconds in medians.items()]
    print(common.markdown_table(
        [f"{BACKEND}: over {batches} x {batch_size}", "median",
         "update_bn / it"], rows))
    common.emit(result)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=common.summary(__doc__))
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    for name in ("batches", "batch_size", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    run(args.batches, args.batch_size, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
