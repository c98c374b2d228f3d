"""The averaging engine: state in Keras variables, one update per real
optimizer step, exact swaps. Pure ``keras.ops``; placement through
``keras_ema_opt.backend``.

State created by ``build`` (all optimizer variables, so ``.keras`` files and
JAX's stateless steps carry them):

- one average per averaged variable and slot (``<path>_average``);
- ``averaging_count``: the number of averaging updates made so far;
- ``averaging_debias``: the bias correction ``c = 1 - prod(decays)``
  (``debias=True`` only), held as ``c`` below 1/2 and as ``-prod(decays)``
  from there, times ``2**126`` (``_debias_step``). The averages of a
  debiased EMA hold the debiased average itself (a state of before,
  ``|s| <= 1``, holds the zero-started one and reads ``a / c``).
"""

import collections.abc
import contextlib
import os
import warnings

import keras
import numpy as np
from keras import ops

from keras_ema_opt import backend
from keras_ema_opt.errors import InvalidArgumentError
from keras_ema_opt.errors import InvalidArgumentTypeError
from keras_ema_opt.errors import UnknownVariableError


# The debias state's held form is stored times this (`_debias_step`):
# exact, a power of 2, whose inverse is float32's smallest normal number.
_HELD = 2.0 ** 126


def _is_float(variable):
    return "float" in str(variable.dtype)


def _working_dtype(dtype):
    """The dtype an average of ``dtype`` is computed in: float32 for
    bfloat16 and float16 (in bfloat16 a decay of 0.999 is 1.0; a small
    debias correction is 0 in float16), else its own."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def _new_run(shape, dtype=None):
    """A run's identity: 64 bits of the system's randomness, not of Keras'
    seed (two runs seeded alike are still two runs), the chief's on every
    process of a multi-process run."""
    drawn = np.frombuffer(os.urandom(8), "<i4").reshape(shape)
    return ops.convert_to_tensor(backend.from_chief(drawn), dtype=dtype)


def run_name(run):
    """The text a snapshot records for the ``run`` variable's value."""
    return np.asarray(run, "<i4").tobytes().hex()


