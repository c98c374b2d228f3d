"""``RestoredOptimizer``: Keras 2 optimizers revived by ``tf.saved_model.load``.

``register_savedmodel_revival()`` registers this class for the SavedModel
identifiers Keras 2 writes for optimizers (``experimentalOptimizer``,
``tf_keras_experimentalOptimizer``, ``optimizer``,
``tf_keras_optimizer``), so that ``tf.saved_model.load(path).optimizer`` is
a ``RestoredOptimizer`` holding the iteration count, the learning rate, the
slots and the EMA averages, with or without tf_keras installed (TensorFlow
alone fails on OptimizerV2 SavedModels there: "'_UserObject' object has no
attribute 'add_slot'"). ``to_keras(model)`` turns it into a built Keras 3
optimizer holding that state.

Needs TensorFlow (this is TensorFlow's own loader). Importing
``keras_ema_opt.compat`` registers it, at once if TensorFlow is imported,
else right after ``import tensorflow``.
"""

import importlib
import importlib.abc
import importlib.util
import re
import sys

import keras
import numpy as np

from keras_ema_opt.compat import configs
from keras_ema_opt.compat import legacy_rules
from keras_ema_opt.compat import slots as slot_tables
from keras_ema_opt.errors import LegacyConfigError

IDENTIFIERS = ("experimentalOptimizer", "tf_keras_experimentalOptimizer",
               "optimizer", "tf_keras_optimizer")


