"""The named optimizers: Keras 3's update rules with the Keras 2 contract.

Each class here is Keras' own class (``keras.optimizers.Adam``, ...; on
PyTorch the multi-tensor variant Keras itself builds there) with
:class:`keras_ema_opt.Optimizer` in front of it in the MRO. No update rule is
written again: on the same gradients each gives what
``keras.optimizers.<Name>`` gives.
"""

import copy
import inspect

import keras
from keras.src.optimizers.base_optimizer import BaseOptimizer

from keras_ema_opt import backend
from keras_ema_opt.averaging import Averaging
from keras_ema_opt.errors import InvalidArgumentError
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
    if any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
        # `__init__(self, *args, **kwargs)` (a backend class in between):
        # the arguments are those of Keras' base optimizer.
        sig = inspect.signature(BaseOptimizer.__init__)
    params = [
        p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD
    ]
    params.append(
        inspect.Parameter("jit_compile", inspect.Parameter.KEYWORD_ONLY,
                          default=True)
    )
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    return sig, sig.replace(parameters=params)


_CONTRACT_CLASSES = {}


def contract_class(keras_cls):
    """``keras_cls`` with the Keras 2 contract and averaging in front of it.

    The class is made once per Keras class and registered as Keras
    serializable: a class of Keras' own under ``keras_ema_opt>`` + its name
    (made at import for every Keras optimizer, so ``.keras`` files of
    ``averaged(keras.optimizers.Muon(...))`` load in a new process); any
    other class (a user's subclass, which may share a Keras name) under
    ``keras_ema_opt>`` + its module and qualified name, which never takes
    the place of Keras' own. A file holding such a class loads once this
    function has run for it.

    Args:
        keras_cls: A subclass of ``keras.optimizers.Optimizer``.

    Returns:
        A subclass of ``keras_ema_opt.Optimizer`` and ``keras_cls``.

    Example:

    ```python
    import keras
    import keras_ema_opt

    Muon = keras_ema_opt.contract_class(keras.optimizers.Muon)
    optimizer = Muon(averaging=keras_ema_opt.EMA(0.99))
    ```
    """
    if issubclass(keras_cls, Optimizer):
        return keras_cls
    cls = _CONTRACT_CLASSES.get(keras_cls)
    if cls is not None:
        return cls
    name = keras_cls.__name__
    keras_sig, public_sig = _signature(keras_cls)

    # The name of the class's `**kwargs`, whatever it is (`**kw`).
    rest = next((p.name for p in keras_sig.parameters.values()
                 if p.kind is p.VAR_KEYWORD), None)

    def __init__(self, *args, **kwargs):
        bound = keras_sig.bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        del arguments["self"]
        if rest is not None:
            arguments.update(arguments.pop(rest, {}))
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
    cls = keras.saving.register_keras_serializable(
        package="keras_ema_opt", name=_registered_name(keras_cls))(cls)
    _CONTRACT_CLASSES[keras_cls] = cls
    return cls


def _registered_name(keras_cls):
    """``Adam`` for Keras' own classes (and its backend variants of them),
    ``module.Qualname`` for any other class."""
    name = keras_cls.__name__
    own = getattr(keras.optimizers, name, None)
    package = keras_cls.__module__.split(".")[0]
    if isinstance(own, type) and issubclass(keras_cls, own) and (
            package in ("keras", "keras_ema_opt")):
        return name
    return f"{keras_cls.__module__}.{keras_cls.__qualname__}"


def _named(name):
    keras_cls = backend.keras_optimizer_class(name)
    cls = contract_class(keras_cls)
    # `keras.optimizers.<Name>` itself maps to ours too, and so do the
    # classes between (on PyTorch Keras instantiates a multi-tensor
    # subclass of it, which a backend fast path may subclass again).
    for parent in keras_cls.__mro__:
        if parent.__name__ == name and issubclass(
                parent, keras.optimizers.Optimizer):
            _CONTRACT_CLASSES.setdefault(parent, cls)
    return cls


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

