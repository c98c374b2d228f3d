"""Keras 2 training state into Keras 3, without TensorFlow.

Readers for tf.keras SavedModel directories, full ``.h5`` files, TF object
checkpoints (``tf.train.Checkpoint`` and ``save_weights`` TF format) and
tf_keras ``.keras`` files produce one plain :class:`LegacyRecord`; the
migration builds the Keras 3 model from its config and gives it the
weights and the optimizer state, so that training resumes exactly on any
backend. Layouts and rules: ``docs/migration.md``.

Example:

```python
import os
import tempfile

import numpy as np
import tf_keras  # Keras 2, only to make an artifact for this example

import keras_ema_opt

old = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
old.compile(optimizer=tf_keras.optimizers.Adam(use_ema=True), loss="mse")
old.train_on_batch(np.ones((4, 3)), np.ones((4, 2)))
path = os.path.join(tempfile.mkdtemp(), "old_model.h5")
old.save(path)

record = keras_ema_opt.savedmodel.inspect(path)     # plain numpy data
assert record.optimizer.iterations == 1
model = keras_ema_opt.load_legacy(path)             # compiled, with state
model.train_on_batch(np.ones((4, 3)), np.ones((4, 2)))  # resumes
```
"""

import os
import warnings

import numpy as np

from keras_ema_opt import _io
from keras_ema_opt.errors import InvalidArgumentError
from keras_ema_opt.errors import LegacyStateError
from keras_ema_opt.savedmodel import convert
from keras_ema_opt.savedmodel import readers
from keras_ema_opt.savedmodel.record import LegacyRecord
from keras_ema_opt.savedmodel.record import OptimizerState
from keras_ema_opt.savedmodel.record import Slot


def inspect(path):
    """Read a Keras 2 artifact into a :class:`LegacyRecord` (numpy only).

    Args:
        path: A SavedModel directory, a full ``.h5`` file, a TF checkpoint
            prefix (or its ``.index`` file, or a folder with a
            ``checkpoint`` file), or a tf_keras ``.keras`` file.

    Returns:
        The record: model config, weights by object path, optimizer class,
        config, iterations, learning rate, slots and EMA averages.

    Raises:
        keras_ema_opt.errors.LegacyFormatError: naming the file (and key)
            when it is not such an artifact or is damaged.

    Example:

    ```python
    import os
    import tempfile

    import numpy as np
    import tf_keras  # Keras 2, only to make an artifact for this example

    import keras_ema_opt

    old = tf_keras.Sequential([tf_keras.Input((3,)),
                               tf_keras.layers.Dense(2, name="d")])
    old.compile(optimizer=tf_keras.optimizers.Adam(use_ema=True), loss="mse")
    old.train_on_batch(np.ones((4, 3)), np.ones((4, 2)))
    path = os.path.join(tempfile.mkdtemp(), "old.h5")
    old.save(path)

    record = keras_ema_opt.savedmodel.inspect(path)
    assert record.optimizer.class_name == "Adam"
    assert sorted(record.names.values()) == ["d/bias", "d/kernel"]
    assert len(record.optimizer.averages) == 2  # the EMA of each weight
    ```
    """
    return readers.read(path)


def model_from_config(config, custom_objects=None, safe_mode=True):
    """A Keras 3 model from a Keras 2 model config (a dict or its JSON, as
    ``model.to_json()`` / ``model.get_config()`` wrote it in Keras 2).

    Raises:
        LegacyConfigError: a Lambda layer under ``safe_mode``, a removed
            argument with a value that mattered, an unknown class (named).

    Example:

    ```python
    import tf_keras  # Keras 2, only to make a config for this example

    from keras_ema_opt.savedmodel import model_from_config

    old = tf_keras.Sequential([
        tf_keras.layers.InputLayer(batch_input_shape=(None, 3)),
        tf_keras.layers.Dense(2, activation="relu"),
    ])
    model = model_from_config(old.to_json())  # `batch_input_shape` and all
    assert model.output_shape == (None, 2)
    ```
    """
    import json

    if isinstance(config, (str, bytes)):
        config = json.loads(config, object_hook=readers._tuples)
    record = LegacyRecord(path="<config>", format="config",
                          model_config=config)
    return convert.build_model(record, custom_objects, safe_mode)


