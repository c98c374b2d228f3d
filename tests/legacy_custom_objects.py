"""Keras 3 twins of the custom classes in ``scripts/make_legacy_artifacts.py``
(``--custom-objects legacy_custom_objects`` in the migration tests) and of
the custom loss in ``scripts/make_compile_artifacts.py``, and a model
builder for ``--model legacy_custom_objects:mlp_adam_ema``."""

import keras

import keras_ema_opt


class Scale(keras.layers.Layer):
    """``y = x * w + b`` per feature (``keo_test>Scale`` in Keras 2)."""

    def __init__(self, init=1.0, **kwargs):
        super().__init__(**kwargs)
        self.init = init

    def build(self, input_shape):
        self.w = self.add_weight(
            name="w", shape=(input_shape[-1],),
            initializer=keras.initializers.Constant(self.init))
        self.b = self.add_weight(name="b", shape=(input_shape[-1],),
                                 initializer="zeros")

    def call(self, x):
        return x * self.w + self.b

    def get_config(self):
        return {**super().get_config(), "init": self.init}


def my_loss(y_true, y_pred):
    """The custom loss of ``scripts/make_compile_artifacts.py``."""
    return keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1) * 2.0


CUSTOM_OBJECTS = {"keo_test>Scale": Scale, "Scale": Scale}


def mlp_adam_ema():
    """The ``mlp`` model of the artifact script, compiled with the optimizer
    of its ``adam_ema`` case: what a user passes for a bare checkpoint."""
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(5, activation="relu", name="d1"),
        keras.layers.Dense(2, name="d2"),
    ], name="mlp")
    model.compile(optimizer=keras_ema_opt.Adam(
        learning_rate=0.01, use_ema=True, ema_momentum=0.9, amsgrad=True),
        loss="mse")
    return model
