"""What the bridge is given, and what it must say: a checkpoint of a custom
loop, an optimizer of another class, a bare checkpoint with a schedule,
and the command's module arguments. Artifacts made here by real tf_keras.

The readers and the command are the same whatever Keras backend is
active: the module runs in the PyTorch backend's suite only."""

import os
import re
import signal
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
k2 = pytest.importorskip("tf_keras")

import keras  # noqa: E402

import keras_ema_opt  # noqa: E402
from keras_ema_opt import savedmodel  # noqa: E402
from keras_ema_opt.cli import main  # noqa: E402
from keras_ema_opt.errors import LegacyConfigError  # noqa: E402
from keras_ema_opt.errors import LegacyStateError  # noqa: E402
from conftest import only_on  # noqa: E402
from conftest import run_python  # noqa: E402
from conftest import to_numpy  # noqa: E402

pytestmark = only_on("torch")


def _batches(n):
    rng = np.random.RandomState(0)
    return [(rng.randn(8, 4).astype("float32"),
             rng.randn(8, 2).astype("float32")) for _ in range(n)]


def _k2_model():
    return k2.Sequential([k2.Input((4,)), k2.layers.Dense(3, name="d1"),
                          k2.layers.Dense(2, name="d2")], name="seq")


def _k3_model(optimizer=None):
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(3, name="d1"),
                              keras.layers.Dense(2, name="d2")], name="seq")
    if optimizer is not None:
        model.compile(optimizer=optimizer, loss="mse")
    return model


def test_custom_loop_checkpoint_finds_the_optimizer_by_its_structure(
        tmp_path):
    # tf.train.Checkpoint(model=net, opt=opt): the optimizer's key is the
    # writer's choice (its state was dropped: "not saved").
    net, opt = _k2_model(), k2.optimizers.Adam(0.01)
    for x, y in _batches(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((net(x) - y) ** 2)
        grads = tape.gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables))
    prefix = str(tmp_path / "ckpt")
    tf.train.Checkpoint(model=net, opt=opt).write(prefix)
    model = savedmodel.load_legacy(
        prefix, model=lambda: _k3_model(keras_ema_opt.Adam(0.01)))
    assert int(to_numpy(model.optimizer.iterations)) == 3
    kernel = model.get_layer("d2").kernel
    index = model.optimizer._get_variable_index(kernel)
    np.testing.assert_array_equal(
        to_numpy(model.optimizer._momentums[index]),
        opt._momentums[opt._index_dict[opt._var_key(
            net.get_layer("d2").kernel)]].numpy())
    # Two optimizers: which one is the model's is not in the file.
    tf.train.Checkpoint(model=net, a=opt, b=k2.optimizers.Adam()).write(
        str(tmp_path / "two"))
    with pytest.raises(ValueError, match=r"several optimizers \(\['a'"):
        savedmodel.inspect(str(tmp_path / "two"))


def test_state_of_another_optimizer_class_is_loaded_with_a_warning(tmp_path):
    net = _k2_model()
    net.compile(optimizer=k2.optimizers.Nadam(0.01), loss="mse")
    for x, y in _batches(2):
        net.train_on_batch(x, y)
    prefix = str(tmp_path / "ckpt")
    tf.train.Checkpoint(model=net, optimizer=net.optimizer).write(prefix)
    with pytest.warns(UserWarning, match=r"state of a Nadam optimizer.*"
                      "compiled with Adam"):
        savedmodel.load_legacy(
            prefix, model=lambda: _k3_model(keras_ema_opt.Adam(0.01)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        savedmodel.load_legacy(
            prefix, model=lambda: _k3_model(keras_ema_opt.Nadam(0.01)))


def test_bare_checkpoint_with_a_schedule_asks_for_the_optimizer(tmp_path):
    # A legacy optimizer's schedule is no checkpoint variable: rebuilt with
    # a default rate it resumed 0.05 away from tf_keras in 5 steps.
    net = _k2_model()
    schedule = k2.optimizers.schedules.ExponentialDecay(0.05, 1, 0.5)
    net.compile(optimizer=k2.optimizers.legacy.SGD(schedule, momentum=0.9),
                loss="mse")
    for x, y in _batches(3):
        net.train_on_batch(x, y)
    prefix = str(tmp_path / "ckpt")
    tf.train.Checkpoint(model=net, optimizer=net.optimizer).write(prefix)
    with pytest.raises(LegacyConfigError, match="learning-rate schedule"):
        savedmodel.restore_checkpoint(_k3_model(), prefix)
    opt = savedmodel.restore_checkpoint(
        _k3_model(), prefix, optimizer=keras_ema_opt.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.05, 1, 0.5),
            momentum=0.9))
    assert int(to_numpy(opt.iterations)) == 3



def _checkpoint(tmp_path, optimizer, steps=3):
    """A Keras 2 model trained ``steps`` steps with ``optimizer``, written
    as TensorFlow's guide does; the prefix, and tf_keras' loss of the next
    batch."""
    net = _k2_model()
    net.compile(optimizer=optimizer, loss="mse")
    batches = _batches(steps + 1)
    for x, y in batches[:steps]:
        net.train_on_batch(x, y)
    prefix = str(tmp_path / "ckpt")
    tf.train.Checkpoint(model=net, optimizer=net.optimizer).write(prefix)
    return prefix, float(net.train_on_batch(*batches[steps]))


def _next_loss(model, steps=3):
    return float(to_numpy(model.train_on_batch(*_batches(steps + 1)[steps])))