def load_legacy(path, custom_objects=None, safe_mode=True, model=None):
    """A compiled Keras 3 model holding a Keras 2 artifact's training state.

    Args:
        path: As for :func:`inspect`.
        custom_objects: Dict of custom layers, losses and optimizers by
            name.
        safe_mode: Refuse Lambda layers (marshalled bytecode), as Keras 3
            does; ``False`` to load them from a trusted file.
        model: A Keras 3 model (or a function returning one) to use instead
            of the artifact's config: required for bare checkpoints. If it
            is compiled, its optimizer receives the state (a bare
            checkpoint records no optimizer config).

    Returns:
        The model, compiled with the migrated optimizer (every slot, the
        iteration count, the learning rate, the EMA averages).

    Raises:
        LegacyFormatError, LegacyConfigError, LegacyStateError: naming the
        file, key, class or variable.

    Example:

    ```python
    import os
    import tempfile

    import numpy as np
    import tf_keras  # Keras 2, only to make an artifact for this example

    import keras_ema_opt

    old = tf_keras.Sequential([tf_keras.Input((3,)),
                               tf_keras.layers.Dense(2)])
    old.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                loss="mse")
    old.train_on_batch(np.ones((4, 3)), np.ones((4, 2)))
    folder = os.path.join(tempfile.mkdtemp(), "old_savedmodel")
    old.save(folder, save_format="tf")

    model = keras_ema_opt.load_legacy(folder)
    assert int(model.optimizer.iterations) == 1
    model.train_on_batch(np.ones((4, 3)), np.ones((4, 2)))
    ```
    """
    return _load(path, custom_objects, safe_mode, model)[0]


def _load(path, custom_objects, safe_mode, model):
    """(model, record, {record weight key: model variable}, [(what,
    optimizer variable, source value)]); the model's compile config is
    made portable (``_portable_compile_config``)."""
    loaded = _load_model(path, custom_objects, safe_mode, model)
    _portable_compile_config(loaded[0])
    return loaded


def _portable_compile_config(model):
    """Make the compile config that ``model.save`` writes train, where the
    file is loaded, as the model trains here, also for a model given
    compiled: each Keras loss whose config leaves out its argument
    (``Huber``'s ``delta``, ``CosineSimilarity``'s ``axis``) becomes
    ``keras_ema_opt.compat.losses``' class of that name, and a
    ``jit_compile`` equal to what ``"auto"`` resolves to on this backend
    is written as ``"auto"``. The model's own training is unchanged.

    Keras stores the value ``"auto"`` resolves to (True on JAX), and a
    file written there would turn ``torch.compile`` on when it is loaded
    on PyTorch. Keras 2 configs do not hold the choice (the models
    compiled from them here pass ``"auto"``), and Keras cannot tell a
    given model's resolved value from the same value chosen: each
    backend makes its own choice where the file is loaded, and only a
    value ``"auto"`` would not give is kept."""
    from keras_ema_opt.compat import losses

    holder = getattr(model, "_compile_config", None)
    config = getattr(holder, "config", None)
    if not isinstance(config, dict):
        return  # not compiled
    if config.get("loss") is not None:
        config["loss"] = losses.keeping_arguments(config["loss"])
    jit = config.get("jit_compile")
    resolve = getattr(model, "_resolve_auto_jit_compile", None)
    if isinstance(jit, bool) and resolve is not None and not config.get(
            "run_eagerly") and jit == bool(resolve()):
        config["jit_compile"] = "auto"


