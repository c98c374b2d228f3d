"""Keras 2 optimizer configs -> working keras_ema_opt optimizers.

Handles every Keras 2 form met in SavedModels, ``.h5`` training configs and
``tf.keras.optimizers.serialize``: ``"Custom>Adam"``, modules
``keras.optimizers`` / ``keras.optimizers.legacy`` /
``keras.optimizers.experimental``, string identifiers (``"adam"``),
OptimizerV2 configs (``decay``, ``lr``), NumPy scalars, schedules whose
``name`` is null, and ``LossScaleOptimizer`` wrappers.
"""

import warnings

import keras
import numpy as np

import keras_ema_opt
from keras_ema_opt.compat import legacy_rules
from keras_ema_opt.errors import LegacyConfigError

# Keras 2 class names and string identifiers, lower-cased -> our class name.
CLASS_NAMES = {
    "sgd": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "adagrad": "Adagrad",
    "adadelta": "Adadelta",
    "adamax": "Adamax",
    "nadam": "Nadam",
    "rmsprop": "RMSprop",
    "ftrl": "Ftrl",
    "lion": "Lion",
    "adafactor": "Adafactor",
}

# OptimizerV2 rules that Keras 3 changed: name -> (class, applies(config)).
LEGACY_RULES = {
    "Nadam": (legacy_rules.LegacyNadam, lambda c: True),
    "Adagrad": (legacy_rules.LegacyAdagrad, lambda c: True),
    "RMSprop": (legacy_rules.LegacyRMSprop,
                lambda c: not c.get("momentum")),
}

LOSS_SCALE_NAMES = ("LossScaleOptimizer", "LossScaleOptimizerV3",
                    "LossScaleOptimizerV1")

# Identifiers Keras 2's `get` and `deserialize` took for the experimental
# (not OptimizerV2) classes, with `use_legacy_optimizer=True` too.
EXPERIMENTAL_ALIASES = {"experimentaladadelta": "Adadelta",
                        "experimentaladagrad": "Adagrad",
                        "experimentaladam": "Adam",
                        "experimentalsgd": "SGD"}

# The classes of OptimizerV2 (`tf.keras.optimizers.legacy`): Keras 2 had
# no AdamW, Lion or Adafactor there.
OPTIMIZER_V2_NAMES = ("SGD", "Adam", "Adagrad", "Adadelta", "Adamax",
                      "Nadam", "RMSprop", "Ftrl")


def from_legacy_config(config, custom_objects=None):
    """A keras_ema_opt optimizer from a Keras 2 optimizer config.

    Args:
        config: A dict ``{"class_name": ..., "config": {...}}`` (any Keras 2
            serialization), or a string identifier such as ``"adam"``.
        custom_objects: Dict of user optimizer classes by name.

    Returns:
        A built-ready optimizer: ours for the Keras 2 classes, the legacy
        rule classes of ``keras_ema_opt.compat`` for OptimizerV2 Nadam,
        Adagrad and RMSprop without momentum, a
        ``compat.LegacyLossScaleOptimizer`` (a
        ``keras.optimizers.LossScaleOptimizer`` counting its skipped steps,
        as Keras 2's did) for wrapped ones.

    Raises:
        LegacyConfigError: naming the class when it is unknown, or the
            config when it is malformed.

    Example:

    ```python
    from keras_ema_opt.compat import from_legacy_config

    optimizer = from_legacy_config({
        "class_name": "SGD",
        "config": {"name": "SGD", "learning_rate": 0.1, "decay": 0.01,
                   "momentum": 0.9, "nesterov": False},
    })
    ```
    """
    if isinstance(config, str):
        if config.lower() in _LOSS_SCALE_LOWER:
            raise LegacyConfigError(
                f"{config!r} wraps another optimizer: pass its config, "
                "{'class_name': 'LossScaleOptimizer', 'config': "
                "{'inner_optimizer': ...}}, not its name alone.")
        return _class_for(config, {}, False, custom_objects)()
    if not isinstance(config, dict) or "class_name" not in config:
        raise LegacyConfigError(
            "A Keras 2 optimizer config is a dict with 'class_name' and "
            f"'config', or a string identifier. Received: {config!r}"
        )
    class_name = str(config["class_name"])
    module = str(config.get("module") or "")
    inner = _plain(dict(config.get("config") or {}))
    base = _base_name(class_name)
    if base.lower() in _LOSS_SCALE_LOWER:
        return _loss_scale(inner, custom_objects)
    v2 = _is_optimizer_v2(class_name, module, inner)
    inner.pop("is_legacy_optimizer", None)
    if "lr" in inner:
        inner.setdefault("learning_rate", inner.pop("lr"))
        inner.pop("lr", None)
    if isinstance(inner.get("learning_rate"), dict):
        inner["learning_rate"] = schedule_from_keras2(inner["learning_rate"],
                                           custom_objects)
    cls = _class_for(class_name, inner, v2, custom_objects)
    try:
        return cls.from_config(inner)
    except (TypeError, ValueError) as e:
        raise LegacyConfigError(
            f"Could not build {cls.__name__} from the Keras 2 config of "
            f"{class_name!r}: {e}"
        ) from e


