"""aggregate_gradients and skip_gradients_aggregation as real multi-replica
runs: tf.distribute MirroredStrategy (the sum over replicas, Keras 2) on two logical CPUs (tf_keras beside it
as the oracle) and two torch.distributed gloo processes on localhost (the mean over ranks)."""

import json
import socket
from pathlib import Path

import pytest
from conftest import only_on
from conftest import run_python

SCRIPTS = Path(__file__).parent / "scripts"


def _run(script, *args, backend):
    proc = run_python(SCRIPTS / script, *args, backend=backend)
    return [json.loads(line) for line in proc.stdout.splitlines()
            if line.startswith("{")]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@only_on("tensorflow")
def test_mirrored_strategy_sums_replicas_like_tf_keras():
    pytest.importorskip("tf_keras")
    (result,) = _run("tf_mirrored_aggregation.py", backend="tensorflow")
    # Default: the sum over replicas (1 + 2), on both replicas, as tf_keras.
    assert result["default"]["ours"] == [[-3.0, -3.0]] * 2
    assert result["default"]["ours"] == result["default"]["tf_keras"]
    # skip_gradients_aggregation=True: the caller's own mean is used as is.
    assert result["skip_mean"]["ours"] == [[-1.5, -1.5]] * 2
    assert result["skip_mean"]["ours"] == result["skip_mean"]["tf_keras"]
    assert result["aggregate"] == [[3.0, 3.0]] * 2
    # Built by the first apply_gradients of a custom loop's strategy.run in
    # a tf.function: the variables made in that trace failed the step
    # ("You must feed a value for placeholder tensor"), as Keras 3's own;
    # tf_keras built them under tf.init_scope(), as ours now does.
    import numpy as np

    for label in ("built_in_step", "built_in_step_ema",
                  "subclass_built_in_step"):
        ours, theirs = (result[label][k] for k in ("ours", "tf_keras"))
        assert ours[-1] == theirs[-1] == 3
        assert len(ours) == len(theirs) == (
            3 if label.endswith("ema") else 2)
        for a, b in zip(ours[:-1], theirs[:-1]):
            assert len(a) == 2  # each replica's copy
            np.testing.assert_allclose(a, b, rtol=1e-6)


@only_on("tensorflow")
def test_mirrored_fit_overwrites_with_the_average_as_one_device():
    # Keras' step was shown no frequency by setting the optimizer's
    # attribute for the step; MirroredStrategy runs each replica's step in
    # a thread of its own, so a replica could read it unset and run Keras'
    # own overwrite, a `cond` around a merge_call: fit() failed.
    import numpy as np

    (result,) = _run("tf_mirrored_overwrite.py", backend="tensorflow")
    mirrored, single = result["mirrored"], result["single"]
    assert mirrored["iterations"] == single["iterations"] == 6
    for kind in ("weights", "averages"):
        for a, b in zip(mirrored[kind], single[kind]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Step 6 overwrote the weights with their averages.
    for a, b in zip(mirrored["weights"], mirrored["averages"]):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    # An eager step outside the scope moves every replica's copy (the
    # one-kernel average wrote the first copy only); float64 rule.
    w, a = np.array([1.0, 2.0]), np.array([1.0, 2.0])
    for _ in range(2):
        w = w - 0.1
        a = 0.5 * a + 0.5 * w
    copies = result["cross_replica"]
    for kind, want in (("weights", w), ("averages", a)):
        assert len(copies[kind]) == 2
        for copy in copies[kind]:
            np.testing.assert_allclose(copy, want, rtol=1e-6)


@only_on("torch")
def test_torch_distributed_averages_ranks(tmp_path):
    import numpy as np

    _run("torch_gloo_aggregation.py", str(_free_port()), str(tmp_path),
         backend="torch")
    results = [json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        # The mean over the ranks ((1 + 2) / 2), DDP's convention.
        assert r["default_aggregate"] == [1.5, 1.5]
        assert r["default"] == [-1.5, -1.5]
        assert r["default_input"] == [float(r["rank"] + 1)] * 2
        # Skipped: each rank applies its own gradient.
        assert r["skip"] == [-(r["rank"] + 1.0)] * 2
        # fit()'s path with global_clipnorm=1: the mean (1.5, 1.5) scaled
        # to norm 1, in place (the step made it); the input unchanged.
        np.testing.assert_allclose(r["clipped"], [-0.5 ** 0.5] * 2,
                                   rtol=1e-6)
        assert r["clipped_input"] == [float(r["rank"] + 1)] * 2
        assert r["clipped_in_place"] == [True]
        # apply_gradients' own mean: clipped in place too.
        np.testing.assert_allclose(r["applied"], [-0.5 ** 0.5] * 2,
                                   rtol=1e-6)
        assert r["applied_input"] == [float(r["rank"] + 1)] * 2
        assert r["applied_in_place"] == [True]
        # A mean the caller holds: clipped into new tensors, the caller's
        # left as it was.
        np.testing.assert_allclose(r["held"], [-0.5 ** 0.5] * 2, rtol=1e-6)
        assert r["held_in_place"] == [False]
        assert r["held_mean"] == [1.5, 1.5]


@only_on("torch")
def test_torch_ddp_starts_frozen_weights_from_rank_0(tmp_path):
    # Each rank builds from its own seed; DDP broadcasts a module's
    # parameters and buffers, trainable or not. Only the trainable ones
    # were: the frozen layer stayed per rank (1.77 apart), and the
    # gradients averaged came from different feature extractors.
    import numpy as np

    _run("torch_gloo_frozen.py", str(_free_port()), str(tmp_path),
         backend="torch")
    _run("torch_gloo_frozen.py", "single", str(tmp_path), backend="torch")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text())
             for r in (0, 1)]
    single = json.loads((tmp_path / "single.json").read_text())
    assert "sequential/frozen/kernel" in single
    for path, value in single.items():
        for rank, result in enumerate(ranks):
            np.testing.assert_allclose(result[path], value, rtol=1e-5,
                                       atol=1e-6,
                                       err_msg=f"{path}, rank {rank}")


