"""Data-parallel training on torch.distributed (gloo), launched by torchrun
with 2 processes on localhost:

    torchrun --nproc-per-node 2 tests/scripts/torch_distributed_fit.py OUT

Each rank builds the model from its own seed (rank 0's weights must reach
every rank), then ``fit()`` on its half of each global batch: 2 steps, a
``.keras`` and a ``.h5`` save by rank 0 only (``mid.keras``, ``mid.h5``), 2
more steps, and an ``AveragedCheckpoint`` that only rank 0 may write. A
custom loop (``minimize`` on each rank's half) follows, with a list of
variables and with a callable; then rank 0 alone loads ``mid.keras`` and
``mid.h5``; last, a ``save_on_chief`` and a snapshot that rank 0 cannot
write (``common.failed_writes``). Each rank writes OUT/rank<r>.json with its weights, averages
and iterations.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "torch"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402

import distributed_common as common  # noqa: E402


def custom_loop(rank, world, named):
    """``minimize`` on this rank's share of each global batch, its
    ``var_list`` a list (``named=list``) or a callable; the state."""
    import keras

    loop = common.make_model(seed=10 + rank)
    var_list = (loop.trainable_variables if named is list
                else (lambda: loop.trainable_variables))
    for step in range(common.STEPS):
        xs, ys = (keras.ops.convert_to_tensor(a)
                  for a in common.local(rank, world, [step]))

        def loss():
            return keras.ops.mean(keras.ops.square(loop(xs) - ys))

        loop.optimizer.minimize(loss, var_list)
    return common.state(loop)


def main(out):
    common.torch_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    import keras

    import keras_ema_opt

    result = {"rank": rank, "world": world}
    model = common.make_model(seed=rank)
    checkpoints = os.path.join(out, f"checkpoints-rank{rank}")
    os.makedirs(checkpoints)
    callback = keras_ema_opt.callbacks.AveragedCheckpoint(
        os.path.join(out, "averaged-{epoch}.keras"))
    x, y = common.local(rank, world, range(common.MID))
    model.fit(x, y, batch_size=len(x) // common.MID, epochs=1,
              shuffle=False, verbose=0, callbacks=[callback])
    keras_ema_opt.distributed.save_on_chief(model,
                                            os.path.join(out, "mid.keras"))
    keras_ema_opt.distributed.save_on_chief(model,
                                            os.path.join(out, "mid.h5"))
    result["mid"] = common.state(model)
    common.fit_steps(model, range(common.MID, common.STEPS), rank, world)
    result["fit"] = common.state(model)
    result["callback_wrote"] = [os.path.basename(p) for p in callback.saved]

    result["loop"] = custom_loop(rank, world, named=list)
    # The same loop with a callable var_list, which names the variables
    # once the loss has run: the gradients of the first step are taken at
    # rank 0's weights too.
    result["loop_callable"] = custom_loop(rank, world, named=callable)
    result["update_bn"] = common.bn_update(rank, world)
    if rank == 0:  # alone, while rank 1 goes on (no collective)
        result["update_bn_alone"] = common.bn_update(
            rank, world, all_processes=False)
    # Keras' gradient accumulation: each rank sums its own gradients, and
    # the real step averages them over the ranks.
    accumulated = common.make_model(seed=20 + rank, accumulate=2)
    common.fit_steps(accumulated, range(common.STEPS), rank, world)
    result["accumulated"] = common.state(accumulated)
    if rank == 0:
        # The chief loads alone while the group is up (no rank joins a
        # broadcast): the loaded weights replace whatever the build saw.
        loaded = keras.saving.load_model(os.path.join(out, "mid.keras"))
        result["chief_loaded"] = common.state(loaded)
        loaded = keras.saving.load_model(os.path.join(out, "mid.h5"))
        result["chief_loaded_h5"] = common.state(loaded)
    result["failed_writes"] = common.failed_writes(
        model, out, lambda m, callbacks: m.fit(
            x, y, batch_size=len(x) // common.MID, epochs=1, shuffle=False,
            verbose=0, callbacks=callbacks))
    common.write(os.path.join(out, f"rank{rank}.json"), result)
    common.leave_torch_group()


if __name__ == "__main__":
    main(sys.argv[1])
