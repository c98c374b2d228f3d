"""Recompute BatchNormalization statistics for averaged weights.

The moving mean and variance a ``BatchNormalization`` layer keeps during
training belong to the raw weights of each moment. An average of the
weights (SWA, EMA) has statistics of its own, which one pass over training
data measures: SWA's "recompute the BatchNorm statistics" step (Izmailov et
al., 2018, *Averaging Weights Leads to Wider Optima and Better
Generalization*, section 3.2), which PyTorch ships as
``torch.optim.swa_utils.update_bn``.
"""

import itertools
import warnings

import keras
import numpy as np

from keras_ema_opt import backend
from keras_ema_opt.errors import InvalidArgumentError


def update_bn(model, x, batch_size=None, steps=None, all_processes=True):
    """Sets every BatchNormalization layer's statistics to their data average.

    Runs ``model`` in training mode over ``x`` and gives each trainable
    ``keras.layers.BatchNormalization`` layer, nested ones included, the
    mean of the batch statistics it computes there, each batch weighted by
    its number of samples:

    ``moving_mean = sum_b n_b mean_b / sum_b n_b``,
    ``moving_variance = sum_b n_b var_b / sum_b n_b``,

    with ``mean_b`` and ``var_b`` what the layer normalizes batch ``b`` by
    (Keras' biased variance), accumulated in float64. A layer that runs
    several times a pass (inside ``TimeDistributed``, or shared by two
    branches) takes the mean over its calls. With batches of one
    size this is ``torch.optim.swa_utils.update_bn`` (whose variances are
    unbiased: Keras' times ``n / (n - 1)``). Use it after the averages are
    in the model (``fit()`` ends on them, or inside
    ``optimizer.swap_average(model)``), since BatchNorm statistics measured
    under the raw weights do not fit the averaged ones.

    Nothing else changes: the layers' ``momentum``, the weights, and every
    other variable of the model (dropout's random seeds, renormalization
    statistics, metrics) are as before. Layers with ``trainable=False`` run
    in inference mode in Keras and keep their statistics, as do layers the
    forward pass does not run in training mode (called with
    ``training=False``); a warning names them. If reading the data or the forward pass fails, the statistics
    are restored bit for bit before the error propagates.

    In a multi-process run (``torch.distributed``, JAX processes, a
    ``MultiWorkerMirroredStrategy``) every process calls it on its own
    share of the data (under a JAX distribution, with as many batches as
    the others: one that has more is an ``InvalidArgumentError`` on
    every process), and each ends with the statistics of all the shares
    (``docs/averaging.md``); with
    ``all_processes=False`` one process measures the data it is given
    alone (on PyTorch and TensorFlow: the chief, say, before it saves).
    Under a ``tf.distribute`` strategy with several replicas in one
    process, a ``BatchNormalization`` without ``synchronized=True``
    normalized each replica's share of a batch in training: give it the
    per-replica ``batch_size`` (``docs/averaging.md``).

    Inside ``swap_average`` the recomputed statistics are swapped back out
    with the averages only when the averaging has
    ``include_non_trainable=True``; otherwise they stay in the model.

    Reference: Izmailov et al., 2018, "Averaging Weights Leads to Wider
    Optima and Better Generalization", https://arxiv.org/abs/1803.05407.

    Args:
        model: a built ``keras.Model`` (or layer).
        x: the inputs, as ``model.fit`` takes them: arrays (or a dict or list
            of them), a ``tf.data.Dataset``, a ``keras.utils.PyDataset``, a
            ``torch.utils.data.DataLoader`` or a generator. Batches may be
            ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``; only ``x`` is
            used.
        batch_size: the batch size for arrays (default 32).
        steps: at most this many batches (default: all of ``x``; a
            generator that never ends needs it).
        all_processes: in a multi-process run, whether every process
            calls it, each on its share (a collective), or this process
            alone on ``x``. Under a JAX distribution over several
            processes the model's variables span them all, and every
            process must call it.

    Returns:
        The number of samples seen (by every process of a multi-process
        run).

    Raises:
        InvalidArgumentError: ``steps`` or ``batch_size`` is not a positive
            integer, ``x`` yields no batch, the model is not built, or
            ``all_processes=False`` under a JAX distribution over several
            processes.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_ema_opt

    x = np.random.rand(64, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras_ema_opt.SGD(
        0.01, averaging=keras_ema_opt.SWA(start_step=2)), loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)  # ends on the SWA
    keras_ema_opt.update_bn(model, x, batch_size=16)
    ```
    """
    if not isinstance(model, keras.layers.Layer):
        raise InvalidArgumentError(
            "update_bn: `model` must be a Keras model (or layer) holding "
            f"BatchNormalization layers. Received: {model!r} of type "
            f"{type(model).__name__}.")
    if x is None:
        raise InvalidArgumentError(
            "update_bn: `x` must be the inputs to recompute the statistics "
            "on, as `model.fit` takes them (arrays, a dict or list of them, "
            "a tf.data.Dataset, a PyDataset, a DataLoader or a generator). "
            "Received: x=None")
    _check_count("steps", steps)
    _check_count("batch_size", batch_size)
    if not isinstance(all_processes, bool):
        raise InvalidArgumentError(
            "update_bn: `all_processes` must be True or False. Received: "
            f"all_processes={all_processes!r}")
    if not all_processes and backend.forward_spans_processes():
        raise InvalidArgumentError(
            "update_bn(all_processes=False): under a JAX distribution over "
            "several processes the model's variables span them all, and "
            "its forward pass needs every process: call update_bn on every "
            "process, each with its share of the data.")
    layers = _trainable_batch_norms(model)
    if not layers:
        return 0
    recomputed = _statistics(layers)
    ids = {id(v) for v in recomputed}
    others = list({id(v): v for v in model.non_trainable_variables
                   + model.metrics_variables if id(v) not in ids}.values())
    before = [(v, backend.current_value(v)) for v in recomputed + others]
    momenta = [layer.momentum for layer in layers]
    calls = _Calls(layers)
    try:
        seen = _measure(model, layers, calls, x, batch_size, steps,
                        all_processes)
    except BaseException:
        _assign_all(before)
        raise
    finally:
        calls.close()
        for layer, momentum in zip(layers, momenta):
            layer.momentum = momentum
    _assign_all(before[len(recomputed):])
    _keep_the_unreached(layers, calls.per_pass,
                        {id(v): value for v, value in before})
    return seen


