"""Keras 2 compatibility: legacy configs and OptimizerV2 update rules.

- ``from_legacy_config(config)``: any Keras 2 optimizer config -> a working
  optimizer.
- ``LegacyNadam``, ``LegacyAdagrad``, ``LegacyRMSprop``: the OptimizerV2
  rules that Keras 3 changed.

Example:

```python
from keras_ema_opt.compat import from_legacy_config

optimizer = from_legacy_config({"class_name": "Custom>Adam",
                                "config": {"learning_rate": 0.01,
                                           "is_legacy_optimizer": False}})
```
"""

from keras_ema_opt.compat.configs import from_legacy_config
from keras_ema_opt.compat.legacy_rules import LegacyAdagrad
from keras_ema_opt.compat.legacy_rules import LegacyNadam
from keras_ema_opt.compat.legacy_rules import LegacyRMSprop

__all__ = [
    "LegacyAdagrad",
    "LegacyNadam",
    "LegacyRMSprop",
    "from_legacy_config",
]