def _load_model(path, custom_objects, safe_mode, model):
    """``_load``'s tuple, before the compile config is made portable."""
    from keras_ema_opt.compat import configs

    record = readers.read(path)
    if record.format == "keras_v2_zip":
        model = _load_keras_zip(record, custom_objects, safe_mode, model)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            # Built on the model, as below: the written file then holds
            # the variables Keras builds when it is loaded.
            optimizer.build(model.trainable_variables)
        return model, record, {}, []
    given = model is not None
    model = _given_model(record, custom_objects, safe_mode, model)
    convert.set_vocabularies(record, model)
    convert.check_vocabularies(record, model)
    mapping = convert.assign_weights(record, model, given=given)
    optimizer = getattr(model, "optimizer", None)
    placed = []
    if record.optimizer is not None:
        if optimizer is None:
            optimizer = convert.optimizer_from_record(record, custom_objects)
        convert.fill_optimizer(record, optimizer, mapping, model, placed)
        _warn_loss_scale(record, optimizer)
    elif optimizer is None:
        config = (record.training_config or {}).get("optimizer_config")
        if config is not None:
            optimizer = configs.from_legacy_config(config, custom_objects)
    if getattr(model, "optimizer", None) is None or not getattr(
            model, "compiled", False):
        if optimizer is None:
            warnings.warn(
                f"{record.path} holds no optimizer and no training config "
                "(an uncompiled model, or one saved with "
                "`include_optimizer=False`): the Keras 3 model is not "
                "compiled.", stacklevel=3)
            return model, record, mapping, placed
        arguments = convert.compile_arguments(record, custom_objects)
        if "loss" not in arguments and record.training_config is None:
            # (A training config without a loss: the model's own losses,
            # add_loss, as it was compiled.)
            warnings.warn(
                f"{record.path} holds no loss (a checkpoint keeps no "
                "training config): the Keras 3 model is compiled with its "
                "optimizer alone, and fit() trains on the model's own "
                "losses (add_loss) only, 0 where it has none. Pass the "
                "model compiled with its loss (load_legacy(path, "
                "model=build) with a build that compiles it, or "
                "--model module:function): the state goes into its "
                "optimizer.", stacklevel=3)
        model.compile(optimizer=optimizer, **arguments)
    if record.optimizer is None:
        inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        warnings.warn(
            f"{record.path} holds no optimizer state (the optimizer had not "
            "taken a step, or was not saved): "
            f"{type(inner).__name__} starts fresh (iterations 0, its slots "
            "and averages new).", stacklevel=3)
    if not model.optimizer.built:
        # Built on the model, so that the written file holds its variables
        # (Keras builds it when the file is loaded).
        model.optimizer.build(model.trainable_variables)
    return model, record, mapping, placed


def _given_model(record, custom_objects, safe_mode, model):
    """The Keras 3 model: built from the record's config, or the one given
    (a model, or a function returning one)."""
    import keras

    if model is None:
        return convert.build_model(record, custom_objects, safe_mode)
    built = model
    if callable(model) and not isinstance(model, keras.Model):
        built = model()
    if not isinstance(built, keras.Model):
        raise InvalidArgumentError(
            "`model` must be a Keras 3 model, or a function returning one. "
            f"Received: {model!r}, which gave {type(built).__name__}.")
    return built


def _warn_loss_scale(record, optimizer):
    """h5 files do not store a loss-scale optimizer's dynamic scale."""
    if hasattr(optimizer, "dynamic_scale") and (
            "current_loss_scale" not in record.optimizer.hyperparameters):
        warnings.warn(
            f"{record.path} does not store the loss scale of its "
            "LossScaleOptimizer (h5 files do not): the dynamic scale and "
            "its count of good steps start again from the initial scale. "
            "A SavedModel or checkpoint of the same model keeps them.",
            stacklevel=4)


def _load_keras_zip(record, custom_objects, safe_mode, model):
    """A tf_keras ``.keras`` file: the model and its weights, compiled with
    a fresh optimizer from its config (the file keeps the optimizer's state
    by position only: a warning names what is not migrated)."""
    from keras_ema_opt.compat import configs

    model = _given_model(record, custom_objects, safe_mode, model)
    convert.assign_layout_weights(record, model)
    convert.load_zip_assets(record, model)
    convert.check_vocabularies(record, model)
    for message in record.warnings:
        warnings.warn(message, stacklevel=4)
    if getattr(model, "compiled", False) and model.optimizer is not None:
        return model
    if record.training_config is None:
        warnings.warn(
            f"{record.path} holds no compile config (an uncompiled model): "
            "the Keras 3 model is not compiled.", stacklevel=4)
        return model
    config = (record.training_config or {}).get("optimizer")
    optimizer = (configs.from_legacy_config(config, custom_objects)
                 if config else "rmsprop")
    model.compile(optimizer=optimizer,
                  **convert.compile_arguments(record, custom_objects))
    return model


