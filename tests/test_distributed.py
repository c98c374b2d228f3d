"""Training on each backend's own distributed engine equals single-process
training on the same global batch (weights and averages within 1e-5), and
state saved under one topology resumes under another in lockstep.

Real multi-process runs on localhost, each bounded in time:
torch.distributed with gloo (``torchrun``, 2 processes), TensorFlow's
MirroredStrategy (2 logical CPUs) and MultiWorkerMirroredStrategy (2
processes), JAX's ``keras.distribution`` on several host devices and on 2
processes (``jax.distributed``). The model, data and reference run are in
``tests/scripts/distributed_common.py``.
"""

import os
import socket
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from conftest import BACKEND
from conftest import ROOT
from conftest import computed
from conftest import last_json
from conftest import only_on
from conftest import run_python
from conftest import to_numpy

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import distributed_common as common  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_same(got, want, what):
    for key in ("weights", "averages"):
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL,
                                       err_msg=f"{what}: {key}[{i}]")
    assert got["iterations"] == want["iterations"], what


def _single(steps, model=None):
    """The uninterrupted single-process run over ``steps``."""
    model = model or common.make_model(seed=0)
    common.fit_steps(model, steps)
    return model


def _only_the_chief_wrote(out, results, averaged, *saved):
    """Process 0 is the chief; its callback wrote ``averaged``, the other
    process's nothing; the folder holds that, ``mid.keras`` and the other
    ``saved`` files alone."""
    assert [r["chief"] for r in results] == [True, False]
    assert results[0]["callback_wrote"] == [averaged]
    assert results[1]["callback_wrote"] == []
    assert sorted(p.name for p in out.glob("*.keras")) == sorted([
        averaged, "mid.keras", *saved])


def _assert_every_process_raised(out, results):
    """A ``save_on_chief``, a PowerEMA snapshot, and in ``fit()`` an
    ``AveragedCheckpoint`` and ``PowerEMASnapshots``, into a folder that
    is a file, and a write a ``KeyboardInterrupt`` ends
    (``common.failed_writes``): the chief raised its own error, every
    other process a ``ChiefWriteError`` at the same call (none went on to
    wait for the chief in a collective), and a collective after them still
    joined every process. Nothing was written. Every process holds the
    chief's PowerEMA run identity (drawn at random on each)."""
    assert len({r["failed_writes"]["run"] for r in results}) == 1, [
        r["failed_writes"]["run"] for r in results]
    for i, result in enumerate(results):
        raised = result["failed_writes"]
        assert raised["in_step"] is True, i
        for write in ("save_on_chief", "snapshot", "averaged_checkpoint",
                      "snapshots_in_fit"):
            name, is_os_error = raised[write] or (None, None)
            assert is_os_error, (i, write, raised[write])
            assert (name == "ChiefWriteError") == (i > 0), (i, write, name)
        # Told of a Ctrl-C the chief caught, before the chief's next
        # collective (which would have paired with the outcome's).
        assert raised["interrupted"] == (
            ["KeyboardInterrupt", False] if i == 0 else
            ["ChiefWriteError", True]), i
    assert (out / "not-a-folder").is_file()


def _resumed(path, backend):
    """``path`` loaded under ``backend`` (here, or in a fresh process) and
    trained the steps after the save: its state."""
    if backend == BACKEND:
        model = keras.saving.load_model(path)
        common.fit_steps(model, range(common.MID, common.STEPS))
        return common.state(model)
    return _resume_elsewhere(path, backend)


def _resume_elsewhere(path, backend):
    """Load ``path`` under ``backend`` in a fresh process and fit the
    steps after the save; its state as JSON."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[2])\n"
        "import keras, keras_ema_opt, distributed_common as c\n"
        "m = keras.saving.load_model(sys.argv[1])\n"
        "c.fit_steps(m, range(c.MID, c.STEPS))\n"
        "print(json.dumps(c.state(m)))\n")
    return last_json(run_python("-c", code, path, SCRIPTS, backend=backend,
                                timeout=300))


# ---------------------------------------------------------------------------
# PyTorch: torch.distributed (gloo), two processes launched by torchrun
# ---------------------------------------------------------------------------


def _assert_bn_measured(results, replicas, global_batches, key="update_bn",
                        **reference):
    """Every process's ``update_bn`` (each over its share of the data)
    gave the statistics of all the shares' batches, float64 reference."""
    want = common.bn_reference(replicas, global_batches, **reference)
    for i, result in enumerate(results):
        got = result[key]
        assert got["seen"] == want["seen"], i
        np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-6)
        np.testing.assert_allclose(got["variance"], want["variance"],
                                   rtol=1e-5)


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch-dist")
    run_python("-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", _free_port(),
               SCRIPTS / "torch_distributed_fit.py", out, backend="torch",
               timeout=300)
    ranks = [common.read(out / f"rank{r}.json") for r in (0, 1)]
    return out, ranks


