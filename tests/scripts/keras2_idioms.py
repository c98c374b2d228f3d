"""Keras 2's optimizer subclassing idiom, shared by the tests and the
scripts they run (``tests/test_keras2_subclass.py``,
``tf_mirrored_aggregation.py``)."""


def keras2_momentum_sgd(base, ops):
    """The Keras 2 subclassing idiom, verbatim apart from the ops module."""

    class MomentumSGD(base):
        def __init__(self, learning_rate=0.01, momentum=0.9,
                     name="MomentumSGD", **kwargs):
            super().__init__(name=name, **kwargs)
            self._learning_rate = self._build_learning_rate(learning_rate)
            self.momentum = momentum

        def build(self, var_list):
            super().build(var_list)
            if hasattr(self, "_built") and self._built:
                return
            self.momentums = [
                self.add_variable_from_reference(
                    model_variable=var, variable_name="m"
                )
                for var in var_list
            ]
            self._built = True

        def update_step(self, gradient, variable):
            lr = ops.cast(self.learning_rate, variable.dtype)
            m = self.momentums[self._index_dict[self._var_key(variable)]]
            m.assign(m * self.momentum - lr * gradient)
            variable.assign_add(m)

        def get_config(self):
            config = super().get_config()
            config.update({
                "learning_rate": self._serialize_hyperparameter(
                    self._learning_rate),
                "momentum": self.momentum,
            })
            return config

    return MomentumSGD