def _restored_class():
    import tensorflow as tf

    class RestoredOptimizer(tf.__internal__.tracking.AutoTrackable):
        """The state of a Keras 2 optimizer revived from a SavedModel.

        Attributes:
            iterations: The iteration count (an int).
            learning_rate: The stored learning rate (a float), or ``None``
                where a schedule drove it.
            slots: ``{(slot name, model variable name): numpy array}``.
            averages: ``{model variable name: numpy array}`` (EMA).
            legacy: Whether it was an OptimizerV2 (``optimizers.legacy``).

        Example:

        ```python
        import keras_ema_opt.compat  # registers the revival
        # restored = tf.saved_model.load("old_model").optimizer
        # optimizer = restored.to_keras(keras3_model)
        ```
        """

        def __init__(self):
            super().__init__()
            self._keo_slot_records = []
            self._keo_children = {}

        # -- hooks of TensorFlow's loader ------------------------------
        def _keo_set(self, name, value):
            self._keo_children[name] = value
            if hasattr(type(self), name):
                # A Keras 2 child named like one of our properties
                # (`learning_rate`): tracked for the checkpoint, not set.
                self._track_trackable(value, name=name, overwrite=True)
            else:
                setattr(self, name, value)

        def add_slot(self, var, slot_name, initializer="zeros"):
            """Called by TensorFlow's loader for OptimizerV2 slots."""
            del initializer
            with tf.init_scope():
                slot = tf.Variable(tf.zeros(var.shape, var.dtype),
                                   trainable=False,
                                   name=f"{_name(var)}/{slot_name}")
            self._keo_slot_records.append((slot_name, var, slot))
            return slot

        def _create_or_restore_slot_variable(
            self, slot_variable_position, slot_name, variable,
            slot_variable_shape=None,
        ):
            """Called by TensorFlow's checkpoint restore for each slot."""
            del slot_variable_position, slot_variable_shape
            for name, var, slot in self._keo_slot_records:
                if name == slot_name and var is variable:
                    return slot
            return self.add_slot(variable, slot_name)

        # -- reading ---------------------------------------------------
        @property
        def legacy(self):
            return "_iterations" not in self._keo_children

        @property
        def iterations(self):
            var = self._keo_children.get("_iterations",
                                         self._keo_children.get("iter"))
            return None if var is None else int(var.numpy())

        @property
        def learning_rate(self):
            var = self._keo_children.get(
                "_learning_rate", self._keo_children.get("learning_rate"))
            if var is None or not hasattr(var, "numpy"):
                return None
            value = np.asarray(var.numpy())
            return float(value) if value.ndim == 0 else None

        @property
        def hyperparameters(self):
            """OptimizerV2's hyperparameter variables, as floats."""
            return {k: float(v.numpy()) for k, v in self._keo_children.items()
                    if hasattr(v, "numpy") and k not in ("iter",)
                    and not k.startswith("_")}

        @property
        def slots(self):
            out = {}
            if self.legacy:
                for slot_name, var, slot in self._keo_slot_records:
                    out[(slot_name, _name(var))] = slot.numpy()
                return out
            for attribute, slot_name in slot_tables.NEW_LIST_SLOTS.items():
                for var in _list(self._keo_children.get(attribute)):
                    if var is None or var.shape.rank is None:
                        continue
                    model_name = _model_name(var, slot_name)
                    if model_name is not None:
                        out[(slot_name, model_name)] = var.numpy()
            return out

        @property
        def averages(self):
            out = {}
            for var in _list(self._keo_children.get(
                    "_model_variables_moving_average")):
                out[_model_name(var, "average")] = var.numpy()
            return out

        @property
        def u_product(self):
            var = self._keo_children.get("_u_product")
            return None if var is None else float(var.numpy())

        def get_config(self):
            raise NotImplementedError(
                "A RestoredOptimizer holds the state of a Keras 2 optimizer "
                "revived from a SavedModel, not its configuration. Call "
                "`restored.to_keras(model, config=None)` for a working Keras "
                "3 optimizer (pass the Keras 2 config from the SavedModel's "
                "training_config for the exact hyperparameters)."
            )

        def to_keras(self, model, config=None):
            """A built Keras 3 optimizer holding this state.

            Args:
                model: The Keras 3 model (its ``trainable_variables`` are
                    matched in order with the Keras 2 model's, by shape).
                config: The Keras 2 optimizer config (``training_config``'s
                    ``optimizer_config``); without it the class is told from
                    the state's structure and the hyperparameters kept in it.

            Returns:
                A keras_ema_opt optimizer, built on ``model``'s variables.
            """
            optimizer = self._new_optimizer(config)
            return _fill(optimizer, self, model)

        def _new_optimizer(self, config):
            if config is not None:
                return configs.from_legacy_config(config)
            if not self.legacy:
                raise LegacyConfigError(
                    "A Keras 2 optimizer of the 2.11+ kind keeps only its "
                    "learning rate among its variables; its other "
                    "hyperparameters (momentum, betas, ...) are in the "
                    "SavedModel's keras_metadata.pb. Pass them: "
                    "`to_keras(model, config=training_config["
                    "'optimizer_config'])`."
                )
            hypers = self.hyperparameters
            legacy = configs.legacy_config_from_state(
                self._class_name(), hypers,
                {s for s, _, _ in self._keo_slot_records},
                hypers.get("learning_rate", self.learning_rate or 0.001))
            legacy["config"].setdefault("decay", 0.0)
            if self.averages:
                legacy["config"]["use_ema"] = True
            return configs.from_legacy_config(legacy)

        def _class_name(self):
            """The OptimizerV2 class told by its slots and hyperparameters;
            Adam's and Adamax's, which are the same, by the prefix of its
            variables' names (``Adamax/beta_1:0``: Keras 2 named them
            after the class)."""
            names = set(self._keo_children)
            slot_names = {s for s, _, _ in self._keo_slot_records}
            name = slot_tables.legacy_class(slot_names, names)
            if name != "Adam":
                if name is not None:
                    return name
                raise LegacyConfigError(
                    "Cannot tell the Keras 2 optimizer class from the "
                    f"restored state (children {sorted(names)}). Pass its "
                    "config: `to_keras(model, config=training_config["
                    "'optimizer_config'])`.")
            # Any hyperparameter's name (an `iter` read before the first
            # step is made outside the name scope: `iter:0`).
            prefixes = {str(getattr(child, "name", "")).split("/")[0]
                        for child in self._keo_children.values()
                        if "/" in str(getattr(child, "name", ""))}
            told = {configs.CLASS_NAMES.get(p.lower()) for p in prefixes}
            if told in ({"Adam"}, {"Adamax"}):
                return told.pop()
            raise LegacyConfigError(
                "The restored state is Adam's or Adamax's (they keep the "
                "same slots and hyperparameters), and its variables are "
                f"named after {', '.join(sorted(prefixes)) or 'nothing'}, "
                "not one of them. Pass its config: `to_keras(model, "
                "config=training_config['optimizer_config'])`.")

    return RestoredOptimizer


def _list(value):
    if value is None:
        return []
    try:
        return list(value)
    except TypeError:
        return [value]


def _name(var):
    return re.sub(r":\d+$", "", var.name)


def _model_name(var, slot_name):
    """``Adam/m/d1/kernel:0`` -> ``d1/kernel`` (new optimizer naming)."""
    parts = _name(var).split("/")
    if slot_name in parts:
        return "/".join(parts[parts.index(slot_name) + 1:])
    return None


