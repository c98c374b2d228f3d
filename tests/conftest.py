"""Shared fixtures. Each test file is backend-agnostic: CI runs the suite
once per backend in separate processes (KERAS_BACKEND=jax|tensorflow|torch).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()

if BACKEND == "torch":
    import torch

    # As Keras' own conftest: no TF32 in matmuls (it changes float32 results).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def only_on(*backends):
    """Mark a test as meaningful on some backends only."""
    return pytest.mark.skipif(
        BACKEND not in backends,
        reason=f"specific to the {'/'.join(backends)} backend(s)",
    )


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.utils.clear_session()
    keras.utils.set_random_seed(1234)
    yield


def to_numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def computed(variables):
    """``variables`` but a ``PowerEMA``'s run identity (``averaging_run``),
    drawn apart for each run: what two runs compute alike."""
    return [v for v in variables if not v.path.endswith("/averaging_run")]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(*args, backend=None, timeout=240, **env):
    """Run ``python *args`` from the repository root (a script path, or
    ``"-c", code``) with ``env`` added to the environment; assert it
    succeeded and return the finished process."""
    import subprocess
    import sys

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env)
    if backend is not None:
        env["KERAS_BACKEND"] = backend
    proc = subprocess.run([sys.executable, *map(str, args)], env=env,
                          cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def last_json(proc):
    """The JSON object a script printed on its last line."""
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])


def made_by_script(script, args, tag="", python=None, env=None):
    """The folder of artifacts ``script OUT *args`` makes with real
    TensorFlow / tf_keras in a subprocess, made once per machine and
    script version under ``.pytest-fixtures/`` (CI runs the backends over
    the same clone, possibly at the same time: a file lock keeps one
    maker). ``python`` runs it in another environment (an older
    TensorFlow's, ``tests/old_tf.py``; its version then goes in ``tag``
    and, as its TensorFlow reports it, in the folder's
    ``TENSORFLOW_VERSION``), with ``env`` added to the environment."""
    import fcntl
    import hashlib
    import shutil

    with open(script, "rb") as f:
        text = f.read()
    try:
        import tf_keras

        version = tf_keras.__version__
    except ImportError:  # pragma: no cover - the legacy extra is installed
        version = "none"
    digest = hashlib.sha1(
        text + version.encode() + " ".join(args).encode() + tag.encode()
    ).hexdigest()[:12]
    base = os.path.join(ROOT, ".pytest-fixtures")
    os.makedirs(base, exist_ok=True)
    name = os.path.splitext(os.path.basename(script))[0]
    folder = os.path.join(base, f"{name}-{digest}")
    with open(os.path.join(base, f".{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(folder, "DONE")):
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            _run_in_parallel(script, folder, args, python=python, env=env)
            if python is not None:
                import subprocess

                version = subprocess.run(
                    [python, "-c", "import tensorflow as tf; "
                     "print(tf.__version__)"], check=True, text=True,
                    capture_output=True, env=_maker_env(env)).stdout
                with open(os.path.join(folder, "TENSORFLOW_VERSION"),
                          "w") as f:
                    f.write(version)
            open(os.path.join(folder, "DONE"), "w").close()
    return folder


def _maker_env(env=None):
    """The environment of a maker: the TensorFlow backend on the CPU, and
    ``env``."""
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                KERAS_BACKEND="tensorflow", CUDA_VISIBLE_DEVICES="",
                **(env or {}))


def _run_in_parallel(script, folder, args, timeout=900, python=None,
                     env=None):
    """``script folder *chunk`` for the arguments dealt round-robin into one
    chunk per core (at most 2: each maker writes its own cases' folders),
    under the TensorFlow backend on the CPU, by ``python`` (this
    interpreter where None); every maker must succeed."""
    import subprocess
    import sys
    import tempfile

    jobs = max(1, min(2, os.cpu_count() or 1, len(args)))
    env = _maker_env(env)
    makers = []
    for i in range(jobs):
        err = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(
            [python or sys.executable, str(script), folder,
             *args[i::jobs]], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=err, text=True)
        makers.append((proc, err))
    failures = []
    for proc, err in makers:
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = f"killed after {timeout} s"
        err.seek(0)
        if code != 0:
            failures.append(f"{' '.join(proc.args[3:])}: exit {code}\n"
                            f"{err.read()[-3000:]}")
        err.close()
    assert not failures, "\n".join(failures)
