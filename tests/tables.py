"""One table of the named optimizers and the arguments each test uses."""

import numpy as np

import keras_ema_opt

# name -> constructor arguments that exercise the rule (lr large enough to
# move the weights visibly in five steps).
OPTIMIZERS = {
    "SGD": dict(learning_rate=0.1, momentum=0.9, nesterov=True),
    "Adam": dict(learning_rate=0.05, amsgrad=True),
    "AdamW": dict(learning_rate=0.05, weight_decay=0.01),
    "Adagrad": dict(learning_rate=0.1),
    "Adadelta": dict(learning_rate=1.0),
    "Adamax": dict(learning_rate=0.05),
    "Nadam": dict(learning_rate=0.05),
    "RMSprop": dict(learning_rate=0.01, momentum=0.5, centered=True),
    "Ftrl": dict(learning_rate=0.1, l1_regularization_strength=0.01),
    "Lion": dict(learning_rate=0.01),
    "Adafactor": dict(learning_rate=0.1),
}

NAMES = sorted(OPTIMIZERS)
assert set(NAMES) == set(keras_ema_opt.optimizers.NAMES)


def initial_weights():
    rng = np.random.default_rng(0)
    # A matrix (Adafactor factors it), a vector, and a 3-D tensor.
    return [
        rng.normal(size=(4, 3)).astype("float32"),
        rng.normal(size=(3,)).astype("float32"),
        rng.normal(size=(2, 3, 2)).astype("float32"),
    ]


def gradients(steps):
    rng = np.random.default_rng(1)
    return [
        [rng.normal(size=w.shape).astype("float32") for w in initial_weights()]
        for _ in range(steps)
    ]
