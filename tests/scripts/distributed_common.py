"""The model, data and state shared by the distributed tests (and their
single-process references): a global batch of 8 split across replicas,
Adam with a power-warm-up EMA, 4 steps, a save after step 2."""

import contextlib
import json
import os

import numpy as np

GLOBAL_BATCH = 8
STEPS = 4
MID = 2


def batches():
    rng = np.random.RandomState(3)
    return [(rng.randn(GLOBAL_BATCH, 6).astype("float32"),
             rng.randn(GLOBAL_BATCH, 2).astype("float32"))
            for _ in range(STEPS)]


def local(replica, replicas, steps):
    """Replica ``replica``'s share of each global batch in ``steps``, one
    after the other (a contiguous slice of each)."""
    size = GLOBAL_BATCH // replicas
    part = slice(replica * size, (replica + 1) * size)
    data = [batches()[s] for s in steps]
    return (np.concatenate([x[part] for x, _ in data]),
            np.concatenate([y[part] for _, y in data]))


def mlp(seed):
    """The MLP, its initial weights from ``seed``."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="relu", name="d1"),
        keras.layers.Dense(2, name="d2"),
    ], name="mlp")


def make_model(seed=0, layout=None, accumulate=None):
    """The MLP, compiled. ``seed`` sets its initial weights: replicas given
    different seeds must still start from rank 0's (the shims' job).
    ``accumulate``: Keras' ``gradient_accumulation_steps``."""
    import keras_ema_opt

    model = mlp(seed)
    model.compile(optimizer=keras_ema_opt.Adam(
        learning_rate=0.01,
        averaging=keras_ema_opt.EMA(0.9, warmup="power", finalize=False),
        gradient_accumulation_steps=accumulate),
        # Not "mse": Keras 3.15 cannot compile that alias from a `.h5`.
        loss="mean_squared_error")
    return model


def fit_steps(model, steps, replica=0, replicas=1):
    """``fit`` over ``steps`` (global batch indices), this replica's share."""
    x, y = local(replica, replicas, steps)
    model.fit(x, y, batch_size=GLOBAL_BATCH // replicas, epochs=1,
              shuffle=False, verbose=0)


def state(model):
    import keras

    def array(v):
        return np.asarray(keras.ops.convert_to_numpy(v), "float64").tolist()

    opt = model.optimizer
    return {
        "weights": [array(v) for v in model.trainable_weights],
        "averages": [array(opt.average_of(v))
                     for v in model.trainable_weights],
        "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
    }


def snapshot_run(folder, save=None):
    """The MLP trained 4 steps on the global batches, PowerEMA snapshots
    every 2 in ``folder``, as ``fit()`` with ``PowerEMASnapshots``, then
    saved to ``save`` (``save_on_chief``) where given: the paths of the
    snapshots this process wrote, and the model."""
    import keras_ema_opt

    model = mlp(30)
    model.compile(optimizer=keras_ema_opt.Adam(
        0.01, averaging=keras_ema_opt.PowerEMA(
            snapshot_every=2, snapshot_dir=str(folder))), loss="mse")
    callback = keras_ema_opt.callbacks.PowerEMASnapshots()
    x, y = local(0, 1, range(STEPS))
    model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0,
              callbacks=[callback])
    if save is not None:
        keras_ema_opt.distributed.save_on_chief(model, save)
    return callback.written, model


def failed_writes(model, out, fit, scope=contextlib.nullcontext):
    """Writes the chief cannot make, into ``out/not-a-folder`` (a file the
    chief makes): a ``save_on_chief`` of ``model``, a ``PowerEMA``
    snapshot, in ``fit(model, callbacks)`` (one epoch on this process's
    share) an ``AveragedCheckpoint`` and ``PowerEMASnapshots``, and a
    write through ``on_chief`` that a ``KeyboardInterrupt`` ends. For each, what this process raised: ``[type name, whether an
    OSError]`` (None where nothing was); then whether a collective after
    them still joins every process (``any_process`` of the chief's
    True), and the snapshots' run identity this process holds. ``scope``:
    where the snapshots' model is made (a strategy's)."""
    import keras_ema_opt
    from keras_ema_opt import backend

    blocker = os.path.join(out, "not-a-folder")
    chief = keras_ema_opt.distributed.is_chief()
    if chief:
        open(blocker, "w").close()
    with scope():
        snap = mlp(31)
        snap.compile(optimizer=keras_ema_opt.Adam(
            0.01, averaging=keras_ema_opt.PowerEMA(
                snapshot_every=1, snapshot_dir=blocker)),
            loss="mean_squared_error")
        snap.optimizer.build(snap.trainable_variables)
    callbacks = keras_ema_opt.callbacks
    writes = {
        "save_on_chief": lambda: keras_ema_opt.distributed.save_on_chief(
            model, os.path.join(blocker, "model.keras")),
        "snapshot": snap.optimizer.save_snapshot,
        "averaged_checkpoint": lambda: fit(model, [
            callbacks.AveragedCheckpoint(
                os.path.join(blocker, "averaged-{epoch}.keras"))]),
        "snapshots_in_fit": lambda: fit(snap, [
            callbacks.PowerEMASnapshots()]),
    }

    def interrupted():
        raise KeyboardInterrupt  # a Ctrl-C the chief's script catches

    writes["interrupted"] = lambda: keras_ema_opt.distributed.on_chief(
        interrupted, blocker)
    raised = {}
    for name, write in writes.items():
        raised[name] = None
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - its type is the result
            raised[name] = [type(e).__name__, isinstance(e, OSError)]
    raised["in_step"] = backend.any_process(chief)
    # The snapshots' run, which every process holds as the chief drew it.
    from keras_ema_opt.averaging.engine import run_name

    raised["run"] = run_name(backend.host_array(snap.optimizer._averager.run))
    return raised