def restore_checkpoint(model, path, optimizer=None):
    """Restore a TF checkpoint (``tf.train.Checkpoint`` or ``save_weights``)
    into a Keras 3 model you built.

    Args:
        model: The Keras 3 model, with the architecture the checkpoint was
            written from.
        path: The checkpoint prefix (or ``.index`` file, or folder).
        optimizer: The Keras 3 optimizer to fill; default ``model.optimizer``,
            else one made from the checkpoint's structure.

    Returns:
        The optimizer holding the state (``None`` when the checkpoint has
        none); the model holds the weights.

    Example:

    ```python
    import os
    import tempfile

    import numpy as np
    import tensorflow as tf  # only to write a checkpoint for this example
    import tf_keras

    import keras
    import keras_ema_opt

    old = tf_keras.Sequential([tf_keras.Input((3,)),
                               tf_keras.layers.Dense(2, name="d")])
    old.compile(optimizer=tf_keras.optimizers.SGD(0.1, momentum=0.9),
                loss="mse")
    old.train_on_batch(np.ones((4, 3)), np.ones((4, 2)))
    prefix = os.path.join(tempfile.mkdtemp(), "ckpt")
    tf.train.Checkpoint(model=old, optimizer=old.optimizer).write(prefix)

    # The weights are placed by their Keras 2 names: the same layer names.
    model = keras.Sequential([keras.Input((3,)),
                              keras.layers.Dense(2, name="d")])
    model.compile(optimizer=keras_ema_opt.SGD(0.1, momentum=0.9),
                  loss="mse")
    keras_ema_opt.savedmodel.restore_checkpoint(model, prefix)
    assert int(model.optimizer.iterations) == 1
    ```
    """
    record = readers.read(path)
    mapping = convert.assign_weights(record, model, given=True)
    if record.optimizer is None:
        return None
    optimizer = optimizer or getattr(model, "optimizer", None) or (
        convert.optimizer_from_record(record))
    return convert.fill_optimizer(record, optimizer, mapping, model)