class _Calls:
    """Each layer's training-mode calls in one forward pass.

    A layer may run several times a pass (inside ``TimeDistributed``, or
    shared by two branches): its ``i``-th call of the pass gets momentum
    ``(i - 1) / i``, so that its moving statistics end the pass as the mean
    of the statistics of all its calls. Counted as the pass runs (at trace
    time, where it is compiled), from ``start_pass``.
    """

    def __init__(self, layers):
        self.layers = layers
        self.counts = [0] * len(layers)
        self.per_pass = None
        # Keras before 3.15 may compute the moments inline: such a layer
        # runs with momentum 0 (its last call of a pass counts), uncounted.
        self.counted = [hasattr(layer, "_moments") for layer in layers]
        for i, layer in enumerate(layers):
            if self.counted[i]:
                object.__setattr__(layer, "_moments",
                                   self._counted(i, layer, layer._moments))
            else:
                layer.momentum = 0.0

    def _counted(self, i, layer, moments):
        def counted(*args, **kwargs):
            self.counts[i] += 1
            layer.momentum = (self.counts[i] - 1) / self.counts[i]
            return moments(*args, **kwargs)
        return counted

    def start_pass(self):
        self.counts = [0] * len(self.layers)

    def note_first_pass(self):
        """Each layer's calls in the first pass (which runs, or traces,
        all of them); None where uncounted."""
        if self.per_pass is None:
            self.per_pass = [n if counted else None
                             for n, counted in zip(self.counts, self.counted)]

    def close(self):
        for layer in self.layers:
            if "_moments" in vars(layer):
                object.__delattr__(layer, "_moments")


def _keep_the_unreached(layers, per_pass, before):
    """Layers the forward pass did not run in training mode (called with
    ``training=False``, or in a branch not taken) keep their statistics."""
    unreached = [layer for layer, n in zip(layers, per_pass or [])
                 if n == 0]
    for layer in unreached:
        for variable in _statistics([layer]):
            variable.assign(before[id(variable)])
    if unreached:
        warnings.warn(
            "update_bn: these BatchNormalization layers did not run in "
            "training mode in the model's forward pass (called with "
            "`training=False`, or not reached) and keep their statistics: "
            f"{[layer.name for layer in unreached]}.", stacklevel=3)


def _assign_all(pairs):
    for variable, value in pairs:
        variable.assign(value)


def _check_count(name, value):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(
            f"`{name}` must be a positive integer or None. "
            f"Received: {name}={value!r} (of type {type(value).__name__})."
        )
    if value < 1:
        raise InvalidArgumentError(
            f"`{name}` must be a positive integer or None. "
            f"Received: {name}={value}."
        )