# OptimizerV2 variables that hold state, not constructor arguments: Nadam's
# product of momenta, the loss-scale wrapper's scale and count.
LEGACY_STATE_VARIABLES = ("iter", "momentum_cache", "current_loss_scale",
                          "good_steps")

# OptimizerV2 slot name -> the constructor flag its presence tells.
LEGACY_SLOT_FLAGS = {"vhat": "amsgrad", "mg": "centered"}


def legacy_config_from_state(name, hyperparameters, slot_names,
                             learning_rate):
    """The OptimizerV2 config of a state saved without one.

    An OptimizerV2 keeps each ``_set_hyper`` argument as a float32 variable
    (``beta_1``, ``rho``, Ftrl's ``l1_regularization_strength``, Nadam's
    ``decay``, which is its ``schedule_decay``); each is given back as the
    shortest decimal that is the same float32 (``0.999``, not
    ``0.9990000128746033``). Flags that are no variable are told by the
    slots (``vhat``: ``amsgrad``, ``mg``: ``centered``); arguments that are
    neither (``epsilon``, ``nesterov``) keep their defaults.

    Args:
        name: The OptimizerV2 class name (``"Adam"``).
        hyperparameters: ``{name: value}`` of its non-slot variables.
        slot_names: The names of its slots.
        learning_rate: The rate, a float.

    Returns:
        A config for :func:`from_legacy_config`.
    """
    config = {k: float(str(np.float32(v)))
              for k, v in hyperparameters.items()
              if k not in LEGACY_STATE_VARIABLES and not k.startswith("_")
              and np.ndim(v) == 0}
    config["learning_rate"] = float(str(np.float32(learning_rate)))
    for slot, flag in LEGACY_SLOT_FLAGS.items():
        if slot in slot_names:
            config[flag] = True
    return {"class_name": name, "module": "keras.optimizers.legacy",
            "config": config}


def _is_optimizer_v2(class_name, module, config):
    if "legacy" in module or "legacy" in class_name.lower():
        return True
    if "is_legacy_optimizer" in config:
        return bool(config["is_legacy_optimizer"])
    # OptimizerV2 always wrote `decay`; the experimental optimizer never did.
    return "decay" in config


_LOSS_SCALE_LOWER = {n.lower() for n in LOSS_SCALE_NAMES}


def _base_name(class_name):
    """The class's own name in a Keras 2 ``class_name`` (``"Custom>Adam"``,
    ``"keras.optimizers.legacy.Adam"``: ``"Adam"``)."""
    return str(class_name).split(">")[-1].split(".")[-1]


def refuse_unknown_to_optimizer_v2(config, custom_objects=None):
    """Keras 2's ``use_legacy_optimizer=True`` knew OptimizerV2's classes,
    the experimental aliases and the loss-scale wrapper, not AdamW, Lion
    or Adafactor: those are refused as Keras 2 refused them, unless
    ``custom_objects`` gives the name."""
    base = _base_name(config.get("class_name", ""))
    known = {n.lower() for n in OPTIMIZER_V2_NAMES + LOSS_SCALE_NAMES} | (
        set(EXPERIMENTAL_ALIASES))
    if (base.lower() in CLASS_NAMES and base.lower() not in known
            and not (custom_objects and base in custom_objects)):
        raise LegacyConfigError(
            f"Unknown optimizer {base!r} with use_legacy_optimizer=True: "
            "Keras 2's OptimizerV2 (tf.keras.optimizers.legacy) has no "
            f"such class. Accepted: {', '.join(OPTIMIZER_V2_NAMES)}"
            ", LossScaleOptimizer; or use_legacy_optimizer=False.")


