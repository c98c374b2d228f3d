"""Keras 3 losses whose config keeps their arguments.

Keras 3.15's ``Huber`` and ``CosineSimilarity`` leave ``delta`` and
``axis`` out of their config: a model compiled with ``Huber(delta=0.5)``
and saved to ``.keras`` is reloaded with ``delta=1.0``, and trains on
another loss with no warning. A migrated model whose Keras 2 loss was one
of them is compiled with the class of the same name here (a subclass of
Keras', which computes the same loss and writes its argument into its
config); it is registered, and a ``.keras`` file that uses it loads
wherever ``keras_ema_opt`` is imported. :func:`keeping_arguments` makes
that choice for any loss, and leaves alone one whose config already keeps
its arguments.

Example:

```python
import keras
from keras_ema_opt.compat.losses import keeping_arguments

loss = keeping_arguments(keras.losses.Huber(delta=0.5))
again = keras.losses.deserialize(keras.losses.serialize(loss))
assert float(again(keras.ops.zeros((1, 1)), keras.ops.ones((1, 1)))) == 0.375
```
"""

import keras
import numpy as np


def _config_with(loss, name):
    config = keras.losses.Loss.get_config(loss)
    config[name] = loss._fn_kwargs[name]
    return config


@keras.saving.register_keras_serializable(package="keras_ema_opt")
class Huber(keras.losses.Huber):
    """``keras.losses.Huber`` whose config keeps ``delta``.

    Example:

    ```python
    import keras
    from keras_ema_opt.compat.losses import Huber

    loss = Huber(delta=0.5)
    assert keras.losses.deserialize(
        keras.losses.serialize(loss))._fn_kwargs["delta"] == 0.5
    ```
    """

    def get_config(self):
        return _config_with(self, "delta")


@keras.saving.register_keras_serializable(package="keras_ema_opt")
class CosineSimilarity(keras.losses.CosineSimilarity):
    """``keras.losses.CosineSimilarity`` whose config keeps ``axis``.

    Example:

    ```python
    import keras
    from keras_ema_opt.compat.losses import CosineSimilarity

    loss = CosineSimilarity(axis=0)
    assert keras.losses.deserialize(
        keras.losses.serialize(loss))._fn_kwargs["axis"] == 0
    ```
    """

    def get_config(self):
        return _config_with(self, "axis")


_KEEPING = {keras.losses.Huber: Huber,
            keras.losses.CosineSimilarity: CosineSimilarity}


def loss_form(loss):
    """What a compiled loss computes, comparable across a save: for each
    loss object its function's (or class's) name, arguments and
    reduction, in the structure ``compile`` took (a name or function as
    its name). Argument values are taken as a file gives them back:
    ``np.float32(0.5)`` and ``0.5``, ``(1, 2)`` and ``[1, 2]`` are the
    same.

    Example:

    ```python
    import keras
    from keras_ema_opt.compat.losses import loss_form

    assert loss_form(keras.losses.Huber(delta=0.5)) != loss_form(
        keras.losses.Huber())
    ```
    """
    if isinstance(loss, dict):
        return {k: loss_form(v) for k, v in loss.items()}
    if isinstance(loss, (list, tuple)):
        return [loss_form(v) for v in loss]
    if isinstance(loss, keras.losses.Loss):
        fn = getattr(loss, "fn", None)
        if fn is not None:
            arguments = {k: _plain(v) for k, v in loss._fn_kwargs.items()}
            return (getattr(fn, "__name__", repr(fn)), arguments,
                    loss.reduction)
        config = {k: _plain(v) for k, v in loss.get_config().items()
                  if k != "name"}
        return (type(loss).__name__, config, loss.reduction)
    return getattr(loss, "__name__", loss)


def _plain(value):
    try:
        return np.asarray(value).tolist()
    except (TypeError, ValueError):
        return repr(value)


def _config_loses_arguments(loss):
    """Whether ``loss``'s class, rebuilt from its config, computes another
    loss (its config leaves out an argument)."""
    try:
        again = type(loss).from_config(loss.get_config())
    except (TypeError, ValueError):
        return False
    return loss_form(again) != loss_form(loss)


def keeping_arguments(loss):
    """``loss`` (a loss object, or a list or dict of them, as ``compile``
    takes), with each Keras loss whose config leaves out its arguments
    (Keras 3.15's ``Huber`` and ``CosineSimilarity``) replaced by this
    module's class of the same name and arguments. Anything else is
    returned as it is.

    Example:

    ```python
    import keras
    from keras_ema_opt.compat import losses

    kept = losses.keeping_arguments(
        {"a": keras.losses.Huber(delta=0.5), "b": "mse"})
    assert isinstance(kept["a"], losses.Huber)
    assert kept["a"].get_config()["delta"] == 0.5 and kept["b"] == "mse"
    ```
    """
    if isinstance(loss, dict):
        return {k: keeping_arguments(v) for k, v in loss.items()}
    if isinstance(loss, (list, tuple)):
        return type(loss)(keeping_arguments(v) for v in loss)
    keeping = _KEEPING.get(type(loss))
    if keeping is None or not _config_loses_arguments(loss):
        return loss
    config = keras.losses.Loss.get_config(loss)
    return keeping(**config, **loss._fn_kwargs)

