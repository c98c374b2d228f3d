"""Keras 2 compatibility: legacy configs and OptimizerV2 update rules.

- ``from_legacy_config(config)``: any Keras 2 optimizer config -> a working
  optimizer.
- ``LegacyNadam``, ``LegacyAdagrad``, ``LegacyRMSprop``: the OptimizerV2
  rules that Keras 3 changed.
- ``LegacyLossScaleOptimizer``: Keras 3's loss-scale wrapper counting its
  skipped steps in ``iterations``, as Keras 2's did.
- ``keras2_hard_sigmoid``: Keras 2's ``hard_sigmoid`` (Keras 3's has
  another slope), which migrated models use where theirs named it.
- ``losses.Huber``, ``losses.CosineSimilarity``: Keras 3's losses of those
  names, whose configs keep ``delta`` and ``axis`` (Keras 3.15's leave
  them out), which migrated models are compiled with.
- ``RestoredOptimizer`` / ``register_savedmodel_revival()``: Keras 2
  optimizers revived by ``tf.saved_model.load`` (TensorFlow needed), with
  ``to_keras(model)``.

Example:

```python
from keras_ema_opt.compat import from_legacy_config

optimizer = from_legacy_config({"class_name": "Custom>Adam",
                                "config": {"learning_rate": 0.01,
                                           "is_legacy_optimizer": False}})
```
"""

from keras_ema_opt.compat import losses
from keras_ema_opt.compat.activations import keras2_hard_sigmoid
from keras_ema_opt.compat.configs import from_legacy_config
from keras_ema_opt.compat.legacy_rules import LegacyAdagrad
from keras_ema_opt.compat.legacy_rules import LegacyLossScaleOptimizer
from keras_ema_opt.compat.legacy_rules import LegacyNadam
from keras_ema_opt.compat.legacy_rules import LegacyRMSprop
from keras_ema_opt.compat.revival import register_savedmodel_revival
from keras_ema_opt.compat.revival import maybe_register as _maybe_register

__all__ = [
    "LegacyAdagrad",
    "LegacyLossScaleOptimizer",
    "LegacyNadam",
    "LegacyRMSprop",
    "from_legacy_config",
    "keras2_hard_sigmoid",
    "losses",
    "register_savedmodel_revival",
]

_maybe_register()


def __getattr__(name):
    # `keras_ema_opt.compat.RestoredOptimizer`: made (and registered with
    # TensorFlow) on first use.
    if name == "RestoredOptimizer":
        return register_savedmodel_revival()
    raise AttributeError(name)