@only_on("tensorflow")
@pytest.mark.parametrize("cluster,task", [
    ({"chief": ["h:1"], "worker": ["h:2"], "evaluator": ["h:3"]},
     ("chief", 0)),
    ({"chief": ["h:1"], "worker": ["h:2"], "evaluator": ["h:3"]},
     ("worker", 0)),
    ({"chief": ["h:1"], "worker": ["h:2"], "evaluator": ["h:3"]},
     ("evaluator", 0)),
    ({"worker": ["h:1", "h:2"]}, ("worker", 0)),
    ({"worker": ["h:1", "h:2"]}, ("worker", 1)),
    ({"worker": ["h:1", "h:2"], "evaluator": ["h:3"]}, ("evaluator", 0)),
])
def test_tf_chief_is_tensorflows(monkeypatch, cluster, task):
    # The oracle: TensorFlow's own rule (a sidecar evaluator writes too).
    import tensorflow as tf
    from tensorflow.python.distribute import multi_worker_util

    import keras_ema_opt

    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": cluster, "task": {"type": task[0], "index": task[1]}}))
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    expected = multi_worker_util.is_chief(resolver.cluster_spec(),
                                          resolver.task_type,
                                          resolver.task_id)
    assert keras_ema_opt.distributed.is_chief() is expected


@only_on("torch")
def test_torch_ddp_loss_scale_skips_together_as_grad_scaler(tmp_path):
    # Only rank 1's scaled gradients overflow at first. Keras'
    # LossScaleOptimizer checked each rank's own gradients before ours
    # all-reduced them: rank 1 skipped while rank 0 waited in the
    # all-reduce (a hang, or a crash when rank 1 left). The peer: DDP with
    # torch.amp.GradScaler under the same scale rule, side by side.
    import numpy as np

    _run("torch_gloo_loss_scale.py", str(_free_port()), str(tmp_path),
         backend="torch")
    _run("torch_gloo_loss_scale.py", "peer", str(_free_port()),
         str(tmp_path), backend="torch")
    ours = [json.loads((tmp_path / f"rank{r}.json").read_text())
            for r in (0, 1)]
    peer = json.loads((tmp_path / "peer0.json").read_text())
    assert 0 < peer["iterations"] < 12  # some steps skipped, some taken
    for result in ours:
        assert result["iterations"] == peer["iterations"]
        assert result["scale"] == peer["scale"]
        for a, b in zip(result["weights"], peer["weights"]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    assert ours[0]["averages"] == ours[1]["averages"]