@only_on("torch")
def test_torch_ddp_fit_and_custom_loop_equal_one_process(torch_run):
    _, ranks = torch_run
    reference = common.state(_single(range(common.STEPS)))
    loop = common.make_model(seed=10)
    for step in range(common.STEPS):
        xs, ys = (keras.ops.convert_to_tensor(a)
                  for a in common.local(0, 1, [step]))
        loop.optimizer.minimize(
            lambda: keras.ops.mean(keras.ops.square(loop(xs) - ys)),
            loop.trainable_variables)
    for rank in ranks:
        assert rank["world"] == 2
        # Rank 1 was built from another seed: rank 0's weights reached it.
        _assert_same(rank["fit"], reference, f"fit, rank {rank['rank']}")
        _assert_same(rank["loop"], common.state(loop),
                     f"custom loop, rank {rank['rank']}")
        _assert_same(rank["loop_callable"], common.state(loop),
                     f"custom loop, callable var_list, rank {rank['rank']}")
    # The same averages on every rank, bit for bit.
    assert ranks[0]["fit"]["averages"] == ranks[1]["fit"]["averages"]


def _accumulated_reference():
    """Two real steps of gradient accumulation over 4 global batches, in
    one process."""
    return common.state(_single(range(common.STEPS), common.make_model(
        seed=20, accumulate=2)))


@only_on("torch")
def test_torch_ddp_gradient_accumulation_equals_one_process(torch_run):
    _, ranks = torch_run
    reference = _accumulated_reference()
    assert reference["iterations"] == 2
    for rank in ranks:
        _assert_same(rank["accumulated"], reference,
                     f"accumulated, rank {rank['rank']}")


@only_on("torch")
def test_torch_ddp_update_bn_measures_every_ranks_share(torch_run):
    # Each rank normalizes by its own batches (DDP without SyncBatchNorm);
    # the statistics are those of all ranks' batches, on every rank.
    _, ranks = torch_run
    _assert_bn_measured(ranks, 2, global_batches=False)
    # Rank 0 alone (all_processes=False): its own share's statistics.
    _assert_bn_measured(ranks[:1], 2, global_batches=False,
                        key="update_bn_alone", only=0)
    assert ranks[0]["update_bn_alone"]["seen"] == 8


@only_on("torch")
def test_torch_ddp_chief_loads_alone_while_the_group_is_up(torch_run):
    # load_model builds the optimizer; that build broadcasts nothing (it
    # had waited for the other rank), and the file's state is what loads.
    _, ranks = torch_run
    assert "chief_loaded" not in ranks[1]
    assert ranks[0]["chief_loaded"] == ranks[0]["mid"]
    # The same of the `.h5` file (Keras' loader builds the optimizer for
    # the model's own variables alone, none here: ours takes the model's).
    assert ranks[0]["chief_loaded_h5"] == ranks[0]["mid"]


@only_on("torch")
def test_torch_ddp_only_rank_0_writes_files(torch_run):
    out, ranks = torch_run
    assert ranks[0]["callback_wrote"] == ["averaged-1.keras"]
    assert ranks[1]["callback_wrote"] == []
    assert sorted(p.name for p in out.glob("*.keras")) == [
        "averaged-1.keras", "mid.keras"]


@only_on("torch")
def test_torch_ddp_a_write_failing_on_rank_0_raises_on_every_rank(torch_run):
    _assert_every_process_raised(*torch_run)


@only_on("torch")
@pytest.mark.parametrize("resume_backend", ["torch", "jax"])
def test_torch_ddp_save_resumes_in_one_process(torch_run, resume_backend):
    """Saved by 2 processes after step 2, resumed by 1 (on PyTorch and on
    JAX): in lockstep with the uninterrupted single-process run."""
    out, _ = torch_run
    reference = common.state(_single(range(common.STEPS)))
    resumed = _resumed(out / "mid.keras", resume_backend)
    _assert_same(resumed, reference, f"resumed on {resume_backend}")


# ---------------------------------------------------------------------------
# TensorFlow: MirroredStrategy (2 logical CPUs), MultiWorkerMirroredStrategy
# (2 worker processes)
# ---------------------------------------------------------------------------


