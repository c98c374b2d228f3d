"""Keras 2 activations whose name means another function in Keras 3.

Keras 2's ``hard_sigmoid`` is ``clip(0.2 x + 0.5, 0, 1)``; Keras 3's is
``relu6(x + 3) / 6``, with a slope of 1/6 instead of 0.2. A Keras 2 model
config that names ``"hard_sigmoid"`` (the default ``recurrent_activation``
of ``ConvLSTM1D/2D/3D``) is migrated with :func:`keras2_hard_sigmoid`, so
that the model computes what it computed under Keras 2; the function is
registered, and a ``.keras`` file that uses it loads wherever
``keras_ema_opt`` is imported.

Example:

```python
import numpy as np
from keras_ema_opt.compat.activations import keras2_hard_sigmoid

y = keras2_hard_sigmoid(np.array([-3.0, -1.0, 0.0, 1.0, 3.0]))
# [0.0, 0.3, 0.5, 0.7, 1.0]
```
"""

import keras


@keras.saving.register_keras_serializable(package="keras_ema_opt")
def keras2_hard_sigmoid(x):
    """Keras 2's ``hard_sigmoid``: ``clip(0.2 x + 0.5, 0, 1)``.

    Args:
        x: A tensor.

    Returns:
        A tensor of ``x``'s shape and dtype.
    """
    x = keras.ops.convert_to_tensor(x)
    return keras.ops.clip(x * 0.2 + 0.5, 0.0, 1.0)


# Keras 2 activation name -> the registered name of the function that
# computes it in Keras 3 (data for `model_configs.upgrade_model_config`).
CHANGED_ACTIVATIONS = {
    "hard_sigmoid": "keras_ema_opt>keras2_hard_sigmoid",
}
