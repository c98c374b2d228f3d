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


def _arguments_lost(loss):
    """The arguments of Keras loss object ``loss`` that its config leaves
    out (``{name: value}``, as its class rebuilds it from that config
    without them); ``{}`` where it keeps them all, or is no loss object
    with arguments."""
    kwargs = getattr(loss, "_fn_kwargs", None)
    if not kwargs or not isinstance(loss, keras.losses.Loss):
        return {}
    try:
        again = type(loss).from_config(loss.get_config())
    except (TypeError, ValueError):
        return {}
    kept = getattr(again, "_fn_kwargs", {})
    return {k: v for k, v in kwargs.items()
            if k not in kept or not _same(kept[k], v)}


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
    if keeping is None or not _arguments_lost(loss):
        return loss
    config = keras.losses.Loss.get_config(loss)
    return keeping(**config, **loss._fn_kwargs)


def _same(a, b):
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # arrays: elementwise
        return a is b