# Keras' other optimizers (Lamb, Muon, ScheduleFreeAdamW, ...), made here
# so that a `.keras` file of `averaged(keras.optimizers.Muon(...))` finds
# its class in a new process; the wrappers are not update rules.
_WRAPPERS = ("Optimizer", "LossScaleOptimizer", "MultiOptimizer")
for _name, _cls in sorted(vars(keras.optimizers).items()):
    if isinstance(_cls, type) and issubclass(
            _cls, keras.optimizers.Optimizer) and _name == _cls.__name__ and (
            _name not in NAMES + _WRAPPERS):
        _named(_name)
del _name, _cls


def averaged(optimizer, averaging):
    """Add weight averaging to any Keras 3 optimizer.

    Returns a new, unbuilt optimizer of the same kind and configuration with
    ``averaging`` attached and the Keras 2 contract: Keras' own optimizers
    (``keras.optimizers.Lion``, ``Muon``, ...), a user's subclass of
    ``keras.optimizers.Optimizer`` (its ``get_config`` must round-trip), one
    of ours, or a ``keras.optimizers.LossScaleOptimizer`` (the inner
    optimizer gets the averages; averages are only updated on the steps the
    loss scale lets through).

    Args:
        optimizer: An optimizer that has not been built yet.
        averaging: ``keras_ema_opt.EMA(...)``, ``SWA(...)``, ``PowerEMA(...)``
            or another ``Averaging``.

    Returns:
        The averaged optimizer.

    Raises:
        InvalidArgumentError: an optimizer that is built, that already
            averages (Keras' ``use_ema=True``, or ``averaging=``), or a
            ``MultiOptimizer`` (average each of its optimizers instead);
            an ``averaging`` that is no strategy.

    Example:

    ```python
    import keras
    import keras_ema_opt

    optimizer = keras_ema_opt.averaged(
        keras.optimizers.Lion(learning_rate=1e-4), keras_ema_opt.EMA(0.999)
    )
    ```
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(
            "averaged() takes a Keras 3 optimizer instance. Received: "
            f"{optimizer!r}"
        )
    if optimizer.built:
        raise InvalidArgumentError(
            f"averaged() needs an optimizer that has not been built yet; "
            f"{optimizer.name} already holds state for "
            f"{len(optimizer._trainable_variables)} variables. Call "
            "averaged() before compile()/fit() or the first apply."
        )
    if not isinstance(averaging, Averaging):
        raise InvalidArgumentError(
            "averaged() takes an averaging strategy: keras_ema_opt.EMA(...), "
            f"SWA(...), PowerEMA(...). Received: averaging={averaging!r}")
    multi = getattr(keras.optimizers, "MultiOptimizer", None)
    if multi is not None and isinstance(optimizer, multi):
        raise InvalidArgumentError(
            "averaged() takes one update rule; a MultiOptimizer routes "
            "variables to several: average each of them instead "
            "(MultiOptimizer(OptimizerMap(averaged(a, ...), {pattern: "
            f"averaged(b, ...)}}))). Received: {optimizer!r}")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        config = optimizer.get_config()
        config.pop("inner_optimizer")
        inner = averaged(optimizer.inner_optimizer, averaging)
        from keras_ema_opt.compat import legacy_rules

        # A wrapper counting its skipped steps (migrated from Keras 2)
        # keeps counting them.
        cls = (legacy_rules.AveragedLegacyLossScaleOptimizer
               if isinstance(optimizer, legacy_rules.LegacyLossScaleOptimizer)
               else AveragedLossScaleOptimizer)
        return cls(inner, **config)
    if isinstance(optimizer, Optimizer):
        held = optimizer.averaging
        held = None if held is None else f"averaging={held!r}"
    else:
        held = getattr(optimizer, "use_ema", False) and (
            f"use_ema=True, ema_momentum={optimizer.ema_momentum}")
    if held:
        raise InvalidArgumentError(
            f"averaged() attaches one averaging, and {optimizer.name} "
            f"already averages ({held}): pass the optimizer without its "
            "averaging. For several averages at once, give one strategy "
            "that keeps them all: PowerEMA(sigma_rels=(...)). Received: "
            f"averaging={averaging!r}")
    rate = getattr(optimizer, "_learning_rate", None)
    live = not isinstance(rate, keras.Variable) and (
        isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)
        or callable(rate)
    )
    if live:
        # The live schedule or callable, not its serialization: a user's
        # schedule without `get_config`, an unregistered class or a lambda
        # would not come back (nor serialize at all, for the first).
        optimizer._learning_rate = 0.0
    try:
        config = optimizer.get_config()
    finally:
        if live:
            optimizer._learning_rate = rate
    if live:
        config["learning_rate"] = rate
    config["averaging"] = averaging
    new = contract_class(type(optimizer)).from_config(config)
    # What `exclude_from_weight_decay()` set is no part of the config.
    for attribute in ("_exclude_from_weight_decay",
                      "_exclude_from_weight_decay_pattern"):
        if hasattr(optimizer, attribute):
            setattr(new, attribute, copy.copy(getattr(optimizer, attribute)))
    return new


class LossScaleWrapping:
    """What ours adds to Keras' loss-scale wrapper: the averaging API
    (``average_of``, ``swap_average``, ``assign_averages``, ``averaging``,
    ``save_snapshot``, ``track_non_trainable``), reaching the inner
    optimizer, and an eager step on JAX."""

    def apply(self, grads, trainable_variables=None):
        """Keras 3's step; on JAX an eager one runs as the stateless step
        (Keras' wrapper steps with a ``cond`` whose branches assign, which
        JAX traces: its eager ``apply_gradients`` failed)."""
        if not backend.stateless_step(self, grads, trainable_variables):
            super().apply(grads, trainable_variables)

    @property
    def averaging(self):
        """The inner optimizer's averaging strategy (None without)."""
        return getattr(self.inner_optimizer, "averaging", None)

    def _averaging_optimizer(self, method):
        inner = self.inner_optimizer
        if not isinstance(inner, Optimizer) or inner.averaging is None:
            raise InvalidArgumentError(
                f"{method}() needs averages, and the inner optimizer "
                f"{inner.name} ({type(inner).__name__}) keeps none: wrap "
                "the loss-scale optimizer with keras_ema_opt.averaged(..., "
                "EMA()), or give the inner optimizer an averaging.")
        return inner

    def average_of(self, variable, slot=0):
        """The inner optimizer's ``average_of``: the current average of
        ``variable`` (see ``keras_ema_opt.Optimizer.average_of``)."""
        return self._averaging_optimizer("average_of").average_of(
            variable, slot)

    def swap_average(self, model=None, slot=0):
        """The inner optimizer's ``swap_average``: the averages in, the raw
        values back on exit (see ``keras_ema_opt.Optimizer.swap_average``).
        """
        return self._averaging_optimizer("swap_average").swap_average(
            model, slot)

    def assign_averages(self, var_list=None, slot=0):
        """The inner optimizer's ``assign_averages``: the variables
        overwritten with their averages (see
        ``keras_ema_opt.Optimizer.assign_averages``)."""
        return self._averaging_optimizer("assign_averages").assign_averages(
            var_list, slot)

    def save_snapshot(self, directory=None):
        """The inner optimizer's ``save_snapshot`` (``PowerEMA``; see
        ``keras_ema_opt.Optimizer.save_snapshot``)."""
        return self._averaging_optimizer("save_snapshot").save_snapshot(
            directory)

    def track_non_trainable(self, model):
        """The inner optimizer's ``track_non_trainable`` (see
        ``keras_ema_opt.Optimizer.track_non_trainable``)."""
        return self._averaging_optimizer(
            "track_non_trainable").track_non_trainable(model)