def _class_for(class_name, config, v2, custom_objects):
    base = _base_name(class_name)
    if custom_objects and base in custom_objects:
        return custom_objects[base]
    if base.lower() in EXPERIMENTAL_ALIASES:
        return getattr(keras_ema_opt, EXPERIMENTAL_ALIASES[base.lower()])
    name = CLASS_NAMES.get(base.lower())
    if name is None:
        raise LegacyConfigError(
            f"Unknown Keras 2 optimizer class {class_name!r}. Known: "
            f"{', '.join(sorted(CLASS_NAMES.values()))}, LossScaleOptimizer; "
            "pass other classes through `custom_objects={name: class}`."
        )
    if v2 and name in LEGACY_RULES:
        cls, applies = LEGACY_RULES[name]
        if applies(config):
            return cls
    return getattr(keras_ema_opt, name)


def _loss_scale(config, custom_objects):
    if "inner_optimizer" not in config:
        raise LegacyConfigError(
            "A Keras 2 LossScaleOptimizer config holds the optimizer it "
            "wraps under 'inner_optimizer'. Received the config keys "
            f"{sorted(config)}.")
    inner = from_legacy_config(config["inner_optimizer"], custom_objects)
    scale = float(config.get("initial_scale", 2.0**15))
    if not config.get("dynamic", True):
        # A fixed loss scale is Keras 3's `loss_scale_factor`.
        inner.loss_scale_factor = scale
        return inner
    return legacy_rules.LegacyLossScaleOptimizer(
        inner, initial_scale=scale,
        dynamic_growth_steps=int(config.get("dynamic_growth_steps", 2000)),
    )


def without_unnamed(config):
    """A serialized schedule without ``"name": None`` (Keras 2's default):
    Keras 3 takes ``name=None``, then fails at the first step. Anything
    else serialized there (a registered function, whose ``config`` is its
    name) is returned as it is."""
    config = dict(config)
    if not isinstance(config.get("config") or {}, dict):
        return config
    inner = dict(config.get("config") or {})
    if inner.get("name", "") is None:
        inner.pop("name")
    config["config"] = inner
    return config


def schedule_from_keras2(config, custom_objects=None):
    """A learning-rate schedule from its Keras 2 serialization. A user's
    class is found in ``custom_objects`` under its registered name
    (``"my>Halve"``, as SavedModels store it) or its class name, or among
    the classes registered with Keras 3 under that name; Keras' own by
    name."""
    config = without_unnamed(config)
    registered = config.get("registered_name") or config.get("class_name")
    cls = _custom_class(str(registered or ""), custom_objects)
    try:
        if cls is not None:
            return cls.from_config(dict(config.get("config") or {}))
        if ">" in str(registered or ""):
            raise LegacyConfigError(
                f"{registered!r} is a user's class, registered with "
                "tf_keras; pass its Keras 3 class through "
                "custom_objects={name: class} (keras-ema-opt migrate "
                "--custom-objects module), or register it with "
                "keras.saving.register_keras_serializable.")
        config.setdefault("module", "keras.optimizers.schedules")
        config.setdefault("registered_name", None)
        return keras.optimizers.schedules.deserialize(config)
    except (TypeError, ValueError) as e:
        raise LegacyConfigError(
            f"Could not rebuild the learning-rate schedule {config!r}: {e}"
        ) from e


def _custom_class(name, custom_objects):
    """The class of registered name ``name`` (``"package>Class"``) or of
    class name ``name`` from ``custom_objects``, or registered with Keras
    3 under ``name``; None for none."""
    base = name.split(">")[-1]
    for key in (name, base):
        if custom_objects and key in custom_objects:
            return custom_objects[key]
    if ">" in name:
        return keras.saving.get_registered_object(name)
    return None


def _plain(value):
    """NumPy scalars and arrays, and tensors (a tf_keras schedule's
    ``get_config()`` may hold ``tf.constant``s) -> Python numbers and
    NumPy arrays, recursively."""
    if not isinstance(value, (np.ndarray, np.generic, str, bytes)) and (
            hasattr(value, "__array__") and hasattr(value, "shape")):
        value = np.asarray(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    return value