def _fill(optimizer, restored, model):
    """Assign the restored state into a freshly built Keras 3 optimizer."""
    variables = list(model.trainable_variables)
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    inner.build(variables)
    if restored.iterations is not None:
        inner.iterations.assign(restored.iterations)
    if restored.learning_rate is not None and isinstance(
            inner._learning_rate, keras.Variable):
        inner._learning_rate.assign(restored.learning_rate)
    table = slot_tables.SLOT_ATTRIBUTES.get(type(inner).__name__, {})
    by_name = _order(restored, variables)
    missed = []
    for (slot_name, model_name), value in restored.slots.items():
        attribute = table.get(slot_name)
        index = by_name.get(model_name)
        target = getattr(inner, attribute, []) if attribute else []
        if index is None or index >= len(target) or target[index] is None:
            if np.any(value) and np.ndim(value):
                missed.append(f"{slot_name} of {model_name}")
            continue  # all-zero state (tf_keras' unused SGD `m`) is no loss
        _assign(target[index], value, f"{slot_name} of {model_name}")
    if missed:
        raise LegacyConfigError(
            f"{type(inner).__name__} has no place for the Keras 2 state "
            f"{missed[:6]}{'...' if len(missed) > 6 else ''}: the optimizer "
            "built from the config does not match the one saved (check the "
            "config and the model's trainable variables)."
        )
    averager = getattr(inner, "_averager", None)
    for model_name, value in restored.averages.items():
        index = by_name.get(model_name)
        if averager is not None and index is not None:
            slot = averager.slots[index]
            if slot is not None:
                _assign(slot[0], value, f"average of {model_name}")
    cache = restored.hyperparameters.get("momentum_cache")
    if cache is not None and hasattr(inner, "_momentum_cache"):
        inner._momentum_cache.assign(cache)
    if restored.u_product is not None and hasattr(inner, "_u_product"):
        inner._u_product.assign(
            legacy_rules.nadam_u_product(inner.beta_1, restored.iterations))
    return optimizer


def _order(restored, variables):
    """Keras 2 model-variable name -> index in the Keras 3 variables.

    A Keras 2 name (``d1/kernel``) goes to the first unused Keras 3 variable
    whose path ends with it and whose shape matches; names that match no
    path fall back to their order of appearance (the order of the Keras 2
    optimizer's lists), again with a shape check.
    """
    shapes = {}
    names = []
    for (_, name), value in list(restored.slots.items()) + [
            (("average", n), v) for n, v in restored.averages.items()]:
        if name not in shapes:
            shapes[name] = tuple(np.shape(value))
            names.append(name)
    mapping, used = {}, set()
    for name in names:
        for i, var in enumerate(variables):
            path = getattr(var, "path", var.name)
            if i not in used and (path == name or path.endswith("/" + name)) \
                    and tuple(var.shape) == shapes[name]:
                mapping[name] = i
                used.add(i)
                break
    free = [i for i in range(len(variables)) if i not in used]
    for name in names:
        if name not in mapping and free:
            i = free.pop(0)
            if tuple(variables[i].shape) == shapes[name]:
                mapping[name] = i
    return mapping


def _assign(variable, value, what):
    if tuple(variable.shape) != tuple(np.shape(value)):
        raise LegacyConfigError(
            f"Shape mismatch restoring the {what}: the Keras 3 variable has "
            f"{tuple(variable.shape)}, the Keras 2 state {np.shape(value)}."
        )
    variable.assign(value)


_REGISTERED = []


def _has_base(obj, name, module_suffix):
    return any(c.__name__ == name and c.__module__.endswith(module_suffix)
               for c in type(obj).__mro__)


# Saving keeps writing tf_keras' identifiers for tf_keras' optimizers (the
# registry maps one identifier to one predicate: ours replaces theirs).
_SAVE_PREDICATES = {
    "experimentalOptimizer": lambda obj: _has_base(
        obj, "Optimizer", "optimizers.optimizer"),
    "optimizer": lambda obj: _has_base(obj, "OptimizerV2", "optimizer_v2"),
}


def register_savedmodel_revival():
    """Make ``tf.saved_model.load`` revive Keras 2 optimizers as ours.

    Imports tf_keras' optimizer modules first when tf_keras is installed
    (TensorFlow would import them during the load and take the identifiers
    back), then registers ``RestoredOptimizer`` for the four identifiers.

    Returns:
        The ``RestoredOptimizer`` class.
    """
    if _REGISTERED:
        return _REGISTERED[0]
    import tensorflow as tf

    for module in ("tf_keras.optimizers.legacy", "tf_keras.src.optimizers.optimizer"):
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    cls = _restored_class()
    load = tf.__internal__.saved_model.load
    for identifier in IDENTIFIERS:
        load.register_revived_type(
            identifier,
            _SAVE_PREDICATES.get(identifier, lambda obj: False),
            versions=[load.VersionedTypeRegistration(
                object_factory=lambda proto: cls(),
                version=2, min_producer_version=1, min_consumer_version=1,
                setter=cls._keo_set,
            )],
        )
    _REGISTERED.append(cls)
    return cls


class _RegisterAfterTensorFlow(importlib.abc.MetaPathFinder):
    """Registers the revival right after ``import tensorflow`` completes,
    when ``keras_ema_opt.compat`` was imported first."""

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            register_savedmodel_revival()

        spec.loader.exec_module = exec_module
        return spec


def maybe_register():
    """Register now if TensorFlow is imported, else right after it is
    (never where it is blocked: ``sys.modules["tensorflow"] = None``)."""
    if "tensorflow" in sys.modules:
        if sys.modules["tensorflow"] is not None:
            register_savedmodel_revival()
    elif importlib.util.find_spec("tensorflow") is not None and not any(
        isinstance(f, _RegisterAfterTensorFlow) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _RegisterAfterTensorFlow())
