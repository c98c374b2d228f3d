"""Documentation examples run, and the command line answers."""

import os
import re
import subprocess
import textwrap
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import BACKEND
from conftest import to_numpy

import keras_ema_opt
from keras_ema_opt import cli
from keras_ema_opt import compat

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = [getattr(keras_ema_opt, n) for n in keras_ema_opt.__all__
          if n not in ("errors", "callbacks", "averaging")] + [
    keras_ema_opt.callbacks.SwapAverage,
    keras_ema_opt.callbacks.AveragedCheckpoint,
    keras_ema_opt.callbacks.PowerEMASnapshots,
    keras_ema_opt.Optimizer.swap_average,
    keras_ema_opt.distributed.on_chief,
    keras_ema_opt.averaging.assign_by_path,
    compat.from_legacy_config,
    keras_ema_opt.savedmodel.migrate,
    keras_ema_opt.savedmodel.inspect,
    keras_ema_opt.savedmodel.LegacyRecord,
    keras_ema_opt.savedmodel.model_from_config,
    keras_ema_opt.savedmodel.restore_checkpoint,
    keras_ema_opt.savedmodel.verify_same,
    compat.LegacyAdagrad,
    compat.LegacyNadam,
    compat.LegacyRMSprop,
    compat.losses,
    compat.losses.Huber,
    compat.losses.CosineSimilarity,
    compat.losses.keeping_arguments,
    compat.losses.loss_form,
]


def _python_blocks(text):
    return [textwrap.dedent(b) for b in
            re.findall(r"```python\n(.*?)```", text, flags=re.S)]


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda o: o.__name__)
def test_every_public_name_has_a_runnable_example(obj):
    blocks = _python_blocks(obj.__doc__ or "")
    assert blocks, f"{obj.__name__} has no ```python example"
    for block in blocks:
        exec(compile(block, f"<{obj.__name__} docstring>", "exec"), {})


def _method_examples():
    """Methods of the public classes whose docstrings hold an example."""
    out = {}
    classes = [o for o in PUBLIC if isinstance(o, type)]
    classes.append(keras_ema_opt.Optimizer)
    for cls in classes:
        for name in dir(cls):
            member = getattr(cls, name, None)
            doc = getattr(member, "__doc__", None) or ""
            module = getattr(member, "__module__", None) or ""
            if "```python" in doc and module.startswith("keras_ema_opt") \
                    and not isinstance(member, type):
                out[f"{module}.{member.__qualname__}"] = member
    return out


@pytest.mark.parametrize("name", sorted(_method_examples()))
def test_every_method_example_runs(name):
    for block in _python_blocks(_method_examples()[name].__doc__):
        exec(compile(block, f"<{name} docstring>", "exec"), {})


def test_base_class_example_result():
    namespace = {}
    exec(_python_blocks(keras_ema_opt.Optimizer.__doc__)[0], namespace)
    np.testing.assert_allclose(to_numpy(namespace["w"]), [0.8, 1.6])


def test_readme_examples_run():
    blocks = _python_blocks((ROOT / "README.md").read_text())
    namespace = {}
    for block in blocks:
        exec(compile(block, "<README>", "exec"), namespace)
    np.testing.assert_allclose(to_numpy(namespace["w"]), [1.5, 0.5])


def test_cli_info(capsys):
    assert cli.main(["info", "--json"]) == 0
    out = capsys.readouterr().out
    assert f'"backend": "{BACKEND}"' in out


def test_cli_without_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: keras-ema-opt" in capsys.readouterr().out


