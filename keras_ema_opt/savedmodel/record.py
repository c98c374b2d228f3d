"""The one plain record every legacy reader produces.

A :class:`LegacyRecord` holds what a Keras 2 artifact carries, as Python
values and numpy arrays, with no framework object in it: the model config,
the weights keyed by object path, and the optimizer state (class, config,
iteration count, learning rate, slots and EMA averages) keyed by the same
paths. ``keras_ema_opt.savedmodel.inspect(path)`` returns it; the migration
turns it into a Keras 3 model.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass
class Slot:
    """One piece of per-variable optimizer state.

    Attributes:
        slot: The Keras 2 slot name (``"m"``, ``"v"``, ``"momentum"``,
            ``"rms"``, ...; ``"average"`` for the EMA).
        weight: The key in ``LegacyRecord.weights`` of the model variable it
            belongs to.
        value: The array.
        name: The Keras 2 variable name of the slot, for messages.

    See :class:`LegacyRecord`'s example.
    """

    slot: str
    weight: str
    value: np.ndarray
    name: str = ""


@dataclasses.dataclass
class OptimizerState:
    """The optimizer part of a legacy artifact.

    Attributes:
        kind: ``"new"`` (the Keras 2 ``experimental`` optimizer, default
            since 2.11) or ``"legacy"`` (``OptimizerV2``).
        class_name: The Keras 2 class (``"Adam"``), or ``None`` when only
            the structure is known.
        config: The Keras 2 serialization ``{"class_name", "config"}`` where
            the artifact has one (SavedModel metadata, h5 training config),
            else ``None``.
        iterations: The number of optimizer steps taken.
        learning_rate: The stored learning-rate value, or ``None``.
        learning_rate_schedule: Whether that value is a schedule's, the
            rate of its last step (a Keras 2.11+ optimizer keeps a
            schedule's ``_current_learning_rate``); the schedule itself is
            in no checkpoint.
        hyperparameters: Other scalar state by name (OptimizerV2
            hyperparameter variables such as ``decay`` or
            ``momentum_cache``; ``_u_product`` for the new Nadam;
            ``loss_scale``/``good_steps`` for a loss-scale optimizer).
        slots: Per-variable state, :class:`Slot` entries, the EMA averages
            included (slot ``"average"``).

    See :class:`LegacyRecord`'s example.
    """

    kind: str
    class_name: object = None
    config: object = None
    iterations: int = 0
    learning_rate: object = None
    learning_rate_schedule: bool = False
    hyperparameters: dict = dataclasses.field(default_factory=dict)
    slots: list = dataclasses.field(default_factory=list)

    @property
    def averages(self):
        """The EMA averages, ``{weight key: array}``."""
        return {s.weight: s.value for s in self.slots if s.slot == "average"}

    def slot_names(self):
        """Slot names in first-seen order (``"average"`` excluded)."""
        seen = []
        for s in self.slots:
            if s.slot != "average" and s.slot not in seen:
                seen.append(s.slot)
        return seen


@dataclasses.dataclass
class LegacyRecord:
    """Everything a Keras 2 artifact holds, in plain Python and numpy.

    Attributes:
        path: The artifact read.
        format: ``"savedmodel"``, ``"h5"``, ``"checkpoint"`` or
            ``"keras_v2_zip"``.
        keras_version: The Keras version that wrote it, where recorded.
        model_config: The Keras 2 model config ``{"class_name", "config"}``
            or ``None`` (a bare checkpoint).
        training_config: The Keras 2 compile arguments, or ``None``.
        weights: ``{key: array}`` of the model's variables, in model order;
            the key is the object path in checkpoints and SavedModels
            (``layer_with_weights-0/kernel``) and the dataset's path under
            its layer's group in h5 files (``d1/d1/kernel``).
        names: ``{key: Keras 2 variable name}`` (``d1/kernel``), used to
            place the weights in a Keras 3 model.
        optimizer: :class:`OptimizerState` or ``None``.
        vocabularies: ``{layer name: (keys, values, idf_weights,
            class_name)}`` of a SavedModel's lookup layers
            (``TextVectorization``, ``StringLookup``, ``IntegerLookup``):
            the contents of each one's lookup table, strings as ``bytes``,
            the idf weights of a ``"tf_idf"`` layer (else ``None``) and
            the Keras 2 class; ``None`` for a name two such layers share.
        warnings: What the artifact lacks or what is not exact, in words.

    Example (``keras_ema_opt.savedmodel.inspect`` returns one):

    ```python
    import os
    import tempfile

    import numpy as np
    import tf_keras  # Keras 2, only to make an artifact for this example

    import keras_ema_opt

    old = tf_keras.Sequential([tf_keras.Input((3,)),
                               tf_keras.layers.Dense(2, name="d")])
    old.compile(optimizer=tf_keras.optimizers.Adam(), loss="mse")
    old.train_on_batch(np.ones((4, 3)), np.ones((4, 2)))
    path = os.path.join(tempfile.mkdtemp(), "old.h5")
    old.save(path)

    record = keras_ema_opt.savedmodel.inspect(path)
    record.format                        # "h5"
    assert record.names == {"d/d/kernel": "d/kernel", "d/d/bias": "d/bias"}
    record.weights["d/d/kernel"].shape   # (3, 2), numpy
    state = record.optimizer             # an OptimizerState
    assert (state.kind, state.class_name, state.iterations) == (
        "new", "Adam", 1)
    assert state.slot_names() == ["m", "v"]
    slot = state.slots[0]                # a Slot: Adam's m of d/kernel
    assert (slot.slot, slot.weight) == ("m", "d/d/kernel")
    ```
    """

    path: str
    format: str
    keras_version: object = None
    model_config: object = None
    training_config: object = None
    weights: dict = dataclasses.field(default_factory=dict)
    names: dict = dataclasses.field(default_factory=dict)
    optimizer: object = None
    vocabularies: dict = dataclasses.field(default_factory=dict)
    warnings: list = dataclasses.field(default_factory=list)

    def summary(self):
        """A JSON-ready description (what ``keras-ema-opt inspect`` prints)."""
        model = None
        if isinstance(self.model_config, dict):
            config = self.model_config.get("config") or {}
            model = {
                "class_name": self.model_config.get("class_name"),
                "name": config.get("name") if isinstance(config, dict)
                else None,
                "layers": len(config.get("layers") or [])
                if isinstance(config, dict) else None,
            }
        out = {
            "path": self.path,
            "format": self.format,
            "keras_version": self.keras_version,
            "model": model,
            "weights": {
                k: {"name": self.names.get(k, k), "shape": list(v.shape),
                    "dtype": str(v.dtype)}
                for k, v in self.weights.items()
            },
            "optimizer": None,
            "vocabularies": {
                name: None if table is None else len(table[0])
                for name, table in self.vocabularies.items()
            },
            "warnings": list(self.warnings),
        }
        opt = self.optimizer
        if opt is not None:
            per_variable = {}
            for s in opt.slots:
                name = self.names.get(s.weight, s.weight)
                per_variable.setdefault(name, []).append(s.slot)
            out["optimizer"] = {
                "kind": opt.kind,
                "class_name": opt.class_name,
                "config": _jsonable(opt.config),
                "iterations": int(opt.iterations),
                "learning_rate": _jsonable(opt.learning_rate),
                "hyperparameters": _jsonable(opt.hyperparameters),
                "ema": bool(opt.averages),
                "slots": per_variable,
            }
        return out


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
