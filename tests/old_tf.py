"""Keras 2 artifacts written by older TensorFlow releases themselves:
tf.keras 2.12 (TensorFlow 2.12.1) and Keras 2.15 (TensorFlow 2.15.1, the
last release whose ``tf.keras`` is Keras 2).

They are made during the test run, as tf_keras 2.21's are: the release is
installed from the package registry into a virtual environment of its own
under ``.pytest-fixtures/`` (about 20 s; once per clone, shared by the
backends' runs through a file lock), and runs the same makers,
``tests/scripts/make_legacy_artifacts.py`` (whose ``expected.npz`` is that
release's own continuation) and ``make_lookup_artifacts.py``. It needs a
Python that release has wheels for (3.8 to 3.11): the tests' own where it
is one, else ``KEO_OLD_TF_PYTHON``.

``KEO_OLD_TF_FIXTURES=committed`` reads the sets committed under
``tests/fixtures/tf2.12*`` and ``tf2.15*`` instead (made by the same
releases with ``tests/scripts/make_old_tf_fixtures.sh``): for a machine
without the registry.
"""

import fcntl
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
RELEASES = {"2.12": "2.12.1", "2.15": "2.15.1"}
# Every optimizer each release's Keras 2 has (new and OptimizerV2, EMA on
# and off) on the MLP; Lion came in Keras 2.13.
_OPTIMIZERS = ["sgd", "sgd_ema", "adam", "adam_ema", "adamw", "adagrad",
               "adadelta", "adamax", "nadam", "rmsprop_ema", "ftrl",
               "adafactor", "lion", "L_sgd", "L_adam", "L_adagrad",
               "L_adadelta", "L_adamax", "L_nadam", "L_rmsprop",
               "L_rmsprop_m", "L_ftrl"]
# ... and a few on each other model.
_OTHERS = ["adam_ema:conv", "L_sgd:conv", "rmsprop_ema:embed",
           "L_adagrad:embed", "sgd_ema:nested", "L_rmsprop:rnn",
           "adam:custom"]


def optimizers(version):
    return [o for o in _OPTIMIZERS if o != "lion" or version != "2.12"]


def cases(version):
    """The set's cases, ``"optimizer:model"`` (folders ``optimizer-model``)."""
    return [f"{o}:mlp" for o in optimizers(version)] + _OTHERS


def committed():
    return os.environ.get("KEO_OLD_TF_FIXTURES") == "committed"


def _install(version):
    """The interpreter of a virtual environment holding TensorFlow
    ``RELEASES[version]``'s CPU build, made once per clone."""
    release = RELEASES[version]
    base = os.path.join(ROOT, ".pytest-fixtures")
    os.makedirs(base, exist_ok=True)
    venv = os.path.join(base, f"venv-tensorflow-cpu-{release}")
    python = os.path.join(venv, "bin", "python")
    stamp = os.path.join(venv, "INSTALLED")
    with open(os.path.join(base, f".venv-{release}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(stamp):
            return python
        maker = os.environ.get("KEO_OLD_TF_PYTHON", sys.executable)
        steps = [
            [maker, "-m", "venv", "--clear", venv],
            # h5py 3.17 needs numpy 2, which these releases do not take.
            [python, "-m", "pip", "install", "-q",
             "--disable-pip-version-check", f"tensorflow-cpu=={release}",
             "h5py<3.17"],
            [python, "-c", "import tensorflow as tf; "
             f"assert tf.__version__ == {release!r}, tf.__version__"],
        ]
        for step in steps:
            proc = subprocess.run(step, capture_output=True, text=True,
                                  timeout=900)
            if proc.returncode:
                raise RuntimeError(
                    f"cannot make the TensorFlow {release} environment "
                    f"({' '.join(step[:4])} ...: exit {proc.returncode}):\n"
                    f"{proc.stderr[-2000:]}\nIt needs the package registry "
                    "and a Python 3.8 to 3.11 (KEO_OLD_TF_PYTHON); "
                    "KEO_OLD_TF_FIXTURES=committed reads the committed "
                    "sets instead.")
        open(stamp, "w").close()
    return python


def _made(script, version, args):
    """``script``'s artifacts for ``args``, made by TensorFlow
    ``RELEASES[version]``, with a ``TENSORFLOW_VERSION`` file."""
    from conftest import made_by_script

    release = RELEASES[version]
    return made_by_script(os.path.join(SCRIPTS, script), args,
                          tag=f"tensorflow-cpu=={release}",
                          python=_install(version),
                          # TensorFlow 2.15 would look for tf_keras where
                          # this is set (the makers set it for 2.16 on).
                          env={"TF_USE_LEGACY_KERAS": "0"})


def artifacts(version):
    """The folder of the ``cases(version)`` set, each in every format."""
    if committed():
        return os.path.join(ROOT, "tests", "fixtures", f"tf{version}")
    return _made("make_legacy_artifacts.py", version, cases(version))


def lookups(version):
    """The folder of ``make_lookup_artifacts.py``'s SavedModels."""
    if committed():
        return os.path.join(ROOT, "tests", "fixtures", f"tf{version}-lookups")
    return _made("make_lookup_artifacts.py", version, [])


def main(argv):
    """For ``make_old_tf_fixtures.sh``: ``python tests/old_tf.py cases
    VERSION`` prints the set's cases, ``python tests/old_tf.py python
    VERSION`` the interpreter of the release's environment (made first
    where missing)."""
    command, version = argv[1:]
    if version not in RELEASES:
        sys.exit(f"no fixture set for TensorFlow {version} (one of "
                 f"{', '.join(RELEASES)})")
    print(" ".join(cases(version)) if command == "cases"
          else _install(version))


if __name__ == "__main__":
    main(sys.argv)
