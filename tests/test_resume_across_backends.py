"""A .keras file saved mid-training under this backend resumes under each
other backend in lockstep with the uninterrupted run: weights, averages,
iteration count."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from conftest import BACKEND
from conftest import run_python

SCRIPT = Path(__file__).parent / "scripts" / "resume_across_backends.py"


def _run(mode, folder, backend):
    run_python(SCRIPT, mode, folder, backend=backend)


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
