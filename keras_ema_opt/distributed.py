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

import os

from keras_ema_opt import _io
from keras_ema_opt import backend


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
    array, and the save is made so as to need none of the others.

    Args:
        model: The model (with its optimizer state and averages).
        filepath: A ``.keras`` path.

    Returns:
        ``filepath`` on the chief, ``None`` elsewhere.

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
    if not backend.is_chief():
        return None
    filepath = os.fspath(filepath)
    folder = os.path.dirname(os.path.abspath(filepath))
    os.makedirs(folder, exist_ok=True)
    with _io.temporary_beside(filepath, ".keras", ".saving-") as tmp:
        with backend.chief_only_scope():
            model.save(tmp)
        _io.publish(tmp, filepath)
    return filepath