def _run_together(commands, timeout=300):
    """Start every command at once (workers of one job); all must end well
    within ``timeout`` seconds."""
    import subprocess

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND=BACKEND,
               CUDA_VISIBLE_DEVICES="")
    procs = [subprocess.Popen([sys.executable, *map(str, c)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for c in commands]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]


def _reference(result):
    """The single-process runs from the distributed run's initial weights
    (tf.distribute gives every replica worker 0's)."""
    def start(seed, init):
        model = common.make_model(seed=seed)
        for var, value in zip(model.trainable_variables, init):
            var.assign(np.asarray(value, "float32"))
        return model

    fit = _single(range(common.STEPS), start(0, result["init"]))
    loop = start(10, result["loop_init"])
    for step in range(common.STEPS):
        xs, ys = (keras.ops.convert_to_tensor(a)
                  for a in common.local(0, 1, [step]))
        loop.optimizer.minimize(
            lambda: keras.ops.mean(keras.ops.square(loop(xs) - ys)),
            loop.trainable_variables)
    return common.state(fit), common.state(loop)


@pytest.fixture(scope="module")
def tf_runs(tmp_path_factory):
    mirrored = tmp_path_factory.mktemp("tf-mirrored")
    script = SCRIPTS / "tf_distributed_fit.py"
    run_python(script, mirrored, "mirrored", backend="tensorflow",
               timeout=300)
    workers = tmp_path_factory.mktemp("tf-multiworker")
    ports = [_free_port(), _free_port()]
    _run_together([[script, workers, "multiworker", i, *ports]
                   for i in (0, 1)])
    return {"mirrored": (mirrored, [common.read(mirrored / "mirrored0.json")]),
            "multiworker": (workers, [common.read(
                workers / f"multiworker{i}.json") for i in (0, 1)])}


@only_on("tensorflow")
@pytest.mark.parametrize("kind", ["mirrored", "multiworker"])
def test_tf_distribute_fit_and_custom_loop_equal_one_process(tf_runs, kind):
    _, results = tf_runs[kind]
    fit, loop = _reference(results[0])
    for i, result in enumerate(results):
        assert result["replicas"] == 2
        assert result["init"] == results[0]["init"]  # worker 1: seed 1
        _assert_same(result["fit"], fit, f"{kind} fit, worker {i}")
        _assert_same(result["loop"], loop, f"{kind} custom loop, worker {i}")
        # Averages and slots are mirrored beside their variables, each
        # replica under its own name.
        assert result["placement"] == [True] * 4
        names = result["state_names"]
        assert len(names) >= 12
        parts = [part for _, replicas in names for part in replicas]
        local = 2 if kind == "mirrored" else 1  # replicas in the process
        assert len(set(parts)) == len(parts) == local * len(names)
        for name, replicas in names:
            assert all(f"/{name}" in part for part in replicas), replicas
    assert results[0]["fit"]["averages"] == results[-1]["fit"]["averages"]


@only_on("tensorflow")
@pytest.mark.parametrize("kind,replicas", [("mirrored", 1),
                                           ("multiworker", 2)])
def test_tf_distribute_update_bn_measures_every_workers_share(
        tf_runs, kind, replicas):
    # One process (MirroredStrategy) measures all the data; each of two
    # workers its share, and the statistics are those of both.
    _, results = tf_runs[kind]
    _assert_bn_measured(results, replicas, global_batches=False)


@only_on("tensorflow")
def test_tf_gradient_accumulation_under_a_strategy_is_refused_at_build():
    # Keras 3.15's accumulation fails in the first step under any
    # strategy (its own Adam too): refused, typed, before training.
    import tensorflow as tf

    import keras_ema_opt
    from keras_ema_opt.errors import InvalidArgumentError

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras_ema_opt.averaged(
            keras.optimizers.Adam(gradient_accumulation_steps=2),
            keras_ema_opt.EMA(0.9)), loss="mse")
    before = [to_numpy(v) for v in model.weights]
    with pytest.raises(InvalidArgumentError, match=r"Received: "
                       r"gradient_accumulation_steps=2 under "
                       r"MirroredStrategy"):
        model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4,
                  verbose=0)
    for v, old in zip(model.weights, before):
        np.testing.assert_array_equal(to_numpy(v), old)


@only_on("tensorflow")
def test_tf_accumulating_model_loads_under_a_strategy(tmp_path):
    # A load builds the optimizer too: under a strategy the model loads
    # and predicts; training it is refused at its first step.
    import tensorflow as tf

    import keras_ema_opt
    from keras_ema_opt.errors import InvalidArgumentError

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras_ema_opt.Adam(
        gradient_accumulation_steps=2, averaging=keras_ema_opt.EMA(0.9)),
        loss="mse")
    model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
    model.save(tmp_path / "m.keras")
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        loaded = keras.saving.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(loaded.predict(np.ones((2, 3)), verbose=0),
                               model.predict(np.ones((2, 3)), verbose=0))
    with pytest.raises(InvalidArgumentError, match="under MirroredStrategy"):
        loaded.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4,
                   verbose=0)


