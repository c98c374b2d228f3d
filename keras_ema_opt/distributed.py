"""Helpers for multi-process training on each backend's own engine.

The optimizers need nothing from here: under ``tf.distribute``, JAX's
``keras.distribution`` and ``torch.distributed`` they aggregate gradients,
place their averages beside their variables and keep the same averages on
every replica by themselves (``docs/distributed-*.md``). What a training
script still needs is to know which process writes files, and a way to
write one there:

- :func:`is_chief`: whether this process is the one that writes (rank 0 of
  ``torch.distributed``, JAX process 0, the chief of a multi-worker
  ``tf.distribute`` strategy; always, in a single process).
- :func:`save_on_chief`: ``model.save`` on the chief only, atomically.
- :func:`on_chief`: any write of your own on the chief only; every
  process raises if it failed there, none is left waiting for the chief.

Example:

```python
import os
import tempfile

import keras
import keras_ema_opt

model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(optimizer=keras_ema_opt.Adam(use_ema=True), loss="mse")
path = os.path.join(tempfile.mkdtemp(), "model.keras")
keras_ema_opt.distributed.save_on_chief(model, path)  # writes here: one process
assert keras_ema_opt.distributed.is_chief() and os.path.exists(path)
```
"""

import contextlib
import os

from keras_ema_opt import _io
from keras_ema_opt import backend
from keras_ema_opt.errors import ChiefWriteError
from keras_ema_opt.errors import InvalidArgumentError

# What `model.save` writes, by the file's extension: a `.keras` zip, or
# the legacy HDF5 format.
_MODEL_FILE_SUFFIXES = (".keras", ".h5", ".hdf5")


def is_chief():
    """Whether this process writes files.

    Returns:
        ``True`` on rank 0 of a running ``torch.distributed`` group, on JAX
        process 0 (``jax.distributed``), on the chief of a multi-worker
        ``tf.distribute`` strategy (the ``chief`` task, else worker 0, as
        Keras 2), and in any single-process run.

    Example:

    ```python
    import keras_ema_opt

    if keras_ema_opt.distributed.is_chief():
        print("this process writes the checkpoints")
    ```
    """
    return backend.is_chief()


def save_on_chief(model, filepath):
    """``model.save(filepath)`` on the chief, through a temporary file in
    the same folder renamed into place (never a partial file); nothing on
    the other processes, which hold the same state.

    Call it on every process: on JAX several processes hold one global
    array, and the save is made so as to need none of the others (where
    a layout shards variables across processes, each process first
    gathers them whole, so that the chief writes them whole); after
    it, every process joins one small collective that tells it whether
    the chief's write failed. So do not call it under ``if is_chief():``:
    the chief would wait there for the others (as with orbax's and
    Lightning's checkpoint saves, which every process calls too).

    Args:
        model: The model (with its optimizer state and averages).
        filepath: A ``.keras`` path (or ``.h5``/``.hdf5``, Keras' legacy
            HDF5 format).

    Returns:
        ``filepath`` on the chief, ``None`` elsewhere.

    Raises:
        InvalidArgumentError: ``filepath`` ends in none of those, on every
            process.
        OSError: the file cannot be written (its folder is a file, no
            permission): on the chief, and as a ``ChiefWriteError`` (an
            ``OSError``) on every other process, which learn the chief's
            outcome in one collective: none is left waiting for the
            others.

    Example:

    ```python
    import os
    import tempfile

    import keras
    import keras_ema_opt

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    assert keras_ema_opt.distributed.save_on_chief(model, path) == path
    ```
    """
    filepath = os.fspath(filepath)
    suffix = os.path.splitext(filepath)[1]
    if suffix not in _MODEL_FILE_SUFFIXES:
        # The temporary file's extension picks the format `model.save`
        # writes: a `.keras` zip under another name would load as nothing.
        raise InvalidArgumentError(
            "save_on_chief() writes what `model.save` does, by the file's "
            f"extension: one of {', '.join(_MODEL_FILE_SUFFIXES)}. "
            f"Received: filepath={filepath!r}")

    def write():
        folder = os.path.dirname(os.path.abspath(filepath))
        os.makedirs(folder, exist_ok=True)
        with _io.temporary_beside(filepath, suffix, ".saving-") as tmp:
            with backend.chief_only_scope(), _compile_config_kept(model):
                model.save(tmp)
            _io.publish(tmp, filepath)
        return filepath

    # Every process: where variables are sharded across processes (JAX),
    # each gathers them, so that the chief saves them whole.
    with backend.whole_values_scope(_saved_variables(model)):
        return on_chief(write, filepath)


def _saved_variables(model):
    """The variables ``model.save`` writes: the model's and, once built,
    its optimizer's (slots and averages)."""
    optimizer = getattr(model, "optimizer", None)
    extra = list(getattr(optimizer, "variables", None) or [])
    return list(model.variables) + extra


def on_chief(write, path):
    """``write()`` on the chief alone; then every process learns whether it
    raised.

    Every process calls it with the same ``path``. The chief runs
    ``write`` (a callable of no arguments that writes ``path``); then every
    process joins one small collective (an all-reduce, or JAX's
    all-gather) that carries whether ``write`` raised. A write that failed
    on the chief alone would otherwise leave the other processes waiting
    for it in their next collective, until its timeout (on
    ``torch.distributed`` by default 30 minutes with gloo, 10 with NCCL;
    none under ``jax.distributed``).
    ``save_on_chief``, ``AveragedCheckpoint`` and the ``PowerEMA``
    snapshots write through it.

    Args:
        write: A callable of no arguments, run on the chief only.
        path: The file or folder it writes (named in the other processes'
            error).

    Returns:
        What ``write()`` returned, on the chief; ``None`` elsewhere.

    Raises:
        BaseException: ``write``'s own error, on the chief (a
            ``KeyboardInterrupt`` too: the others are told of it first).
        ChiefWriteError: on every other process, where ``write`` raised on
            the chief (an ``OSError``, whatever the chief's error was).

    Example:

    ```python
    import json
    import os
    import tempfile

    import keras_ema_opt

    path = os.path.join(tempfile.mkdtemp(), "notes.json")

    def write():
        with open(path, "w") as f:
            json.dump({"epochs": 3}, f)
        return path

    # Every process calls it; the chief writes.
    written = keras_ema_opt.distributed.on_chief(write, path)
    assert written == path  # one process: the chief
    ```
    """
    error = result = None
    if backend.is_chief():
        try:
            result = write()
        except BaseException as e:  # noqa: BLE001 - every process must
            error = e  # learn of it, a Ctrl-C the chief may catch too
    if backend.any_process(error is not None):
        if error is not None:
            raise error
        raise ChiefWriteError(
            f"The chief process could not write {os.fspath(path)!r} (its "
            "own error names the cause). This process stops with it, "
            "rather than wait for the chief in its next collective.",
            path=path)
    return result


@contextlib.contextmanager
def _compile_config_kept(model):
    """Keras 3.15's `.h5` writer takes the optimizer out of the model's
    own compile config (``training_config.pop("optimizer")`` on
    ``model._compile_config.config``): a later `.keras` save of the model
    then recorded no optimizer, and its load compiled Keras' default
    (RMSprop) and skipped the saved state. The config's entries are put
    back after the save."""
    config = getattr(getattr(model, "_compile_config", None), "config", None)
    kept = dict(config) if isinstance(config, dict) else None
    try:
        yield
    finally:
        if kept is not None:
            config.clear()
            config.update(kept)
