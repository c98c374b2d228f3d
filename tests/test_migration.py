"""Keras 2 training state migrated into Keras 3 resumes exactly.

Artifacts are made by real tf_keras during the test run
(``tests/scripts/make_legacy_artifacts.py``, in a subprocess, cached per
session under ``.pytest-fixtures/``): each case trains 3 steps, saves a
SavedModel, a full ``.h5``, a ``tf.train.Checkpoint`` and a ``save_weights``
checkpoint, then continues 5 steps in tf_keras (the oracle). Here each
case is migrated under the active backend from one of its formats (a
different one for each model an optimizer is on), trained the same 5 steps,
and the weights and EMA averages compared within 1e-6 (absolute plus
relative); each of its other formats must migrate to that same state: every
weight equal to tf_keras' and every optimizer variable, path by path, and
the optimizer's config equal to what the trained format gave.
"""

import functools
import json
import os
import re
import shutil
import zipfile

import h5py
import keras
import numpy as np
import pytest

import keras_ema_opt
from keras_ema_opt.compat import from_legacy_config
from keras_ema_opt.savedmodel import load_legacy
from keras_ema_opt.savedmodel import model_from_config
from conftest import BACKEND
from conftest import ROOT
from conftest import last_json
from conftest import made_by_script
from conftest import only_on
from conftest import run_python
from conftest import to_numpy
from legacy_custom_objects import CUSTOM_OBJECTS
import old_tf

pytest.importorskip("tf_keras")

SCRIPT = os.path.join(ROOT, "tests", "scripts", "make_legacy_artifacts.py")

NEW = ["sgd", "sgd_ema", "adam", "adam_ema", "adamw", "adagrad", "adadelta",
       "adamax", "nadam", "rmsprop_ema", "ftrl", "lion", "adafactor"]
LEGACY = ["L_sgd", "L_adam", "L_adagrad", "L_adadelta", "L_adamax",
          "L_nadam", "L_rmsprop", "L_rmsprop_m", "L_ftrl"]
FORMATS = {"savedmodel": "savedmodel", "h5": "model.h5",
           "checkpoint": "ckpt/ckpt", "save_weights": "weights/w"}
# Every optimizer on the MLP, the conv net with BatchNormalization and the
# Embedding+LSTM model, in every format; a spread of optimizers (new and
# OptimizerV2, EMA on and off) on nested models, a Bidirectional GRU and a
# custom layer class.
SPREAD = ("sgd_ema", "adam_ema", "nadam", "L_sgd", "L_nadam", "L_rmsprop")
CASES = [f"{o}:{m}" for m in ("mlp", "conv", "embed") for o in NEW + LEGACY
         ] + [f"{o}:{m}" for m in ("nested", "rnn", "custom") for o in SPREAD]


@pytest.fixture(scope="session")
def artifacts():
    return made_by_script(SCRIPT, CASES)


def _user_model(folder, **compile_arguments):
    """What a user does for a bare checkpoint: build the model and compile
    it with the optimizer it was trained with (and ``compile_arguments``,
    the loss ``"mse"`` unless given)."""
    with h5py.File(os.path.join(folder, "model.h5"), "r") as f:
        config = f.attrs["model_config"]
        training = json.loads(f.attrs["training_config"])
    compile_arguments.setdefault("loss", "mse")

    def build():
        model = model_from_config(config, CUSTOM_OBJECTS)
        model.compile(optimizer=from_legacy_config(
            training["optimizer_config"]), **compile_arguments)
        return model

    return build


def _find(model, name):
    """The model variable of a Keras 2 weight name. Keras 2 numbered the
    cell names it made up per process (``lstm/lstm_cell_1/kernel``): where
    the exact name is not found, path parts are compared without ``_N``."""
    name = name.split(":")[0]
    found = [w for w in model.weights
             if w.path == name or w.path.endswith("/" + name)]
    if not found:
        def plain(path):
            return [re.sub(r"_[0-9]+$", "", p) for p in path.split("/")]

        found = [w for w in model.weights
                 if plain(w.path)[-len(plain(name)):] == plain(name)]
    assert len(found) == 1, (name, [w.path for w in model.weights])
    return found[0]


def _trained_format(cases, case):
    """The format a case is trained from: optimizers and models taken in
    turn, so that an optimizer on the MLP, the conv net and the LSTM model
    is trained from three different formats and every format is trained
    from under each model."""
    optimizer, model = case.split(":")
    optimizers = list(dict.fromkeys(c.split(":")[0] for c in cases))
    models = list(dict.fromkeys(c.split(":")[1] for c in cases))
    names = list(FORMATS)
    return names[(optimizers.index(optimizer) + models.index(model))
                 % len(names)]


def _trained(cases):
    return [(c, _trained_format(cases, c)) for c in cases]


