"""``Optimizer``: the Keras 2 optimizer contract on a Keras 3 optimizer.

The public contract of the Keras 2 "experimental" optimizer
(``keras/optimizers/optimizer_experimental/optimizer.py`` in Keras 2.9-2.10,
``tf.keras.optimizers.Optimizer`` from 2.11 on, ``tf_keras`` today) carried
onto ``keras.optimizers.Optimizer``: its constructor arguments and their
validation, ``minimize``, ``compute_gradients``,
``apply_gradients(skip_gradients_aggregation=)``, ``aggregate_gradients``,
``finalize_variable_values``, ``add_variable``,
``add_variable_from_reference``, an assignable ``iterations``,
``learning_rate``/``lr``, ``get_config``/``from_config``, ``variables``, and
its error messages. Update rules stay Keras 3's own.
"""

import inspect
import numbers
import re
import sys
import threading
import warnings
import weakref

import keras
import numpy as np
from keras.src.optimizers.base_optimizer import BaseOptimizer
from keras.src.utils import tracking

from keras_ema_opt import backend
from keras_ema_opt.averaging import engine
from keras_ema_opt.averaging.strategies import EMA
from keras_ema_opt.averaging.strategies import Averaging
from keras_ema_opt.errors import InvalidArgumentError
from keras_ema_opt.errors import InvalidArgumentTypeError
from keras_ema_opt.errors import UnknownArgumentError
from keras_ema_opt.errors import UnknownVariableError

_CLIP_ARGS = ("clipnorm", "clipvalue", "global_clipnorm")
# Arguments Keras 2 wrote into configs that carry no meaning any more.
_DROPPED_ARGS = ("is_legacy_optimizer",)
# OptimizerV2 (``tf.keras.optimizers.legacy``) arguments, honoured here.
_LEGACY_ARGS = ("decay", "gradient_aggregator", "gradient_transformers")


class CallableList(list):
    """A list that returns itself when called (Keras 2's ``variables()``)."""

    def __call__(self):
        return self


def _is_real_number(value):
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Real):
        return True
    return isinstance(value, np.ndarray) and value.ndim == 0 and (
        np.issubdtype(value.dtype, np.floating)
        or np.issubdtype(value.dtype, np.integer)
    )


# Per thread: whether Keras' own step is running under ours.
_KERAS_STEP = threading.local()


def _as_real_number(value):
    """A scalar tensor or variable as a float (Keras 2 took
    ``tf.constant(0.1)`` and ``tf.Variable(0.1)`` learning rates, as their
    initial value), other values as given."""
    if _is_real_number(value) or isinstance(value, (str, bytes)) or not (
        hasattr(value, "__array__") or isinstance(value, keras.Variable)
    ):
        return value
    try:
        array = np.asarray(value)
    except Exception:  # a symbolic tensor: left to Keras
        return value
    if array.ndim == 0 and (np.issubdtype(array.dtype, np.floating)
                            or np.issubdtype(array.dtype, np.integer)):
        return float(array)
    return value


def _is_keras2_schedule(value):
    """A Keras 2 (tf_keras) ``LearningRateSchedule`` object: called with
    the step, where Keras 3 calls a plain callable with no argument."""
    return not isinstance(
        value, keras.optimizers.schedules.LearningRateSchedule
    ) and any(c.__name__ == "LearningRateSchedule"
              for c in type(value).__mro__[1:])


def _float_value(value):
    """A real number, 0-d tensor or variable as the Python float it holds
    (its value now); anything else unchanged, for the checks to name."""
    value = _as_real_number(value)
    return float(value) if _is_real_number(value) else value


def _learning_rate(value):
    """``learning_rate`` as Keras 3 takes it: scalar tensors and variables
    as floats, a Keras 2 built-in schedule rebuilt as Keras 3's."""
    value = _float_value(value)
    if isinstance(value, float):
        return value
    if not _is_keras2_schedule(value):
        return value
    name = type(value).__name__
    if not hasattr(keras.optimizers.schedules, name):
        raise InvalidArgumentError(
            f"learning_rate is a Keras 2 schedule of the class {name} "
            f"({type(value).__module__}), which Keras 3 cannot call (it "
            "calls a plain callable with no argument). Accepted: a float, "
            "a keras.optimizers.schedules.LearningRateSchedule (Keras 2's "
            "built-in schedules are converted), or a callable with no "
            "arguments."
        )
    from keras_ema_opt.compat import configs

    return configs.schedule_from_keras2(
        {"class_name": name, "config": configs._plain(value.get_config())})


def _without_unnamed_schedule(config):
    """A config whose serialized schedule has ``name: None`` (Keras 2's
    default) without it (``compat.configs.without_unnamed``)."""
    rate = config.get("learning_rate")
    if isinstance(rate, dict):
        from keras_ema_opt.compat import configs

        config["learning_rate"] = configs.without_unnamed(rate)
    return config


def _scalar_value(value):
    """A scalar tensor (``tf.constant(0.9)``, a 0-d array) as the Python
    number it holds, as Keras 2 took them; anything else unchanged."""
    if isinstance(value, (bool, numbers.Number, str)) or value is None:
        return value
    try:
        array = np.asarray(keras.ops.convert_to_numpy(value))
    except Exception:  # not a tensor: left to the checks to name
        return value
    if array.ndim == 0 and (np.issubdtype(array.dtype, np.floating)
                            or np.issubdtype(array.dtype, np.integer)):
        return array.item()
    return value


# Arguments of Keras' base optimizer that default to None and are a
# number where given.
_OPTIONAL_NUMBERS = ("weight_decay",) + _CLIP_ARGS


def _is_number_like(value):
    """A real number, or a 0-d numeric tensor or variable. Not a callable:
    Keras 3's docstrings offer ``beta_1=lambda: 0.9``, but its steps
    cast the value (``float() argument must be ... not 'function'``)."""
    if _is_real_number(value):
        return True
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None or len(tuple(shape)) != 0:
        return False
    try:
        return (keras.backend.is_float_dtype(dtype)
                or keras.backend.is_int_dtype(dtype))
    except (TypeError, ValueError):
        return False


# Checked where Keras 2 checked them: the rate (it also takes a schedule),
# and the EMA's arguments, only where `use_ema` is set.
_CHECKED_APART = ("learning_rate", "ema_momentum", "ema_overwrite_frequency",
                  "loss_scale_factor")


# Arguments of Keras' own optimizers that default to a number and take
# None too (Muon: "Set to `None` to disable"; no decay).
_NONE_TAKEN = {("Muon", "rms_rate"), ("Muon", "weight_decay"),
               ("Muon", "adam_weight_decay")}


def _check_numbers(cls_name, arguments, defaults, keras_init):
    """A hyperparameter of Keras' own optimizer classes whose default is a
    number (``beta_1=0.9``, ``epsilon=1e-7``, ``momentum=0.0``), or one of
    ``_OPTIONAL_NUMBERS`` (of any class), given a string, a list, a
    callable or ``None`` (save where ``_NONE_TAKEN`` or its default says
    it takes None): an ``InvalidArgumentTypeError`` naming it, where Keras
    accepted it and failed at the first step (``could not convert string
    to float``; on PyTorch a string ``beta_1`` trained). A user's class's
    own arguments are its own to check; ``_CHECKED_APART`` are not checked
    here."""
    owner = getattr(keras_init, "__qualname__", "").split(".")[0]
    own = str(getattr(keras_init, "__module__", "")).split(".")[0] == (
        "keras")
    for key, given in arguments.items():
        default = defaults.get(key, inspect.Parameter.empty)
        optional = key in _OPTIONAL_NUMBERS and default is None
        if key in _CHECKED_APART or not (optional or (
                own and _is_real_number(default))):
            continue
        if given is None and (optional or (owner, key) in _NONE_TAKEN):
            continue
        if _is_number_like(given):
            continue
        hint = ""
        if key == "epsilon" and given is None:
            hint = (" (Keras 2's OptimizerV2 read None as "
                    "`keras.backend.epsilon()`, 1e-7: pass that)")
        raise InvalidArgumentTypeError(
            f"{cls_name}: `{key}` must be a number"
            + (" or None" if optional else "")
            + f"{hint}. Received: {key}={given!r}")


def _check_loss_scale_factor(value):
    """Keras 3's ``loss_scale_factor``: None or a positive number (Keras
    divides every gradient by it; a bool there was a misplaced argument)."""
    if value is None:
        return
    if not _is_real_number(value) or not float(value) > 0:
        raise InvalidArgumentError(
            "`loss_scale_factor` must be None or a positive number. "
            f"Received: loss_scale_factor={value!r}"
        )


def _accumulation_steps(value):
    """Keras 3's ``gradient_accumulation_steps``: an integer >= 2 (0 and
    False are none, as Keras reads a falsy value). Keras took ``2.5``
    (steps at a fractional count) and failed at ``"2"`` with a bare
    ``TypeError``."""
    if value is False or (_is_real_number(value) and value == 0):
        return None
    if not _is_real_number(value):
        raise InvalidArgumentTypeError(
            "`gradient_accumulation_steps` must be an integer >= 2 or None. "
            f"Received: gradient_accumulation_steps={value!r}")
    if not np.isfinite(float(value)) or float(value) != int(value) or int(
            value) < 2:
        raise InvalidArgumentError(
            "`gradient_accumulation_steps` must be an integer >= 2 or None. "
            f"Received: gradient_accumulation_steps={value!r}")
    return int(value)