def test_given_optimizer_without_the_checkpoints_momentum_is_refused(
        tmp_path):
    # An OptimizerV2 SGD stores its momentum (0.9) and its buffers: an SGD
    # given without momentum has no place for them (they were dropped as
    # tf_keras' unused buffer of momentum 0, without a word).
    prefix, theirs = _checkpoint(
        tmp_path, k2.optimizers.legacy.SGD(0.05, momentum=0.9))
    with pytest.warns(UserWarning, match=r"trained with momentum=0\.9 "
                      r"\(given 0\.0\)"):
        with pytest.raises(LegacyStateError,
                           match=r"no place for the Keras 2 state "
                           r"\['momentum of d1/kernel'"):
            savedmodel.load_legacy(prefix, model=lambda: _k3_model(
                keras_ema_opt.SGD(0.05)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = savedmodel.load_legacy(prefix, model=lambda: _k3_model(
            keras_ema_opt.SGD(0.05, momentum=0.9)))
    assert _next_loss(model) == pytest.approx(theirs, rel=1e-6)


def test_checkpoint_with_an_uncompiled_model_warns_of_no_loss(tmp_path):
    # A checkpoint keeps no training config: an uncompiled model given for
    # it was written compiled with the optimizer rebuilt from the state and
    # no loss, without a word, and fit() then trained on a loss of 0 while
    # the momentum buffers went on moving the weights.
    prefix, theirs = _checkpoint(
        tmp_path, k2.optimizers.legacy.SGD(0.05, momentum=0.9))
    with pytest.warns(UserWarning, match="holds no loss .* compiled with "
                      "its optimizer alone"):
        model = savedmodel.load_legacy(prefix, model=_k3_model)
    assert model.loss is None
    assert int(to_numpy(model.optimizer.iterations)) == 3
    # Given compiled with its loss (the advice), nothing is said of it,
    # and the next step is tf_keras'.
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = savedmodel.load_legacy(prefix, model=lambda: _k3_model(
            keras_ema_opt.SGD(0.05, momentum=0.9)))
    assert not [w for w in said if "holds no loss" in str(w.message)]
    assert _next_loss(model) == pytest.approx(theirs, rel=1e-6)


class _K2Penalty(k2.layers.Layer):
    def call(self, x):
        self.add_loss(tf.reduce_mean(tf.square(x)))
        return x


class _Penalty(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.mean(keras.ops.square(x)))
        return x


def test_h5_compiled_without_a_loss_is_not_warned_of(tmp_path):
    # A training config without a loss (the model's own add_loss): the
    # model is compiled as it was, and nothing is said of a missing loss.
    inputs = k2.Input((4,))
    net = k2.Model(inputs, _K2Penalty()(k2.layers.Dense(2, name="d")(
        inputs)))
    net.compile(optimizer=k2.optimizers.Adam(0.01))
    x = _batches(1)[0][0]
    net.fit(x, verbose=0)
    path = str(tmp_path / "m.h5")
    net.save(path)

    def build():
        inputs = keras.Input((4,))
        return keras.Model(inputs, _Penalty()(keras.layers.Dense(
            2, name="d")(inputs)))

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = savedmodel.load_legacy(path, model=build)
    assert not [w for w in said if "holds no loss" in str(w.message)]
    assert int(to_numpy(model.optimizer.iterations)) == 1
    theirs = net.train_on_batch(x)
    assert float(to_numpy(model.train_on_batch(x))) == pytest.approx(
        float(theirs), rel=1e-6)


def _schedule(module):
    return module.optimizers.schedules.ExponentialDecay(0.05, 1, 0.5)


@pytest.mark.parametrize("trained, named, other, same", [
    # An OptimizerV2 stores its betas as variables.
    (lambda: k2.optimizers.legacy.Adam(0.01, beta_1=0.8, beta_2=0.95),
     r"trained with beta_1=0\.8 \(given 0\.9\), beta_2=0\.95 \(given "
     r"0\.999\); the Adam given",
     lambda: keras_ema_opt.Adam(0.01),
     lambda: keras_ema_opt.Adam(0.01, beta_1=0.8, beta_2=0.95)),
    # A Keras 2.11+ optimizer keeps a schedule's rate of its last step
    # (`_current_learning_rate`): an optimizer given a constant rate took
    # it, and kept it.
    (lambda: k2.optimizers.Adam(_schedule(k2)),
     r"learning rate was a schedule, at 0\.0125 on its last step; the Adam "
     "given has a constant rate",
     lambda: keras_ema_opt.Adam(0.01),
     lambda: keras_ema_opt.Adam(_schedule(keras))),
], ids=["betas", "schedule"])
def test_what_the_optimizer_given_holds_otherwise_is_named(
        tmp_path, trained, named, other, same):
    """Training went on under the optimizer given, without a word."""
    prefix, theirs = _checkpoint(tmp_path, trained())
    with pytest.warns(UserWarning, match=named):
        savedmodel.load_legacy(prefix, model=lambda: _k3_model(other()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = savedmodel.load_legacy(
            prefix, model=lambda: _k3_model(same()))
    assert _next_loss(model) == pytest.approx(theirs, rel=1e-6)


@pytest.mark.parametrize("option,value,text", [
    ("--model", "no_such_module_keo:build",
     "--model takes module:function.*'no_such_module_keo'"),
    ("--model", "json:no_such_function",
     "module 'json' has no 'no_such_function'"),
    ("--model", "json", "--model takes module:function. Received: 'json'"),
    ("--custom-objects", "no_such_module_keo",
     "--custom-objects takes a module.*ModuleNotFoundError"),
])
def test_cli_names_a_module_argument_it_cannot_use(tmp_path, capsys, option,
                                                   value, text):
    net = _k2_model()
    net.compile(optimizer="adam", loss="mse")
    net.train_on_batch(*_batches(1)[0])
    net.save(str(tmp_path / "m.h5"))
    code = main(["migrate", str(tmp_path / "m.h5"),
                 str(tmp_path / "new.keras"), option, value])
    assert code != 0
    err = capsys.readouterr().err
    assert "InvalidArgumentError" in err
    assert re.search(text, err), err
    assert sorted(os.listdir(tmp_path)) == ["m.h5"]


@pytest.mark.parametrize("fmt", ["savedmodel", "model.h5"])
def test_augmentation_layers_migrate(tmp_path, fmt):
    # tf_keras' Random* layers carry `rng_type` (refused by Keras 3 as an
    # unknown argument, with advice to pass a custom class) and, in a
    # SavedModel, their generator's state (no place in Keras 3).
    inputs = k2.Input((6, 6, 1))
    x = k2.layers.RandomFlip("horizontal", seed=1)(inputs)
    x = k2.layers.RandomZoom(0.1, seed=2)(x)
    x = k2.layers.Flatten()(x)
    net = k2.Model(inputs, k2.layers.Dense(2, name="out")(x), name="aug")
    net.compile(optimizer=k2.optimizers.Adam(0.01), loss="mse")
    rng = np.random.RandomState(0)
    for _ in range(2):
        net.train_on_batch(rng.randn(8, 6, 6, 1).astype("float32"),
                           rng.randn(8, 2).astype("float32"))
    net.save(str(tmp_path / "savedmodel"), save_format="tf")
    net.save(str(tmp_path / "model.h5"))
    out = tmp_path / "new.keras"
    savedmodel.migrate(str(tmp_path / fmt), str(out))
    model = keras.saving.load_model(str(out))
    assert int(to_numpy(model.optimizer.iterations)) == 2
    np.testing.assert_array_equal(to_numpy(model.get_layer("out").kernel),
                                  net.get_layer("out").kernel.numpy())
    if fmt == "savedmodel":
        record = savedmodel.inspect(str(tmp_path / fmt))
        assert any("random generator state" in w for w in record.warnings)


def _trained_two_steps(net, width, seed):
    """``net`` compiled with tf_keras' Adam and trained two steps; four
    batches of ``width`` features, the last two for the resumed steps."""
    net.compile(optimizer=k2.optimizers.Adam(0.01), loss="mse")
    rng = np.random.RandomState(seed)
    batches = [(rng.randn(8, width).astype("float32"),
                rng.randn(8, width).astype("float32")) for _ in range(4)]
    for x, y in batches[:2]:
        net.train_on_batch(x, y)
    return batches


@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_checkpoint_goes_where_its_object_paths_lead(tmp_path, kind):
    """A checkpoint holds no config: the model is the user's, and the
    names Keras 2 and Keras 3 made up (`dense_1`) count the layers their
    processes made before. Placed by name, the Keras 2 model's first
    layer went to the Keras 3 model's second (the same shape): it failed
    at the third, or, where nothing was left over, would not have. Placed
    by object path (`layer_with_weights-0/kernel`), as Keras 2 restores."""
    def build(layers, model_class):
        dense = [layers.Dense(6, activation="tanh") for _ in range(3)]
        norm, drop = layers.BatchNormalization(), layers.Dropout(0.0)
        if kind == "sequential":
            return model_class.Sequential(
                [layers.Input((6,)), dense[0], norm, drop, dense[1],
                 dense[2]])
        inputs = layers.Input((6,))
        hidden = drop(norm(dense[0](inputs)))
        return model_class.Model(
            inputs, layers.Add()([dense[1](hidden), dense[2](hidden)]))

    k2.backend.clear_session()
    k2.layers.Dense(1)  # the model's layers are dense_1 to dense_3
    net = build(k2.layers, k2)
    batches = _trained_two_steps(net, 6, seed=3)
    path = str(tmp_path / "ckpt")
    tf.train.Checkpoint(model=net, optimizer=net.optimizer).write(path)

    def k3_model():  # its layers are dense to dense_2
        model = build(keras.layers, keras)
        model.compile(optimizer=keras_ema_opt.Adam(0.01), loss="mse")
        return model

    _loaded_and_resumed_beside(path, k3_model, net, batches[2:])


def _loaded_and_resumed_beside(path, k3_model, net, batches):
    """``path`` loaded into ``k3_model()`` with every weight equal to
    ``net``'s, then ``batches`` trained by both, within float32
    round-off."""
    model = savedmodel.load_legacy(path, model=k3_model)
    for got, want in zip(model.weights, net.weights):
        np.testing.assert_array_equal(to_numpy(got), want.numpy())
    for x, y in batches:
        net.train_on_batch(x, y)
        model.train_on_batch(x, y)
    for got, want in zip(model.weights, net.weights):
        np.testing.assert_allclose(to_numpy(got), want.numpy(), rtol=1e-5,
                                   atol=1e-6)
    return model


class _K3Blocks(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [keras.layers.Dense(4), keras.layers.Dense(4)]

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _restored_after_another_layer(tmp_path, net, k3_class):
    """Keras 2 subclassed ``net`` written as a checkpoint, restored into
    a ``k3_class`` model built after another layer (its layer names
    numbered after it, unlike the checkpoint's)."""
    net(np.ones((1, 4), "float32"))
    path = str(tmp_path / "ckpt")
    tf.train.Checkpoint(model=net).write(path)
    keras.layers.Dense(2)
    model = k3_class()
    model(np.ones((1, 4), "float32"))
    savedmodel.restore_checkpoint(model, path)
    return model


def test_checkpoint_of_layers_held_in_a_list_attribute(tmp_path):
    """`self.blocks = [Dense, Dense]`: Keras 2 tracked the items by
    position (`blocks/0/kernel`), which the object path now follows; by
    name, the Keras 2 model's second block went to the Keras 3 model's
    first where the two processes' layer counts differed."""
    class K2Blocks(k2.Model):
        def __init__(self):
            super().__init__()
            self.blocks = [k2.layers.Dense(4), k2.layers.Dense(4)]

        def call(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    net = K2Blocks()
    model = _restored_after_another_layer(tmp_path, net, _K3Blocks)
    for ours, theirs in zip(model.blocks, net.blocks):
        for got, want in zip(ours.weights, theirs.weights):
            np.testing.assert_array_equal(to_numpy(got), want.numpy())


class _K3Parts(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.parts = {"proj": keras.layers.Dense(4),
                      "head": keras.layers.Dense(4)}

    def call(self, x):
        return self.parts["head"](self.parts["proj"](x))


def test_checkpoint_of_layers_held_in_a_dict_attribute(tmp_path):
    """`self.parts = {"proj": Dense, "head": Dense}`: Keras 2 tracked the
    items by key (`parts/proj/kernel`); by name, the Keras 2 model's
    layers went to the Keras 3 model's others where the two processes'
    layer counts differed (`weight 'parts/proj/bias' has no place`)."""
    class K2Parts(k2.Model):
        def __init__(self):
            super().__init__()
            self.parts = {"proj": k2.layers.Dense(4),
                          "head": k2.layers.Dense(4)}

        def call(self, x):
            return self.parts["head"](self.parts["proj"](x))

    k2.backend.clear_session()
    net = K2Parts()  # its layers are dense and dense_1
    model = _restored_after_another_layer(tmp_path, net, _K3Parts)
    for key in ("proj", "head"):
        for got, want in zip(model.parts[key].weights,
                             net.parts[key].weights):
            np.testing.assert_array_equal(to_numpy(got), want.numpy())


class _K3Guide(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(5, activation="tanh")
        self.out = keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.hidden(x))


def test_custom_loop_checkpoint_of_a_subclassed_model_under_its_own_name(
        tmp_path):
    """TensorFlow's checkpoint guide: `tf.train.Checkpoint(step=...,
    optimizer=opt, net=Net())` written by a `CheckpointManager`. A
    subclassed model has attribute children, not `layer-N` ones: the root
    was taken for the model, and its `step` and `save_counter` for model
    weights (`weight 'save_counter' has no place`)."""
    class K2Guide(k2.Model):
        def __init__(self):
            super().__init__()
            self.hidden = k2.layers.Dense(5, activation="tanh")
            self.out = k2.layers.Dense(2)

        def call(self, x):
            return self.out(self.hidden(x))

    net, opt = K2Guide(), k2.optimizers.Adam(0.01, use_ema=True,
                                             ema_momentum=0.9)
    checkpoint = tf.train.Checkpoint(step=tf.Variable(0), optimizer=opt,
                                     net=net)
    manager = tf.train.CheckpointManager(checkpoint, str(tmp_path / "run"),
                                         max_to_keep=2)
    batches = _batches(5)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(net(x) - y))
        grads = tape.gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables))

    for x, y in batches[:3]:
        step(x, y)
        checkpoint.step.assign_add(1)
        manager.save()

    def build():
        keras.layers.Dense(1)  # built after another layer, as in a notebook
        model = _K3Guide()
        model(np.zeros((1, 4), "float32"))
        model.compile(optimizer=keras_ema_opt.Adam(
            0.01, use_ema=True, ema_momentum=0.9), loss="mse")
        return model

    model = savedmodel.load_legacy(str(tmp_path / "run"), model=build)
    assert int(to_numpy(model.optimizer.iterations)) == 3
    # Beside another object holding variables (a metric), written with
    # or without a `save_counter`: the model is the child under which the
    # model given finds every variable; the others are named.
    loss = k2.metrics.Mean()
    loss.update_state(2.0)
    both = tf.train.Checkpoint(step=tf.Variable(0), optimizer=opt, net=net,
                               train_loss=loss)
    for path in (both.save(str(tmp_path / "saved")),
                 both.write(str(tmp_path / "written"))):
        with pytest.warns(UserWarning, match=r"the model is the "
                          r"checkpoint's 'net'; its other objects \((?:"
                          r"'save_counter', )?'step', 'train_loss'\) are "
                          r"not migrated"):
            again = savedmodel.load_legacy(path, model=build)
        assert int(to_numpy(again.optimizer.iterations)) == 3
    for x, y in batches[3:]:
        step(x, y)
        model.train_on_batch(x, y)
    for layer in ("hidden", "out"):
        for got, want in zip(getattr(model, layer).weights,
                             getattr(net, layer).weights):
            np.testing.assert_allclose(to_numpy(got), want.numpy(),
                                       rtol=1e-5, atol=1e-6)
    averages = {id(v): a for v, a in zip(
        model.trainable_variables,
        model.optimizer._model_variables_moving_average)}
    for layer in ("hidden", "out"):
        for ours, theirs in zip(getattr(model, layer).trainable_weights,
                                getattr(net, layer).trainable_weights):
            np.testing.assert_allclose(
                to_numpy(averages[id(ours)]),
                opt._model_variables_moving_average[opt._index_dict[
                    opt._var_key(theirs)]].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["save_weights", "model.save"])
def test_h5_into_a_given_model_goes_by_layer_order(tmp_path, fmt):
    """An `.h5` file into a model built after another layer: its layers
    are named `dense_1`... where the file's are `dense`..., and by name the
    file's second layer went to the model's first (`weight
    'dense/dense/kernel' has no place`). Keras' own `load_weights` places
    an `.h5` file by layer order; so does the bridge, where every layer
    agrees weight by weight."""
    def build(layers, module):
        return module.Sequential([
            layers.Input((4,)), layers.Dense(4, activation="tanh"),
            layers.BatchNormalization(), layers.Dense(4, activation="tanh"),
            layers.Dense(4)])

    k2.backend.clear_session()
    net = build(k2.layers, k2)  # dense, batch_normalization, dense_1, ...
    batches = _trained_two_steps(net, 4, seed=5)
    path = str(tmp_path / "m.h5")
    if fmt == "save_weights":
        net.save_weights(path)
    else:
        net.save(path)

    def k3_model():
        keras.layers.Dense(1)
        keras.layers.BatchNormalization()
        model = build(keras.layers, keras)
        model.compile(optimizer=keras_ema_opt.Adam(0.01), loss="mse")
        return model

    # A weights-only file has no optimizer state to resume.
    model = _loaded_and_resumed_beside(
        path, k3_model, net, [] if fmt == "save_weights" else batches[2:])
    assert int(to_numpy(model.optimizer.iterations)) == (
        0 if fmt == "save_weights" else 4)


@pytest.mark.parametrize("names", ["named", "made_up"])
def test_h5_by_layer_order_keeps_a_layer_frozen_in_the_file_in_place(
        tmp_path, names):
    """Keras 2 wrote a nested model's trainable weights first: with its
    first Dense frozen, `d2/kernel, d2/bias, d1/kernel, d1/bias`. Into a
    model where it is not frozen (fine-tuning), placed by position the two
    same-shaped layers swapped their weights, without a word. Within a
    layer the weights go by name, and those alike (made-up names,
    `dense_4`) in the order their layers were made."""
    def build(layers, module, frozen):
        kwargs = (lambda n: {"name": n}) if names == "named" else (
            lambda n: {})
        inner = module.Sequential([
            layers.Input((4,)), layers.Dense(4, **kwargs("d1")),
            layers.Dense(4, **kwargs("d2"))], name="base")
        inner.layers[0].trainable = not frozen
        inputs = layers.Input((4,))
        return module.Model(inputs, layers.Dense(1)(inner(inputs)))

    k2.backend.clear_session()
    net = build(k2.layers, k2, frozen=True)
    net.compile(optimizer=k2.optimizers.Adam(0.01), loss="mse")
    _trained_two_steps(net, 4, seed=7)
    path = str(tmp_path / "m.h5")
    net.save_weights(path)

    def k3_model():
        keras.layers.Dense(1)  # made-up names numbered apart
        return build(keras.layers, keras, frozen=False)

    model = savedmodel.load_legacy(path, model=k3_model)
    theirs = net.get_layer("base").layers
    ours = model.get_layer("base").layers
    for got_layer, want_layer in zip(ours, theirs):
        for got, want in zip(got_layer.weights, want_layer.weights):
            np.testing.assert_array_equal(to_numpy(got), want.numpy())
    x = np.random.RandomState(1).randn(3, 4).astype("float32")
    np.testing.assert_allclose(to_numpy(model(x)), net(x).numpy(),
                               rtol=1e-5, atol=1e-6)


def test_h5_layer_order_gives_way_to_names_that_disagree(tmp_path):
    """Placed by layer order only where each weight's shape and name agree:
    a given model whose layers come in another order, named as the file's,
    is placed by name."""
    k2.backend.clear_session()
    inputs = k2.Input((4,))
    a = k2.layers.Dense(3, name="a")(inputs)
    b = k2.layers.Dense(3, name="b")(inputs)
    net = k2.Model(inputs, k2.layers.Concatenate(name="c")([a, b]))
    net.save_weights(str(tmp_path / "w.h5"))

    def k3_model():
        inputs = keras.Input((4,))
        b = keras.layers.Dense(3, name="b")
        a = keras.layers.Dense(3, name="a")
        model = keras.Model(inputs, keras.layers.Concatenate(name="c")(
            [b(inputs), a(inputs)]))
        assert [layer.name for layer in model.layers][1:3] == ["b", "a"]
        return model

    model = savedmodel.load_legacy(str(tmp_path / "w.h5"), model=k3_model)
    for name in ("a", "b"):
        np.testing.assert_array_equal(
            to_numpy(model.get_layer(name).kernel),
            net.get_layer(name).kernel.numpy())


def test_adapted_vocabulary_is_migrated_not_lost(tmp_path):
    """An adapted `TextVectorization` keeps its vocabulary in a lookup
    table of the SavedModel's graph: the layer built from the config had
    none (every token out of vocabulary), without a word. From a SavedModel
    it comes from that table, also into a model given with another
    vocabulary; from a tf_keras `.keras` file, from its assets. Only a
    config cannot hold it: a warning names the layer."""
    corpus = np.array(["the cat sat", "the dog ran far", "a cat ran"])
    vectorize = k2.layers.TextVectorization(
        max_tokens=20, output_sequence_length=4, name="tv")
    vectorize.adapt(corpus)
    vocabulary = vectorize.get_vocabulary()
    inputs = k2.Input((1,), dtype="string")
    x = k2.layers.Embedding(20, 3, name="emb")(vectorize(inputs))
    outputs = k2.layers.Dense(1, name="out")(
        k2.layers.GlobalAveragePooling1D()(x))
    net = k2.Model(inputs, outputs)
    net.compile(optimizer=k2.optimizers.Adam(0.01), loss="mse")
    x_text = corpus.reshape(-1, 1)
    y = np.array([[1.0], [0.0], [1.0]], "float32")
    net.train_on_batch(x_text, y)
    path = str(tmp_path / "savedmodel")
    net.save(path, save_format="tf")
    net.save(str(tmp_path / "model.keras"))

    # A tf_keras `.keras` file keeps the vocabulary in its assets
    # (`assets/layers/text_vectorization/vocabulary.txt`): migrated.
    out = tmp_path / "from-zip.keras"
    with pytest.warns(UserWarning, match="optimizer state is not migrated"):
        savedmodel.migrate(str(tmp_path / "model.keras"), str(out))
    written = keras.saving.load_model(str(out))
    assert written.get_layer("tv").get_vocabulary() == vocabulary
    np.testing.assert_array_equal(
        to_numpy(written.get_layer("tv")(x_text)), vectorize(x_text).numpy())
    # Only the config: the caller is told, and has the layer to adapt.
    with pytest.warns(UserWarning, match=r"layer 'tv' \(TextVectorization"
                      r"\) was adapted: its vocabulary of 9 entries is not "
                      "in a config"):
        savedmodel.model_from_config(net.to_json())

    out = tmp_path / "new.keras"
    assert main(["migrate", path, str(out), "--quiet"]) == 0
    written = keras.saving.load_model(str(out))
    assert written.get_layer("tv").get_vocabulary() == vocabulary
    np.testing.assert_array_equal(
        to_numpy(written.get_layer("tv")(x_text)), vectorize(x_text).numpy())

    def k3_model():
        inputs = keras.Input((1,), dtype="string")
        tv = keras.layers.TextVectorization(
            max_tokens=20, output_sequence_length=4, name="tv",
            vocabulary=["other", "words"])
        x = keras.layers.Embedding(20, 3, name="emb")(tv(inputs))
        outputs = keras.layers.Dense(1, name="out")(
            keras.layers.GlobalAveragePooling1D()(x))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras_ema_opt.Adam(0.01), loss="mse")
        return model

    # A model given with another vocabulary takes the file's, as its
    # weights.
    model = savedmodel.load_legacy(path, model=k3_model)
    assert model.get_layer("tv").get_vocabulary() == vocabulary
    np.testing.assert_array_equal(
        to_numpy(model.get_layer("tv")(x_text)), vectorize(x_text).numpy())
    for name in ("emb", "out"):
        for got, want in zip(model.get_layer(name).weights,
                             net.get_layer(name).weights):
            np.testing.assert_array_equal(to_numpy(got), want.numpy())


class _K3Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(3, name="d1")
        self.d2 = keras.layers.Dense(2, name="d2")

    def call(self, x):
        return self.d2(self.d1(x))


@pytest.mark.parametrize("fmt", ["ckpt", "savedmodel"])
def test_subclassed_model_resumes_like_tf_keras(tmp_path, fmt):
    # Its layers are attributes (`d1/kernel`), not `layer-N` children, and
    # its variables are named under the model's own name (`k2_net/d1/...`).
    class K2Net(k2.Model):
        def __init__(self):
            super().__init__(name="k2_net")
            self.d1 = k2.layers.Dense(3, name="d1")
            self.d2 = k2.layers.Dense(2, name="d2")

        def call(self, x):
            return self.d2(self.d1(x))

    batches = _batches(5)
    net = K2Net()
    net.compile(optimizer=k2.optimizers.Adam(0.01), loss="mse")
    for x, y in batches[:3]:
        net.train_on_batch(x, y)
    if fmt == "ckpt":
        path = str(tmp_path / "ckpt")
        tf.train.Checkpoint(model=net, optimizer=net.optimizer).write(path)
    else:
        path = str(tmp_path / "savedmodel")
        net.save(path, save_format="tf")

    def build():
        model = _K3Net(name="k3_net")
        model(np.zeros((1, 4), "float32"))
        model.compile(optimizer=keras_ema_opt.Adam(0.01), loss="mse")
        return model

    # Without it: a class Keras 3 cannot build (a SavedModel's config), or
    # no config (a checkpoint); each error names `--model`.
    with pytest.raises(LegacyConfigError, match=r"`--model module:function`"):
        savedmodel.load_legacy(path)
    model = savedmodel.load_legacy(path, model=build)
    assert int(to_numpy(model.optimizer.iterations)) == 3
    # Written and verified: the check's forward pass read the model's
    # `inputs`, which a subclassed model has not (an AttributeError, and
    # no file); it runs on the shape the model was built on.
    out = str(tmp_path / "new.keras")
    savedmodel.migrate(path, out, model=build,
                       custom_objects={"_K3Net": _K3Net})
    written = keras.saving.load_model(out, custom_objects={"_K3Net": _K3Net})
    assert int(to_numpy(written.optimizer.iterations)) == 3
    for x, y in batches[3:]:
        net.train_on_batch(x, y)
        model.train_on_batch(x, y)
    for layer in ("d1", "d2"):
        for weight in ("kernel", "bias"):
            np.testing.assert_allclose(
                to_numpy(getattr(getattr(model, layer), weight)),
                getattr(getattr(net, layer), weight).numpy(),
                rtol=1e-5, atol=1e-6)


def _saved_h5(tmp_path, compiled=True):
    net = _k2_model()
    if compiled:
        net.compile(optimizer="adam", loss="mse")
        net.train_on_batch(*_batches(1)[0])
    src = str(tmp_path / "m.h5")
    net.save(src)
    return src


def test_cli_replaces_an_existing_file_only_when_told_never_its_source(
        tmp_path, capsys):
    src = _saved_h5(tmp_path)
    dst = tmp_path / "new.keras"
    dst.write_text("keep me")
    assert main(["migrate", src, str(dst), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "InvalidArgumentError" in err and "exists" in err
    assert "--overwrite" in err
    assert dst.read_text() == "keep me"
    assert main(["migrate", src, str(dst), "--quiet", "--overwrite"]) == 0
    model = keras.saving.load_model(dst)
    assert int(to_numpy(model.optimizer.iterations)) == 1
    # The source under another name: refused, even with --overwrite.
    source = open(src, "rb").read()
    link = tmp_path / "link.keras"
    os.symlink(src, link)
    assert main(["migrate", src, str(link), "--overwrite"]) == 1
    assert "is the source itself" in capsys.readouterr().err
    assert os.path.islink(link) and open(src, "rb").read() == source


@pytest.mark.skipif(not os.path.isdir("/sys"),
                    reason="a folder no process may write (Linux's /sys)")
def test_cli_to_a_folder_it_cannot_write_fails_first_naming_the_file(
        tmp_path, capsys):
    """An unwritable destination folder fails before the source is read,
    and the error names the destination asked for, not a temporary file
    (/sys: no new file, even for root)."""
    src = _saved_h5(tmp_path)
    assert main(["migrate", src, "/sys/new.keras"]) == 1
    captured = capsys.readouterr()
    err = captured.err
    # PermissionError, or an OSError of a read-only /sys (containers)
    assert "keras-ema-opt migrate: error: " in err and "Error: " in err
    assert "cannot write /sys/new.keras" in err and ".migrate-" not in err
    assert "reading" not in captured.out + err  # before the conversion
    assert not os.path.exists("/sys/new.keras")


def test_a_stored_input_shape_is_migrated_without_keras_advice(tmp_path):
    """A Keras 2 config keeps its first layer's `input_shape`; rebuilding
    it is no reason for Keras 3's warning against passing one."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keras.layers.Dense(3, input_shape=(4,))
    if not [w for w in caught if "input_shape" in str(w.message)]:
        pytest.skip("this Keras does not advise against `input_shape`")
    net = k2.Sequential([k2.layers.Dense(3, input_shape=(4,), name="d1")])
    net.compile(optimizer="adam", loss="mse")
    net.train_on_batch(np.ones((2, 4)), np.ones((2, 3)))
    net.save(tmp_path / "m.h5")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = savedmodel.migrate(str(tmp_path / "m.h5"),
                                   str(tmp_path / "new.keras"))
    assert model.layers[0].name == "d1"
    assert not [w for w in caught if "input_shape" in str(w.message)], [
        str(w.message) for w in caught]


def test_cli_shows_a_warning_on_one_line_of_its_own(tmp_path):
    """The command's warnings read as its other messages: one line, named
    by the command, without the library's source line."""
    src = _saved_h5(tmp_path, compiled=False)
    proc = run_python("-W", "always", "-c",
                      "import sys; from keras_ema_opt.cli import main; "
                      "sys.exit(main(sys.argv[1:]))", "migrate", src,
                      str(tmp_path / "new.keras"), backend="torch")
    err = proc.stderr
    lines = [line for line in err.splitlines() if "Warning: " in line]
    assert lines and all(line.startswith("keras-ema-opt migrate: warning: ")
                         for line in lines), lines
    assert [line for line in lines if line.startswith(
        "keras-ema-opt migrate: warning: UserWarning: ")
        and "holds no optimizer" in line]
    assert not [line for line in err.splitlines()
                if line.startswith(" ")], err  # no source line


def test_cli_holds_back_tensorflow_start_up_notes(tmp_path):
    """Keras imports TensorFlow to save a model on any backend, and its C++
    runtime writes info lines (oneDNN, CUDA drivers) before its logging
    starts: the command shows its own lines only, and TensorFlow's
    warnings and errors."""
    src = _saved_h5(tmp_path, compiled=True)
    proc = run_python("-c", "import sys; from keras_ema_opt.cli import "
                      "main; sys.exit(main(sys.argv[1:]))", "migrate", src,
                      str(tmp_path / "new.keras"), backend="torch")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.splitlines()
    assert [line for line in err if line.startswith(
        "keras-ema-opt migrate: done")]
    notes = [line for line in err if re.match(r"I\d{4} |WARNING: All log "
                                              r"messages before absl", line)]
    assert not notes, "\n".join(err)
    from keras_ema_opt.backend._tf_startup import STARTUP_NOTE

    for line in ("E0000 00:00:1796.5   22679 cuda_platform.cc:52] failed "
                 "call to cuInit: INTERNAL", "W0000 00:00:17.4  7 "
                 "tf_trt.cc:3] TF-TRT Warning: Could not find TensorRT",
                 "UserWarning: something", "keras-ema-opt migrate: done"):
        assert not STARTUP_NOTE.match(line), line


def test_cli_shows_what_a_failing_tensorflow_import_writes(tmp_path):
    """Where TensorFlow's import aborts the process (a fatal `F...` line,
    as on a CPU without the instructions it was built for), what it wrote
    still reaches stderr, its notes still held back. TensorFlow cannot be
    made to fail so here: a package of its name on PYTHONPATH writes the
    lines and aborts, as its C++ runtime does."""
    import subprocess
    import sys

    fake = tmp_path / "fake" / "tensorflow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import os\n"
        "os.write(2, b'I0000 00:00:17.5  7 port.cc:153] oneDNN custom "
        "operations are on.\\n')\n"
        "os.write(2, b'F0000 00:00:17.6  7 cpu_feature_guard.cc:9] The "
        "TensorFlow library was compiled to use AVX instructions\\n')\n"
        "os.abort()\n")
    src = _saved_h5(tmp_path, compiled=False)
    env = dict(os.environ, KERAS_BACKEND="torch",
               PYTHONPATH=str(fake.parent))
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from keras_ema_opt.cli import "
         "main; sys.exit(main(sys.argv[1:]))", "migrate", src,
         str(tmp_path / "new.keras")], env=env, capture_output=True,
        text=True, timeout=240)
    assert proc.returncode == -signal.SIGABRT, proc.stderr
    assert "compiled to use AVX instructions" in proc.stderr
    assert "oneDNN" not in proc.stderr
    assert not (tmp_path / "new.keras").exists()


def test_cli_warning_format_is_given_back_and_warnings_still_recorded(
        tmp_path):
    """In-process, the command changes only how a warning is formatted,
    for its own run: `catch_warnings(record=True)` still records it."""
    src = _saved_h5(tmp_path, compiled=False)
    formatted = warnings.formatwarning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["migrate", src, str(tmp_path / "new.keras"),
                     "--quiet"]) == 0
    assert [w for w in caught if "holds no optimizer" in str(w.message)]
    assert warnings.formatwarning is formatted


def test_cli_migrates_a_model_without_an_optimizer(tmp_path, capsys):
    src = _saved_h5(tmp_path, compiled=False)
    dst = tmp_path / "new.keras"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["migrate", src, str(dst), "--quiet"]) == 0
    assert "4 weights, no optimizer" in capsys.readouterr().out
    assert keras.saving.load_model(dst).weights