def test_console_script_is_installed():
    exe = Path(sys.executable).with_name("keras-ema-opt")
    if not exe.exists():
        pytest.skip("package not installed with its console script")
    out = subprocess.run([str(exe), "--version"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    assert out.stdout.startswith("keras-ema-opt ")


def test_demo_runs_and_writes_its_files(tmp_path, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    assert cli.main(["demo", "--output", str(tmp_path), "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "raw weights" in out and "post-hoc power EMA" in out
    for name in ("demo.png", "averaged.keras", "results.json"):
        assert (tmp_path / name).is_file()
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import json

    result = json.loads((tmp_path / "results.json").read_text())
    assert all(0.5 < v <= 1.0 for v in result["final"].values())
    model = keras.saving.load_model(tmp_path / "averaged.keras")
    assert type(model.optimizer) is keras_ema_opt.Adam
    # Its files alone: the power-EMA snapshots' scratch folder is gone
    # (one of 6 MB was left by each run).
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "averaged.keras", "demo.png", "results.json"]
    # SWA starts halfway through the steps, and says so.
    [(last, total)] = re.findall(r"SWA \(last (\d+) of (\d+) steps\)", out)
    assert int(last) == int(total) - int(total) // 2
    # Written through temporary files, with the mode a new file gets
    # (mkstemp's 0600 was kept by the rename).
    umask = os.umask(0)
    os.umask(umask)
    for name in ("demo.png", "averaged.keras", "results.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask



def test_demo_stopped_says_so_and_leaves_no_scratch(tmp_path, capsys,
                                                    monkeypatch):
    pytest.importorskip("sklearn")
    from keras_ema_opt import demo

    def stopped(*args, **kwargs):
        assert [p.name for p in tmp_path.iterdir()][0].startswith("phema-")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_train", stopped)
    assert cli.main(["demo", "--output", str(tmp_path), "--epochs", "1",
                     "--no-plot"]) == 130
    assert capsys.readouterr().err == "keras-ema-opt demo: interrupted\n"
    assert list(tmp_path.iterdir()) == []

def test_saved_files_get_a_new_files_mode(tmp_path):
    from keras_ema_opt.averaging import posthoc

    umask = os.umask(0o022)
    try:
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        paths = [
            keras_ema_opt.distributed.save_on_chief(
                model, str(tmp_path / "model.keras")),
            posthoc.write_snapshot(str(tmp_path / "snapshots"), 3, [6.9],
                                   1, {"0/w": np.ones(2, "float32")}),
        ]
    finally:
        os.umask(umask)
    for path in paths:
        assert os.stat(path).st_mode & 0o777 == 0o644, path


@pytest.mark.parametrize("flag, value, named", [
    ("--epochs", "0", "epochs must be a positive integer; received 0"),
    ("--epochs", "-3", "epochs must be a positive integer; received -3"),
    ("--seed", "-1", "seed must be a non-negative integer; received -1"),
])
def test_demo_refuses_bad_numbers_before_training(tmp_path, capsys, flag,
                                                  value, named):
    output = tmp_path / "out"
    assert cli.main(["demo", "--output", str(output), flag, value]) == 1
    assert named in capsys.readouterr().err
    assert not output.exists()  # nothing trained, nothing written


def test_demo_refuses_an_existing_file_as_its_folder(tmp_path, capsys):
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    assert cli.main(["demo", "--output", str(target), "--epochs", "1"]) == 1
    err = capsys.readouterr().err
    assert str(target) in err and "existing file" in err
    assert target.read_text() == "keep me"


def test_demo_without_matplotlib_says_so_before_training(
        tmp_path, capsys, monkeypatch):
    # `None` in sys.modules makes `import matplotlib` raise ImportError, as
    # on a machine without it.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    output = tmp_path / "out"
    assert cli.main(["demo", "--output", str(output), "--epochs", "1"]) == 1
    err = capsys.readouterr().err
    assert "matplotlib" in err and "--no-plot" in err
    assert not output.exists()


def test_run_demo_refuses_a_non_integer_epochs(tmp_path):
    from keras_ema_opt import demo
    from keras_ema_opt.errors import InvalidArgumentError

    for bad in (2.5, True, "3"):
        with pytest.raises(InvalidArgumentError, match="received"):
            demo.run_demo(tmp_path / "out", epochs=bad, plot=False)
    assert not (tmp_path / "out").exists()