def _other_formats(cases):
    return [(c, f) for c in cases for f in FORMATS
            if f != _trained_format(cases, c)]


def test_every_format_is_trained_from_under_every_model():
    pairs = _trained(CASES)
    for model in ("mlp", "conv", "embed"):
        assert {f for c, f in pairs if c.endswith(":" + model)} == set(
            FORMATS), model
    for optimizer in NEW + LEGACY:
        assert len({f for c, f in pairs
                    if c.split(":")[0] == optimizer}) >= 3, optimizer
    assert len(_trained(CASES)) + len(_other_formats(CASES)) == len(
        CASES) * len(FORMATS)


@pytest.mark.parametrize("case,fmt", _trained(CASES))
def test_migrated_training_continues_like_tf_keras(artifacts, case, fmt):
    _check_continuation(os.path.join(artifacts, case.replace(":", "-")), fmt)


@pytest.mark.parametrize("case,fmt", _other_formats(CASES))
def test_every_format_migrates_to_the_same_state(artifacts, case, fmt):
    _check_same_state(os.path.join(artifacts, case.replace(":", "-")), fmt,
                      _trained_format(CASES, case))


# Sets written by older TensorFlow releases themselves, made in the run in
# environments of their own (``tests/old_tf.py``): tf.keras 2.12, and Keras
# 2.15, the last Keras 2 that TensorFlow shipped as ``tf.keras``.
OLD_TF = sorted(old_tf.RELEASES)


@pytest.fixture(scope="session")
def old_tf_set():
    """The folder of a release's set (made at the first call for it)."""
    return functools.cache(old_tf.artifacts)


@pytest.mark.parametrize("version", OLD_TF)
def test_old_tf_fixture_sets_are_complete(old_tf_set, version):
    """Each set: every optimizer its Keras 2 has, on the MLP, and a few on
    each other model, in every format, written by that TensorFlow release
    itself."""
    folder = old_tf_set(version)
    release = old_tf.RELEASES[version]
    with open(os.path.join(folder, "TENSORFLOW_VERSION")) as f:
        assert f.read().strip() == release
    cases = sorted(c for c in os.listdir(folder)
                   if os.path.isdir(os.path.join(folder, c)))
    assert cases == sorted(c.replace(":", "-")
                           for c in old_tf.cases(version))
    assert {c.split(":")[0] for c in old_tf.cases(version)
            if c.endswith(":mlp")} == set(old_tf.optimizers(version))
    assert {c.split(":")[1] for c in old_tf.cases(version)} == {
        "mlp", "conv", "embed", "nested", "rnn", "custom"}
    assert {f for _, f in _trained(sorted(old_tf.cases(version)))} == set(
        FORMATS)
    for case in cases:
        for path in FORMATS.values():
            assert os.path.exists(os.path.join(
                folder, case, path if path in ("savedmodel", "model.h5")
                else path + ".index")), (case, path)
        with open(os.path.join(folder, case, "info.json")) as f:
            assert json.load(f)["tensorflow"] == release


def _old(pairs_of):
    return [pytest.param(v, *p, id=f"{v}-{p[0]}-{p[1]}") for v in OLD_TF
            for p in pairs_of(sorted(old_tf.cases(v)))]


def _old_folder(old_tf_set, version, case):
    return os.path.join(old_tf_set(version), case.replace(":", "-"))


@pytest.mark.parametrize("version,case,fmt", _old(_trained))
def test_old_tf_artifacts_continue_like_their_keras_2(old_tf_set, version,
                                                      case, fmt):
    """Artifacts of tf.keras 2.12 and Keras 2.15, continued 5 steps by that
    release itself when they were made: its ``expected.npz``."""
    _check_continuation(_old_folder(old_tf_set, version, case), fmt)


def _other_formats_with_trained(cases):
    return [(c, f, _trained_format(cases, c))
            for c, f in _other_formats(cases)]


@pytest.mark.parametrize("version,case,fmt,trained",
                         _old(_other_formats_with_trained))
def test_every_old_tf_format_migrates_to_the_same_state(old_tf_set, version,
                                                        case, fmt, trained):
    _check_same_state(_old_folder(old_tf_set, version, case), fmt, trained)


def _migrate(folder, fmt):
    """``folder``'s artifact in ``fmt`` migrated, and its info.json."""
    with open(os.path.join(folder, "info.json")) as f:
        info = json.load(f)
    bare = fmt in ("checkpoint", "save_weights")
    model = load_legacy(os.path.join(folder, FORMATS[fmt]),
                        custom_objects=CUSTOM_OBJECTS,
                        model=_user_model(folder) if bare else None)
    return model, info