def _trainable_batch_norms(model):
    found = [
        layer
        for layer in model._flatten_layers(include_self=True)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    unbuilt = [layer.name for layer in found if not layer.built]
    if unbuilt:
        raise InvalidArgumentError(
            "update_bn: the model's BatchNormalization layers "
            f"{unbuilt} are not built, so they have no statistics yet. "
            "Build the model first (train it, or call it on a batch)."
        )
    frozen = [layer.name for layer in found if not layer.trainable]
    if frozen:
        warnings.warn(
            "update_bn: these BatchNormalization layers have "
            f"trainable=False and keep their statistics: {frozen}. Keras "
            "runs a frozen BatchNormalization in inference mode; set "
            "`trainable=True` on a layer to recompute its statistics.",
            stacklevel=3,
        )
    return [layer for layer in found if layer.trainable]


def _statistics(layers):
    """The variables recomputed: moving mean and variance (and, with batch
    renormalization, the moving standard deviation they come from)."""
    found = []
    for layer in layers:
        found += [layer.moving_mean, layer.moving_variance]
        if layer.renorm:
            found.append(layer.moving_stddev)
    return found


def _measure(model, layers, calls, x, batch_size, steps, all_processes):
    for layer in layers:
        # The first call of a pass has momentum 0 and leaves the batch's
        # own statistics in the moving ones; start from finite values,
        # since 0 * nan is nan.
        _fill(layer.moving_mean, 0.0)
        _fill(layer.moving_variance, 1.0)
        if layer.renorm:
            _fill(layer.moving_stddev, 1.0)
    moments = [v for layer in layers
               for v in (layer.moving_mean, layer.moving_variance)]
    sums = [np.zeros(v.shape, "float64") for v in moments]
    seen = 0
    forward = backend.training_forward(model, calls.start_pass)
    # Under a JAX distribution over several processes each batch is a
    # step of every process together: they agree, batch by batch, that
    # each has one, or a process left with more would wait for ever.
    batches = _batches(x, batch_size, steps)
    if all_processes and backend.forward_spans_processes():
        batches = _in_lockstep(batches)
    for inputs in batches:
        count = forward(inputs)  # on JAX, the global batch's
        calls.note_first_pass()
        for total, variable in zip(sums, moments):
            total += count * keras.ops.convert_to_numpy(
                variable.value).astype("float64")
        seen += count
    if all_processes:
        seen = _sum_over_processes(sums, seen)
    if seen == 0:
        raise InvalidArgumentError(
            "update_bn: the data gave no samples. Received: "
            f"x of type {type(x).__name__}"
            + (f", steps={steps}" if steps is not None else "")
            + ". Pass the training inputs as `model.fit` takes them."
        )
    for total, variable in zip(sums, moments):
        variable.assign(keras.ops.cast(total / seen, variable.dtype))
    for layer in layers:
        if layer.renorm:
            # What the layer's own update keeps: the variance is derived
            # from this standard deviation at its next training step.
            layer.moving_stddev.assign(keras.ops.sqrt(
                keras.ops.add(layer.moving_variance, layer.epsilon)))
    return seen


def _in_lockstep(batches):
    """``batches``, checked before each (one all-gather of a flag) to come
    to an end on every process at once, else an ``InvalidArgumentError``
    on every process."""
    batches = iter(batches)
    end = object()
    n = 0
    while True:
        inputs = next(batches, end)
        ended = inputs is end
        if backend.any_process(ended):
            # Every process is here, at its batch n + 1, and each asks
            # (the same collective on every one) whether all are done.
            if backend.any_process(not ended):
                raise InvalidArgumentError(
                    "update_bn: under a JAX distribution over several "
                    "processes every process must pass as many batches "
                    "(each batch is a step of them all, one global batch). "
                    "Received: " + (
                        f"this process has more than {n} batches, and "
                        f"another process had {n}" if not ended else
                        f"this process had {n} batches, and another "
                        "process has more") + ".")
            return
        n += 1
        yield inputs


def _sum_over_processes(sums, seen):
    """Every process's batches of a multi-process run: ``sums`` summed in
    place over the processes (each measured its own share of the data; on
    JAX, the same global batches), and the total of ``seen``."""
    flat = backend.sum_over_processes(np.concatenate(
        [np.ravel(total) for total in sums] + [np.array([seen], "float64")]))
    start = 0
    for total in sums:
        total[...] = np.reshape(flat[start:start + total.size], total.shape)
        start += total.size
    return int(round(flat[-1]))


def _fill(variable, value):
    variable.assign(keras.ops.full(variable.shape, value, variable.dtype))


def _numpy_iterator(adapter, x):
    """Keras' numpy batches of ``x`` (its data adapter's). Keras' own
    iterator over a torch ``DataLoader`` makes a tuple of each batch, which
    splits a batch that is one tensor (a ``DataLoader`` over a tensor, as
    ``torch.optim.swa_utils.update_bn`` takes) into its rows: such a
    loader's batches are converted as they come."""
    if type(adapter).__name__ != "TorchDataLoaderAdapter":
        return adapter.get_numpy_iterator()

    def to_numpy(t):
        return np.asarray(t.cpu() if hasattr(t, "cpu") else t)
    return (keras.tree.map_structure(to_numpy, batch) for batch in x)


def _batches(x, batch_size, steps):
    """The inputs of each batch of ``x``, as numpy structures."""
    from keras.src.trainers.data_adapters import get_data_adapter

    adapter = get_data_adapter(x, batch_size=batch_size, shuffle=False)
    begin = getattr(adapter, "on_epoch_begin", None)
    if begin is not None:
        begin()
    try:
        for data in itertools.islice(_numpy_iterator(adapter, x), steps):
            inputs, _, _ = keras.utils.unpack_x_y_sample_weight(data)
            yield inputs
    finally:
        end = getattr(adapter, "on_epoch_end", None)
        if end is not None:
            end()