@keras.saving.register_keras_serializable(package="keras_ema_opt")
class AveragedLossScaleOptimizer(LossScaleWrapping,
                                 keras.optimizers.LossScaleOptimizer):
    """``LossScaleOptimizer`` whose inner optimizer keeps weight averages.

    Made by ``averaged(LossScaleOptimizer(...), averaging)``; the averaging
    API (``average_of``, ``swap_average``, ``assign_averages``,
    ``averaging``) reaches the inner optimizer.

    Example:

    ```python
    import keras
    import keras_ema_opt

    optimizer = keras_ema_opt.averaged(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
        keras_ema_opt.EMA(0.99),
    )
    ```
    """


# ---------------------------------------------------------------------------
# Keras 2's module functions: tf.keras.optimizers.get / serialize /
# deserialize, for code that used the module itself.
# ---------------------------------------------------------------------------


def serialize(optimizer, use_legacy_format=False):
    """The config of ``optimizer``, as Keras 2's
    ``tf.keras.optimizers.serialize`` gave it: Keras 3's serialization
    (``keras.optimizers.serialize``), or with ``use_legacy_format=True``
    Keras 2's ``{"class_name", "config"}``. :func:`deserialize` turns
    either back into the optimizer.

    Example:

    ```python
    import keras_ema_opt

    config = keras_ema_opt.serialize(keras_ema_opt.SGD(0.1, momentum=0.9))
    optimizer = keras_ema_opt.deserialize(config)  # SGD, momentum 0.9
    ```
    """
    if not isinstance(optimizer, BaseOptimizer):
        raise InvalidArgumentError(
            "serialize() takes a Keras optimizer. Received: "
            f"{optimizer!r} of type {type(optimizer).__name__}")
    config = keras.optimizers.serialize(optimizer)
    if use_legacy_format:
        return {"class_name": config["class_name"],
                "config": config["config"]}
    return config