@only_on("tensorflow")
def test_tf_multiworker_only_the_chief_writes(tf_runs):
    _only_the_chief_wrote(*tf_runs["multiworker"], "averaged-worker0-1.keras")


@only_on("tensorflow")
@pytest.mark.parametrize("kind", ["mirrored", "multiworker"])
def test_tf_a_write_failing_on_the_chief_raises_on_every_worker(tf_runs,
                                                                kind):
    _assert_every_process_raised(*tf_runs[kind])


@only_on("tensorflow")
@pytest.mark.parametrize("kind,resume_backend", [
    ("multiworker", "tensorflow"), ("mirrored", "torch")])
def test_tf_distribute_save_resumes_in_one_process(tf_runs, kind,
                                                   resume_backend):
    """Saved by 2 workers (or 2 replicas) after step 2, resumed by one
    process (TensorFlow, PyTorch): in lockstep with the uninterrupted
    single-process run."""
    out, results = tf_runs[kind]
    fit, _ = _reference(results[0])
    resumed = _resumed(out / "mid.keras", resume_backend)
    _assert_same(resumed, fit, f"{kind} resumed on {resume_backend}")


# ---------------------------------------------------------------------------
# JAX: keras.distribution on 4 host devices (DataParallel, ModelParallel with
# a LayoutMap) and on 2 processes (jax.distributed, gloo collectives)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jax_runs(tmp_path_factory):
    script = SCRIPTS / "jax_distributed_fit.py"
    runs = {}
    for mode in ("dataparallel", "modelparallel"):
        out = tmp_path_factory.mktemp(f"jax-{mode}")
        run_python(script, out, mode, backend="jax", timeout=300)
        runs[mode] = (out, [common.read(out / f"{mode}0.json")])
    out = tmp_path_factory.mktemp("jax-multiprocess")
    port = _free_port()
    _run_together([[script, out, "multiprocess", i, port] for i in (0, 1)])
    runs["multiprocess"] = (out, [common.read(
        out / f"multiprocess{i}.json") for i in (0, 1)])
    return runs


def _jax_reference():
    fit = _single(range(common.STEPS))
    loop = common.make_model(seed=10)
    for step in range(common.STEPS):
        xs, ys = common.batches()[step]
        loop.optimizer.minimize(
            lambda: keras.ops.mean(keras.ops.square(
                loop(xs) - keras.ops.convert_to_tensor(ys))),
            loop.trainable_variables)
    return common.state(fit), common.state(loop)


@only_on("jax")
@pytest.mark.parametrize("mode", ["dataparallel", "modelparallel",
                                  "multiprocess"])
def test_jax_distribution_fit_and_custom_loop_equal_one_device(jax_runs,
                                                               mode):
    _, results = jax_runs[mode]
    fit, loop = _jax_reference()
    accumulated = _accumulated_reference()
    for i, result in enumerate(results):
        assert result["devices"] == 4
        _assert_same(result["fit"], fit, f"{mode} fit, process {i}")
        _assert_same(result["loop"], loop, f"{mode} custom loop, process {i}")
        # Every average and slot has the sharding of its variable.
        assert result["sharded_alike"] == [True] * 4
        assert result["loop_sharded_alike"] == [True] * 4
        # Keras' gradient accumulation, as one device accumulating.
        _assert_same(result["accumulated"], accumulated,
                     f"{mode} accumulated, process {i}")
    assert results[0]["fit"]["averages"] == results[-1]["fit"]["averages"]


@only_on("jax")
@pytest.mark.parametrize("mode,replicas", [("dataparallel", 1),
                                           ("multiprocess", 2)])
def test_jax_distribution_update_bn_measures_global_batches(jax_runs, mode,
                                                            replicas):
    # As in fit(), each process's batch is its share of one global batch,
    # which the BatchNormalization normalizes by.
    _, results = jax_runs[mode]
    _assert_bn_measured(results, replicas, global_batches=True)
    if mode == "dataparallel":
        # A batch the 4 devices cannot split (6, then a last 4) runs
        # whole on each, as in one process.
        _assert_bn_measured(results, 1, global_batches=True,
                            key="update_bn_uneven", size=6)
    else:
        # Its variables span the processes: each must take part.
        for result in results:
            assert "call update_bn on every process" in result[
                "update_bn_alone_refused"]
        # As many batches on each: two against one is refused on both.
        assert "this process has more than 1 batches, and another " \
            "process had 1" in results[0]["update_bn_unequal_refused"]
        assert "this process had 1 batches, and another process has " \
            "more" in results[1]["update_bn_unequal_refused"]