def migrate(src, dst, custom_objects=None, safe_mode=True, model=None,
            verify=True, progress=None, overwrite=True):
    """Write the Keras 3 ``.keras`` file of a Keras 2 artifact, atomically.

    The file is written to a temporary name beside ``dst``, then (unless
    ``verify=False``) reloaded: every model and optimizer tensor is compared
    with the migrated model and with the source artifact, the reloaded
    loss with the migrated model's (the same functions, arguments and
    reductions), and one forward pass runs; only then is it renamed to
    ``dst``. On any failure no file
    is left at ``dst``.

    Args:
        src, custom_objects, safe_mode, model: As for :func:`load_legacy`.
        dst: The ``.keras`` file to write.
        verify: Reload and compare before renaming (default).
        progress: Called with a message at each stage; if it also has an
            ``update(done, total)`` method, that is called while tensors
            are compared (``keras-ema-opt migrate`` shows a counter).
        overwrite: Whether an existing ``dst`` may be replaced (the
            command refuses it unless given ``--overwrite``). ``src``
            itself is never replaced.

    Returns:
        The migrated model.

    Example:

    ```python
    import os
    import tempfile

    import numpy as np
    import tf_keras  # Keras 2, only to make an artifact for this example

    import keras
    import keras_ema_opt

    old = tf_keras.Sequential([tf_keras.Input((3,)),
                               tf_keras.layers.Dense(2)])
    old.compile(optimizer=tf_keras.optimizers.Adam(use_ema=True), loss="mse")
    old.train_on_batch(np.ones((4, 3)), np.ones((4, 2)))
    folder = tempfile.mkdtemp()
    old.save(os.path.join(folder, "old.h5"))

    keras_ema_opt.savedmodel.migrate(os.path.join(folder, "old.h5"),
                                     os.path.join(folder, "new.keras"))
    model = keras.saving.load_model(os.path.join(folder, "new.keras"))
    assert int(model.optimizer.iterations) == 1
    ```
    """
    import keras

    say = progress or (lambda message: None)
    if not str(dst).endswith(".keras"):
        raise InvalidArgumentError(
            f"The destination must be a .keras file. Received: {dst}")
    directory = os.path.dirname(os.path.abspath(dst))
    if os.path.isdir(dst):
        raise InvalidArgumentError(
            f"The destination {dst} is a directory: expected the path of a "
            ".keras file to write.")
    if not os.path.isdir(directory):
        raise InvalidArgumentError(
            f"The folder of the destination {dst} does not exist "
            f"({directory}): create it first.")
    if os.path.exists(dst) and os.path.exists(src) and os.path.samefile(
            src, dst):
        raise InvalidArgumentError(
            f"The destination {dst} is the source itself: the migration "
            "would replace the Keras 2 state it reads. Write it elsewhere.")
    if not overwrite and os.path.lexists(dst):
        raise InvalidArgumentError(
            f"The destination {dst} exists: it is replaced only with "
            "overwrite=True (`keras-ema-opt migrate --overwrite`).")
    # The temporary file first: an unwritable folder fails before the
    # conversion, named by the destination.
    with _io.temporary_beside(dst, ".keras", ".migrate-") as tmp:
        say(f"reading {src}")
        migrated, record, mapping, placed = _load(src, custom_objects,
                                                  safe_mode, model)
        say(f"writing {dst}")
        migrated.save(tmp)
        if verify:
            say("verifying: reload, compare every tensor with the model "
                "and the source, one forward pass")
            try:
                reloaded = keras.saving.load_model(
                    tmp, custom_objects=custom_objects, safe_mode=safe_mode)
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise LegacyStateError(
                    f"{src} -> {dst}: Keras 3 cannot load the .keras file "
                    f"it wrote for this model ({type(e).__name__}: "
                    f"{convert._first_line(e)}). No file was written.",
                ) from e
            try:
                verify_same(migrated, reloaded, progress)
            except LegacyStateError as e:
                raise LegacyStateError(
                    f"{src} -> {dst}: {e} No file was written.") from e
            _verify_source(record, mapping, placed, migrated, reloaded)
            _verify_loss(src, dst, migrated, reloaded)
        _io.publish(tmp, dst)
    say("done")
    return migrated


def verify_same(expected, actual, progress=None):
    """Every weight and optimizer variable equal, and a forward pass runs.

    Raises:
        LegacyStateError: naming the first tensor that differs.

    Example:

    ```python
    import os
    import tempfile

    import numpy as np

    import keras
    import keras_ema_opt

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras_ema_opt.Adam(use_ema=True), loss="mse")
    model.train_on_batch(np.ones((4, 3)), np.ones((4, 2)))
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    keras_ema_opt.savedmodel.verify_same(model, keras.saving.load_model(path))
    ```
    """
    from keras import ops

    pairs = list(zip(expected.weights, actual.weights))
    want = getattr(expected, "optimizer", None)
    got = getattr(actual, "optimizer", None)
    if want is not None and got is not None:
        pairs += list(zip(want.variables, got.variables))
    if len(expected.weights) != len(actual.weights) or (
            (want is None) != (got is None)) or (
            want is not None and len(want.variables) != len(got.variables)):
        raise LegacyStateError(
            "The written .keras file does not hold the same number of "
            "variables as the migrated model.")
    update = getattr(progress, "update", None)
    for done, (a, b) in enumerate(pairs, 1):
        x = np.asarray(ops.convert_to_numpy(a))
        y = np.asarray(ops.convert_to_numpy(b))
        if x.shape != y.shape or not np.array_equal(x, y):
            raise LegacyStateError(
                f"{a.path} differs after writing and reloading the .keras "
                "file.")
        if update is not None:
            update(done, len(pairs))
    _verify_vocabularies(expected, actual)
    inputs = _probe_inputs(actual)
    if inputs is not None:
        try:
            actual.predict(inputs if len(inputs) > 1 else inputs[0],
                           verbose=0)
        except Exception as e:  # the backend's own error types, any of them
            raise LegacyStateError(
                "The written .keras file's model fails its forward pass on "
                f"zeros of its inputs' shapes and dtypes ({type(e).__name__}"
                f": {convert._first_line(e)}).") from e


