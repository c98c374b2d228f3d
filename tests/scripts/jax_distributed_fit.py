"""Training under keras.distribution on JAX, on localhost.

    jax_distributed_fit.py OUT dataparallel
        DataParallel over 4 host devices (XLA_FLAGS, set here).
    jax_distributed_fit.py OUT modelparallel
        ModelParallel on a (2, 2) mesh with a LayoutMap sharding the MLP's
        kernels over "model".
    jax_distributed_fit.py OUT multiprocess INDEX PORT
        DataParallel over 2 processes of 2 devices (jax.distributed, gloo
        collectives); each process feeds its half of each global batch.

``fit()`` 2 steps, a ``.keras`` save by the chief only (``mid.keras``), 2
more steps, with an ``AveragedCheckpoint`` only the chief may write; then a
custom loop of ``apply_gradients`` on gradients of the global batch; last,
a ``save_on_chief`` and a snapshot the chief cannot write
(``common.failed_writes``).
Writes OUT/<mode><index>.json: states, and whether every average and
Adam slot carries the sharding of its variable.
"""

import os
import sys

out, mode = sys.argv[1], sys.argv[2]
index = int(sys.argv[3]) if mode == "multiprocess" else 0
devices_here = 2 if mode == "multiprocess" else 4
os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={devices_here}")
os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

if mode == "multiprocess":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{sys.argv[4]}", num_processes=2,
                               process_id=index)

import keras  # noqa: E402
keras.config.disable_traceback_filtering()
import numpy as np  # noqa: E402

import distributed_common as common  # noqa: E402
import keras_ema_opt  # noqa: E402

DEVICES = jax.devices()


def distribution():
    if mode == "modelparallel":
        mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                             DEVICES)
        layout = keras.distribution.LayoutMap(mesh)
        layout[".*d1/kernel"] = (None, "model")
        layout[".*d1/bias"] = ("model",)
        layout[".*d2/kernel"] = ("model", None)
        return keras.distribution.ModelParallel(
            layout_map=layout, batch_dim_name="batch")
    return keras.distribution.DataParallel(
        devices=DEVICES, auto_shard_dataset=mode != "multiprocess")


def sharded_alike(model):
    """Per trainable variable: whether its average and Adam slots have its
    sharding (and it is sharded over the mesh as asked)."""
    opt = model.optimizer
    out = []
    for i, var in enumerate(model.trainable_variables):
        want = var.value.sharding
        state = [opt._averager.slots[i][0], opt._momentums[i],
                 opt._velocities[i]]
        out.append(all(s.value.sharding.is_equivalent_to(want, var.ndim)
                       for s in state))
    return out


def specs(model):
    return {v.path: str(getattr(v.value.sharding, "spec", None))
            for v in model.trainable_variables}


def whole_values_failed(model, out):
    """What each of two failures while the chief holds the whole values
    of ``model``'s variables sharded over the processes raised on this
    process (a ``save_on_chief`` into a folder that is a file; a gather
    failing part way, at a variable whose value cannot be read), and
    whether every variable then holds its global array again (the same
    object)."""
    from keras_ema_opt import backend

    class Unreadable:
        @property
        def _value(self):
            raise RuntimeError("this variable's value cannot be read")

    variables = list(model.variables) + list(model.optimizer.variables)
    before = [v._value for v in variables]
    sharded = [v for v in variables if not v.value.is_fully_addressable]
    blocker = os.path.join(out, "not-a-folder-sharded")
    if keras_ema_opt.distributed.is_chief():
        open(blocker, "w").close()
    raised = {}
    try:
        keras_ema_opt.distributed.save_on_chief(
            model, os.path.join(blocker, "m.keras"))
    except OSError as e:  # the chief's own error; ChiefWriteError else
        raised["save_on_chief"] = type(e).__name__
    try:
        with backend.whole_values_scope(
                sharded[:3] + [Unreadable()] + sharded[3:]):
            pass
    except RuntimeError as e:
        raised["gather"] = type(e).__name__
    return {"raised": raised, "sharded": len(sharded),
            "restored": [v._value is b for v, b in zip(variables, before,
                                                       strict=True)]}


