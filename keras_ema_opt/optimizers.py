"""The named optimizers: Keras 3's update rules with the Keras 2 contract.

Each class here is Keras' own class (``keras.optimizers.Adam``, ...; on
PyTorch the multi-tensor variant Keras itself builds there) with
:class:`keras_ema_opt.Optimizer` in front of it in the MRO. No update rule is
written again: on the same gradients each gives what
``keras.optimizers.<Name>`` gives.
"""

import inspect

import keras

from keras_ema_opt import backend
from keras_ema_opt.optimizer import Optimizer

NAMES = (
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "Nadam",
    "RMSprop",
    "Ftrl",
    "Lion",
    "Adafactor",
)

_DOC = """{name} with the Keras 2 optimizer contract.

    Keras 3's ``keras.optimizers.{name}`` update rule, unchanged, plus what
    :class:`keras_ema_opt.Optimizer` adds: Keras 2's constructor validation,
    ``jit_compile``, ``minimize``, ``compute_gradients``,
    ``apply_gradients(skip_gradients_aggregation=)``, ``aggregate_gradients``,
    an assignable ``iterations``, ``lr``, Keras 2 ``add_variable`` /
    ``add_variable_from_reference`` signatures and error messages.

    Args: those of ``keras.optimizers.{name}``{signature}, and
        jit_compile: Bool, default ``True`` (see ``keras_ema_opt.Optimizer``).

    Example:

    ```python
    import keras
    import keras_ema_opt

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras_ema_opt.{name}(use_ema=True), loss="mse")
    ```

    Reference: see ``keras.optimizers.{name}``.
    """


def _signature(keras_cls):
    sig = inspect.signature(keras_cls.__init__)
    params = [
        p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD
    ]
    params.append(
        inspect.Parameter("jit_compile", inspect.Parameter.KEYWORD_ONLY,
                          default=True)
    )
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    return sig, sig.replace(parameters=params)


def _named(name):
    keras_cls = backend.keras_optimizer_class(name)
    keras_sig, public_sig = _signature(keras_cls)

    def __init__(self, *args, **kwargs):
        bound = keras_sig.bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        del arguments["self"]
        arguments.update(arguments.pop("kwargs", {}))
        self._construct(keras_cls.__init__, arguments, keras_sig)

    __init__.__signature__ = public_sig
    shown = ", ".join(
        str(p) for p in list(public_sig.parameters.values())[1:4]
    )
    cls = type(
        name,
        (Optimizer, keras_cls),
        {
            "__init__": __init__,
            "__doc__": _DOC.format(name=name, signature=f" ({shown}, ...)"),
            "__module__": "keras_ema_opt",
            "__qualname__": name,
        },
    )
    return keras.saving.register_keras_serializable(package="keras_ema_opt")(
        cls
    )


SGD = _named("SGD")
Adam = _named("Adam")
AdamW = _named("AdamW")
Adagrad = _named("Adagrad")
Adadelta = _named("Adadelta")
Adamax = _named("Adamax")
Nadam = _named("Nadam")
RMSprop = _named("RMSprop")
Ftrl = _named("Ftrl")
Lion = _named("Lion")
Adafactor = _named("Adafactor")