def _static_shape(value):
    """A tensor's shape as a tuple of ints; None where it has none or a
    dimension is not known (a traced TensorFlow tensor)."""
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    try:
        dims = tuple(shape)
    except (TypeError, ValueError):  # a shape of unknown rank
        return None
    if any(not isinstance(d, (int, np.integer)) for d in dims):
        return None
    return tuple(int(d) for d in dims)


def _check_gradient_shapes(cls_name, grads, variables):
    """A gradient of another shape than its variable: an
    ``InvalidArgumentError`` naming both, on every backend. Keras
    broadcast it into the update on JAX and PyTorch and raised from inside
    TensorFlow's ops there, and tf_keras did either by the class (its SGD
    broadcast a (1,) gradient; its Adagrad raised)."""
    for grad, variable in zip(grads, variables):
        if grad is None:
            continue
        try:
            if grad.shape == variable.shape:  # the step's common case, fast
                continue
        except (AttributeError, TypeError, ValueError):
            pass
        theirs, own = _static_shape(grad), _static_shape(variable)
        if theirs is not None and own is not None and theirs != own:
            raise InvalidArgumentError(
                f"{cls_name}: a gradient must have its variable's shape: "
                f"variable {getattr(variable, 'path', variable.name)!r} is "
                f"{own}. Received: a gradient of shape {theirs}")


def _list_argument(given, argument, takes, item_type=object):
    """``given``, an iterable of ``item_type``, read once as a list; else
    an ``InvalidArgumentTypeError``: ``takes``, then the value received.
    One tensor or variable, or a string, is not such an iterable (a Keras
    variable read as one yields its rows without end on JAX)."""
    items = None
    if not isinstance(given, (str, bytes)) and not hasattr(given, "shape"):
        try:
            items = list(given)
        except TypeError:
            pass
    if items is None or not all(isinstance(i, item_type) for i in items):
        raise InvalidArgumentTypeError(
            f"{takes}. Received: {argument}={given!r}")
    return items


def _moved_by_forward(model):
    """Whether ``model`` has a trainable layer whose training forward pass
    moves its non-trainable float variables: Keras' BatchNormalization
    (moving statistics) and SpectralNormalization (its power iteration's
    vector). Not a frozen layer's weights, nor an adapted Normalization's
    statistics, which no forward pass moves (a user's layer of its own
    kind is not known here)."""
    moving = (keras.layers.BatchNormalization,
              keras.layers.SpectralNormalization)
    return any(isinstance(layer, moving) and layer.trainable
               for layer in model._flatten_layers())


def _validate_ema(use_ema, ema_momentum, ema_overwrite_frequency):
    """Keras 2's checks of the EMA arguments, made when ``use_ema`` is set."""
    if not use_ema:
        return
    number = _is_real_number(ema_momentum)
    if not number or not 0 <= ema_momentum <= 1:
        # A value of another type is also Keras 2's TypeError.
        raise (InvalidArgumentError if number else InvalidArgumentTypeError)(
            "`ema_momentum` must be in the range [0, 1]. "
            f"Received: ema_momentum={ema_momentum!r}"
        )
    # A bool is an int to Keras 2 and 3 alike: True is every step.
    if ema_overwrite_frequency is not None and (
        not isinstance(ema_overwrite_frequency, (int, np.integer))
        or ema_overwrite_frequency < 1
    ):
        raise InvalidArgumentError(
            "`ema_overwrite_frequency` must be an integer >= 1 or None. "
            f"Received: ema_overwrite_frequency={ema_overwrite_frequency!r}"
        )


def _refused_by_keras(cls_name, error, arguments):
    """Keras' own ``ValueError`` for an argument of ``arguments`` (a
    ``momentum`` outside [0, 1], a ``learning_rate`` of no accepted kind),
    as a typed error naming the value received: an
    ``InvalidArgumentTypeError`` (also a ``TypeError``, as Keras 2 raised)
    where the value is not a number, else an ``InvalidArgumentError``."""
    message = str(error)
    named = [name for name in re.findall(r"`(\w+)`", message)
             if name in arguments]
    if not named:
        return InvalidArgumentError(f"{cls_name}: {message}")
    name, value = named[0], arguments[named[0]]
    # Keras' own "Received instead: learning_rate=0.1" shows a string as
    # the number it is not: the value is named by its repr.
    message = re.sub(r"\s*Received( instead)?:.*$", "", message,
                     flags=re.DOTALL)
    message = f"{message.rstrip()} Received: {name}={value!r}"
    kind = InvalidArgumentError if _is_real_number(value) or (
        isinstance(value, keras.optimizers.schedules.LearningRateSchedule)
        or callable(value)) else InvalidArgumentTypeError
    return kind(f"{cls_name}: {message}")


def _validate_clipping(clipnorm, global_clipnorm):
    if clipnorm is not None and global_clipnorm is not None:
        raise InvalidArgumentError(
            "At most one of `clipnorm` and `global_clipnorm` can "
            f"be set. Received: clipnorm={clipnorm!r}, "
            f"global_clipnorm={global_clipnorm!r}."
        )


# The base class's default learning rate, told by identity from a 0.001
# passed in (`lr=` alone is a rate given; beside `learning_rate=`, unused).
_DEFAULT_LEARNING_RATE = float("0.001")


def _take_lr_alias(arguments, cls_name):
    """Keras 2's ``lr=`` spelling of ``learning_rate``, with a warning."""
    if "lr" not in arguments:
        return
    lr = arguments.pop("lr")
    if "learning_rate" in arguments:
        # tf_keras' optimizer takes both and uses `learning_rate`.
        warnings.warn(
            f"{cls_name}: `lr={lr!r}` is not used: `learning_rate="
            f"{arguments['learning_rate']!r}` is given too (`lr` is the "
            "deprecated Keras 2 name of `learning_rate`).",
            DeprecationWarning, stacklevel=4)
        return
    warnings.warn(
        "`lr` is deprecated, please use `learning_rate` instead. "
        f"Received: lr={lr!r}.",
        DeprecationWarning,
        stacklevel=4,
    )
    arguments["learning_rate"] = lr


def _variable_names(variable):
    """The names ``exclude_from_weight_decay(var_names=)`` patterns match,
    the same on every backend: Keras 3's (``kernel``) and Keras 2's, the
    path with its output index (``dense/kernel:0``). Keras' TensorFlow
    step passes the ``tf.Variable`` (named the Keras 2 way), the others
    the Keras variable."""
    if isinstance(variable, keras.Variable):
        return variable.name, f"{variable.path}:0"
    name = getattr(variable, "name", None)
    if not isinstance(name, str):
        return ()
    return name.rsplit("/", 1)[-1].split(":")[0], name


def not_overridden(obj, cls, name):
    """Whether ``obj``'s method ``name`` is ``cls``'s own: neither a
    subclass nor the instance replaces it."""
    return (getattr(type(obj), name, None) is getattr(cls, name)
            and name not in vars(obj))


def _filter_empty_gradients(grads_and_vars):
    """Keras 2's handling of ``None`` gradients: those pairs are dropped
    with a warning naming their variables; all ``None`` is an error.
    NumPy gradients become tensors of their variable's dtype (Keras 2 took
    them on every backend)."""
    kept, empty = [], []
    for grad, var in grads_and_vars:
        if grad is None:
            empty.append(var)
            continue
        if isinstance(grad, (np.ndarray, np.generic)):
            grad = keras.ops.convert_to_tensor(grad, dtype=var.dtype)
        kept.append((grad, var))
    names = [getattr(v, "path", None) or getattr(v, "name", repr(v))
             for v in empty]
    if not kept:
        raise InvalidArgumentError(
            f"No gradients provided for any variable: {names}. Received "
            f"{len(names)} (gradient, variable) pairs, every gradient None."
        )
    if empty:
        warnings.warn(
            f"Gradients do not exist for variables {names} when minimizing "
            "the loss. If you're using `model.compile()`, did you forget to "
            "provide a `loss` argument?",
            stacklevel=3,
        )
    return kept


def _take_mesh(arguments, cls_name):
    """Keras 2's DTensor ``mesh`` argument: ``None`` (its default) is
    accepted; a mesh has no meaning in Keras 3, whose distribution API
    takes its place."""
    if "mesh" not in arguments:
        return
    mesh = arguments.pop("mesh")
    if mesh is not None:
        raise InvalidArgumentError(
            f"{cls_name} received mesh={mesh!r}: Keras 2's DTensor mesh has "
            "no Keras 3 counterpart on an optimizer. Accepted: mesh=None; "
            "distribute with keras.distribution (JAX) or a tf.distribute "
            "strategy instead (docs/distributed-*.md)."
        )


def _check_known(cls_name, arguments, accepted):
    unknown = sorted(k for k in arguments if k not in accepted)
    if not unknown:
        return
    received = {k: arguments[k] for k in unknown}
    raise UnknownArgumentError(
        f"{cls_name} does not accept the argument(s) {received}. "
        f"Accepted arguments: {', '.join(sorted(accepted))}."
    )


