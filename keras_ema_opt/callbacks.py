"""Callbacks that use the averaged weights during ``fit``/``evaluate``/
``predict``.

- ``SwapAverage``: evaluation, testing and prediction run on the averaged
  weights, then the raw weights come back bit for bit; with
  ``swap_on_epoch=True`` the averages are also in the model at the end of
  each epoch, for ``ModelCheckpoint`` or ``EarlyStopping`` listed after it.
- ``AveragedCheckpoint``: writes the averaged model as ``.keras`` during
  ``fit``, atomically.
- ``PowerEMASnapshots``: writes ``PowerEMA`` snapshots every
  ``snapshot_every`` optimizer steps during ``fit``.
"""

import os
import sys
import warnings

import keras

from keras_ema_opt import backend
from keras_ema_opt import distributed
from keras_ema_opt.averaging import strategies
from keras_ema_opt.errors import InvalidArgumentError


def _averaging_optimizer(model, who):
    optimizer = getattr(model, "optimizer", None)
    # Under a mixed-precision policy Keras wraps the compiled optimizer in
    # a `LossScaleOptimizer`: the averages are the inner one's.
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None and hasattr(inner, "swap_average"):
        optimizer = inner
    if optimizer is None or not hasattr(optimizer, "swap_average") or (
        getattr(optimizer, "averaging", None) is None
    ):
        raise InvalidArgumentError(
            f"{who} needs a model compiled with a keras_ema_opt optimizer "
            "that averages (`use_ema=True`, `averaging=...`, or "
            "`keras_ema_opt.averaged(...)`). Received the optimizer "
            f"{optimizer!r}."
        )
    return optimizer


class SwapAverage(keras.callbacks.Callback):
    """Evaluate, test and predict on the averaged weights, then restore.

    Unlike Keras 3.15's ``SwapEMAWeights`` it restores the raw weights after
    ``predict`` (defect L1), and early stopping with ``swap_on_epoch=True``
    ends training on the averages (defect L2): the optimizer's
    ``finalize_variable_values`` settles the open swap.

    Args:
        swap_on_epoch: Also hold the averages in the model from the end of
            each epoch to the start of the next (put ``ModelCheckpoint`` or
            ``EarlyStopping`` after this callback to act on them, and
            ``BackupAndRestore`` before it: listed after it, it is refused,
            since it would back up the averages as the weights).
        slot: Which average, for strategies keeping several (PowerEMA).

    ``EarlyStopping(restore_best_weights=True)`` and
    ``ModelCheckpoint(save_best_only=True)`` watching a ``val_`` metric
    choose their epoch by what this callback measures on the averages: they
    keep those averages only with ``swap_on_epoch=True`` and listed after
    this callback; otherwise a warning says so when ``fit()`` begins.

    A ``fit()``, ``evaluate()`` or ``predict()`` that ends in an exception
    (Keras then calls no ``*_end``) leaves nothing of this callback behind:
    the next call with this callback puts the raw weights back first, and
    an ``evaluate()`` after an interrupted ``fit()`` ends on them. (On JAX,
    Keras 3.15's own trainer leaves a model whose ``evaluate()`` raised
    with its variables unset, with or without this callback: its next
    ``get_weights()`` raises ``TypeError``.)

    Example:

    ```python
    import keras
    import numpy as np
    import keras_ema_opt

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras_ema_opt.Adam(use_ema=True), loss="mse")
    x, y = np.ones((8, 2)), np.ones((8, 1))
    model.fit(x, y, validation_data=(x, y), verbose=0,
              callbacks=[keras_ema_opt.callbacks.SwapAverage()])
    ```
    """

    def __init__(self, swap_on_epoch=False, slot=0):
        super().__init__()
        self.swap_on_epoch = strategies._check_bool("swap_on_epoch",
                                                    swap_on_epoch)
        self.slot = strategies._check_int("slot", slot, 0)
        self._open = None

    @property
    def averages_in_model(self):
        """Whether the model holds the averaged weights now."""
        return self._open is not None

    def _swap_in(self):
        if self._open is None:
            optimizer = _averaging_optimizer(self.model, "SwapAverage")
            if not optimizer.built:
                return
            self._open = optimizer.swap_average(self.model, self.slot)
            self._open.__enter__()

    def _swap_out(self):
        if self._open is not None:
            context, self._open = self._open, None
            context.__exit__(None, None, None)

    def on_epoch_begin(self, epoch, logs=None):
        self._swap_out()

    def on_epoch_end(self, epoch, logs=None):
        if self.swap_on_epoch:
            self._swap_in()

    def on_test_begin(self, logs=None):
        self._swap_in()

    def on_test_end(self, logs=None):
        if not self.swap_on_epoch or not self._in_fit():
            self._swap_out()

    def on_predict_begin(self, logs=None):
        self._swap_in()

    def on_predict_end(self, logs=None):
        self._swap_out()

    def on_train_end(self, logs=None):
        # fit() has called finalize_variable_values, which settled the swap;
        # closing it here restores nothing.
        self._fitting = False
        self._swap_out()

    def _in_fit(self):
        return bool(getattr(self, "_fitting", False))

    def set_params(self, params):
        # Keras gives each fit(), evaluate() and predict() call its own
        # callback list, which sets the parameters of its callbacks (the
        # validation inside fit() reuses fit's list). A fit() that ended in
        # an exception never called `on_train_end`: a later evaluate() is
        # not inside it.
        self._fitting = False
        super().set_params(params)

    def on_train_begin(self, logs=None):
        # A swap left open by a fit(), evaluate() or predict() that ended in
        # an exception (Keras calls no `*_end` then): put the raw weights
        # back before training on them, and close it, so that this fit()'s
        # end does not restore it.
        self._fitting = True
        self._swap_out()
        self._check_order(_callbacks_of_this_call())

    def _check_order(self, callbacks):
        """Refuse or warn of callbacks that would act on the wrong weights
        at an epoch's end, by where they are listed beside this one."""
        mine = next((i for i, c in enumerate(callbacks or ()) if c is self),
                    None)
        if mine is None:
            return
        after, before = callbacks[mine + 1:], callbacks[:mine]
        if self.swap_on_epoch:
            # One saving at epochs' ends; with `save_freq=<batches>` it
            # saves after a batch, when the model holds the raw weights.
            backups = [c for c in after
                       if isinstance(c, keras.callbacks.BackupAndRestore)
                       and getattr(c, "save_freq", "epoch") == "epoch"]
            if backups:
                raise InvalidArgumentError(
                    "SwapAverage(swap_on_epoch=True) is listed before "
                    "BackupAndRestore, which would back up the averages it "
                    "holds at each epoch's end as the model's weights, and "
                    "resume training from them. List BackupAndRestore before "
                    "SwapAverage. Received the callbacks "
                    f"{[type(c).__name__ for c in callbacks]}.")
        chosen = [c for c in (before if self.swap_on_epoch else callbacks)
                  if _keeps_the_best_epoch(c)]
        if chosen:
            warnings.warn(
                f"{[type(c).__name__ for c in chosen]} choose the best epoch "
                f"by {sorted({c.monitor for c in chosen})}, measured on the "
                "averaged weights (SwapAverage), but would keep that "
                "epoch's raw weights. Use SwapAverage(swap_on_epoch=True) "
                "listed before them, so that they keep the averages they "
                "measured.", stacklevel=2)