def bn_data():
    """The inputs ``update_bn`` measures: 16 samples of 3 features."""
    rng = np.random.default_rng(7)
    return rng.normal(2.0, 3.0, size=(16, 3)).astype("float32")


def bn_update(replica, replicas, size=None, **kwargs):
    """``update_bn`` of a model whose first layer is a BatchNormalization
    (its statistics a function of the data alone), over this replica's
    contiguous share of ``bn_data()`` in batches of ``size`` (default
    ``GLOBAL_BATCH // replicas``): what it measured."""
    import keras

    import keras_ema_opt

    model = keras.Sequential([
        keras.Input((3,)), keras.layers.BatchNormalization(name="bn"),
        keras.layers.Dense(1, name="o")], name="bn_model")
    share = bn_data().reshape(replicas, -1, 3)[replica]
    seen = keras_ema_opt.update_bn(
        model, share, batch_size=size or GLOBAL_BATCH // replicas, **kwargs)
    bn = model.get_layer("bn")
    return {"seen": seen,
            "mean": np.asarray(keras.ops.convert_to_numpy(
                bn.moving_mean), "float64").tolist(),
            "variance": np.asarray(keras.ops.convert_to_numpy(
                bn.moving_variance), "float64").tolist()}


def bn_reference(replicas, global_batches, size=None, only=None):
    """float64 numpy: the mean over batches, weighted by their sizes, of
    each batch's mean and biased variance; the batches are each replica's
    own (PyTorch, TensorFlow: what each process normalizes by) or, with
    ``global_batches``, the replicas' batches of one step together (JAX:
    one global batch). ``size``: as ``bn_update``'s; ``only``: one
    replica's batches alone."""
    shares = bn_data().astype("float64").reshape(replicas, -1, 3)
    if only is not None:
        shares = shares[only:only + 1]
    size = size or GLOBAL_BATCH // replicas
    steps = -(-shares.shape[1] // size)
    parts = [[share[b * size:(b + 1) * size] for b in range(steps)]
             for share in shares]
    if global_batches:
        batches = [np.concatenate([p[b] for p in parts]) for b in
                   range(steps)]
    else:
        batches = [batch for p in parts for batch in p]
    n = sum(len(b) for b in batches)
    mean = sum(len(b) * b.mean(axis=0) for b in batches) / n
    variance = sum(len(b) * b.var(axis=0) for b in batches) / n
    return {"seen": n, "mean": mean, "variance": variance}


def write(path, data):
    with open(path, "w") as f:
        json.dump(data, f)


def read(path):
    with open(path) as f:
        return json.load(f)


def torch_group(rank=None, port=None, timeout=60):
    """Join the two-rank gloo group: on ``127.0.0.1:port`` as ``rank``, or
    from torchrun's environment when ``port`` is None. Ranks out of step
    wait in a collective: they fail in ``timeout`` seconds, not 30 minutes.

    Keras is imported first, on purpose. ``import keras`` imports
    ``torch._dynamo``, and a process group created before that import
    outlives ``destroy_process_group()``: its gloo threads keep running
    until the process exits, and the exit can then abort with "terminate
    called without an active exception" (seen in CI; reproduced by
    importing ``torch._dynamo`` after ``init_process_group``). A script
    that imports Keras first, as ours and the docs' do, is torn down
    cleanly."""
    import datetime

    import keras  # noqa: F401  (before the group: see above)
    import torch.distributed as dist

    kwargs = {"timeout": datetime.timedelta(seconds=timeout)}
    if port is not None:
        kwargs.update(init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                      world_size=2)
    dist.init_process_group("gloo", **kwargs)
    return dist


def leave_torch_group():
    """Both ranks done before either tears gloo down (a rank that destroys
    the group while its peer's collective still runs can end the peer),
    then the group destroyed; on Linux, check that its gloo threads are
    gone rather than left to abort the process at exit."""
    import glob

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    left = [n for n in names if n.startswith(("pt_gloo", "gloo_"))]
    assert not left, f"gloo threads outlive destroy_process_group: {left}"


def clipping_spies(calls):
    """The torch backend's clipping rules, each appending to ``calls``
    whether it was asked to write in place: a value for
    ``keras_ema_opt.backend.torch._CLIP_RULES``."""
    from keras_ema_opt.backend import torch as torch_backend

    def spied(rule):
        def spy(grads, threshold, in_place=False):
            calls.append(in_place)
            return rule(grads, threshold, in_place=in_place)
        return spy

    return tuple((name, spied(rule))
                 for name, rule in torch_backend._CLIP_RULES)
