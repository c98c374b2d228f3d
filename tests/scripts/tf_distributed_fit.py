"""Data-parallel training under tf.distribute, on localhost.

    tf_distributed_fit.py OUT mirrored
        MirroredStrategy over 2 logical CPUs, one process.
    tf_distributed_fit.py OUT multiworker INDEX PORT0 PORT1
        MultiWorkerMirroredStrategy, worker INDEX of 2 (a cluster
        resolver, no TF_CONFIG).

Each replica set builds the model in the strategy scope (worker i from
seed i: tf.distribute must give every worker worker 0's weights), then
``fit()`` on the global batches (the strategy splits each), 2 steps, a
``.keras`` save by the chief only (``mid.keras``), 2 more steps, with an
``AveragedCheckpoint`` that only the chief may write. A custom loop
follows: ``strategy.run`` with each replica's half of a batch, the loss
scaled by the global batch (``compute_average_loss``) and
``apply_gradients``, which sums over replicas (Keras 2); last, a
``save_on_chief`` and a snapshot the chief cannot write
(``common.failed_writes``). Writes
OUT/<name>.json with the initial weights, the states and where the
optimizer state lives.
"""

import json
import os
import sys

out, mode = sys.argv[1], sys.argv[2]
index = int(sys.argv[3]) if mode == "multiworker" else 0
os.environ.pop("TF_CONFIG", None)
os.environ["KERAS_BACKEND"] = "tensorflow"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if mode == "mirrored":
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
else:
    # The cluster from a resolver, as SLURM's gives it, and no TF_CONFIG:
    # who is chief is told by the strategy, also outside its scope (where
    # Keras runs the callbacks that write files).
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": [
                f"127.0.0.1:{p}" for p in sys.argv[4:6]]}),
            task_type="worker", task_id=index))

import keras  # noqa: E402

import distributed_common as common  # noqa: E402
import keras_ema_opt  # noqa: E402


def devices(variable):
    value = variable.value if isinstance(variable, keras.Variable) else (
        variable)
    return sorted(v.device for v in value.values)


def placement(model):
    """Per trainable variable: whether its average and Adam slots are
    mirrored over the same devices as the variable itself."""
    opt = model.optimizer
    out = []
    for i, var in enumerate(model.trainable_variables):
        state = [opt._averager.slots[i][0], opt._momentums[i],
                 opt._velocities[i]]
        out.append(all(
            isinstance(s.value, tf.distribute.DistributedValues)
            and devices(s) == devices(var) for s in state))
    return out


def dataset(steps):
    x = np.concatenate([common.batches()[s][0] for s in steps])
    y = np.concatenate([common.batches()[s][1] for s in steps])
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        common.GLOBAL_BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    return data.with_options(options)


def main():
    result = {"replicas": strategy.num_replicas_in_sync}
    with strategy.scope():
        model = common.make_model(seed=index)
    result["chief"] = keras_ema_opt.distributed.is_chief()  # outside
    result["init"] = [keras.ops.convert_to_numpy(v).tolist()
                      for v in model.trainable_variables]
    callback = keras_ema_opt.callbacks.AveragedCheckpoint(
        os.path.join(out, f"averaged-worker{index}-{{epoch}}.keras"))
    model.fit(dataset(range(common.MID)), epochs=1, verbose=0,
              callbacks=[callback])
    keras_ema_opt.distributed.save_on_chief(model,
                                            os.path.join(out, "mid.keras"))
    result["placement"] = placement(model)
    # Each replica of each slot and average by its own name (each is made
    # under its kind: backend.state_variable_role).
    result["state_names"] = [
        [v.name, [part.name for part in v.value.values]]
        for v in model.optimizer.variables
        if isinstance(v.value, tf.distribute.DistributedValues)]
    model.fit(dataset(range(common.MID, common.STEPS)), epochs=1, verbose=0)
    result["fit"] = common.state(model)
    result["callback_wrote"] = [os.path.basename(p) for p in callback.saved]

    with strategy.scope():
        loop = common.make_model(seed=10 + index)
        loop.optimizer.build(loop.trainable_variables)
    result["loop_init"] = [keras.ops.convert_to_numpy(v).tolist()
                           for v in loop.trainable_variables]
    replicas = strategy.num_replicas_in_sync

    @tf.function
    def step(xs, ys):
        def replica_step(xs, ys):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean(tf.square(loop(xs) - ys), -1)
                loss = tf.nn.compute_average_loss(
                    per_example, global_batch_size=common.GLOBAL_BATCH)
            variables = loop.trainable_variables
            grads = tape.gradient(loss, [v.value for v in variables])
            loop.optimizer.apply_gradients(zip(grads, variables))
        strategy.run(replica_step, args=(xs, ys))

    for s in range(common.STEPS):
        def shard(ctx, s=s, part=0):
            return common.local(ctx.replica_id_in_sync_group, replicas,
                                [s])[part]
        xs = strategy.experimental_distribute_values_from_function(shard)
        ys = strategy.experimental_distribute_values_from_function(
            lambda ctx, s=s: shard(ctx, s, 1))
        step(xs, ys)
    result["loop"] = common.state(loop)
    result["update_bn"] = common.bn_update(
        index, 2 if mode == "multiworker" else 1)
    result["failed_writes"] = common.failed_writes(
        model, out, lambda m, callbacks: m.fit(
            dataset(range(common.MID)), epochs=1, verbose=0,
            callbacks=callbacks), strategy.scope)
    common.write(os.path.join(out, f"{mode}{index}.json"), result)


main()
print("ok")