@pytest.mark.parametrize("signum, code, said", [
    (signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_cli_stopped_while_writing_leaves_no_file(tmp_path, capsys,
                                                 monkeypatch, signum, code,
                                                 said):
    src = _saved_h5(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    verify = savedmodel.verify_same

    def stopped(*args, **kwargs):  # the signal while the file is written
        os.kill(os.getpid(), signum)
        return verify(*args, **kwargs)

    monkeypatch.setattr(savedmodel, "verify_same", stopped)
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    assert main(["migrate", src, str(out / "new.keras"), "--quiet"]) == code
    assert f"{said}; " in capsys.readouterr().err
    assert os.listdir(out) == []  # nor the temporary file
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)
            ] == handlers  # given back


@k2.utils.register_keras_serializable(package="keo_sched")
class _K2Halve(k2.optimizers.schedules.LearningRateSchedule):
    """A user's schedule, registered with tf_keras (``keo_sched>...``)."""

    def __init__(self, rate):
        self.rate = rate

    def __call__(self, step):
        return self.rate * tf.pow(0.5, tf.cast(step, tf.float32))

    def get_config(self):
        return {"rate": self.rate}


class _Halve(keras.optimizers.schedules.LearningRateSchedule):
    """Its Keras 3 twin, not registered: given through custom_objects."""

    def __init__(self, rate):
        self.rate = rate

    def __call__(self, step):
        return self.rate * keras.ops.power(
            0.5, keras.ops.cast(step, "float32"))

    def get_config(self):
        return {"rate": self.rate}


@pytest.mark.parametrize("legacy", [False, True])
def test_custom_schedule_comes_in_through_custom_objects(tmp_path, legacy):
    # A SavedModel stores the schedule under its registered name as the
    # class name ({"class_name": "keo_sched>_K2Halve"}, no module): it was
    # looked up among Keras' own schedules, and custom_objects never
    # consulted (the .h5 of the same model migrated).
    optimizers = k2.optimizers.legacy if legacy else k2.optimizers
    net = _k2_model()
    net.compile(optimizer=optimizers.Adam(_K2Halve(0.05)), loss="mse")
    batches = _batches(3)
    for x, y in batches[:2]:
        net.train_on_batch(x, y)
    folder, h5 = str(tmp_path / "sm"), str(tmp_path / "m.h5")
    net.save(folder, save_format="tf")
    net.save(h5)
    theirs = float(net.train_on_batch(*batches[2]))
    for path in (folder, h5):
        with pytest.raises(LegacyConfigError, match="custom_objects"):
            savedmodel.load_legacy(path)
        for key in ("_K2Halve", "keo_sched>_K2Halve"):
            model = savedmodel.load_legacy(path,
                                           custom_objects={key: _Halve})
            assert isinstance(model.optimizer._learning_rate, _Halve)
            ours = float(to_numpy(model.train_on_batch(*batches[2])))
            assert ours == pytest.approx(theirs, rel=1e-6)
