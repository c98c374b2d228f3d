"""keras-ema-opt: weight averaging for every Keras 3 optimizer.

Public names:

- :class:`Optimizer`: the base class, a Keras 3 optimizer with the Keras 2
  optimizer contract.
- ``SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, Nadam, RMSprop, Ftrl, Lion,
  Adafactor``: Keras 3's update rules with that contract.
- ``get``, ``serialize``, ``deserialize``: Keras 2's
  ``tf.keras.optimizers`` module functions, giving these optimizers.

Example:

```python
import keras
import keras_ema_opt

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
model.compile(optimizer=keras_ema_opt.AdamW(use_ema=True), loss="mse")
```
"""

import keras

from keras_ema_opt import callbacks
from keras_ema_opt import compat
from keras_ema_opt import distributed
from keras_ema_opt import errors
from keras_ema_opt import averaging
from keras_ema_opt import savedmodel
from keras_ema_opt.savedmodel import load_legacy
from keras_ema_opt.averaging import EMA
from keras_ema_opt.averaging import PowerEMA
from keras_ema_opt.averaging import SWA
from keras_ema_opt.averaging import Averaging
from keras_ema_opt.averaging import update_bn
from keras_ema_opt.optimizer import Optimizer
from keras_ema_opt.optimizers import SGD
from keras_ema_opt.optimizers import AveragedLossScaleOptimizer
from keras_ema_opt.optimizers import averaged
from keras_ema_opt.optimizers import contract_class
from keras_ema_opt.optimizers import deserialize
from keras_ema_opt.optimizers import get
from keras_ema_opt.optimizers import serialize
from keras_ema_opt.optimizers import Adadelta
from keras_ema_opt.optimizers import Adafactor
from keras_ema_opt.optimizers import Adagrad
from keras_ema_opt.optimizers import Adam
from keras_ema_opt.optimizers import Adamax
from keras_ema_opt.optimizers import AdamW
from keras_ema_opt.optimizers import Ftrl
from keras_ema_opt.optimizers import Lion
from keras_ema_opt.optimizers import Nadam
from keras_ema_opt.optimizers import RMSprop

Optimizer = keras.saving.register_keras_serializable(package="keras_ema_opt")(
    Optimizer
)

__version__ = "0.1.0.dev0"

__all__ = [
    "load_legacy",
    "savedmodel",
    "EMA",
    "PowerEMA",
    "SWA",
    "Averaging",
    "update_bn",
    "AveragedLossScaleOptimizer",
    "averaged",
    "contract_class",
    "deserialize",
    "get",
    "serialize",
    "SGD",
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Ftrl",
    "Lion",
    "Nadam",
    "Optimizer",
    "RMSprop",
    "averaging",
    "callbacks",
    "distributed",
    "errors",
]
