"""A .keras file saved mid-training under this backend resumes under each
other backend in lockstep with the uninterrupted run: weights, averages,
iteration count."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import BACKEND

SCRIPT = Path(__file__).parent / "scripts" / "resume_across_backends.py"


def _run(mode, folder, backend):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, str(SCRIPT), mode, str(folder)],
                          capture_output=True, text=True, timeout=240,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Train and save under this process's backend, in process."""
    folder = tmp_path_factory.mktemp("resume")
    spec = importlib.util.spec_from_file_location("resume_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main("save", str(folder))
    return folder


@pytest.mark.parametrize(
    "target", [b for b in ("jax", "tensorflow", "torch") if b != BACKEND]
)
def test_resume_under_another_backend_in_lockstep(target, saved, tmp_path):
    for name in ("mid.keras", "uninterrupted.npz"):
        (tmp_path / name).write_bytes((saved / name).read_bytes())
    _run("resume", tmp_path, target)
    uninterrupted = np.load(tmp_path / "uninterrupted.npz")
    resumed = np.load(tmp_path / "resumed.npz")
    assert sorted(uninterrupted.files) == sorted(resumed.files)
    assert int(resumed["iterations"]) == int(uninterrupted["iterations"]) == 6
    for key in uninterrupted.files:
        np.testing.assert_allclose(resumed[key], uninterrupted[key],
                                   rtol=1e-5, atol=1e-6, err_msg=key)