def _verify_vocabularies(expected, actual):
    """The vocabularies of lookup layers (kept as assets, not variables)
    are the same after writing and reloading."""
    def vocabularies(model):
        return [(layer.name, list(layer.get_vocabulary()))
                for layer in model._flatten_layers(include_self=False)
                if callable(getattr(layer, "get_vocabulary", None))]

    for (name, want), (_, got) in zip(vocabularies(expected),
                                      vocabularies(actual)):
        want, got = [str(t) for t in want], [str(t) for t in got]
        if want != got:
            raise LegacyStateError(
                f"The vocabulary of layer {name!r} differs after writing "
                "and reloading the .keras file: "
                + convert.first_difference(want, "before", got, "after")
                + ".")


def _probe_inputs(model):
    """Zeros for one forward pass of ``model``: of its inputs' shapes (empty
    strings for a string input), or, for a subclassed model (which has no
    ``inputs``), of the shape it was built on (``get_build_config``); None
    where neither is known, or where a string input or output meets a
    backend whose tensors cannot hold one (the tensors were compared
    already)."""
    from keras_ema_opt import backend

    tensors = getattr(model, "inputs", None)
    if backend.string_probe([1]) is None and any(
            "string" in str(getattr(layer, "dtype", ""))
            for layer in model._flatten_layers(include_self=False)):
        # A layer that gives strings: an inverted StringLookup, whose
        # symbolic output Keras 3 types int64.
        return None
    if tensors:
        probes = [
            backend.string_probe([1 if d is None else d for d in t.shape])
            if _dtype(t) == "string" else
            np.zeros([1 if d is None else d for d in t.shape],
                     dtype=_dtype(t)) for t in tensors]
        # None: a string input the backend cannot feed a model.
        return None if any(p is None for p in probes) else probes
    build = getattr(model, "get_build_config", lambda: None)()
    shape = (build or {}).get("input_shape")
    if not isinstance(shape, (list, tuple)) or not all(
            isinstance(d, int) or d is None for d in shape):
        return None  # several inputs, or a structure: not guessed
    return [np.zeros([1 if d is None else d for d in shape],
                     dtype="float32")]


def _verify_source(record, mapping, placed, migrated, reloaded):
    """The reloaded weights and optimizer state equal the source
    artifact's, tensor by tensor."""
    from keras import ops

    def check(got, want, what):
        got = np.asarray(ops.convert_to_numpy(got))
        want = np.asarray(want).astype(got.dtype)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise LegacyStateError(
                f"{record.path}: {what} differs from the source after "
                "writing and reloading.")

    position = {id(v): i for i, v in enumerate(migrated.weights)}
    for key, var in mapping.items():
        check(reloaded.weights[position[id(var)]], record.weights[key],
              f"weight {key!r}")
    if not placed:
        return
    position = {id(v): i for i, v in enumerate(migrated.optimizer.variables)}
    for what, var, value in placed:
        check(reloaded.optimizer.variables[position[id(var)]], value,
              f"optimizer state {what}")


def _verify_loss(src, dst, migrated, reloaded):
    """The reloaded model's loss computes what the migrated model's does:
    the same functions, with the same arguments and reductions."""
    from keras_ema_opt.compat.losses import loss_form

    want = loss_form(getattr(migrated, "loss", None))
    got = loss_form(getattr(reloaded, "loss", None))
    if want != got:
        raise LegacyStateError(
            f"{src} -> {dst}: the loss differs after writing and reloading "
            f"the .keras file: {want} migrated, {got} reloaded. No file was "
            "written.")


def _dtype(tensor):
    dtype = str(getattr(tensor, "dtype", "float32"))
    if "string" in dtype:
        return "string"
    return "int32" if "int" in dtype else "float32"


__all__ = [
    "LegacyRecord",
    "OptimizerState",
    "Slot",
    "inspect",
    "load_legacy",
    "migrate",
    "model_from_config",
    "restore_checkpoint",
    "verify_same",
]
