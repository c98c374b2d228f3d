"""Weight averaging: strategies (pure decay rules) and the engine (state)."""

from keras_ema_opt.averaging.strategies import EMA
from keras_ema_opt.averaging.strategies import SWA
from keras_ema_opt.averaging.strategies import Averaging

__all__ = ["EMA", "SWA", "Averaging"]