@only_on("jax")
def test_jax_snapshots_of_averages_sharded_over_processes(jax_runs,
                                                          tmp_path):
    # Each process holds half of every kernel's averages: the chief wrote
    # them whole (every process gathers), as one device writes them.
    out, results = jax_runs["multiprocess"]
    assert [r["snapshots_written"] for r in results] == [
        ["phema-000000002.npz", "phema-000000004.npz"], []]
    common.snapshot_run(tmp_path)  # the snapshots, one device
    for name in results[0]["snapshots_written"]:
        with np.load(out / "snapshots" / name) as got, \
                np.load(tmp_path / name) as want:
            assert sorted(got.files) == sorted(want.files)
            for key in want.files:
                if key != "__meta__":
                    np.testing.assert_allclose(got[key], want[key], **TOL,
                                               err_msg=f"{name}: {key}")


@only_on("jax")
def test_jax_save_on_chief_of_variables_sharded_over_processes(jax_runs,
                                                              tmp_path):
    # Each process holds half of every kernel, its moments and averages:
    # the chief's `.keras` holds them whole (every process gathers), as one
    # device saves them.
    out, _ = jax_runs["multiprocess"]
    common.snapshot_run(tmp_path, save=tmp_path / "one.keras")
    got = keras.saving.load_model(out / "sharded.keras")
    want = keras.saving.load_model(tmp_path / "one.keras")
    for kind in ("weights", "optimizer"):
        pairs = (zip(got.weights, want.weights, strict=True)
                 if kind == "weights" else zip(
                     computed(got.optimizer.variables),
                     computed(want.optimizer.variables), strict=True))
        for a, b in pairs:
            # The optimizers' own names differ (`adam`, `adam_3`).
            assert a.path.split("/", 1)[-1] == b.path.split("/", 1)[-1]
            np.testing.assert_allclose(to_numpy(a), to_numpy(b), **TOL,
                                       err_msg=f"{kind}: {a.path}")


@only_on("jax")
def test_jax_a_failure_while_the_chief_holds_whole_values_restores_them(
        jax_runs):
    # A save_on_chief the chief cannot write, and a gather failing after
    # the chief took three whole values: each process raised, and every
    # variable of the chief holds its global array again.
    _, results = jax_runs["multiprocess"]
    raised = [r["whole_values_failed"]["raised"] for r in results]
    assert raised[0].get("save_on_chief") not in (None, "ChiefWriteError")
    assert raised[0]["gather"] == "RuntimeError"
    assert raised[1] == {"save_on_chief": "ChiefWriteError",
                         "gather": "RuntimeError"}
    for r in results:
        failed = r["whole_values_failed"]
        assert failed["sharded"] >= 4  # two kernels, their slots, averages
        assert all(failed["restored"]), failed["restored"]


@only_on("jax")
def test_jax_model_parallel_shards_as_the_layout_map_says(jax_runs):
    _, (result,) = jax_runs["modelparallel"]
    assert result["specs"] == {
        "mlp/d1/kernel": "P(None, 'model')", "mlp/d1/bias": "P('model',)",
        "mlp/d2/kernel": "P('model', None)", "mlp/d2/bias": "P(None,)"}


@only_on("jax")
def test_jax_multiprocess_only_process_0_writes(jax_runs):
    _only_the_chief_wrote(*jax_runs["multiprocess"],
                          "averaged-process0-1.keras", "sharded.keras")


@only_on("jax")
@pytest.mark.parametrize("mode", ["dataparallel", "multiprocess"])
def test_jax_a_write_failing_on_process_0_raises_on_every_process(jax_runs,
                                                                  mode):
    _assert_every_process_raised(*jax_runs[mode])


@only_on("jax")
@pytest.mark.parametrize("mode,resume_backend", [
    ("multiprocess", "jax"), ("modelparallel", "torch")])
def test_jax_distribution_save_resumes_elsewhere(jax_runs, mode,
                                                 resume_backend):
    """Saved by 2 processes (or sharded over 4 devices) after step 2,
    resumed by one process on one device (JAX, PyTorch): in lockstep with
    the uninterrupted run."""
    out, _ = jax_runs[mode]
    fit, _ = _jax_reference()
    resumed = _resumed(out / "mid.keras", resume_backend)
    _assert_same(resumed, fit, f"{mode} resumed on {resume_backend}")