def _check_weights_before(model, info, expected):
    """Every weight tf_keras saved, in place, and the step count."""
    weights = [_find(model, n) for n in info["weights"]]
    for i, var in enumerate(weights):
        np.testing.assert_array_equal(to_numpy(var), expected[f"before{i}"],
                                      err_msg=var.path)
    assert int(to_numpy(model.optimizer.iterations)) == info["iterations"] - 5
    return weights


def _state(model):
    """Optimizer class and config, and every optimizer variable by its place
    and path: paths alone are not unique (Adafactor's three slots of a
    kernel are all ``Adafactor/kernel``), and Keras numbers unnamed
    variables per process (Nadam's ``u_product``: ``variable_3`` is taken
    as ``variable``)."""
    optimizer = model.optimizer
    variables = {}
    for i, var in enumerate(optimizer.variables):
        path = re.sub(r"(^|/)variable(_[0-9]+)?$", r"\1variable", var.path)
        variables[f"{i}: {path}"] = to_numpy(var)
    return type(optimizer), optimizer.get_config(), variables


_TRAINED_STATES = {}


def _check_same_state(folder, fmt, trained_fmt):
    """Migrated from ``fmt``, the case's state is tf_keras' weights and
    exactly the optimizer state its ``trained_fmt`` gives (that one is
    checked by training on against tf_keras)."""
    expected = np.load(os.path.join(folder, "expected.npz"))
    model, info = _migrate(folder, fmt)
    _check_weights_before(model, info, expected)
    key = (folder, trained_fmt)
    if key not in _TRAINED_STATES:
        _TRAINED_STATES[key] = _state(_migrate(folder, trained_fmt)[0])
    cls, config, variables = _TRAINED_STATES[key]
    got_cls, got_config, got = _state(model)
    assert got_cls is cls
    assert got_config == config
    assert {p: v.shape for p, v in got.items()} == {
        p: v.shape for p, v in variables.items()}
    for path, value in variables.items():
        np.testing.assert_array_equal(got[path], value, err_msg=path)


def _check_continuation(folder, fmt):
    """Migrate ``folder``'s artifact in ``fmt``, check the state it starts
    from, train the 5 recorded steps and compare weights and EMA averages
    with Keras 2's continuation (1e-6 absolute plus relative)."""
    expected = np.load(os.path.join(folder, "expected.npz"))
    model, info = _migrate(folder, fmt)
    case = info["case"]
    weights = _check_weights_before(model, info, expected)
    trainable = [_find(model, n) for n in info["trainable"]]
    for i in range(5):
        model.train_on_batch(expected[f"x{i}"], expected[f"y{i}"])
    for i, var in enumerate(weights):
        np.testing.assert_allclose(to_numpy(var), expected[f"after{i}"],
                                   rtol=1e-6, atol=1e-6, err_msg=var.path)
    averages = [k for k in expected.files if k.startswith("average")]
    assert bool(averages) == ("ema" in case)
    for i, var in enumerate(trainable):
        if f"average{i}" in expected.files:
            np.testing.assert_allclose(
                to_numpy(model.optimizer.average_of(var)),
                expected[f"average{i}"], rtol=1e-6, atol=1e-6,
                err_msg=f"average of {var.path}")


# ---------------------------------------------------------------------------
# Without TensorFlow, the command line, bad input
# ---------------------------------------------------------------------------

NO_TF = r"""
import sys
sys.modules["tensorflow"] = None  # blocked: any import of it fails
sys.modules["tf_keras"] = None
import json, h5py, numpy as np, keras
from keras_ema_opt.compat import from_legacy_config
from keras_ema_opt.savedmodel import load_legacy, model_from_config


def user_model(folder):
    # A bare checkpoint: the model and optimizer the user builds (here
    # from the .h5 file's configs, with h5py only).
    with h5py.File(folder + "/model.h5", "r") as f:
        config = f.attrs["model_config"]
        training = json.loads(f.attrs["training_config"])
    model = model_from_config(config)
    model.compile(optimizer=from_legacy_config(training["optimizer_config"]),
                  loss="mse")
    return model


def variable(model, name):
    # As _find: by name, or without the cell numbers Keras 2 made up.
    import re
    name = name.split(":")[0]
    found = [w for w in model.weights if w.path.endswith("/" + name)
             or w.path == name]
    if not found:
        def plain(path):
            return [re.sub(r"_[0-9]+$", "", p) for p in path.split("/")]
        found = [w for w in model.weights
                 if plain(w.path)[-len(plain(name)):] == plain(name)]
    (var,) = found
    return var


out = {}
for folder, path in json.loads(sys.argv[1]):
    exp = np.load(folder + "/expected.npz")
    info = json.load(open(folder + "/info.json"))
    bare = path.startswith(("ckpt", "weights"))
    model = load_legacy(folder + "/" + path,
                        model=user_model(folder) if bare else None)
    steps = 0 if path.endswith(".keras") else 5  # no optimizer state
    for i in range(steps):
        model.train_on_batch(exp[f"x{i}"], exp[f"y{i}"])
    key = "after" if steps else "before"
    out["/".join(folder.split("/")[-2:]) + "/" + path] = max(
        float(np.max(np.abs(keras.ops.convert_to_numpy(variable(model, n))
                            - exp[f"{key}{i}"])))
        for i, n in enumerate(info["weights"]))
print(json.dumps({"worst": out,
                  "tensorflow": sys.modules.get("tensorflow") is not None}))
"""