def deserialize(config, custom_objects=None, use_legacy_format=False,
                use_legacy_optimizer=False):
    """An optimizer from a serialization, as Keras 2's
    ``tf.keras.optimizers.deserialize``: :func:`serialize`'s, Keras 3's
    (``keras.optimizers.serialize``) or any Keras 2 serialization
    (``compat.from_legacy_config``); Keras' classes come back as
    keras_ema_opt's. ``use_legacy_optimizer=True`` reads the config as
    OptimizerV2's (``tf.keras.optimizers.legacy``): Adagrad, Nadam and
    RMSprop without momentum come back as the legacy rules of
    ``keras_ema_opt.compat``. ``use_legacy_format`` is accepted, as Keras
    2 took it: both formats are read.

    Raises:
        LegacyConfigError: naming the class where it is unknown (pass
            ``custom_objects``), or the config where it is malformed.

    Example:

    ```python
    import keras_ema_opt

    optimizer = keras_ema_opt.deserialize(
        {"class_name": "Adam", "config": {"learning_rate": 0.01}})
    ```
    """
    from keras_ema_opt.compat import configs

    del use_legacy_format  # both formats are read
    if use_legacy_optimizer:
        if isinstance(config, str):
            config = {"class_name": config, "config": {}}
        if isinstance(config, dict):
            configs.refuse_unknown_to_optimizer_v2(config, custom_objects)
            config = dict(config, module="keras.optimizers.legacy")
    return configs.from_legacy_config(config, custom_objects)


def get(identifier, use_legacy_optimizer=False):
    """Keras 2's ``tf.keras.optimizers.get``: an optimizer instance is
    returned as it is; a name (``"adam"``) or a config goes through
    :func:`deserialize`, and comes back as keras_ema_opt's optimizer.

    Raises:
        InvalidArgumentError: for anything else, naming it (a
            ``ValueError``, as Keras 2 raised).
        LegacyConfigError: for a name or config of no known optimizer.

    Example:

    ```python
    import keras_ema_opt

    optimizer = keras_ema_opt.get("adam")  # keras_ema_opt.Adam()
    assert keras_ema_opt.get(optimizer) is optimizer
    ```
    """
    if isinstance(identifier, BaseOptimizer):
        return identifier
    if isinstance(identifier, (str, dict)):
        return deserialize(identifier,
                           use_legacy_optimizer=use_legacy_optimizer)
    raise InvalidArgumentError(
        "Could not interpret optimizer identifier: get() takes an "
        "optimizer, a name such as 'adam', or a config dict. Received: "
        f"{identifier!r} of type {type(identifier).__name__}")