def _callbacks_of_this_call():
    """The callbacks of the ``fit()`` whose ``CallbackList`` is calling the
    caller's hook, or None when it is called another way."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList):
            return list(owner.callbacks)
    return None


def _keeps_the_best_epoch(callback):
    """Whether ``callback`` keeps the weights of the epoch with the best
    validation metric (which SwapAverage measures on the averages)."""
    monitor = str(getattr(callback, "monitor", ""))
    if not monitor.startswith("val_"):
        return False
    if isinstance(callback, keras.callbacks.EarlyStopping):
        return bool(callback.restore_best_weights)
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        return bool(callback.save_best_only)
    return False


class AveragedCheckpoint(keras.callbacks.Callback):
    """Save the averaged model as ``.keras`` at the end of epochs.

    The file holds the averaged weights in the model and the full optimizer
    state (raw weights are restored in memory right after). Writing goes to
    a temporary file in the same folder, renamed into place, so a crash
    never leaves a partial file. In a multi-process run only the chief
    (rank 0, JAX process 0, the chief worker) writes; the averages are the
    same on every process.

    Args:
        filepath: Path ending in ``.keras``; may hold ``{epoch}`` and log
            keys, e.g. ``"avg-{epoch:02d}-{val_loss:.3f}.keras"``.
        save_freq: Save every ``save_freq`` epochs.
        slot: Which average, for strategies keeping several (PowerEMA).

    A ``fit()`` that ends in an exception leaves nothing of this callback
    behind, as with ``SwapAverage`` (which see, also for Keras' own JAX
    defect there).

    Example:

    ```python
    import os, tempfile
    import keras
    import numpy as np
    import keras_ema_opt

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras_ema_opt.SGD(averaging=keras_ema_opt.SWA()),
                  loss="mse")
    path = os.path.join(tempfile.mkdtemp(), "averaged-{epoch}.keras")
    model.fit(np.ones((8, 2)), np.ones((8, 1)), epochs=2, verbose=0,
              callbacks=[keras_ema_opt.callbacks.AveragedCheckpoint(path)])
    ```
    """

    def __init__(self, filepath, save_freq=1, slot=0):
        super().__init__()
        if not isinstance(filepath, (str, os.PathLike)):
            raise InvalidArgumentError(
                "`filepath` must be a path (str or os.PathLike) ending in "
                "'.keras', which may hold `{epoch}` and the logs' keys. "
                f"Received: filepath={filepath!r} of type "
                f"{type(filepath).__name__}")
        filepath = os.fspath(filepath)
        if not isinstance(filepath, str) or not filepath.endswith(".keras"):
            raise InvalidArgumentError(
                "AveragedCheckpoint writes `.keras` files: `filepath` must "
                f"end in '.keras'. Received: filepath={filepath!r}"
            )
        if isinstance(save_freq, bool) or not isinstance(save_freq, int) or (
            save_freq < 1
        ):
            raise InvalidArgumentError(
                "`save_freq` must be an integer >= 1 (epochs). Received: "
                f"save_freq={save_freq!r}"
            )
        self.filepath = filepath
        self.save_freq = save_freq
        self.slot = strategies._check_int("slot", slot, 0)
        self.saved = []

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.save_freq:
            return
        optimizer = _averaging_optimizer(self.model, "AveragedCheckpoint")
        try:
            path = self.filepath.format(epoch=epoch + 1, **(logs or {}))
        except (KeyError, IndexError, ValueError) as e:
            raise InvalidArgumentError(
                f"AveragedCheckpoint cannot format its filepath "
                f"{self.filepath!r} at epoch {epoch + 1} ({type(e).__name__}:"
                f" {e}): it takes `epoch` and this epoch's logs, "
                f"{sorted(logs or {})} (validation logs exist only on the "
                "epochs that validate).") from e
        # Every process swaps (on JAX, placing a global array is a
        # collective step); only the chief writes.
        chief = backend.is_chief()
        with optimizer.swap_average(self.model, self.slot):
            distributed.save_on_chief(self.model, path)
        if not chief:
            return
        self.saved.append(path)


class PowerEMASnapshots(keras.callbacks.Callback):
    """Write ``PowerEMA`` snapshots every ``snapshot_every`` steps in ``fit``.

    Example:

    ```python
    import tempfile
    import keras
    import numpy as np
    import keras_ema_opt

    folder = tempfile.mkdtemp()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras_ema_opt.SGD(averaging=keras_ema_opt.PowerEMA(
        snapshot_every=2, snapshot_dir=folder)), loss="mse")
    model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=2, verbose=0,
              callbacks=[keras_ema_opt.callbacks.PowerEMASnapshots()])
    weights = model.optimizer.averaging.synthesize(sigma_rel=0.08)
    ```
    """

    def __init__(self):
        super().__init__()
        self.written = []

    def on_train_begin(self, logs=None):
        optimizer = _averaging_optimizer(self.model, "PowerEMASnapshots")
        if not getattr(optimizer.averaging, "snapshot_every", None):
            raise InvalidArgumentError(
                "PowerEMASnapshots needs `PowerEMA(snapshot_every=..., "
                f"snapshot_dir=...)`. Received: {optimizer.averaging!r}"
            )
        self._optimizer = optimizer
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        self._accumulation = inner.gradient_accumulation_steps or 1
        self._first_epoch = True

    def _real_steps(self, micro_steps):
        return micro_steps // self._accumulation

    def on_epoch_begin(self, epoch, logs=None):
        # The count itself (the variables are current between epochs), read
        # here and not at on_train_begin: a BackupAndRestore listed after
        # this callback restores the count in its own on_train_begin, and
        # the snapshots must stay on the grid of `snapshot_every` steps.
        inner = getattr(self._optimizer, "inner_optimizer", self._optimizer)
        self._micro = self._epoch_start = int(
            keras.ops.convert_to_numpy(inner._iterations))
        self._done = self._real_steps(self._micro) // (
            self._optimizer.averaging.snapshot_every)
        if self._first_epoch:
            self._first_epoch = False
            # Where training starts (after any restore), no snapshot of a
            # later step can be this run's: another run's (from step 0,
            # whatever the folder holds), or of the steps a resumed run
            # takes again, on any grid of steps. The chief sets them
            # aside; every process learns whether that failed.
            from keras_ema_opt.averaging import posthoc

            start = self._real_steps(self._micro)
            folder = self._optimizer.averaging.snapshot_dir
            distributed.on_chief(
                lambda: posthoc.set_aside_after_start(folder, start), folder)

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the last step of the call (several under
        # steps_per_execution), counted from the start of the epoch; Keras
        # reports the last, shorter call of an epoch as a full one.
        steps = (self.params or {}).get("steps")
        if steps:
            batch = min(batch, steps - 1)
        self._micro = self._epoch_start + batch + 1
        every = self._optimizer.averaging.snapshot_every
        due = self._real_steps(self._micro) // every
        if due > self._done:
            self._done = due
            backend.sync_training_state(self.model)
            path = self._optimizer.save_snapshot()
            if path is not None:  # None: not the chief of a multi-process run
                self.written.append(path)