@only_on("jax", "torch")  # the TensorFlow backend needs TensorFlow
def test_migration_with_tensorflow_blocked(artifacts, old_tf_set):
    """Every format, from this run's tf_keras and from the tf.keras 2.12
    and Keras 2.15 sets, migrated and continued with
    TensorFlow (and tf_keras) blocked from import: numpy and h5py only."""
    cases = [(os.path.join(artifacts, "adam_ema-conv"), path)
             for path in (*FORMATS.values(), "model.keras")]
    cases += [(os.path.join(artifacts, "L_nadam-nested"), "savedmodel")]
    cases += [(os.path.join(old_tf_set("2.12"), "L_rmsprop-rnn"), path)
              for path in ("savedmodel", "model.h5", "ckpt/ckpt")]
    cases += [(os.path.join(old_tf_set("2.15"), "adam_ema-conv"), path)
              for path in ("savedmodel", "model.h5", "weights/w",
                           "model.keras")]
    result = last_json(run_python("-c", NO_TF, json.dumps(cases),
                                  backend=BACKEND, timeout=300))
    assert result["tensorflow"] is False
    assert len(result["worst"]) == len(cases)
    for case, worst in result["worst"].items():
        assert worst < 2e-6, case


def test_cli_migrate_writes_a_keras_file_that_resumes(artifacts, tmp_path,
                                                       capsys):
    from keras_ema_opt.cli import main

    folder = os.path.join(artifacts, "rmsprop_ema-mlp")
    dst = str(tmp_path / "new.keras")
    assert main(["migrate", os.path.join(folder, "savedmodel"), dst]) == 0
    err = capsys.readouterr().err
    assert "verifying" in err
    # Weights, slots, EMA averages, counters: every tensor compared.
    assert re.search(r"compared (\d+)/\1 tensors", err)
    with zipfile.ZipFile(dst) as archive:
        config = json.loads(archive.read("config.json"))
    # Not the backend's resolved value (True on JAX: torch.compile on PyTorch)
    assert config["compile_config"]["jit_compile"] == "auto"
    model = keras.saving.load_model(dst)
    if keras.backend.backend() == "torch":
        assert model.jit_compile is False  # no torch.compile
    expected = np.load(os.path.join(folder, "expected.npz"))
    with open(os.path.join(folder, "info.json")) as f:
        info = json.load(f)
    for i in range(5):
        model.train_on_batch(expected[f"x{i}"], expected[f"y{i}"])
    for i, name in enumerate(info["weights"]):
        np.testing.assert_allclose(to_numpy(_find(model, name)),
                                   expected[f"after{i}"], rtol=1e-6,
                                   atol=1e-6)
    assert sorted(os.listdir(tmp_path)) == ["new.keras"]


