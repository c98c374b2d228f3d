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