class Averager:
    """The averages of one optimizer, for one strategy."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.variables = []  # averaged model variables, in build order
        self.slots = []  # per variable: list of average variables or None
        # Non-trainable variables averaged too (`include_non_trainable`):
        # the tail of `variables` from `first_extra` on, found by key.
        self.first_extra = None
        self.extra_index = {}
        self.count = None
        self.debias = None
        self.run = None  # PowerEMA: which run its snapshots are of
        self.swaps = []  # open swaps (Python state only while open)
        self._folded = set()  # averaged by this step's update (fold_weights)
        self._fold_plan = None  # the plan fold_weights computed, for update
        self._only = None  # ids of the step's variables, where restricted

    # -- state -------------------------------------------------------------

    def build(self, optimizer, variables, extras=()):
        """Averages for ``variables`` (the trainable ones) and ``extras``
        (non-trainable float variables: BatchNorm statistics)."""
        strategy = self.strategy
        for var in variables:
            self.variables.append(var)
            if not _is_float(var) or optimizer._overwrite_variable_with_gradient(
                var
            ):
                self.slots.append(None)
                continue
            self.slots.append(
                [self._slot(optimizer, var, i) for i in range(
                    strategy.num_slots)]
            )
        self.first_extra = len(self.variables)
        for var in extras:
            if not _is_float(var):
                continue  # integer state (counters, seeds) is never averaged
            self.extra_index[optimizer._var_key(var)] = len(self.variables)
            self.variables.append(var)
            self.slots.append(
                [self._slot(optimizer, var, i) for i in range(
                    strategy.num_slots)]
            )
        self.count = optimizer.add_variable(
            (), dtype="int", initializer="zeros", name="averaging_count"
        )
        if strategy.debias:
            # The correction c = 1 - prod(decays): 0 before the first
            # update (kept as `_debias_step` says).
            self.debias = optimizer.add_variable(
                (), dtype="float32", initializer="zeros",
                name="averaging_debias",
            )
        if hasattr(strategy, "gammas"):
            # Which run the snapshots are of (`save_snapshot`): kept with
            # the state, so that a run resumed from it keeps its own.
            self.run = optimizer.add_variable(
                (2,), dtype="int32", initializer=_new_run,
                name="averaging_run",
            )

    def _slot(self, optimizer, var, index):
        dtype = self.strategy.average_dtype or var.dtype
        suffix = "average" if self.strategy.num_slots == 1 else (
            f"average_{index}"
        )
        if self.strategy.initial == "zeros":
            initializer = "zeros"
        else:
            source = var

            def initializer(shape, dtype=None):
                return ops.cast(backend.current_value(source), dtype)

        path = (getattr(var, "path", None) or str(var.name)).replace(
            "/", "_").replace(":", "_")
        with backend.colocate_with(var), backend.state_variable_role(suffix):
            slot = optimizer.add_variable(
                tuple(var.shape),
                dtype=dtype,
                initializer=initializer,
                name=f"{path}_{suffix}",
                layout=getattr(var, "_layout", None),
            )
        # A given average_dtype, as the value is held (JAX without its
        # 64-bit mode holds a float64 variable's value in float32), not as
        # read (autocast); an average of the weight's own dtype is held as
        # the weight is.
        value = getattr(slot, "_value", None)
        if self.strategy.average_dtype is None or value is None:
            return slot
        held = keras.backend.standardize_dtype(value.dtype)
        wanted = keras.backend.standardize_dtype(dtype)
        if held != wanted:
            raise InvalidArgumentError(
                f"average_dtype={self.strategy.average_dtype!r}: the "
                f"backend holds the average of {getattr(var, 'path', path)} "
                f"in {held}, not {wanted} (JAX keeps "
                "64-bit values only in its 64-bit mode: "
                "`jax.config.update('jax_enable_x64', True)` before any "
                "array is made). Accepted: an average_dtype the backend "
                "holds, or None (the weights' own).")
        return slot

    def primary(self):
        """The first slot of each variable (Keras' EMA list), or None."""
        return [None if s is None else s[0] for s in self.slots]

    # -- update ------------------------------------------------------------

    @staticmethod
    def _step(optimizer, applied=None):
        """(t, real): the 1-based real step just taken, and whether this
        call is a real step (``None``: always, no accumulation). ``applied``
        (a boolean tensor) also gates it: whether the step was taken."""
        steps = optimizer.gradient_accumulation_steps
        raw = optimizer._iterations
        if steps:
            real = ops.equal(ops.mod(raw + 1, steps), 0)
            t = ops.floor_divide(raw, steps) + 1
        else:
            real, t = None, raw + 1
        if applied is not None:
            real = applied if real is None else ops.logical_and(real, applied)
        return ops.cast(t, "int32"), real

    def _targets(self, optimizer, extras_only):
        """(i, variable, slots) of the averages this step updates: all, or
        only the non-trainable ones; those whose current value the step
        cannot read (JAX's stateless ``fit()`` step) are left out."""
        for i, (var, slots) in enumerate(zip(self.variables, self.slots)):
            if slots is None:
                continue
            if i < self.first_extra:
                if not extras_only and (
                        self._only is None or id(var) in self._only):
                    yield i, var, slots
            elif backend.value_visible(var):
                yield i, var, slots
            else:
                self._warn_unseen(optimizer, var)

    @contextlib.contextmanager
    def restricted(self, variables):
        """Update and overwrite only ``variables`` among the trainable ones
        (Keras 2's ``use_ema``: the variables of the step, those with a
        gradient; a strategy passed as ``averaging=`` averages the whole
        model every step, as optax and torch-ema do). The non-trainable
        averages are not affected."""
        self._only = {id(v) for v in variables}
        try:
            yield
        finally:
            self._only = None

    def overwrite(self, optimizer, frequency, extras_only=False,
                  applied=None):
        """Keras 2's ``ema_overwrite_frequency``: every ``frequency`` steps
        the weights (and averaged statistics) become their averages."""
        t, real = self._step(optimizer, applied)
        due = ops.equal(ops.mod(t, frequency), 0)
        if real is not None:
            due = ops.logical_and(due, real)
        for i, var, _ in self._targets(optimizer, extras_only):
            average = ops.cast(self.value(i), var.dtype)
            var.assign(ops.where(due, average, var.value))

    def extras(self):
        """The non-trainable variables averaged, with their positions."""
        return [(i, self.variables[i])
                for i in range(self.first_extra or 0, len(self.variables))]

    def _plan(self, optimizer, applied=None):
        """(average, copy, weights, debias) of this step: the gates
        (``None`` when every step averages), one weight ``w = 1 - d`` per
        slot (formed by the strategy without the cancellation of ``1 - d``;
        ``w / c`` for a debiased average) and the debias state after it
        (``None`` without)."""
        strategy = self.strategy
        t, real = self._step(optimizer, applied)
        plain = real is None and strategy.start_step == 0 and (
            strategy.every == 1
        )
        if plain:
            average = copy = None
        else:
            started = ops.greater(t, strategy.start_step)
            on_grid = ops.equal(ops.mod(t - strategy.start_step,
                                        strategy.every), 0)
            average = ops.logical_and(started, on_grid)
            copy = ops.logical_not(started)
            if real is not None:
                average = ops.logical_and(average, real)
                copy = ops.logical_and(copy, real)
        # Weights the same at every update (an EMA without warm-up) are
        # Python floats, which no backend reads back from a device.
        weights = None if self.debias is not None else (
            strategy.constant_weights())
        if weights is None:
            n = ops.cast(self.count.value, "int32") + 1
            weights = [ops.cast(w, "float32")
                       for w in strategy.weights(n, t)]
        debias = None
        if self.debias is not None:
            debias, weights[0] = self._debias_step(weights[0], average, copy)
        return average, copy, weights, debias

    def fold_weights(self, optimizer):
        """For a backend update step that averages the variables itself,
        right after updating them: the weight ``w`` of
        ``a <- a + w (x - a)`` per slot, for this step. The step then calls
        :meth:`folded` with the variables it averaged, and :meth:`update`
        leaves those to it (and still moves the counters)."""
        self._fold_plan = average, copy, weights, _ = self._plan(optimizer)
        return [self._weight(w, average, copy) for w in weights]

    def fold_gated(self):
        """Whether this step's :meth:`fold_weights` may be exactly 0 (keep)
        or 1 (copy): a strategy with ``start_step``, ``every`` or gradient
        accumulation gates its steps."""
        return self._fold_plan is not None and self._fold_plan[0] is not None

    def folded(self, variables):
        """Mark ``variables`` as averaged for this step by the update."""
        self._folded |= {id(v) for v in variables}

    def slots_of(self, optimizer, variable):
        """The average variables of ``variable`` (one per slot), or None."""
        i = self.index(optimizer, variable)
        return None if i is None else self.slots[i]

    def fold_slots_of(self, optimizer, variable):
        """The averages of ``variable`` that a backend's update step may
        move itself, from the value it writes (:meth:`fold_weights`), or
        None: not those of a variable whose constraint Keras applies after
        the step (:meth:`update` averages the constrained value)."""
        if _averages_constrained(optimizer, variable):
            return None
        return self.slots_of(optimizer, variable)

    def update(self, optimizer, extras_only=False, applied=None):
        """One update after the optimizer's step (traceable, no Python ifs on
        tensors). Under gradient accumulation only real steps count.

        Non-trainable variables whose new value the step cannot see (JAX
        ``fit()``, where the optimizer runs before the model's new
        statistics are returned) are skipped here and updated by
        ``extras_only=True`` afterwards, from the same counters (``applied``:
        whether the optimizer step was taken at all). Variables the
        backend's update step already averaged (:meth:`fold_weights`) are
        skipped too, and the plan of the step is theirs (the counters have
        not moved in between: the same gates and decays, not computed
        twice, which on PyTorch is a dozen eager ops a step).
        """
        folded, self._folded = self._folded, set()
        plan, self._fold_plan = self._fold_plan, None
        if not folded or applied is not None or plan is None:
            plan = self._plan(optimizer, applied)
        average, copy, weights, debias = plan
        targets, constrained = [], []
        for target in self._targets(optimizer, extras_only):
            if id(target[1]) in folded:
                continue
            (constrained if target[0] < self.first_extra
             and _averages_constrained(optimizer, target[1])
             else targets).append(target)
        # Nothing left to mix when the update averaged every variable.
        for k, weight in enumerate(weights if targets else ()):
            pairs = [(slots[k], var) for _, var, slots in targets]
            # A backend fast path (PyTorch: one `_foreach_lerp_` per device
            # and dtype) takes what it can; the rest is mixed here.
            for slot, var in backend.lerp_averages(
                    pairs, self._weight(weight, average, copy),
                    gated=average is not None):
                slot.assign(self._mix(slot, var.value, weight, average,
                                      copy))
        for _, var, slots in constrained:
            # The value Keras' `apply` gives the variable right after this
            # step (`variable.assign(variable.constraint(variable))`): the
            # average is of the weights the model holds.
            value = var.constraint(var.value)
            for slot, weight in zip(slots, weights):
                slot.assign(self._mix(slot, value, weight, average, copy))
        if extras_only:
            return
        step = ops.cast(average if average is not None else True, "int32")
        self.count.assign(self.count.value + ops.cast(step, self.count.dtype))
        if self.debias is not None:
            self.debias.assign(debias)

    def _warn_unseen(self, optimizer, var):
        # JAX's fit() step updates these right after (backend.attach_model);
        # a hand-written stateless step never does: say so, once.
        if getattr(optimizer, "_keo_fit_step", False) or getattr(
            self, "_warned_unseen", False
        ):
            return
        self._warned_unseen = True
        warnings.warn(
            "include_non_trainable=True: this stateless optimizer step was "
            f"not given the model's non-trainable variables ({var.path}, "
            "...), so their averages are not updated by it. Train with "
            "`fit()`, or with stateful steps (`apply_gradients`).",
            stacklevel=4,
        )

    @staticmethod
    def _weight(w, average, copy):
        """The weight of the new value in ``a <- a + w (x - a)``: ``w``
        when averaging, 1 to copy, 0 to keep (the same rule as ``_mix``)."""
        if average is None:
            return w
        return ops.where(copy, 1.0, ops.where(average, w, 0.0))

    @staticmethod
    def _mix(slot, value, weight, average, copy):
        # The new value of `slot` from the variable's `value`. Averages of
        # bfloat16 / float16 are mixed in float32 and rounded once, or
        # they would never move (the fast paths take `1 - d` in float32
        # too).
        dtype = _working_dtype(slot.dtype)
        a = ops.cast(slot.value, dtype)
        w = backend.widen(value, dtype)
        # a + (1 - d) (x - a) with the strategy's 1 - d, as torch's `lerp`
        # computes it: from the nearer end, x - d (x - a) where 1 - d is
        # at least 1/2, so exact at both ends. Not d a + (1 - d) x: in
        # float32 the rounded d and 1 - d need not sum to 1, and the
        # average then drifts from the mean it tracks by up to
        # (d + (1 - d) - 1) / (1 - d) of it (1.7e-4 at d = 0.9999).
        # A weight of exactly 1 or 0 copies or keeps whatever the values
        # (0 (x - a) is NaN where x - a is infinite).
        weight = ops.cast(weight, dtype)
        one = ops.cast(1, dtype)
        near_a = ops.less(weight, ops.cast(0.5, dtype))
        base = ops.where(near_a, a, w)
        step = ops.where(near_a, weight, ops.subtract(weight, one))
        mixed = ops.add(base, ops.multiply(step, ops.subtract(w, a)))
        mixed = ops.where(ops.equal(weight, one), w,
                          ops.where(ops.equal(weight, 0), a, mixed))
        if average is not None:
            mixed = ops.where(copy, w, ops.where(average, mixed, a))
        return ops.cast(mixed, slot.dtype)

    def _debias_step(self, weight, average, copy):
        """(state, weight): the debias state after this step, and the
        weight of the average's update in it.

        The state ``s`` holds the correction ``c = 1 - prod(d)`` as ``c``
        itself while ``c < 1/2``, and as ``-(1 - c) = -prod(d)`` from there
        on: each form keeps the digits that count. ``c <- c + w (1 - c)``
        near 0 (``1 - prod(d)`` would cancel catastrophically in float32);
        ``1 - c <- (1 - c) - w (1 - c)`` near 1, where ``c`` itself would
        stop moving once ``w (1 - c)`` is below half its spacing (``c``
        stalled at ``1 - 3e-8 / w``: ``1 - 3e-4`` for ``d = 0.9999``). 1
        (an exact copy, or a product below ``2**-30``) is kept as 1.

        The average holds the debiased average ``b = a / c`` itself, moved
        by ``b <- b + (w / c') (x - b)`` with the new correction ``c'``
        (``a' = a + w (x - a)`` divided by ``c' = c + w (1 - c)``): the
        first update copies (``w / c' = 1``), and weights that do not move
        are held exactly, where the zero-started ``a`` stalls short of them
        in float32 by about ``3e-8 / w`` of them. This form is stored times
        ``2**126`` (exact: a power of 2; its inverse is float32's smallest
        normal number, which no flush of subnormals to 0 touches), so
        ``|s| >= 2`` (a weight below ``2**-125`` counts as 0 there);
        a state written before it (``0 < |s| <= 1``) holds the zero-started
        ``a``, keeps its form and weight ``w``, and is read as ``a / c``.
        ``s = 0`` (no update yet: the average holds zeros) and ``c = 1``
        (``a = b``) read alike in both.
        """
        s = self._debias_state()
        r, old = self._debias_terms(s)
        weight = ops.cast(weight, "float32")
        # Below 2 / _HELD, c * _HELD could be 1 or less: an old state's.
        weight = ops.where(ops.less(weight, 2.0 / _HELD), 0.0, weight)
        one = ops.cast(1.0, "float32")
        rest = ops.where(ops.less(r, 0.0), ops.negative(r),
                         ops.subtract(one, r))  # prod(d): 1 - c
        rest = ops.subtract(rest, ops.multiply(weight, rest))
        c = ops.add(r, ops.multiply(weight, ops.subtract(one, r)))
        updated = ops.where(
            ops.logical_and(ops.greater_equal(r, 0.0), ops.less(c, 0.5)), c,
            ops.where(ops.less(rest, 2.0 ** -30), one, ops.negative(rest)))
        c = self._correction(updated)
        # w / c' for the held form once started; w itself otherwise.
        keep = ops.logical_or(old, ops.logical_not(ops.greater(c, 0.0)))
        weight = ops.divide(weight, ops.where(keep, one, c))
        updated = ops.multiply(updated, ops.where(old, 1.0, _HELD))
        if average is not None:
            # Before `start_step` the average copies the weights, and the
            # debiased average proper starts after: at 0 (no update yet,
            # read as the weights), its first update a copy (w / c' = 1).
            # Held at 1 here, it read as the copy of the last step before
            # the start, the plain EMA from it, as without `debias`.
            updated = ops.where(copy, 0.0, ops.where(average, updated, s))
        return updated, weight

    def _debias_state(self):
        """The debias state, 0 while no averaging update has been made:
        code before 7596f43 held the copies before a ``start_step`` as a
        correction of 1, and a file it saved between the copies and the
        first update would resume as the plain EMA from the copy."""
        return ops.where(ops.equal(self.count.value, 0), 0.0,
                         self.debias.value)

    @staticmethod
    def _debias_terms(s):
        """(r, old): the debias state ``s`` in the units of ``c`` (``c``
        or ``-prod(d)``), and whether it is a state of before the held
        form (``_debias_step``)."""
        big = ops.greater(ops.abs(s), 1.0)
        old = ops.logical_and(ops.logical_not(big), ops.not_equal(s, 0.0))
        # A product with 1 / _HELD, a normal number (XLA makes a division
        # a product too; with 2**127 that is subnormal, which XLA and
        # TensorFlow may flush to 0).
        return ops.where(big, ops.multiply(s, 1.0 / _HELD), s), old

    @staticmethod
    def _correction(r):
        """The correction ``c = 1 - prod(d)`` that ``r`` (the debias state
        in its units: ``_debias_terms``) holds."""
        return ops.where(ops.less(r, 0.0), ops.add(1.0, r), r)

    # -- reading -------------------------------------------------------------

    def index(self, optimizer, variable):
        """Position of ``variable`` in the build list, or None.

        The averager is built on the optimizer's own variable list, so
        Keras' key -> index map answers without a scan.
        """
        key = optimizer._var_key(variable)
        index = optimizer._trainable_variables_indices.get(key)
        return self.extra_index.get(key) if index is None else index

    def value(self, i, slot=0):
        """The average of variable ``i`` (debiased where asked)."""
        slots = self.slots[i]
        if slots is None:
            return None
        value = slots[slot].value
        if self.debias is not None:
            # Before the first averaging update (c = 0) the average is the
            # weights themselves; a state of before the held form reads
            # a / c (`_debias_step`). c is tested in float32.
            r, old = self._debias_terms(self._debias_state())
            c = self._correction(r)
            started = ops.greater(c, 0.0)
            dtype = value.dtype
            work = _working_dtype(dtype)
            safe = ops.cast(ops.where(ops.logical_and(old, started), c, 1.0),
                            work)
            quotient = ops.divide(ops.cast(value, work), safe)
            # The weight read as a value, not tied to its gradient (a
            # torch parameter's would make the average require grad).
            weight = ops.stop_gradient(self.variables[i].value)
            value = ops.where(started, ops.cast(quotient, dtype),
                              ops.cast(weight, dtype))
        return value

    def save_snapshot(self, optimizer, directory=None):
        """Write the averages of every slot to a snapshot file (PowerEMA)."""
        from keras_ema_opt import distributed
        from keras_ema_opt.averaging import posthoc

        strategy = self.strategy
        directory = directory or getattr(strategy, "snapshot_dir", None)
        if directory is None or not hasattr(strategy, "gammas"):
            raise InvalidArgumentError(
                "save_snapshot() needs a PowerEMA averaging with a "
                "`snapshot_dir` (or a `directory` argument). Received: "
                f"averaging={strategy!r}, directory={directory!r}"
            )
        arrays = {}
        for var, slots in zip(self.variables, self.slots):
            if slots is None:
                continue
            name = getattr(var, "path", None) or str(var.name)
            if f"0/{name}" in arrays:
                raise InvalidArgumentError(
                    "save_snapshot(): two averaged variables have the path "
                    f"{name!r}, and a snapshot keeps the averages by path "
                    "(synthesize() gives them back by path): give the "
                    "layers or sub-models distinct names.")
            for index, slot in enumerate(slots):
                # Whole, on every process (the chief writes it).
                arrays[f"{index}/{name}"] = backend.host_array(slot.value)
        step = int(ops.convert_to_numpy(optimizer.iterations))
        run = run_name(backend.host_array(self.run.value))

        def write():
            # This run's first snapshot into a folder. In a custom loop,
            # what the folder holds of steps after the one its run started
            # at is not of its past (another run's, or steps a resumed run
            # takes again), as `PowerEMASnapshots` sets aside when a fit()
            # starts. Then what it holds of another run, whatever its
            # steps (a run resumed at a later step into another's folder).
            start = optimizer.__dict__.get("_keo_run_start")
            folders = self.__dict__.setdefault("_snapshot_folders", set())
            folder = os.path.abspath(directory)
            if folder not in folders:
                if start is not None:
                    posthoc.set_aside_after_start(directory, start,
                                                  "started")
                posthoc.set_aside_other_runs(directory, run)
                folders.add(folder)
            return posthoc.write_snapshot(
                directory, step, strategy.gammas, strategy.every, arrays,
                run=run)

        # The chief writes the averages every process holds; every process
        # learns whether that failed (`None` elsewhere).
        return distributed.on_chief(write, directory)

    # -- swapping -----------------------------------------------------------

    @contextlib.contextmanager
    def swap(self, optimizer, variables, slot=0):
        """Averages in, then the raw values back, bit for bit."""
        swap = _Swap(optimizer, self, variables, slot)
        self.swaps.append(swap)
        try:
            swap.enter()
            yield swap
        finally:
            if swap in self.swaps:
                self.swaps.remove(swap)
                swap.restore()

    def settle_swaps(self, keep_averages, step=None):
        """Close open swaps at the end of training (``finalize``).

        A swap opened before ``step`` (the optimizer's micro-step count) has
        seen training since: a ``fit()`` inside ``swap_average``, or after
        an evaluate or predict that ended in an exception and left it open.
        Its raw values are older than the trained weights, so it is closed
        without restoring them, with a warning."""
        while self.swaps:
            swap = self.swaps.pop()
            if step is not None and swap.step is not None and (
                    swap.step < step):
                warnings.warn(
                    "A swap of averaged weights open since optimizer step "
                    f"{swap.step} was closed at step {step} without "
                    "restoring the raw weights of that step: the model was "
                    "trained from the averages it held, and restoring would "
                    "undo that training. (A fit() inside `with "
                    "optimizer.swap_average(model):` trains from the "
                    "averages, as does a fit() after an evaluate or predict "
                    "that ended in an exception while a SwapAverage held "
                    "them.)",
                    stacklevel=4)
                continue
            if not keep_averages:
                swap.restore()


class _Swap:
    def __init__(self, optimizer, averager, variables, slot):
        self.optimizer = optimizer
        self.averager = averager
        self.slot = slot
        self.pairs = averaged_pairs(optimizer, averager, variables)
        self.raw = []
        self.step = None

    def enter(self):
        iterations = getattr(self.optimizer, "_iterations", None)
        if iterations is not None:
            self.step = int(ops.convert_to_numpy(iterations))
        self.raw = [ops.copy(var.value) for var, _ in self.pairs]
        for var, i in self.pairs:
            backend.assign_copy(
                self.optimizer, var, self.averager.value(i, self.slot)
            )

    def restore(self):
        for (var, _), raw in zip(self.pairs, self.raw):
            var.assign(raw)
        self.raw = []


def averaged_pairs(optimizer, averager, variables):
    """``[(variable, index)]`` of the averaged ones among ``variables``.

    Variables the optimizer keeps no average of (integer and
    non-trainable ones of a model) are left out; when none of them is
    known to the optimizer at all (a clone of the model, another model),
    that is a mistake, not nothing to do.

    Raises:
        UnknownVariableError: naming the first of them.
    """
    variables = list(variables)
    pairs, known = [], False
    for var in variables:
        i = averager.index(optimizer, var)
        known = known or i is not None
        if i is not None and averager.slots[i] is not None:
            pairs.append((var, i))
    if variables and not known:
        raise UnknownVariableError(
            f"None of the {len(variables)} variables given "
            f"({getattr(variables[0], 'path', variables[0])}, ...) is one "
            "the optimizer was built with, so none has an average: pass "
            "the model (or variables) the optimizer trains.")
    return pairs


def model_variables(target):
    """The variables of a model, a layer, or a list of variables."""
    if target is None:
        return None
    if isinstance(target, (keras.layers.Layer,)):
        return list(target.variables)
    return list(target)


def _short(value, most=120):
    text = repr(value)
    return text if len(text) <= most else text[:most] + "..."


def _numeric(value):
    """Whether ``value`` holds numbers: not None, a string, or an array of
    strings or objects (NumPy kinds O, U, S; a backend's string tensor).
    NumPy's own numeric kinds, ml_dtypes' (int4, float8, bfloat16: kind
    V) and every backend tensor of numbers are."""
    if value is None or isinstance(value, (str, bytes)):
        return False
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        try:
            dtype = np.asarray(value).dtype
        except (TypeError, ValueError):
            return False
    if isinstance(dtype, np.dtype):
        return dtype.kind not in "OUS"
    return "string" not in str(dtype)


def assign_by_path(model, weights):
    """Assign ``{variable path: array}`` to the variables of ``model``.

    Every entry must name a variable of the model with the same shape: no
    silent mismatch; the shapes are all checked before any variable is
    assigned. A path may also name the variable under another name of the
    model, or without the model's name (``sequential/d1/kernel``,
    ``sequential_1/d1/kernel`` and ``d1/kernel``: Keras 3 puts a
    ``Sequential`` or subclassed model's name at the head of its
    variables' paths when it builds them, not when it loads them from a
    ``.keras`` file; ``posthoc.align_paths``), or without the names of the
    models and wrappers nesting its layer, which a loaded model's paths
    lack too (``outer/block/d/kernel`` and ``d/kernel``). A model built
    again in the same process, whose layers Keras named itself, takes the
    weights of its first build: Keras numbers those names anew
    (``sequential/dense/kernel`` is ``sequential_1/dense_2/kernel``), and
    each such name is matched by its number's shift (``posthoc.
    renumbered``; a name given by hand is kept as it is).

    Example:

    ```python
    import keras
    import numpy as np
    import keras_ema_opt

    def build():
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])

    first = build()
    weights = {v.path: np.ones(v.shape) for v in first.weights}
    again = build()  # its paths: sequential_1/dense_1/...
    keras_ema_opt.averaging.assign_by_path(again, weights)
    ```
    """
    from keras_ema_opt.averaging import posthoc

    if not isinstance(weights, collections.abc.Mapping) or not all(
            isinstance(key, str) for key in weights):
        raise InvalidArgumentError(
            "assign_by_path() takes the weights as a dict of {variable "
            "path (str): array}, as synthesize() returns them. Received: "
            f"{type(weights).__name__} {_short(weights)}")
    variables = model_variables(model)
    by_path = {v.path: v for v in variables}
    paths = [v.path for v in variables]
    model_name = getattr(model, "name", None) or ""
    names = posthoc.align_paths(weights, paths, model_name=model_name)
    doubt = posthoc.shadowed(weights, paths)
    if names is None and not doubt:
        # The same model built again in this process: Keras numbers the
        # names it gives layers itself anew (`dense` is now `dense_2`).
        maps = posthoc.renumbered(weights, paths, model_name,
                                  posthoc.keras_named_families(model))
        if len(maps) > 1:  # a frozen layer of the family: by shape
            maps = [m for m in maps if all(
                tuple(by_path[t].shape) == tuple(np.shape(weights[k]))
                for k, t in m.items())]
        if len(maps) == 1:
            names = maps[0]
    repeated = sorted(path for path, n in collections.Counter(paths).items()
                      if n > 1)
    if repeated and (names is None or set(names.values()) & set(repeated)):
        # A loaded model names the layers of two containers alike
        # (`enc/d/kernel` and `dec/d/kernel` both load as `d/kernel`).
        raise InvalidArgumentError(
            f"The model has more than one variable at the path(s) "
            f"{repeated[:5]}, and assign_by_path places weights by path: "
            "give the layers distinct names (a loaded model's paths lack "
            "the names of the Sequential and functional models nesting "
            "its layers).")
    if names is None and doubt:
        raise UnknownVariableError(
            f"{len(doubt)} weight(s) at paths of the model could also be "
            f"other variables of it, which end with those paths: {doubt[:5]} "
            "(a load drops the names of the Sequential and functional "
            "models nesting a layer): neither is chosen. Give the layers "
            "distinct names.")
    if names is None:
        unknown = sorted(set(weights) - set(by_path))
        raise UnknownVariableError(
            f"{len(unknown)} weight(s) name no variable of the model: "
            f"{unknown[:5]} (by path, or by path without the names of its "
            "model and of the models and wrappers nesting a layer, or with "
            "the numbers of the names Keras gave layers itself shifted, as "
            "in a model built again in this process; one variable each; "
            "where two could take one, neither does). The model's "
            f"variables: {sorted(by_path)[:5]}...")
    for path, value in weights.items():  # every shape before any assign
        var = by_path[names[path]]
        if not _numeric(value):
            raise InvalidArgumentTypeError(
                f"assign_by_path() takes numeric arrays: the weight at "
                f"{path} is {type(value).__name__} {_short(value)}.")
        if tuple(var.shape) != tuple(np.shape(value)):
            named = "" if names[path] == path else f" ({var.path} here)"
            raise InvalidArgumentError(
                f"Shape mismatch for {path}{named}: the model has "
                f"{tuple(var.shape)}, the weights {tuple(np.shape(value))}."
            )
    for path, value in weights.items():
        var = by_path[names[path]]
        var.assign(ops.cast(value, var.dtype))
    _warn_of_unmeasured_statistics(model, {id(by_path[t])
                                           for t in names.values()})


def _warn_of_unmeasured_statistics(model, assigned):
    """Warn where a BatchNormalization layer of ``model`` took no weights
    and holds the statistics it was built with (mean 0, variance 1): a
    model built again, given averages without statistics."""
    flatten = getattr(model, "_flatten_layers", None)
    unmeasured = []
    for layer in flatten(include_self=False) if flatten else ():
        stats = [getattr(layer, name, None)
                 for name in ("moving_mean", "moving_variance")]
        if not isinstance(layer, keras.layers.BatchNormalization) or any(
                v is None or id(v) in assigned for v in stats):
            continue
        mean, variance = (ops.convert_to_numpy(v) for v in stats)
        if np.all(mean == 0) and np.all(variance == 1):
            unmeasured.append(layer.name)
    if unmeasured:
        warnings.warn(
            f"assign_by_path: the weights hold no statistics for the "
            f"BatchNormalization layer(s) {unmeasured[:5]}, which keep "
            "those they were built with (mean 0, variance 1): the model "
            "would normalize with them. Run keras_ema_opt.update_bn(model, "
            "data) for statistics of the averaged weights, or average the "
            "statistics too (include_non_trainable=True).", stacklevel=3)


def _averages_constrained(optimizer, variable):
    """Whether the average of ``variable`` is of its value after its
    constraint, which Keras' ``apply`` assigns after the update step: for
    every strategy but Keras 2's ``use_ema`` (which, as Keras 2 and 3 do,
    averages the value the update wrote)."""
    return getattr(variable, "constraint", None) is not None and not (
        getattr(optimizer, "_ema_follows_momentum", False))