def test_cli_inspect_json(artifacts, capsys):
    from keras_ema_opt.cli import main

    folder = os.path.join(artifacts, "L_adam-mlp")
    assert main(["inspect", os.path.join(folder, "model.h5"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "h5"
    assert summary["optimizer"]["kind"] == "legacy"
    assert summary["optimizer"]["iterations"] == 3
    assert summary["optimizer"]["slots"]["d1/kernel"] == ["m", "v"]
    assert summary["optimizer"]["class_name"] == "Adam"


@pytest.mark.parametrize("form,shown", [
    ("model.h5", "learning rate 0.01 (config)"),  # not stored in an h5
    ("savedmodel", "learning rate 0.01,")])
def test_cli_inspect_names_the_learning_rate(artifacts, capsys, form, shown):
    from keras_ema_opt.cli import main

    path = os.path.join(artifacts, "adam-mlp", form)
    assert main(["inspect", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = [line for line in lines if line.startswith("  optimizer: ")]
    assert line and "Adam (new), iterations 3, " + shown in line[0], lines


@pytest.mark.parametrize("config,shown", [
    (None, "not stored"), ({}, "not stored"), ({"config": None}, "not stored"),
    ({"config": "Adam"}, "not stored"),
    ({"class_name": "Adam", "config": {"lr": 0.001}}, "0.001 (config)"),
    ({"config": {"learning_rate": "0.01"}}, "'0.01' (config)"),
    ({"config": {"learning_rate": {"class_name": "ExponentialDecay",
                                   "config": {}}}},
     "ExponentialDecay (config)")])
def test_inspect_learning_rate_of_any_config(config, shown):
    # A damaged or Keras 2 legacy optimizer config (OptimizerV2's `lr`)
    # is shown as it is, never a traceback.
    from keras_ema_opt.cli import _learning_rate

    assert _learning_rate({"learning_rate": None, "config": config}) == shown


def _copy(src, dst):
    import shutil

    (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst)
    return str(dst)


def _edit_h5(path, **attrs):
    with h5py.File(path, "r+") as f:
        for key, edit in attrs.items():
            f.attrs[key] = json.dumps(edit(json.loads(f.attrs[key])))


def _rename_class(old, new):
    def edit(config):
        text = json.dumps(config).replace(f'"{old}"', f'"{new}"')
        return json.loads(text)
    return edit


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def _h5_copy(folder, tmp, name, **edits):
    path = _copy(os.path.join(folder, "model.h5"), tmp / name)
    _edit_h5(path, **edits)
    return path


def _truncated_h5(folder, tmp):
    with open(os.path.join(folder, "model.h5"), "rb") as f:
        data = f.read()
    return _write(tmp / "truncated.h5", data[: len(data) // 3])


def _truncated_index(folder, tmp):
    ckpt = _copy(os.path.join(folder, "ckpt"), tmp / "ckpt")
    with open(os.path.join(ckpt, "ckpt.index"), "r+b") as f:
        f.truncate(40)
    return os.path.join(ckpt, "ckpt")


def _truncated_zip(folder, tmp):
    with open(os.path.join(folder, "model.keras"), "rb") as f:
        data = f.read()
    return _write(tmp / "truncated.keras", data[: len(data) // 2])


def _zip_misfit(folder, tmp):
    """A .keras zip whose config says 7 units where its weights have 5."""
    import zipfile

    src = os.path.join(folder, "model.keras")
    dst = tmp / "misfit.keras"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.namelist():
            data = zin.read(item)
            if item == "config.json":
                data = data.replace(b'"units": 5', b'"units": 7')
            zout.writestr(item, data)
    return str(dst)


def _missing_slot(folder, tmp):
    path = _copy(os.path.join(folder, "model.h5"), tmp / "missing.h5")
    with h5py.File(path, "r+") as f:
        del f["optimizer_weights"]["Adam"]["m"]["d1"]["kernel:0"]
    return path


def _stale_state(folder, tmp):
    stale = tmp / "stale"
    shutil.copytree(os.path.join(folder, "ckpt"), stale)
    _write(stale / "checkpoint", b'model_checkpoint_path: "ckpt-2"\n'
           b'all_model_checkpoint_paths: "ckpt-2"\n')
    return str(stale)


def _unnamed_latest(folder, tmp):
    # Two checkpoints and no `checkpoint` state file naming the latest.
    loose = tmp / "loose"
    loose.mkdir()
    for name in ("ckpt-1", "ckpt-2"):
        for part in os.listdir(os.path.join(folder, "ckpt")):
            if part.startswith("ckpt."):
                shutil.copy(os.path.join(folder, "ckpt", part),
                            loose / part.replace("ckpt", name, 1))
    return str(loose)


def _add_lambda(config):
    config["config"]["layers"].append({
        "class_name": "Lambda",
        "config": {"name": "lam", "function": ["4wEAAAA=", None, None],
                   "function_type": "lambda"}})
    return config


def _bad_table():
    from keras_ema_opt import errors

    fmt, cfg, state = (errors.LegacyFormatError, errors.LegacyConfigError,
                       errors.LegacyStateError)
    # name -> (builder(folder, tmp) -> path, error type, text it names)
    return {
        "truncated h5": (_truncated_h5, fmt, "truncated.h5"),
        "corrupt h5": (lambda f, t: _write(
            t / "garbage.h5", b"\x89HDF\r\n\x1a\n" + b"\x00" * 64),
            fmt, "garbage.h5"),
        "truncated checkpoint index": (_truncated_index, fmt, "ckpt.index"),
        "unknown layer class": (lambda f, t: _h5_copy(
            f, t, "layer.h5",
            model_config=_rename_class("Dense", "FancyDense")),
            cfg, "FancyDense"),
        "unknown optimizer class": (lambda f, t: _h5_copy(
            f, t, "opt.h5",
            training_config=_rename_class("Custom>Adam", "Custom>Adamus")),
            cfg, "Adamus"),
        "missing optimizer variable": (_missing_slot, fmt,
                                       "Adam/m/d1/kernel"),
        "shape mismatch": (lambda f, t: _h5_copy(
            f, t, "shape.h5", model_config=lambda c: json.loads(
                json.dumps(c).replace('"units": 5', '"units": 7'))),
            state, "d1/kernel"),
        "Lambda under safe_mode": (lambda f, t: _h5_copy(
            f, t, "lambda.h5", model_config=_add_lambda), cfg,
            "safe_mode=False` .`--unsafe` on the command line"),
        "not an artifact": (lambda f, t: _write(t / "nothing.bin", b"hello"),
                            fmt, "nothing.bin"),
        "truncated .keras zip": (_truncated_zip, fmt, "truncated.keras"),
        "checkpoint state naming a deleted checkpoint": (
            _stale_state, fmt,
            r"stale/checkpoint names the checkpoint 'ckpt-2' as the latest, "
            r"but .*stale/ckpt-2\.index does not exist .*Checkpoints in the "
            r"folder: \['ckpt'\]"),
        "checkpoints with no state naming the latest": (
            _unnamed_latest, fmt,
            r"loose holds 2 checkpoints, \['ckpt-1', 'ckpt-2'\], and no "
            r"`checkpoint` file naming the latest"),
        ".keras weights that do not fit": (
            _zip_misfit, state, r"shape mismatch for layers/dense/vars/0"),
        "custom class not given": (lambda f, t: os.path.join(
            os.path.dirname(f), "adam_ema-custom", "model.h5"), cfg,
            "Scale"),
    }


BAD = list(_bad_table())


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_a_typed_error_and_leaves_no_file(artifacts, tmp_path,
                                                       name, capsys):
    from keras_ema_opt.cli import main

    build, error, text = _bad_table()[name]
    src = build(os.path.join(artifacts, "adam-mlp"), tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    dst = str(out / "new.keras")
    with pytest.raises(error, match=text.replace("(", r"\(")):
        keras_ema_opt.savedmodel.migrate(src, dst)
    assert os.listdir(out) == []
    assert main(["migrate", src, dst]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.__name__ in err
    assert os.listdir(out) == []


@pytest.mark.parametrize("case,cls", [
    ("L_adamax:mlp", "Adamax"), ("L_sgd:mlp", "SGD"),
    # Ftrl's l1/l2/beta are variables too; centered RMSprop is told by its
    # `mg` slots; Nadam's decay variable is its schedule_decay.
    ("L_ftrl:mlp", "Ftrl"), ("L_rmsprop_m:mlp", "RMSprop"),
    ("L_nadam:mlp", "LegacyNadam")])
def test_bare_optimizer_v2_checkpoint_rebuilds_its_optimizer(artifacts,
                                                             case, cls):
    """No config in the file: the class comes from the variable names
    (Adamax, not the Adam its slots look like), the hyperparameters from
    their variables."""
    folder = os.path.join(artifacts, case.replace(":", "-"))
    with h5py.File(os.path.join(folder, "model.h5"), "r") as f:
        model = model_from_config(f.attrs["model_config"])
    with pytest.warns(UserWarning, match="take their defaults"):
        optimizer = keras_ema_opt.savedmodel.restore_checkpoint(
            model, os.path.join(folder, FORMATS["checkpoint"]))
    assert type(optimizer).__name__ == cls
    model.compile(optimizer=optimizer, loss="mse")
    expected = np.load(os.path.join(folder, "expected.npz"))
    with open(os.path.join(folder, "info.json")) as f:
        info = json.load(f)
    for i in range(5):
        model.train_on_batch(expected[f"x{i}"], expected[f"y{i}"])
    for i, name in enumerate(info["weights"]):
        np.testing.assert_allclose(to_numpy(_find(model, name)),
                                   expected[f"after{i}"], rtol=1e-6,
                                   atol=1e-6)


def test_bare_checkpoint_of_a_new_optimizer_needs_the_optimizer(artifacts):
    from keras_ema_opt.errors import LegacyConfigError

    folder = os.path.join(artifacts, "adam-mlp")
    with h5py.File(os.path.join(folder, "model.h5"), "r") as f:
        model = model_from_config(f.attrs["model_config"])
    with pytest.raises(LegacyConfigError, match="stores only its learning"):
        keras_ema_opt.savedmodel.restore_checkpoint(
            model, os.path.join(folder, FORMATS["checkpoint"]))


@pytest.mark.parametrize("fmt", ["checkpoint", "save_weights"])
def test_checkpoint_into_keras_own_use_ema_optimizer(artifacts, tmp_path,
                                                     fmt):
    """A bare checkpoint of tf_keras' ``Adam(use_ema=True)``, given a model
    compiled with Keras 3's own ``keras.optimizers.Adam(use_ema=True)``:
    the moving averages go to Keras' own averages, and the written file
    trains on as tf_keras did, weights and averages. Given Keras' Adam
    without ``use_ema``, the error says where the averages would go."""
    from keras_ema_opt.errors import LegacyStateError

    folder = os.path.join(artifacts, "adam_ema-mlp")
    with h5py.File(os.path.join(folder, "model.h5"), "r") as f:
        config = f.attrs["model_config"]

    def build(**ema):
        model = model_from_config(config)
        model.compile(optimizer=keras.optimizers.Adam(
            0.01, amsgrad=True, **ema), loss="mse")
        return model

    dst = str(tmp_path / "new.keras")
    with pytest.raises(LegacyStateError, match=r"the Adam the state is "
                       r"loaded into has no place for the Keras 2 state "
                       r"\['average of .*use_ema=True"):
        keras_ema_opt.savedmodel.migrate(
            os.path.join(folder, FORMATS[fmt]), dst, model=build())
    assert not os.path.exists(dst)
    keras_ema_opt.savedmodel.migrate(
        os.path.join(folder, FORMATS[fmt]), dst,
        model=build(use_ema=True, ema_momentum=0.9))
    model = keras.saving.load_model(dst)
    # (On PyTorch, Keras' own Adam is its torch subclass.)
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert not isinstance(model.optimizer, keras_ema_opt.Optimizer)
    _continue_like_tf_keras(model, folder)
    expected = np.load(os.path.join(folder, "expected.npz"))
    with open(os.path.join(folder, "info.json")) as f:
        info = json.load(f)
    averages = model.optimizer._model_variables_moving_average
    for i, name in enumerate(info["trainable"]):
        var = _find(model, name)
        index = model.optimizer._get_variable_index(var)
        np.testing.assert_allclose(to_numpy(averages[index]),
                                   expected[f"average{i}"], rtol=1e-6,
                                   atol=1e-6, err_msg=f"average of {name}")


@pytest.mark.parametrize("jit_compile", ["auto", True, False])
def test_given_model_writes_jit_compile_that_auto_gave_as_auto(
        artifacts, tmp_path, jit_compile):
    """Keras stores what ``"auto"`` resolves to where the model is
    compiled (True on JAX). A model given compiled is written with
    ``"auto"`` where its value is that (the file then makes each
    backend's own choice where it is loaded), and with its value where it
    is not (an explicit choice)."""
    if BACKEND == "torch" and jit_compile is True:
        pytest.skip("torch.compile at the verifying forward pass: slow; "
                    "JAX and TensorFlow cover an explicit value")
    folder = os.path.join(artifacts, "L_sgd-mlp")
    model = _user_model(folder, jit_compile=jit_compile)()
    auto = model._resolve_auto_jit_compile()
    dst = str(tmp_path / "new.keras")
    keras_ema_opt.savedmodel.migrate(
        os.path.join(folder, FORMATS["checkpoint"]), dst, model=model)
    with zipfile.ZipFile(dst) as archive:
        written = json.loads(archive.read("config.json"))[
            "compile_config"]["jit_compile"]
    assert written == ("auto" if jit_compile == "auto" or jit_compile == auto
                       else jit_compile)


@keras.saving.register_keras_serializable(package="test_migration")
class _ForgetfulHuber(keras.losses.Huber):
    """A loss whose config leaves out its argument, as Keras 3.15's Huber
    does, and which ``keeping_arguments`` does not know."""


@pytest.mark.parametrize("loss,written", [
    (keras.losses.Huber(delta=0.5), "keras_ema_opt>Huber"),
    # A NumPy scalar argument comes back from the file as a float.
    (keras.losses.Huber(delta=np.float32(0.5)), "keras_ema_opt>Huber"),
    (keras.losses.CosineSimilarity(axis=0), "keras_ema_opt>CosineSimilarity"),
    (_ForgetfulHuber(delta=0.5), None)])
def test_given_model_loss_is_written_with_its_arguments(artifacts, tmp_path,
                                                        loss, written):
    """A model given compiled with Keras' Huber or CosineSimilarity: the
    file keeps ``delta`` / ``axis`` (``keras_ema_opt.compat.losses``'
    classes), and reloaded computes the given loss. A loss whose argument
    the file would lose, of a class not known to lose it: the check after
    reloading refuses the file (a typed error; nothing written)."""
    from keras_ema_opt.errors import LegacyStateError

    folder = os.path.join(artifacts, "L_sgd-mlp")
    model = _user_model(folder, loss=loss)()
    dst = str(tmp_path / "new.keras")
    src = os.path.join(folder, FORMATS["checkpoint"])
    if written is None:
        with pytest.raises(LegacyStateError, match=r"the loss differs after "
                           r"writing and reloading .*'delta': 0\.5.*"
                           r"'delta': 1\.0"):
            keras_ema_opt.savedmodel.migrate(src, dst, model=model)
        assert os.listdir(tmp_path) == []
        return
    keras_ema_opt.savedmodel.migrate(src, dst, model=model)
    with zipfile.ZipFile(dst) as archive:
        assert json.loads(archive.read("config.json"))["compile_config"][
            "loss"]["registered_name"] == written
    reloaded = keras.saving.load_model(dst)
    y = np.array([[0.0, 3.0], [1.0, -2.0]], "float32")
    p = np.array([[2.0, 0.0], [1.5, 1.0]], "float32")
    assert float(to_numpy(reloaded.loss(y, p))) == pytest.approx(
        float(to_numpy(loss(y, p))), rel=1e-6)


# ---------------------------------------------------------------------------
# tf_keras .keras files, and the command line's --model / --custom-objects
# ---------------------------------------------------------------------------

KERAS_ZIP_CASES = [c for c in CASES if c.split(":")[0] in SPREAD]


@pytest.mark.parametrize("case", KERAS_ZIP_CASES)
def test_tf_keras_keras_file_gives_the_model_and_names_what_is_not_migrated(
        artifacts, case):
    """The model and its weights, exactly; the optimizer of its config with
    a fresh state, and a warning naming the state left behind."""
    folder = os.path.join(artifacts, case.replace(":", "-"))
    expected = np.load(os.path.join(folder, "expected.npz"))
    with open(os.path.join(folder, "info.json")) as f:
        info = json.load(f)
    kept = (r"it holds none of the \w+ optimizer's variables \(tf_keras "
            r"writes none for a legacy optimizer" if case.startswith("L_")
            else r"it keeps the \w+ optimizer's [1-9]\d* variables")
    with pytest.warns(UserWarning, match=r"optimizer state is not migrated"
                      r" from a tf_keras \.keras file: " + kept) as caught:
        model = load_legacy(os.path.join(folder, "model.keras"),
                            custom_objects=CUSTOM_OBJECTS)
    (message,) = [str(w.message) for w in caught
                  if "not migrated" in str(w.message)]
    assert ("EMA averages" in message) == ("ema" in case)
    for i, name in enumerate(info["weights"]):
        np.testing.assert_array_equal(to_numpy(_find(model, name)),
                                      expected[f"before{i}"], err_msg=name)
    assert int(to_numpy(model.optimizer.iterations)) == 0
    with h5py.File(os.path.join(folder, "model.h5"), "r") as f:
        optimizer = json.loads(f.attrs["training_config"])["optimizer_config"]
    assert type(model.optimizer).__name__.replace("Legacy", "") == (
        optimizer["class_name"].replace("Custom>", ""))


def test_cli_custom_objects_module(artifacts, tmp_path, capsys):
    from keras_ema_opt.cli import main

    folder = os.path.join(artifacts, "adam_ema-custom")
    dst = str(tmp_path / "new.keras")
    assert main(["migrate", os.path.join(folder, "savedmodel"), dst]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "LegacyConfigError" in err and "Scale" in err
    assert os.listdir(tmp_path) == []
    assert main(["migrate", os.path.join(folder, "savedmodel"), dst,
                 "--custom-objects", "legacy_custom_objects"]) == 0
    model = keras.saving.load_model(dst, custom_objects=CUSTOM_OBJECTS)
    assert type(model.get_layer("scale")).__name__ == "Scale"
    _continue_like_tf_keras(model, folder)


def test_cli_model_function_for_a_bare_checkpoint(artifacts, tmp_path,
                                                  capsys):
    from keras_ema_opt.cli import main

    folder = os.path.join(artifacts, "adam_ema-mlp")
    src = os.path.join(folder, FORMATS["checkpoint"])
    dst = str(tmp_path / "new.keras")
    assert main(["migrate", src, dst]) == 1
    assert "holds no model config" in capsys.readouterr().err
    assert main(["migrate", src, dst, "--model", "nowhere"]) == 1
    assert "--model takes module:function" in capsys.readouterr().err
    assert main(["migrate", src, dst, "--model",
                 "legacy_custom_objects:mlp_adam_ema"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["new.keras"]
    _continue_like_tf_keras(keras.saving.load_model(dst), folder)


def _continue_like_tf_keras(model, folder):
    expected = np.load(os.path.join(folder, "expected.npz"))
    with open(os.path.join(folder, "info.json")) as f:
        info = json.load(f)
    assert int(to_numpy(model.optimizer.iterations)) == info["iterations"] - 5
    for i in range(5):
        model.train_on_batch(expected[f"x{i}"], expected[f"y{i}"])
    for i, name in enumerate(info["weights"]):
        np.testing.assert_allclose(to_numpy(_find(model, name)),
                                   expected[f"after{i}"], rtol=1e-6,
                                   atol=1e-6, err_msg=name)