def _take_legacy_arguments(arguments, clipping):
    """OptimizerV2's ``decay``, ``gradient_transformers`` and
    ``gradient_aggregator``, validated as OptimizerV2 did."""
    decay = arguments.pop("decay", 0.0)
    if decay is None:
        decay = 0.0
    if not _is_real_number(decay) or float(decay) < 0:
        # OptimizerV2's text.
        raise InvalidArgumentError(
            f"Expected decay >= 0, received: {decay}"
        )
    transformers = arguments.pop("gradient_transformers", None) or []
    transformers = list(transformers)
    for fn in transformers:
        if not callable(fn):
            raise InvalidArgumentError(
                "`gradient_transformers` must be a list of callables taking "
                "and returning a list of (gradient, variable) pairs. "
                f"Received: {fn!r}"
            )
    for key, value in clipping.items():
        if value is not None and transformers:
            raise InvalidArgumentError(
                f"`{key}` cannot be set when `gradient_transformers` "
                "is set. Instead, use the `gradient_transformers` to "
                "specify clipping and other transformations. Received: "
                f"val={value}, gradient_transformers={transformers}."
            )
    aggregator = arguments.pop("gradient_aggregator", None)
    if aggregator is not None and not callable(aggregator):
        raise InvalidArgumentError(
            "`gradient_aggregator` must be a callable taking and returning "
            f"a list of (gradient, variable) pairs. Received: {aggregator!r}"
        )
    return float(decay), transformers, aggregator


