"""Weight averaging: strategies (pure decay rules) and the engine (state)."""

from keras_ema_opt.averaging.batchnorm import update_bn
from keras_ema_opt.averaging.engine import assign_by_path
from keras_ema_opt.averaging.posthoc import solve_coefficients
from keras_ema_opt.averaging.strategies import EMA
from keras_ema_opt.averaging.strategies import PowerEMA
from keras_ema_opt.averaging.strategies import SWA
from keras_ema_opt.averaging.strategies import Averaging

__all__ = [
    "EMA",
    "SWA",
    "Averaging",
    "PowerEMA",
    "assign_by_path",
    "solve_coefficients",
    "update_bn",
]
