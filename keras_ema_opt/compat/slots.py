"""Keras 2 slot names -> the Keras 3 lists that hold the same state.

Data only (reference ``legacy-formats.md`` §4.2): for each class of ours,
the Keras 2 slot names (new optimizer and OptimizerV2 spellings) and the
attribute of the Keras 3 optimizer whose element ``i`` belongs to trainable
variable ``i``.
"""

SLOT_ATTRIBUTES = {
    "SGD": {"m": "momentums", "momentum": "momentums"},
    "Adam": {"m": "_momentums", "v": "_velocities",
             "vhat": "_velocity_hats"},
    "AdamW": {"m": "_momentums", "v": "_velocities",
              "vhat": "_velocity_hats"},
    "Adagrad": {"accumulator": "_accumulators"},
    "Adadelta": {"accumulated_grad": "_accumulated_grads",
                 "accumulated_delta_var": "_accumulated_delta_vars",
                 "accum_grad": "_accumulated_grads",
                 "accum_var": "_accumulated_delta_vars"},
    "Adamax": {"m": "_m", "u": "_u", "v": "_u"},
    "Nadam": {"m": "_momentums", "v": "_velocities"},
    "RMSprop": {"velocity": "_velocities", "rms": "_velocities",
                "momentum": "_momentums",
                "average_gradient": "_average_gradients",
                "mg": "_average_gradients"},
    "Ftrl": {"accumulator": "_accumulators", "linear": "_linears"},
    "Lion": {"m": "_momentums"},
    "Adafactor": {"r": "_r", "c": "_c", "v": "_v"},
    "LegacyAdagrad": {"accumulator": "_accumulators"},
    "LegacyRMSprop": {"rms": "_velocities", "mg": "_average_gradients"},
    "LegacyNadam": {"m": "_momentums", "v": "_velocities"},
}

# Keras 2 per-class list attributes of the new optimizer -> slot name.
NEW_LIST_SLOTS = {
    "momentums": "m", "_momentums": "m", "_velocities": "v",
    "_velocity_hats": "vhat", "_accumulators": "accumulator",
    "_accumulated_grads": "accumulated_grad",
    "_accumulated_delta_vars": "accumulated_delta_var",
    "_m": "m", "_u": "u", "_linears": "linear",
    "_average_gradients": "average_gradient", "_r": "r", "_c": "c",
    "_v": "v",
}

# Structure -> class, for states that come without a config (reference
# §2d step 5): legacy slot-name sets and hyperparameter children.
LEGACY_FINGERPRINTS = (
    (lambda slots, hypers: "momentum_cache" in hypers, "Nadam"),
    (lambda slots, hypers: "linear" in slots, "Ftrl"),
    (lambda slots, hypers: "accumulator" in slots, "Adagrad"),
    (lambda slots, hypers: "accum_grad" in slots, "Adadelta"),
    (lambda slots, hypers: "rms" in slots, "RMSprop"),
    (lambda slots, hypers: "m" in slots and "beta_1" in hypers, "Adam"),
    (lambda slots, hypers: "momentum" in hypers, "SGD"),
)


def legacy_class(slot_names, hyperparameters):
    """The OptimizerV2 class told from its slot and hyperparameter names
    (``LEGACY_FINGERPRINTS``), or ``None``."""
    return next((name for test, name in LEGACY_FINGERPRINTS
                 if test(slot_names, hyperparameters)), None)