def fit(model, steps):
    processes = 2 if mode == "multiprocess" else 1
    common.fit_steps(model, steps, index, processes)


def main():
    keras.distribution.set_distribution(distribution())
    result = {"devices": len(DEVICES),
              "chief": keras_ema_opt.distributed.is_chief()}
    # JAX itself checks that every process places the same initial values.
    model = common.make_model(seed=0)
    callback = keras_ema_opt.callbacks.AveragedCheckpoint(
        os.path.join(out, f"averaged-process{index}-{{epoch}}.keras"))
    processes = 2 if mode == "multiprocess" else 1
    x, y = common.local(index, processes, range(common.MID))
    model.fit(x, y, batch_size=len(x) // common.MID, epochs=1,
              shuffle=False, verbose=0, callbacks=[callback])
    keras_ema_opt.distributed.save_on_chief(model,
                                            os.path.join(out, "mid.keras"))
    fit(model, range(common.MID, common.STEPS))
    result["fit"] = common.state(model)
    result["sharded_alike"] = sharded_alike(model)
    result["specs"] = specs(model)
    result["callback_wrote"] = [os.path.basename(p) for p in callback.saved]

    loop = common.make_model(seed=10)
    loop.optimizer.build(loop.trainable_variables)
    for step in range(common.STEPS):
        xs, ys = common.batches()[step]

        def loss():
            return keras.ops.mean(keras.ops.square(loop(xs) - ys))

        loop.optimizer.minimize(loss, loop.trainable_variables)
    result["loop"] = common.state(loop)
    result["loop_sharded_alike"] = sharded_alike(loop)
    result["update_bn"] = common.bn_update(
        index, 2 if mode == "multiprocess" else 1)
    if mode == "dataparallel":  # batches of 6, 6 and 4 on 4 devices
        result["update_bn_uneven"] = common.bn_update(0, 1, size=6)
    if mode == "multiprocess":
        try:
            common.bn_update(index, 2, all_processes=False)
        except keras_ema_opt.errors.InvalidArgumentError as e:
            result["update_bn_alone_refused"] = str(e)
        # Two batches on process 0, one on process 1: both refuse it (it
        # waited for ever), and the run goes on in step (its later
        # collectives would hang otherwise).
        try:
            common.bn_update(index, 2, steps=2 - index)
        except keras_ema_opt.errors.InvalidArgumentError as e:
            result["update_bn_unequal_refused"] = str(e)
    accumulated = common.make_model(seed=20, accumulate=2)
    fit(accumulated, range(common.STEPS))
    result["accumulated"] = common.state(accumulated)
    if mode == "multiprocess":
        # Kernels sharded over the two processes' devices (the "model"
        # axis spans them; each process feeds the whole batch): each
        # process holds half of every kernel and average, and the chief's
        # snapshots and its save must hold them whole.
        d = np.array(DEVICES).reshape(2, 2).T  # rows: one per process
        mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], d)
        layout = keras.distribution.LayoutMap(mesh)
        layout[".*d1/kernel"] = (None, "model")
        layout[".*d2/kernel"] = ("model", None)
        keras.distribution.set_distribution(keras.distribution.ModelParallel(
            layout_map=layout, batch_dim_name="batch",
            auto_shard_dataset=False))
        written, sharded = common.snapshot_run(
            os.path.join(out, "snapshots"),
            save=os.path.join(out, "sharded.keras"))
        result["snapshots_written"] = [os.path.basename(p) for p in written]
        result["whole_values_failed"] = whole_values_failed(sharded, out)
    if mode == "multiprocess":  # the snapshots' layout: data parallel
        keras.distribution.set_distribution(distribution())
    result["failed_writes"] = common.failed_writes(
        model, out, lambda m, callbacks: m.fit(
            x, y, batch_size=len(x) // common.MID, epochs=1, shuffle=False,
            verbose=0, callbacks=callbacks))
    common.write(os.path.join(out, f"{mode}{index}.json"), result)


main()
print("ok")