class Optimizer(backend.OptimizerHooks, keras.optimizers.Optimizer):
    """Base class: a Keras 3 optimizer with the Keras 2 optimizer contract.

    Subclass it exactly as ``keras.optimizers.Optimizer`` (``build``,
    ``update_step(gradient, variable, learning_rate)``, ``get_config``); the
    named optimizers (``keras_ema_opt.Adam``, ...) are Keras' own classes
    with this contract added.

    Args:
        learning_rate: A float, a
            ``keras.optimizers.schedules.LearningRateSchedule``, or a
            callable taking no arguments. Integers and NumPy scalars are
            accepted and stored as floats.
        weight_decay: Float or ``None``. Decoupled weight decay.
        clipnorm: Float or ``None``. Clip each gradient to this norm.
        clipvalue: Float or ``None``. Clip each gradient element to
            ``[-clipvalue, clipvalue]``.
        global_clipnorm: Float or ``None``. Clip all gradients together to
            this global norm. Not together with ``clipnorm``. When several
            clipping arguments are set, the first of ``clipnorm``,
            ``global_clipnorm``, ``clipvalue`` applies, as in Keras 2.
            On PyTorch, gradients that are the variables' own ``.grad``
            tensors (as ``fit()`` passes them) are clipped in place, as
            ``torch.nn.utils.clip_grad_norm_`` does, so ``.grad`` holds
            the clipped values after the step; so are the gradients the
            step makes itself (gradient accumulation's average, the
            mean over torch.distributed ranks in ``fit()``), which no
            caller holds. There, and under loss scaling
            (``LossScaleOptimizer``) or ``torch.compile``, ``.grad``
            keeps the raw values, as with Keras' optimizer. Gradients
            held otherwise are left unchanged.
        use_ema: Bool. Keep an exponential moving average of the weights.
        ema_momentum: Float in ``[0, 1]``, the EMA momentum.
        ema_overwrite_frequency: Int ``>= 1`` or ``None``: every so many
            iterations, overwrite the weights with their average (``0``
            and ``False`` are never, ``True`` every step, as in Keras 2).
        loss_scale_factor: Float or ``None`` (Keras 3).
        gradient_accumulation_steps: Int ``>= 2`` or ``None`` (Keras 3).
        name: String, the name of the optimizer and prefix of its variables.
        jit_compile: Bool, default ``True`` as in Keras 2. When
            ``apply_gradients`` is called eagerly, run the update compiled:
            with ``jax.jit`` on JAX (old buffers donated); with XLA on
            TensorFlow where a GPU is present (Keras 2 turns it off
            elsewhere, and so do we); on PyTorch the update always runs
            eagerly with Keras' multi-tensor kernels and the attribute reads
            ``False``. Inside ``fit()`` or a compiled custom step the caller's
            compilation applies. ``optimizer.jit_compile`` tells the value in
            effect.

    Example:

    ```python
    import keras
    import keras_ema_opt

    class PlainSGD(keras_ema_opt.Optimizer):
        def update_step(self, gradient, variable, learning_rate):
            lr = keras.ops.cast(learning_rate, variable.dtype)
            self.assign_sub(variable, keras.ops.multiply(gradient, lr))

    w = keras.Variable([1.0, 2.0])
    opt = PlainSGD(learning_rate=0.1)
    opt.minimize(lambda: keras.ops.sum(w * w), [w])
    # w is now [0.8, 1.6]
    ```
    """

    def __init__(
        self,
        learning_rate=_DEFAULT_LEARNING_RATE,
        weight_decay=None,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name=None,
        jit_compile=True,
        **kwargs,
    ):
        if isinstance(learning_rate, str):
            # Keras 2's base class takes `name` first:
            # `super().__init__("MyOptimizer", ...)`. A learning rate is
            # never a string, so the call is unambiguous; the subclass then
            # sets its rate with `_build_learning_rate`.
            if name is not None:
                raise InvalidArgumentError(
                    f"{type(self).__name__} received a name twice: "
                    f"{learning_rate!r} as the first argument (Keras 2's "
                    f"order) and name={name!r}. Pass it once."
                )
            learning_rate, name = _DEFAULT_LEARNING_RATE, learning_rate
            if isinstance(loss_scale_factor, bool):
                # Keras 2's ninth positional argument is `jit_compile`
                # (`super().__init__(name, weight_decay, ..., jit_compile)`,
                # as tf_keras' own optimizers call it); a loss scale is
                # never a bool.
                loss_scale_factor, jit_compile = None, loss_scale_factor
        arguments = dict(
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
            jit_compile=jit_compile,
            **kwargs,
        )
        if "lr" in kwargs and learning_rate is _DEFAULT_LEARNING_RATE:
            # Keras 2's `lr=` alone: the default is no learning rate given.
            del arguments["learning_rate"]
        self._construct(
            keras.optimizers.Optimizer.__init__,
            arguments,
            inspect.signature(Optimizer.__init__),
        )

    # ------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------

    def __init_subclass__(cls, **kwargs):
        """Adapt Keras 2 subclasses: ``update_step(gradient, variable)``.

        Keras 2 optimizers define ``update_step(self, gradient, variable)``
        and read ``self.learning_rate`` inside it; Keras 3 passes the
        learning rate as a third argument. A two-argument ``update_step``
        gets wrapped so that both work.
        """
        super().__init_subclass__(**kwargs)
        step = cls.__dict__.get("update_step")
        if step is None or not _takes_two_arguments(step):
            return

        def update_step(self, gradient, variable, learning_rate=None):
            # Keras 2 steps read self.learning_rate; a `super()` call of
            # theirs reads the rate Keras passed from here.
            self.__dict__["_keras2_step_rate"] = learning_rate
            try:
                return step(self, gradient, variable)
            finally:
                self.__dict__.pop("_keras2_step_rate", None)

        update_step.__doc__ = step.__doc__
        update_step.__wrapped__ = step
        cls.update_step = update_step
        # `super().update_step(gradient, variable)` in that step, as Keras
        # 2's base took: the parent's update_step takes the learning rate
        # too, so a class of the parent's, between the two, passes it on.
        parent = next((base for base in cls.__bases__
                       if issubclass(base, BaseOptimizer)), None)
        own = getattr(parent, "update_step", None)
        if own is None or _takes_two_arguments(own) or (
                parent.__dict__.get("_keras2_rate_bridge")):
            return

        def bridged(self, gradient, variable, learning_rate=None):
            if learning_rate is None:
                learning_rate = self.__dict__.get("_keras2_step_rate")
            if learning_rate is None:
                learning_rate = self._get_current_learning_rate()
            # On along the instance's MRO (a diamond's other branch first).
            return super(bridge, self).update_step(gradient, variable,
                                                   learning_rate)

        bridge = type(parent.__name__, (parent,), {
            "update_step": bridged, "_keras2_rate_bridge": True,
            "__module__": parent.__module__,
            "__qualname__": parent.__qualname__,
            "__doc__": parent.__doc__})
        try:
            cls.__bases__ = tuple(bridge if base is parent else base
                                  for base in cls.__bases__)
        except TypeError:  # a layout the bases cannot change to: as before
            pass

    def _construct(self, keras_init, arguments, signature):
        """Validate ``arguments`` as Keras 2 does, then run ``keras_init``.

        ``signature`` is the public signature of the class being built (the
        Keras class for named optimizers); its parameters and
        ``jit_compile`` are the accepted arguments.
        """
        cls_name = type(self).__name__
        arguments = dict(arguments)
        for key in _DROPPED_ARGS:
            arguments.pop(key, None)
        _take_mesh(arguments, cls_name)
        _take_lr_alias(arguments, cls_name)
        if "ema_momentum" in arguments:
            arguments["ema_momentum"] = _scalar_value(
                arguments["ema_momentum"])
        if arguments.get("ema_overwrite_frequency") is not None and (
                arguments["ema_overwrite_frequency"] == 0):
            # Keras 2 overwrote only on a truthy frequency: 0 (or False)
            # is never.
            arguments["ema_overwrite_frequency"] = None
        _check_loss_scale_factor(arguments.get("loss_scale_factor"))
        if arguments.get("gradient_accumulation_steps") is not None:
            arguments["gradient_accumulation_steps"] = _accumulation_steps(
                arguments["gradient_accumulation_steps"])
        jit_compile = arguments.pop("jit_compile", True)
        averaging = arguments.pop("averaging", None)
        follows = averaging is None  # an EMA from use_ema, if any
        _check_known(cls_name, arguments,
                     _accepted_arguments(signature, type(self), keras_init))
        defaults = _defaults(signature)
        _check_numbers(cls_name, arguments, defaults, keras_init)
        if "momentum" in arguments and isinstance(
                self, keras.optimizers.SGD):
            # Keras 3's SGD takes only a Python float (`isinstance(momentum,
            # float)`); Keras 2 took an int (`momentum=0` is in its
            # configs), a NumPy scalar, a 0-d tensor or a variable.
            arguments["momentum"] = _float_value(arguments["momentum"])
        value = lambda k: arguments.get(k, defaults.get(k))  # noqa: E731
        decay, transformers, aggregator = _take_legacy_arguments(
            arguments, {k: value(k) for k in _CLIP_ARGS}
        )
        _validate_ema(
            value("use_ema") or averaging is not None,
            value("ema_momentum") if averaging is None else 0.0,
            value("ema_overwrite_frequency"),
        )
        averaging = _resolve_averaging(
            averaging, value("use_ema"), value("ema_momentum")
        )
        if not follows and value("use_ema") is True and value(
                "ema_momentum") != defaults.get("ema_momentum") and (
                averaging != EMA(value("ema_momentum"))):
            warnings.warn(
                f"{cls_name}: ema_momentum={value('ema_momentum')} is not "
                f"used: the averages follow averaging={averaging!r}.",
                UserWarning, stacklevel=3)
        if averaging is not None:
            arguments["use_ema"] = True
        _validate_clipping(value("clipnorm"), value("global_clipnorm"))
        if isinstance(arguments.get("ema_overwrite_frequency"),
                      (bool, np.integer)):
            # As the int it is (what is not one is refused above where
            # `use_ema` is set, and kept unchecked otherwise, as Keras 2).
            arguments["ema_overwrite_frequency"] = int(
                arguments["ema_overwrite_frequency"]
            )
        clipping = {k: arguments.pop(k, None) for k in _CLIP_ARGS}
        if "learning_rate" in arguments:
            arguments["learning_rate"] = _learning_rate(
                arguments["learning_rate"])
        try:
            keras_init(self, **arguments)
        except ValueError as e:
            if isinstance(e, (InvalidArgumentError, UnknownArgumentError)):
                raise
            raise _refused_by_keras(cls_name, e, arguments) from e
        except TypeError as e:
            twice = re.search(r"got multiple values for keyword argument "
                              r"'(\w+)'", str(e))
            if twice is None or isinstance(e, UnknownArgumentError):
                raise
            # A subclass whose __init__ sets one of its parent's arguments
            # itself, which its **kwargs would carry too.
            raise UnknownArgumentError(
                f"{cls_name} does not accept the argument(s) "
                f"{{{twice.group(1)!r}: {arguments.get(twice.group(1))!r}}}"
                f": its __init__ sets it itself ({e}).") from e
        # Keras 3 refuses clipnorm with clipvalue; Keras 2 let clipnorm win.
        for key, clip in clipping.items():
            setattr(self, key, clip)
        self.averaging = averaging
        # The EMA `use_ema` made follows `ema_momentum` set afterwards.
        self._ema_follows_momentum = follows and averaging is not None
        self._averager = None
        self.decay = decay
        self.gradient_transformers = transformers
        self.gradient_aggregator = aggregator
        self._jit_compile_requested = bool(jit_compile)
        self.jit_compile = backend.resolve_jit_compile(jit_compile)
        self._gradients_aggregated = False
        backend.on_create(self)

    def __setattr__(self, name, value):
        # A compiled eager step (JAX; TensorFlow under XLA) holds the
        # Python attributes it read when traced: a public one set
        # afterwards (`weight_decay`, `momentum`, `clipnorm`, ...) takes a
        # new trace, as Keras' own eager step reads it anew.
        if not name.startswith("_") and name != "built" and (
                "_keo_compiled" in self.__dict__):
            self.__dict__.pop("_keo_compiled", None)
        super().__setattr__(name, value)

    @property
    def use_ema(self):
        """Keras 2's ``use_ema``: whether the optimizer averages.

        Set before the optimizer is built (its first step), ``True`` adds
        the EMA ``use_ema=True`` makes (of ``ema_momentum``) and ``False``
        removes the averaging; once built, the averages exist or not, and
        a change raises ``InvalidArgumentError``.
        """
        return self.__dict__.get("_use_ema", False)

    @use_ema.setter
    def use_ema(self, value):
        if "_averager" not in self.__dict__:
            # Keras' own __init__.
            self.__dict__["_use_ema"] = value
            return
        if bool(value) == bool(self.use_ema):
            return
        if self.built:
            raise InvalidArgumentError(
                f"`use_ema` of {type(self).__name__} cannot change once the "
                f"optimizer is built (it is {self.use_ema}; received "
                f"use_ema={value!r}). Set it before the first step, or "
                "create a new optimizer."
            )
        if value:
            _validate_ema(True, self.ema_momentum,
                          self.ema_overwrite_frequency)
            self.averaging = EMA(self.ema_momentum)
        else:
            self.averaging = None
        self._ema_follows_momentum = bool(value)
        self.__dict__["_use_ema"] = bool(value)

    @property
    def ema_momentum(self):
        """Keras 2's EMA momentum. Set after construction, it changes the
        momentum of the EMA ``use_ema=True`` made (an ``averaging=``
        strategy passed in is left as given), as in Keras: from the next
        eager ``apply_gradients`` on, and in ``fit()`` from the next time
        it traces its step (a step already traced keeps the value it read,
        in Keras' own optimizers too)."""
        return self.__dict__.get("_ema_momentum")

    @ema_momentum.setter
    def ema_momentum(self, value):
        averaging = self.__dict__.get("averaging")
        follows = averaging is not None and self.__dict__.get(
            "_ema_follows_momentum")
        if follows:
            _validate_ema(True, value, None)
        self.__dict__["_ema_momentum"] = value
        if follows:
            # (`__setattr__` has dropped the compiled eager steps, which
            # read the momentum when traced.)
            averaging.momentum = float(value)

    def get_config(self):
        config = super().get_config()
        config["jit_compile"] = self.jit_compile
        if self.decay:
            config["decay"] = self.decay
        # A strategy passed as `averaging=` is kept, even one equal to the
        # EMA `use_ema` makes: that EMA averages the variables of each step
        # alone (Keras 2's rule), a strategy every variable it was built
        # with, and a reload must average as the run did.
        if self.averaging is not None and not self.__dict__.get(
                "_ema_follows_momentum"):
            config["averaging"] = keras.saving.serialize_keras_object(
                self.averaging
            )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Build an optimizer from ``get_config()``'s output.

        Keras 2 configs work too: ``is_legacy_optimizer`` is dropped and
        serialized learning-rate schedules are rebuilt, also in the form
        tf.keras 2.11 and 2.12 wrote (no ``"module"``; a user's schedule
        found in ``custom_objects`` or Keras 3's registry).
        """
        config = dict(config)
        rate = config.get("learning_rate")
        if isinstance(rate, dict) and "module" not in rate:
            from keras_ema_opt.compat import configs

            config["learning_rate"] = configs.schedule_from_keras2(
                rate, custom_objects)
        return super().from_config(
            _without_unnamed_schedule(config),
            custom_objects=custom_objects)

    # ------------------------------------------------------------------
    # iterations, learning rate
    # ------------------------------------------------------------------

    @property
    def iterations(self):
        """The number of optimizer steps taken (a scalar integer variable).

        Assignable before the optimizer is built: an integer sets the count;
        an integer ``keras.Variable`` replaces the counter (so optimizers can
        share one, as in Keras 2). After ``build`` it raises ``RuntimeError``.
        """
        return super().iterations

    @iterations.setter
    def iterations(self, value):
        if self.built:
            raise RuntimeError(
                "Cannot set `iterations` to a new Variable after "
                "the Optimizer weights have been created. Here it is "
                f"attempting to set `iterations` to {value}. "
                "Usually this means you are trying to set `iterations`"
                " after calling `apply_gradients()`. Please set "
                "`iterations` before calling `apply_gradients()`."
            )
        if isinstance(value, keras.Variable):
            if "int" not in str(value.dtype) or tuple(value.shape) != ():
                raise InvalidArgumentError(
                    "`iterations` must be a scalar integer variable. "
                    f"Received: a variable of dtype {value.dtype} and shape "
                    f"{tuple(value.shape)}."
                )
            self._tracker.replace_tracked_value(
                "variables", self._iterations, value
            )
            self._iterations = value
            return
        if not (_is_real_number(value) and float(value) == int(value)):
            raise InvalidArgumentError(
                "`iterations` must be an integer or a scalar integer "
                f"`keras.Variable`. Received: {value!r}."
            )
        steps = self.gradient_accumulation_steps or 1
        self._iterations.assign(int(value) * steps)

    @property
    def lr(self):
        """Alias of ``learning_rate`` (Keras 2)."""
        return self.learning_rate

    @lr.setter
    def lr(self, learning_rate):
        self.learning_rate = learning_rate

    @property
    def learning_rate(self):
        """The current learning rate (a schedule is evaluated at ``iterations``).

        Assign a float, or a schedule. Assigning a float to an optimizer
        created with a ``LearningRateSchedule`` raises ``TypeError``.
        """
        if self.decay and not self.__dict__.get("_keo_in_step"):
            # OptimizerV2 reads back the rate it was given; the decayed
            # rate is the step's (LearningRateScheduler and
            # ReduceLROnPlateau read the rate and write it back).
            return super()._get_current_learning_rate()
        return self._get_current_learning_rate()

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        given = learning_rate
        learning_rate = _learning_rate(learning_rate)
        if not (isinstance(learning_rate, float) or callable(learning_rate)
                or _is_number_like(learning_rate)):  # a traced 0-d tensor
            # What the constructor refuses (Keras' own setter assigned a
            # string, None or a list to its variable: an untyped error
            # from the backend, or on JAX "0.5" as 0.5, True as 1.0).
            # A 0-d tensor left symbolic (in a `tf.function`) is assigned.
            raise InvalidArgumentTypeError(
                f"{type(self).__name__}: `learning_rate` must be a float, a "
                "0-d tensor or variable, a LearningRateSchedule or a "
                f"callable with no arguments. Received: learning_rate="
                f"{given!r}")
        keras.optimizers.Optimizer.learning_rate.fset(self, learning_rate)

    def _get_current_learning_rate(self):
        """The learning rate, with OptimizerV2's ``decay``:
        ``lr / (1 + decay * iterations)``."""
        lr = super()._get_current_learning_rate()
        if not self.decay:
            return lr
        step = keras.ops.cast(self.iterations, "float32")
        return keras.ops.divide(
            keras.ops.cast(lr, "float32"), 1.0 + self.decay * step
        )

    @property
    def variables(self):
        """All optimizer variables, ``iterations`` first; callable as in Keras 2."""
        return CallableList(self._variables)

    # ------------------------------------------------------------------
    # Variables
    # ------------------------------------------------------------------

    def add_variable(
        self,
        shape=None,
        dtype=None,
        initializer="zeros",
        name=None,
        *,
        aggregation="none",
        layout=None,
    ):
        """Create an optimizer variable (Keras 2 argument order).

        Args:
            shape: Shape of the variable; ``None`` means a scalar.
            dtype: Dtype; defaults to ``keras.config.floatx()``.
            initializer: Initializer name, instance or callable.
            name: Name of the variable.
            aggregation: Keras 3 replica aggregation (keyword only).
            layout: Keras 3 tensor layout (keyword only).

        Returns:
            A ``keras.Variable``, tracked in ``optimizer.variables``; on
            TensorFlow with ``tf.Variable``'s ``scatter_add``,
            ``sparse_read`` and the like too, as Keras 2's slots had them
            (tf_keras' own SGD calls ``m.scatter_add`` on a sparse step).
        """
        return backend.optimizer_variable(super().add_variable(
            shape=() if shape is None else shape,
            initializer=initializer,
            dtype=dtype,
            aggregation=aggregation,
            layout=layout,
            name=name,
        ))

    def add_variable_from_reference(
        self,
        model_variable=None,
        variable_name=None,
        shape=None,
        initial_value=None,
        *,
        reference_variable=None,
        name=None,
        initializer="zeros",
    ):
        """Create an optimizer variable shaped like a model variable.

        Accepts Keras 2's ``(model_variable, variable_name, shape=None,
        initial_value=None)`` and Keras 3's ``(reference_variable, name,
        initializer)`` spellings.

        Args:
            model_variable: The model variable (Keras 2 name).
            variable_name: Name prefix (Keras 2 name).
            shape: A shape other than the model variable's.
            initial_value: A value (array, tensor or variable) to start from;
                by default zeros (or ``initializer``).
            reference_variable: The model variable (Keras 3 name).
            name: Name prefix (Keras 3 name).
            initializer: Initializer when no ``initial_value`` is given.

        Returns:
            A ``keras.Variable`` placed beside the model variable.
        """
        ref = model_variable if model_variable is not None else reference_variable
        if ref is None:
            raise InvalidArgumentError(
                "add_variable_from_reference() needs the model variable, as "
                "`model_variable` (Keras 2) or `reference_variable` (Keras 3)."
                " Received neither."
            )
        prefix = variable_name if variable_name is not None else name
        ref_shape = tuple(ref.shape)
        target = ref_shape if shape is None else tuple(shape)
        if initial_value is not None:
            initializer = _value_initializer(initial_value, target, ref)
        # TensorFlow makes the variable under its kind alone (its cached
        # kernel is shared): the backend hook's docstring.
        with backend.state_variable_role(prefix or "var"):
            if target == ref_shape:
                return super().add_variable_from_reference(
                    ref, name=prefix, initializer=initializer
                )
            path = getattr(ref, "path", None) or str(ref.name)
            with backend.colocate_with(ref):
                return self.add_variable(
                    shape=target,
                    dtype=ref.dtype,
                    initializer=initializer,
                    name=f"{path.replace('/', '_').replace(':', '_')}_"
                    f"{prefix or 'var'}",
                )

    def _check_variables_are_known(self, variables):
        for v in variables:
            if self._var_key(v) not in self._trainable_variables_indices:
                raise UnknownVariableError(
                    "The optimizer cannot recognize variable "
                    f"{getattr(v, 'path', v.name)}. This usually means you "
                    "are trying to call the optimizer to update different "
                    "parts of the model separately. Please call "
                    "`optimizer.build(variables)` with the full list of "
                    "trainable variables before the training loop, or use a "
                    "new optimizer instance for each set of variables."
                )

    # ------------------------------------------------------------------
    # Gradients
    # ------------------------------------------------------------------

    def compute_gradients(self, loss, var_list, tape=None):
        """Compute gradients of ``loss`` with respect to ``var_list``.

        Args:
            loss: A callable taking no arguments and returning the value to
                minimize (every backend), or, on TensorFlow, a tensor
                computed under ``tape``. A non-scalar loss is summed.
            var_list: Variables, or a callable returning them (called after
                ``loss``, so variables the loss creates are included).
            tape: A ``tf.GradientTape`` (TensorFlow only): required with a
                tensor ``loss``.

        Returns:
            A list of ``(gradient, variable)`` pairs; where the loss does
            not depend on a variable its gradient is ``None`` (TensorFlow,
            PyTorch) or zeros (JAX differentiates through values and cannot
            tell).
        """
        if not callable(loss) and tape is None:
            raise ValueError(
                "`tape` is required when a `Tensor` loss is passed. "
                f"Received: loss={loss}, tape={tape}."
            )
        return backend.compute_gradients(loss, var_list, tape)

    def minimize(self, loss, var_list, tape=None):
        """``compute_gradients`` then ``apply_gradients``.

        Example:

        ```python
        import keras
        import keras_ema_opt

        w = keras.Variable(3.0)
        opt = keras_ema_opt.SGD(learning_rate=0.5)
        opt.minimize(lambda: w * w, [w])  # w: 3 - 0.5 * 6 = 0.0
        ```

        With a list of variables the optimizer is built before the loss is
        computed, so that under ``torch.distributed`` rank 0's weights
        reach every rank before the first gradient (as DDP's wrapping).
        A callable ``var_list`` names its variables once the loss has made
        them: the optimizer is built after the first gradients, and where
        the build replaced the weights with rank 0's, the gradients are
        computed again at them (the loss then runs twice in that first
        step, its side effects too).
        """
        if not self.built and not callable(var_list):
            var_list = list(var_list)
            self._build_for_minimize(var_list)
        grads_and_vars = self.compute_gradients(loss, var_list, tape)
        if not self.built:  # a callable var_list: its variables exist now
            self._build_in_step(list(var_list()))
            if self.__dict__.get("_keo_synced_on_build") and callable(loss):
                grads_and_vars = self.compute_gradients(loss, var_list, tape)
        return self.apply_gradients(grads_and_vars)

    def _build_for_minimize(self, variables):
        # The whole build under the backend's scope (TensorFlow: outside a
        # traced step, as Keras 2 built), a Keras 2 subclass's own slots,
        # made after `super().build()`, included.
        with keras.name_scope(self.name, caller=self), backend.build_scope():
            self.build(variables)
        self.built = True

    def _build_in_step(self, variables):
        """``_build_for_minimize`` after the step's forward pass, marked
        as such where it runs eagerly (``_build_state`` warns then)."""
        self.__dict__["_keo_built_by_step"] = backend.executing_eagerly()
        try:
            self._build_for_minimize(variables)
        finally:
            self.__dict__["_keo_built_by_step"] = False

    def aggregate_gradients(self, grads_and_vars):
        """Aggregate gradients over replicas (identity outside a
        distribution).

        On TensorFlow: the sum over the replicas of the current
        ``tf.distribute`` strategy (Keras 2: its losses are scaled by the
        number of replicas); on PyTorch: the mean over the ranks of a
        running ``torch.distributed`` process group (DDP's convention: each
        rank's loss is the mean over its share of the batch); on JAX
        gradients of a distributed step are already global. Override it to
        aggregate differently. See ``docs/distributed-*.md``.

        Returns:
            A list of ``(gradient, variable)`` pairs.
        """
        if self.gradient_aggregator is not None:
            return list(self.gradient_aggregator(list(grads_and_vars)))
        return backend.aggregate_gradients(self, grads_and_vars)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Exclude variables from weight decay, before the optimizer's first
        step (Keras 2: before it is built). A built optimizer that has not
        stepped yet takes them: one ``load_model`` restored, whose
        exclusions are not saved (neither Keras 2 nor Keras 3 saves them).
        After a step, ``ValueError``: the steps compiled already keep the
        exclusions they read.

        Args:
            var_list: Variables to exclude.
            var_names: Regular expressions: a variable is excluded when one
                matches (``re.search``) its Keras 3 name (``"kernel"``) or
                its Keras 2 name, the path with ``":0"``
                (``"dense/kernel:0"``), on every backend.

        Example:

        ```python
        import keras
        import keras_ema_opt

        optimizer = keras_ema_opt.AdamW(weight_decay=0.01)
        optimizer.exclude_from_weight_decay(var_names=["bias", "norm"])
        ```
        """
        if isinstance(var_names, str):
            # One pattern: Keras 2 and 3 alike read a string's characters
            # as patterns ("bias" excluded every name with a b, i, a or s).
            var_names = [var_names]
        if var_list is not None:  # any iterable, read once
            var_list = _list_argument(
                var_list, "var_list", "`exclude_from_weight_decay` takes "
                "`var_list` as a list of variables")
        if var_names is not None:
            var_names = _list_argument(
                var_names, "var_names", "`exclude_from_weight_decay` takes "
                "`var_names` as a list of strings (regular expressions) or "
                "one string", str)
        if self.built and getattr(
                self, "_exclude_from_weight_decay_cache", None):
            raise InvalidArgumentError(
                "`exclude_from_weight_decay()` can only be configured "
                "before the optimizer is built. (Here: before its first "
                "step; this optimizer has stepped with its exclusions, "
                "and the steps compiled keep them.)"
            )
        super().exclude_from_weight_decay(var_list=var_list,
                                          var_names=var_names)

    def _use_weight_decay(self, variable):
        # Keras' decision, with the patterns matched against both names
        # too, decided once per variable in Keras' own cache.
        key = self._var_key(variable)
        cache = getattr(self, "_exclude_from_weight_decay_cache", None)
        if cache is not None and key in cache:
            return cache[key]
        pattern = getattr(self, "_exclude_from_weight_decay_pattern", None)
        use = super()._use_weight_decay(variable) and not (
            pattern is not None and any(
                re.search(pattern, name)
                for name in _variable_names(variable)))
        self._exclude_from_weight_decay_cache[key] = use
        return use

    def apply_gradients(
        self,
        grads_and_vars,
        name=None,
        skip_gradients_aggregation=False,
        **kwargs,
    ):
        """Apply gradients to variables.

        Args:
            grads_and_vars: Iterable of ``(gradient, variable)`` pairs.
            name: Accepted for Keras 2 compatibility (name scope).
            skip_gradients_aggregation: If ``True``, gradients are not summed
                over replicas here: the caller has aggregated them.
            **kwargs: ``experimental_aggregate_gradients`` (the Keras 2
                inverse of ``skip_gradients_aggregation``).

        Returns:
            The ``iterations`` variable.
        """
        aggregate = kwargs.pop("experimental_aggregate_gradients", True)
        if kwargs:
            raise UnknownArgumentError(
                f"apply_gradients() does not accept {sorted(kwargs)}. "
                "Accepted: grads_and_vars, name, skip_gradients_aggregation, "
                "experimental_aggregate_gradients."
            )
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self._iterations
        self._note_run_start()
        for pair in grads_and_vars:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                # A ValueError, as Keras 2 and 3 raise here (unpacking).
                raise InvalidArgumentError(
                    "apply_gradients() takes an iterable of (gradient, "
                    f"variable) pairs. Received the item {pair!r} of type "
                    f"{type(pair).__name__}.")
        if not self.built:
            # On every variable given, as Keras 2 built it: one whose
            # gradient is None at this first step has its state when a
            # later step gives it one (built on the others alone, the
            # optimizer refused it then).
            self._build_in_step([v for _, v in grads_and_vars])
        grads_and_vars = _filter_empty_gradients(grads_and_vars)
        made = []
        if aggregate and not skip_gradients_aggregation:
            given = grads_and_vars
            grads_and_vars = self.aggregate_gradients(grads_and_vars)
            if self.gradient_aggregator is None and not_overridden(
                    self, Optimizer, "aggregate_gradients"):
                # What the backend's own aggregation made (the mean over
                # the ranks) is held by no caller.
                ids = {id(g) for g, _ in given}
                made = [g for g, _ in grads_and_vars if id(g) not in ids]
        backend.mark_step_made(self, made)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        self._gradients_aggregated = True
        try:
            with keras.name_scope(name or self.name):
                backend.compiled_apply(self, grads, variables)
        finally:
            self._gradients_aggregated = False
        return self._iterations

    def apply(self, grads, trainable_variables=None):
        """Keras 3's ``apply``, with sparse duplicate indices summed first
        and OptimizerV2's ``gradient_transformers`` applied in order.

        Under ``torch.distributed`` the gradients of a step that did not
        come through ``apply_gradients`` (``fit()``'s) are first reduced to
        their mean over the ranks (``backend.step_gradients``)."""
        if self.decay and not self.__dict__.get("_keo_in_step"):
            # The step reads the decayed rate, in every thread of it (a
            # tf.distribute merge_call runs outside the replicas' threads).
            self.__dict__["_keo_in_step"] = True
            try:
                return self.apply(grads, trainable_variables)
            finally:
                self.__dict__["_keo_in_step"] = False
        if self.__dict__.get("_keo_check_at_step"):
            backend.check_build(self)
            del self.__dict__["_keo_check_at_step"]
        if trainable_variables is not None:  # any iterable, read once
            trainable_variables = list(trainable_variables)
        try:
            grads = backend.step_gradients(self, list(grads))
            grads = backend.prepare_gradients(grads)
            if self.gradient_transformers:
                variables = (
                    self._trainable_variables if trainable_variables is None
                    else list(trainable_variables)
                )
                pairs = list(zip(grads, variables))
                for fn in self.gradient_transformers:
                    pairs = list(fn(pairs))
                grads = [g for g, _ in pairs]
                if trainable_variables is not None:
                    trainable_variables = [v for _, v in pairs]
            _check_gradient_shapes(
                type(self).__name__, grads,
                getattr(self, "_trainable_variables", []) if
                trainable_variables is None else trainable_variables)
            # Keras' `apply` builds an unbuilt optimizer: after the step's
            # forward pass, in an eager custom loop (see `_build_state`).
            self.__dict__["_keo_built_by_step"] = (
                not self.built and backend.executing_eagerly())
            return super().apply(grads, trainable_variables)
        finally:
            self.__dict__["_keo_built_by_step"] = False
            # What the step noted it made (`backend.mark_step_made`) is
            # this step's only, also when the step raised.
            backend.mark_step_made(self, ())

    # ------------------------------------------------------------------
    # Averages
    # ------------------------------------------------------------------

    def build(self, variables=None, *, var_list=None):
        """Create the optimizer state for ``variables``.

        With averaging (``use_ema=True`` or ``averaging=``), the averages are
        created first, where Keras 3 puts its EMA; with the default EMA they
        start as copies of the variables, as in Keras 2 (Keras 3 starts from
        zeros and skips the first step).

        Args:
            variables: The variables to optimize (Keras 3's name).
            var_list: The same, by Keras 2's name: ``build(var_list=...)``,
                and a Keras 2 subclass's ``super().build(var_list=...)``.

        Example:

        ```python
        import keras
        import keras_ema_opt

        w = keras.Variable([1.0, 2.0])
        opt = keras_ema_opt.Adam(0.1)
        opt.build(var_list=[w])  # as Keras 2's optimizers took it
        assert len(opt.variables) == 4  # iterations, rate, m, v
        ```
        """
        if (variables is None) == (var_list is None):
            raise TypeError(
                f"{type(self).__name__}.build() takes the variables once, as "
                "`variables` (Keras 3) or `var_list` (Keras 2). Received: "
                + ("neither" if variables is None else
                   "both (variables=..., var_list=...)"))
        if variables is None:
            variables = var_list
        if self.built:
            return
        loading = self._model_loading_from_h5()
        if loading is not None:
            # Keras 3.15's `.h5` loader builds with the model's own
            # variables alone (`model._trainable_variables`: none for a
            # Sequential or functional model), then sets the file's state
            # into what that build made: built for no variable, the state
            # was lost and the first step refused the model's variables.
            variables = loading.trainable_variables
        with backend.build_scope():
            self._build_state(variables)

    def _build_state(self, variables):
        loading = self._built_by_a_load()
        if loading:
            # A load may build what this backend cannot train (TensorFlow:
            # accumulation under a strategy): refused at the first step.
            self.__dict__["_keo_check_at_step"] = True
        else:
            backend.check_build(self)
        # The model's own non-trainable float variables (a frozen layer's
        # weights, normalization statistics) start the same everywhere
        # too, as DDP broadcasts a module's parameters and buffers.
        fitting = self._model_on_stack()
        if fitting is not None:
            backend.prepare_model(fitting)
        model = self._model_tracked()
        if model is None:
            model = fitting
        frozen = [v for v in (model.non_trainable_variables if model else ())
                  if keras.backend.is_float_dtype(v.dtype)]
        # Not in a load (`load_model` builds the optimizer in Keras'
        # `compile_from_config`, then puts the file's weights in): a chief
        # loading alone would wait for the other ranks' broadcast.
        self.__dict__["_keo_synced_on_build"] = not loading and bool(
            backend.sync_initial_state(self, list(variables) + frozen))
        averager = None
        if self.averaging is not None:
            extras, model = (), None
            if self.averaging.include_non_trainable:
                model = self._averaged_model()
                extras = model.non_trainable_variables
                if self.__dict__.get("_keo_built_by_step") and (
                        _moved_by_forward(model)):
                    # Built eagerly by its first step (the flag is taken
                    # before `build_scope`, where TensorFlow's
                    # `init_scope` is eager also inside a trace).
                    warnings.warn(
                        f"{type(self).__name__}: this optimizer is built by "
                        "its first step, after the step's forward pass: "
                        "the averages of the model's non-trainable "
                        "variables (BatchNorm statistics) start from their "
                        "values after it, one step late (a traced step, "
                        "and `fit()` on JAX and PyTorch, start them before "
                        "it). Build it before the first forward pass: "
                        "`optimizer.build(model.trainable_variables)`, "
                        "after `optimizer.track_non_trainable(model)` "
                        "(TensorFlow's `fit(run_eagerly=True)` builds it "
                        "in its first step).",
                        UserWarning, stacklevel=2)
            averager = engine.Averager(self.averaging)
            averager.build(self, variables, extras)
            if model is not None:
                backend.attach_model(self, model)
        # Keras' build makes an EMA of its own where `use_ema` holds.
        use_ema, self.__dict__["_use_ema"] = self.use_ema, False
        try:
            super().build(variables)
        finally:
            self.__dict__["_use_ema"] = use_ema
        if averager is not None:
            # Plain Python state, as Keras' own `build` keeps its EMA list
            # (the variables themselves are tracked one by one).
            with tracking.DotNotTrackScope():
                self._averager = averager
                self._model_variables_moving_average = averager.primary()

    def track_non_trainable(self, model):
        """Name the model whose non-trainable variables are averaged (and,
        under ``torch.distributed``, broadcast from rank 0 at build).

        With ``include_non_trainable=True`` the averages of the model's
        non-trainable float variables (BatchNorm statistics) are created
        with the optimizer's other state. ``compile``/``fit`` and
        ``keras.saving.load_model`` find the model themselves (the one whose
        ``optimizer`` is being built); a custom training loop calls this,
        then builds the optimizer before its first forward pass (the
        averages start from the statistics as the build finds them; built
        by the first ``apply_gradients``, after that step's forward pass,
        they start one step late, with a ``UserWarning``).

        Example:

        ```python
        import keras
        import keras_ema_opt

        model = keras.Sequential([
            keras.Input((3,)), keras.layers.Dense(4),
            keras.layers.BatchNormalization(),
        ])
        optimizer = keras_ema_opt.SGD(
            averaging=keras_ema_opt.EMA(0.9, include_non_trainable=True))
        optimizer.track_non_trainable(model)
        optimizer.build(model.trainable_variables)
        moving_mean = model.layers[1].moving_mean
        assert optimizer.average_of(moving_mean) is not None
        ```
        """
        if not isinstance(model, keras.Model):
            raise InvalidArgumentError(
                "track_non_trainable() takes a keras.Model. Received: "
                f"model={model!r} of type {type(model).__name__}"
            )
        if self.built:
            raise InvalidArgumentError(
                "track_non_trainable() must come before the optimizer is "
                "built: the averages are part of its state. Received a "
                f"built optimizer {self.name!r}."
            )
        with tracking.DotNotTrackScope():
            self._tracked_model = weakref.ref(model)

    def _averaged_model(self):
        """The model of ``include_non_trainable``: named by
        ``track_non_trainable``, or the model building this optimizer
        (``compile_from_config``, ``fit``): found on the call stack by
        identity of its optimizer, never guessed."""
        model = self._model_building()
        if model is not None:
            return model
        raise InvalidArgumentError(
            "`include_non_trainable=True` needs the model whose non-trainable "
            "variables are averaged: compile the model with this optimizer "
            "and let `fit()` build it, or call "
            "`optimizer.track_non_trainable(model)` before the first step. "
            f"Received: the optimizer {self.name!r} built on its own."
        )

    def _model_building(self):
        """The model of ``track_non_trainable``, or the model building this
        optimizer, found on the call stack by identity of its optimizer;
        None for an optimizer built on its own."""
        model = self._model_tracked()
        if model is None:
            model = self._model_on_stack()
        return model if model is not None else self._model_loading_from_h5()

    def _model_tracked(self):
        """The model of ``track_non_trainable`` while it lives, or None."""
        ref = self.__dict__.get("_tracked_model")
        return None if ref is None else ref()

    # Where Keras (and this package) load a model: a build under these
    # frames is part of a load, whose weights come from the file.
    _H5_LOADER = ("load_model_from_hdf5",
                  "keras/src/legacy/saving/legacy_h5_format.py")
    _LOADERS = (("_model_from_config", "keras/src/saving/saving_lib.py"),
                _H5_LOADER,
                ("load_legacy", "keras_ema_opt/savedmodel/__init__.py"))

    @classmethod
    def _built_by_a_load(cls):
        """Whether the optimizer is being built by a load (Keras'
        ``load_model`` of a ``.keras`` or ``.h5`` file, ``load_legacy``):
        the file's weights then replace those the build sees, on every
        process that loads it. A ``compile_from_config`` a user calls, or a
        model deserialized from a config alone, is no load."""
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            path = code.co_filename.replace("\\", "/")
            if any(code.co_name == name and path.endswith(file)
                   for name, file in cls._LOADERS):
                return True
            frame = frame.f_back
        return False

    def _model_on_stack(self):
        """The model on the call stack whose optimizer this is (building
        it in ``fit``, ``compile_from_config``), or None."""
        frame = sys._getframe(1)
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if self._optimizer_of(candidate):
                return candidate
            frame = frame.f_back
        return None

    def _optimizer_of(self, model):
        """Whether ``model`` is a Keras model whose optimizer is this one
        (or wraps it: a ``LossScaleOptimizer``)."""
        if not isinstance(model, keras.Model):
            return False
        held = getattr(model, "optimizer", None)
        return held is self or getattr(held, "inner_optimizer", None) is self

    def _model_loading_from_h5(self):
        """The model whose `.h5` file Keras is loading, where it builds
        this optimizer (its ``model`` local, whose optimizer is this one),
        or None."""
        name, file = self._H5_LOADER
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_name == name and code.co_filename.replace(
                    "\\", "/").endswith(file):
                model = frame.f_locals.get("model")
                return model if self._optimizer_of(model) else None
            frame = frame.f_back
        return None

    def _update_model_variables_moving_average(self, trainable_variables):
        """Called by Keras after each step: one update of the averages.

        Under ``gradient_accumulation_steps`` only real optimizer steps
        update them (Keras 3.15 updated on every micro-step, defect L4).
        """
        del trainable_variables  # the averager keeps its own, built, list
        if self._averager is not None:
            self._averager.update(self)

    @property
    def ema_overwrite_frequency(self):
        """Keras 2's ``ema_overwrite_frequency`` (``None``: never)."""
        if getattr(_KERAS_STEP, "hide_overwrite", False):
            return None
        return self.__dict__.get("_ema_overwrite_frequency")

    @ema_overwrite_frequency.setter
    def ema_overwrite_frequency(self, value):
        self.__dict__["_ema_overwrite_frequency"] = value

    def _backend_apply_gradients(self, grads, trainable_variables):
        if self._averager is not None and self._ema_follows_momentum:
            # Keras 2's `use_ema` averages (and overwrites) the variables
            # of the step, those with a gradient, where Keras 3 takes every
            # variable the optimizer was built with.
            with self._averager.restricted(trainable_variables):
                return self._apply_and_overwrite(grads, trainable_variables)
        return self._apply_and_overwrite(grads, trainable_variables)

    def _apply_and_overwrite(self, grads, trainable_variables):
        frequency = self.ema_overwrite_frequency
        if not frequency or self._averager is None:
            return super()._backend_apply_gradients(grads, trainable_variables)
        # Keras' own overwrite multiplies `None` averages (variables with
        # `overwrite_with_gradient`, defect L5), runs on micro-steps, and
        # under tf.distribute is a `cond` around a merge_call, which fails:
        # ours skips them and counts real steps. Keras' step is shown no
        # frequency in this thread only (tf.distribute runs each replica's
        # step in a thread of its own, on this one optimizer).
        _KERAS_STEP.hide_overwrite = True
        try:
            super()._backend_apply_gradients(grads, trainable_variables)
        finally:
            _KERAS_STEP.hide_overwrite = False
        self._averager.overwrite(self, frequency)

    def finalize_variable_values(self, var_list):
        """Write the averages into ``var_list`` (Keras 2 semantics).

        ``fit()`` calls this at its end. Each variable is matched to its
        average by identity, so any subset of the trained variables may be
        passed, and gets a buffer of its own (Keras 3.15 shared one on JAX,
        which broke a second ``fit()``, defect L3). With
        ``averaging=...(finalize=False)`` the raw weights stay (defect L6):
        use ``swap_average`` or ``assign_averages`` to read the averages.
        Swaps still open (a ``SwapAverage`` callback holding averages at the
        end of an epoch) are settled first. A ``fit()`` that ends in an
        exception leaves the raw weights, on every backend.
        """
        if var_list is not None:
            var_list = _list_argument(
                var_list, "var_list",
                "`finalize_variable_values` takes a list of variables")
        averager = self._averager
        if averager is None or backend.fit_failed():
            # A fit() ending in an exception keeps its raw weights, on
            # every backend, and its error.
            return
        keep = self.averaging.finalize
        averager.settle_swaps(keep_averages=keep,
                              step=_count(self._iterations))
        if keep:
            # `fit()` passes the trainable variables: averaged statistics
            # (`include_non_trainable`) go in with their weights.
            extras = [v for _, v in averager.extras()]
            self.assign_averages(
                None if var_list is None else list(var_list) + extras
            )

    def assign_averages(self, var_list=None, slot=0):
        """Overwrite variables with their averages (no swap back).

        Args:
            var_list: Variables to overwrite; default: every averaged one.
            slot: Which average for strategies keeping several (PowerEMA).

        Example:

        ```python
        import keras
        import numpy as np
        import keras_ema_opt

        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras_ema_opt.SGD(use_ema=True), loss="mse")
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
        model.optimizer.assign_averages()  # the model now holds its EMA
        ```
        """
        averager = self._require_averages("assign_averages", slot)
        for var, i in engine.averaged_pairs(
                self, averager,
                averager.variables if var_list is None else var_list):
            backend.assign_copy(self, var, averager.value(i, slot))

    def average_of(self, variable, slot=0):
        """The current average of ``variable`` (a tensor), or ``None``.

        ``None`` where a variable the optimizer was built with is not
        averaged (an integer variable, an ``overwrite_with_gradient``
        one). Debiased averages come back corrected.

        Raises:
            UnknownVariableError: a variable that is neither one the
                optimizer was built with nor an averaged non-trainable one
                (``include_non_trainable`` averages float variables only).

        Example:

        ```python
        import keras
        import numpy as np
        import keras_ema_opt

        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras_ema_opt.SGD(
            averaging=keras_ema_opt.PowerEMA(sigma_rels=(0.05, 0.1))),
            loss="mse")
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
        kernel = model.layers[0].kernel
        narrow = model.optimizer.average_of(kernel)          # width 0.05
        wide = model.optimizer.average_of(kernel, slot=1)    # width 0.1
        ```
        """
        averager = self._require_averages("average_of", slot)
        i = averager.index(self, variable)
        if i is None:
            raise UnknownVariableError(
                f"No average is kept for {getattr(variable, 'path', variable)}"
                ": the optimizer was not built with it."
            )
        value = averager.value(i, slot)
        # A copy: on JAX the next compiled step donates the stored buffer.
        return None if value is None else keras.ops.copy(value)

    def swap_average(self, model=None, slot=0):
        """A context manager that puts the averages in and the raw values back.

        Inside the ``with`` block the averaged variables hold their averages;
        on exit they get back their raw values, bit for bit (the raw values
        are kept as copies, not recomputed by an add/subtract trick).

        Args:
            model: A model or layer, or a list of variables; default: every
                averaged variable.
            slot: Which average for strategies keeping several (PowerEMA).

        Example:

        ```python
        import keras
        import numpy as np
        import keras_ema_opt

        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras_ema_opt.SGD(use_ema=True), loss="mse")
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
        with model.optimizer.swap_average(model):
            averaged_predictions = model.predict(np.ones((1, 2)), verbose=0)
        ```
        """
        averager = self._require_averages("swap_average", slot)
        if model is not None and (isinstance(model, str) or not (
                isinstance(model, keras.layers.Layer)
                or hasattr(model, "__iter__"))):
            raise InvalidArgumentError(
                "swap_average() takes a model or layer, a list of variables "
                f"or None. Received: model={model!r}")
        variables = engine.model_variables(model) or averager.variables
        return averager.swap(self, variables, slot)

    def save_snapshot(self, directory=None):
        """Write a snapshot of the power-EMA averages (``PowerEMA`` only).

        ``fit()`` users add the ``PowerEMASnapshots`` callback instead; a
        custom loop calls this every ``snapshot_every`` steps. In a
        multi-process run, every process calls it: the chief writes the
        file, and every process then learns whether that failed.

        Args:
            directory: The folder (default: the ``PowerEMA``'s
                ``snapshot_dir``).

        Returns:
            The path of the snapshot file; ``None`` on a process that is
            not the chief of a multi-process run (the chief writes it).

        Raises:
            OSError: the snapshot cannot be written (the folder is a file,
                no permission): on the chief, and as a
                ``keras_ema_opt.errors.ChiefWriteError`` on every other
                process of a multi-process run.

        Example:

        ```python
        import tempfile
        import keras
        import keras_ema_opt

        folder = tempfile.mkdtemp()
        w = keras.Variable([1.0, 2.0])
        opt = keras_ema_opt.SGD(0.1, averaging=keras_ema_opt.PowerEMA(
            snapshot_every=2, snapshot_dir=folder))
        for step in range(1, 5):
            opt.minimize(lambda: keras.ops.sum(w * w), [w])
            if step % 2 == 0:
                opt.save_snapshot()  # folder/phema-000000002.npz, ...
        weights = opt.averaging.synthesize(sigma_rel=0.08)
        ```
        """
        return self._require_averages("save_snapshot").save_snapshot(
            self, directory
        )

    def _note_run_start(self):
        """The step this process's run starts at, read at its first
        ``apply_gradients`` (a custom loop's; ``fit()`` tells its
        ``PowerEMASnapshots``): its first snapshot sets aside those of
        later steps in the folder, which are not of its past. Only with
        snapshots to write; None where the first call is traced."""
        if "_keo_run_start" in self.__dict__ or not hasattr(
                self.averaging, "gammas"):
            return
        try:
            start = int(keras.ops.convert_to_numpy(self.iterations))
        except Exception:  # a symbolic value, in a trace: not known
            start = None
        self.__dict__["_keo_run_start"] = start

    def _require_averages(self, what, slot=0):
        if self.averaging is not None:
            slots = self.averaging.num_slots
            if isinstance(slot, bool) or not isinstance(
                    slot, numbers.Integral) or not 0 <= slot < slots:
                raise InvalidArgumentError(
                    f"{what}(): `slot` must be an integer in [0, {slots}) "
                    f"({type(self.averaging).__name__} keeps {slots} "
                    f"average{'s' if slots > 1 else ''} per variable). "
                    f"Received: slot={slot!r}")
        if self._averager is None:
            if self.averaging is None:
                raise InvalidArgumentError(
                    f"{what}() needs averaging: create the optimizer with "
                    "`use_ema=True` or `averaging=keras_ema_opt.EMA(...)` "
                    "(or SWA, PowerEMA)."
                )
            raise InvalidArgumentError(
                f"{what}() needs the optimizer built: call "
                "`optimizer.build(model.trainable_variables)` or train one "
                "step first."
            )
        return self._averager

    # ------------------------------------------------------------------
    # What Keras 2 subclasses call on their base class
    # ------------------------------------------------------------------

    @property
    def _index_dict(self):
        """Variable key -> slot index (Keras 2 subclasses index with it)."""
        return self._trainable_variables_indices

    def _build_learning_rate(self, learning_rate):
        """Keras 2's ``self._learning_rate = self._build_learning_rate(lr)``.

        Sets the learning rate (a float or a schedule) and returns the object
        that holds it, so the Keras 2 assignment idiom is a no-op.
        """
        self.learning_rate = learning_rate
        return self._learning_rate

    def _serialize_hyperparameter(self, hyperparameter):
        """Keras 2's helper for ``get_config`` of subclasses."""
        if isinstance(
            hyperparameter, keras.optimizers.schedules.LearningRateSchedule
        ):
            return keras.optimizers.schedules.serialize(hyperparameter)
        if isinstance(hyperparameter, keras.Variable):
            return float(keras.ops.convert_to_numpy(hyperparameter))
        if callable(hyperparameter):
            return hyperparameter()
        return hyperparameter


def _value_initializer(initial_value, shape, ref):
    value = initial_value
    if isinstance(value, keras.Variable):
        value = value.value
    value_shape = tuple(keras.ops.shape(value))
    if value_shape != tuple(shape):
        raise InvalidArgumentError(
            "`initial_value` must have the shape of the variable created "
            f"from {getattr(ref, 'path', ref.name)}, {tuple(shape)}. "
            f"Received a value of shape {value_shape}."
        )

    def initializer(shape, dtype=None):
        return keras.ops.cast(keras.ops.copy(value), dtype or ref.dtype)

    return initializer


def _resolve_averaging(averaging, use_ema, ema_momentum):
    """The strategy asked for: ``averaging=`` or Keras 2's ``use_ema``."""
    if isinstance(averaging, dict):
        averaging = keras.saving.deserialize_keras_object(averaging)
    if averaging is not None and not isinstance(averaging, Averaging):
        raise InvalidArgumentError(
            "`averaging` must be a keras_ema_opt averaging strategy (EMA, "
            f"SWA, PowerEMA) or None. Received: averaging={averaging!r}"
        )
    if averaging is None and use_ema:
        averaging = EMA(ema_momentum)
    return averaging


def _takes_two_arguments(fn):
    """True for ``def update_step(self, gradient, variable)`` (Keras 2)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return False
    return sum(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
    ) == 3


def _accepted_arguments(signature, cls, init):
    """The arguments ``signature`` accepts, and, where it takes ``**kwargs``
    (of any name), those of the ``__init__`` it passes them on to: the next
    classes' up ``cls``'s MRO from the one that defines ``init`` (a user's
    ``MyAdam(keras.optimizers.Adam)`` with ``__init__(self, foo,
    **kwargs)`` takes Adam's arguments), down to Keras' base class."""
    def named(params):
        return {p.name for p in params
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                and p.name != "self"}

    def forwards(params):
        return any(p.kind is p.VAR_KEYWORD for p in params)

    params = list(signature.parameters.values())
    names = named(params)
    if forwards(params):
        # `**kwargs` reach Keras' base class at least.
        names |= set(_BASE_ARGUMENTS)
        mro = cls.__mro__
        owner = next((i for i, c in enumerate(mro)
                      if c.__dict__.get("__init__") is init), len(mro))
        for parent in mro[owner + 1:]:
            own = parent.__dict__.get("__init__")
            if own is None or parent is BaseOptimizer or not issubclass(
                    parent, BaseOptimizer):
                continue
            try:
                parent_params = list(
                    inspect.signature(own).parameters.values())
            except (TypeError, ValueError):
                break
            names |= named(parent_params)
            if not forwards(parent_params):
                break
    return names | {"jit_compile", "lr", "averaging", *_LEGACY_ARGS}


_BASE_ARGUMENTS = tuple(
    name
    for name in inspect.signature(BaseOptimizer.__init__).parameters
    if name not in ("self", "kwargs")
)


def _defaults(signature):
    return {
        p.name: p.default
        for p in signature.parameters.values()
        if p.default is not inspect.Parameter.empty
    }


def _count(variable):
    return int(keras.ops.convert_to_numpy(variable))
