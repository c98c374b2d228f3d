"""One optimizer step alone: 200 float32 tensors of 50,000 elements, Adam,
with and without averaging, ours beside Keras' own and the backend's peers.

Run under one backend (``KERAS_BACKEND``); ``python -m benchmarks`` runs
it for each in a fresh process and gathers the results.

    python -m benchmarks.step [--strategies ema,swa] [--memory NAME]
"""

import argparse
import gc
import os
import sys

import numpy as np

from benchmarks import common

BACKEND = os.environ.get("KERAS_BACKEND", "jax")
LR = 1e-3
MOMENTUM = 0.999

STRATEGIES = ("ema", "ema_power", "swa", "powerema")


def averaging(name):
    import keras_ema_opt as k

    return {
        None: None,
        "ema": k.EMA(MOMENTUM),
        "ema_power": k.EMA(MOMENTUM, warmup="power"),
        "swa": k.SWA(),
        "powerema": k.PowerEMA([0.05, 0.10]),
    }[name]


def n_averages(name):
    return {None: 0, "powerema": 2}.get(name, 1)


def tensors(n=common.N_TENSORS, size=common.SIZE, seed=0):
    """(weight, gradient) numpy pairs, one at a time (no second copy of
    the whole problem in memory)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield (rng.standard_normal(size, dtype=np.float32),
               rng.standard_normal(size, dtype=np.float32) * 1e-2)


# ---------------------------------------------------------------------------
# Keras optimizers (Keras' own and ours), stepped as fit() steps them
# ---------------------------------------------------------------------------


def keras_optimizer(kind):
    import keras

    import keras_ema_opt

    if kind == "keras":
        return keras.optimizers.Adam(LR)
    if kind == "keras_ema":
        return keras.optimizers.Adam(LR, use_ema=True, ema_momentum=MOMENTUM)
    strategy = None if kind == "ours" else kind.split(":", 1)[1]
    return keras_ema_opt.Adam(LR, averaging=averaging(strategy),
                              jit_compile=False)


def keras_step(kind):
    """(step, sync) for a Keras optimizer on this backend."""
    variables, grads = keras_inputs()
    opt = keras_optimizer(kind)
    opt.build(variables)
    return keras_stepper(kind, opt, variables, grads)


def keras_inputs():
    """The benchmark's weights (Keras variables) and gradients."""
    import keras

    variables, grads = [], []
    for w, g in tensors():
        variables.append(keras.Variable(w))
        grads.append(keras.ops.convert_to_tensor(g))
    return variables, grads


def keras_stepper(kind, opt, variables, grads):
    """(step, sync) of the built Keras optimizer ``opt`` of ``kind``, as
    ``fit()`` steps it on this backend: TensorFlow's step is traced here;
    JAX compiles its step at the first call."""
    if BACKEND == "torch":
        import torch

        def step():
            with torch.no_grad():
                opt.apply(grads, variables)
        return step, _sync_torch
    if BACKEND == "tensorflow":
        import tensorflow as tf

        from keras_ema_opt import backend

        # The concrete function, called directly: a `tf.function` call
        # first looks its trace up by hashing every captured tensor and
        # variable (about 1 ms a step for these 1,000), which is the
        # caller's cost, not the step's. The peers are called the same way.
        # Keras' own step under XLA; ours as it runs: under XLA with a
        # GPU, and on a CPU in a graph, where its Adam is one custom op.
        jit = not kind.startswith("ours") or backend.resolve_jit_compile(
            True)
        fn = tf.function(lambda: opt.apply(grads, variables),
                         jit_compile=jit).get_concrete_function()
        return fn, lambda: opt.iterations.numpy()
    import jax

    # The variables' own buffers, donated as fit() donates its state (the
    # averages were built as copies: no buffer is shared).
    state = {"t": [v.value for v in variables],
             "o": [v.value for v in opt.variables]}
    fn = jax.jit(lambda t, o, g: opt.stateless_apply(o, g, t),
                 donate_argnums=(0, 1))

    def step():
        state["t"], state["o"] = fn(state["t"], state["o"], grads)
    # XLA's optimized HLO of the step (benchmarks.kernels --step).
    step.compiled_text = lambda: fn.lower(
        state["t"], state["o"], grads).compile().as_text()
    return step, lambda: jax.block_until_ready(state["t"])


def _sync_torch():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------
# Peers
# ---------------------------------------------------------------------------


def torch_foreach_step(kind):
    """torch.optim.Adam(foreach=True) and an average by `_foreach_lerp_`
    (as torch's AveragedModel / timm do), torch-ema, or timm ModelEmaV3's
    rule (timm does not import beside this torch: its update, as in
    ``timm/utils/model_ema.py``, is reproduced)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = []
    for w, g in tensors():
        p = torch.nn.Parameter(torch.from_numpy(w).to(device))
        p.grad = torch.from_numpy(g).to(device)
        params.append(p)
    opt = torch.optim.Adam(params, lr=LR, foreach=True)
    if kind == "torch_adam":
        def step():
            opt.step()
        return step, _sync_torch
    if kind == "torch_ema":
        from torch_ema import ExponentialMovingAverage

        ema = ExponentialMovingAverage(params, decay=MOMENTUM)

        def step():
            opt.step()
            ema.update()
        return step, _sync_torch
    averages = [p.detach().clone() for p in params]
    detached = [p.detach() for p in params]
    counter = {"step": 0}

    def timm_decay(step, decay=MOMENTUM, warmup_gamma=1.0,
                   warmup_power=2 / 3, min_decay=0.0):
        # timm ModelEmaV3.get_decay with use_warmup=True.
        step = max(0, step - 1)
        if step <= 0:
            return 0.0
        d = 1 - (1 + step / warmup_gamma) ** -warmup_power
        return max(min(d, decay), min_decay)

    def step():
        opt.step()
        counter["step"] += 1
        d = timm_decay(counter["step"]) if kind == "timm_ema_v3" else (
            MOMENTUM)
        with torch.no_grad():
            torch._foreach_lerp_(averages, detached, 1.0 - d)
    return step, _sync_torch


def optax_step(kind):
    import jax
    import optax

    params, grads = [], []
    for w, g in tensors():
        params.append(jax.numpy.asarray(w))
        grads.append(jax.numpy.asarray(g))
    tx = optax.adam(LR)
    ema = optax.ema(MOMENTUM, debias=False)
    state = {"p": params, "s": tx.init(params), "e": ema.init(params)}

    def update(p, s, e, g):
        updates, s = tx.update(g, s, p)
        p = optax.apply_updates(p, updates)
        if kind == "optax_ema":
            _, e = ema.update(p, e)
        return p, s, e

    fn = jax.jit(update, donate_argnums=(0, 1, 2))

    def step():
        state["p"], state["s"], state["e"] = fn(state["p"], state["s"],
                                                state["e"], grads)
    step.compiled_text = lambda: fn.lower(
        state["p"], state["s"], state["e"], grads).compile().as_text()
    return step, lambda: jax.block_until_ready(state["p"])


def tf_keras_step(kind):
    import tensorflow as tf
    import tf_keras

    variables, grads = [], []
    for w, g in tensors():
        variables.append(tf.Variable(w))
        grads.append(tf.constant(g))
    opt = tf_keras.optimizers.Adam(
        LR, use_ema=kind.startswith("tf_keras_ema"), ema_momentum=MOMENTUM,
        jit_compile=True)
    pairs = list(zip(grads, variables))
    # "tf_keras", "tf_keras_ema": as tf_keras' fit() runs it, in a
    # tf.function; tf_keras compiles each variable's update with XLA where
    # it has a GPU and turns its own `jit_compile` off elsewhere
    # (tf_keras/src/optimizers/optimizer.py). "..._xla": the whole step
    # compiled with XLA, as ours and Keras 3's are here.
    step = tf.function(lambda: opt.apply_gradients(pairs),
                       jit_compile=kind.endswith("_xla"))
    return step.get_concrete_function(), lambda: opt.iterations.numpy()


PEERS = {
    "torch": {"torch_adam": torch_foreach_step,
              "torch_adam+lerp": torch_foreach_step,
              "torch_ema": torch_foreach_step,
              "timm_ema_v3": torch_foreach_step},
    "jax": {"optax_adam": optax_step, "optax_ema": optax_step},
    "tensorflow": {"tf_keras": tf_keras_step, "tf_keras_ema": tf_keras_step,
                   "tf_keras_xla": tf_keras_step,
                   "tf_keras_ema_xla": tf_keras_step},
}


def configurations(strategies=STRATEGIES):
    """Name -> (builder, kind, number of averages kept)."""
    out = {"keras": (keras_step, "keras", 0),
           "keras_ema": (keras_step, "keras_ema", 1),
           "ours": (keras_step, "ours", 0)}
    for s in strategies:
        out[f"ours:{s}"] = (keras_step, f"ours:{s}", n_averages(s))
    for name, builder in PEERS[BACKEND].items():
        averages = 0 if name in ("torch_adam", "optax_adam", "tf_keras",
                                 "tf_keras_xla") else 1
        out[name] = (builder, name, averages)
    return out


def backend_bandwidths(megabytes=common.BANDWIDTH_MB, repeats=7):
    """Bytes per second (read + write, 2 floats an element) of a large copy
    and of an in-place scale by one, in this backend's own compiled or
    multi-threaded kernels, each the best of ``repeats``, as ``{kind:
    bytes/s}`` (see ``common.stream_bandwidths``)."""
    import time

    n = megabytes * (1 << 20) // 4
    if BACKEND == "torch":
        import torch

        src = torch.ones(n, device="cuda" if torch.cuda.is_available()
                         else "cpu")
        dst = torch.empty_like(src)
        kinds = {"copy": lambda: dst.copy_(src),
                 "scale": lambda: src.mul_(1.0)}
        sync = _sync_torch
    elif BACKEND == "jax":
        import jax

        # Scaled by an argument, not by the constant 1 (which XLA folds
        # away: no work, an infinite bandwidth).
        one = jax.numpy.float32(1.0)
        state = {"x": jax.numpy.ones(n)}
        scale = jax.jit(lambda x, s: x * s)
        # Donated: the result may be written over its argument, in place.
        in_place = jax.jit(lambda x, s: x * s, donate_argnums=0)

        def scale_in_place():
            state["x"] = in_place(state["x"], one)
        kinds = {"copy": lambda: scale(state["x"], one).block_until_ready(),
                 "scale": scale_in_place}

        def sync():
            jax.block_until_ready(state["x"])
    else:
        import tensorflow as tf

        one = tf.constant(1.0)
        src = tf.ones(n)
        var = tf.Variable(src)
        spec = tf.TensorSpec([], tf.float32)
        scale = tf.function(lambda x, s: x * s, jit_compile=True)

        def assign(s):
            # No value read back: the stream is the in-place write alone.
            var.assign(var * s, read_value=False)

        in_place = tf.function(assign, jit_compile=True).get_concrete_function(
            spec)
        # One element back to the host: the whole result would add a
        # device-to-host copy on a GPU.
        kinds = {"copy": lambda: scale(src, one)[:1].numpy(),
                 "scale": lambda: in_place(one)}

        def sync():
            var[:1].numpy()
    out = {}
    for kind, fn in kinds.items():
        best = float("inf")
        fn()
        sync()
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - start)
        out[f"{BACKEND}_{kind}"] = 2 * n * 4 / best
    return out


def bandwidths():
    """numpy's streams over every core and this backend's own; a
    process's bandwidth is the best of them."""
    return {**{f"numpy_{k}": v for k, v in
               common.stream_bandwidths().items()}, **backend_bandwidths()}


def run(names=None, strategies=STRATEGIES):
    configs = configurations(strategies)
    n = common.N_TENSORS * common.SIZE
    # This process's bandwidth: the best of numpy's streams over every core
    # and the backend's own (the driver's roofline is the run's median).
    streams = bandwidths()
    bandwidth = max(streams.values())
    for name in names or configs:
        builder, kind, averages = configs[name]
        step, sync = builder(kind)
        seconds = common.median_time(step, sync)
        moved = common.adam_bytes(n, averages)
        common.emit({"bench": "step", "backend": BACKEND, "name": name,
                     "seconds": seconds, "averages": averages,
                     "bytes": moved, "roofline_seconds": moved / bandwidth,
                     "bandwidth": bandwidth, "bandwidths": streams})
        del step, sync
        gc.collect()


def memory(name, strategies=STRATEGIES):
    """Peak memory growth of ``name`` over this process's idle baseline
    (after the imports), against the bytes its state needs."""
    configs = configurations(strategies)
    builder, kind, averages = configs[name]
    _import_backend()
    gc.collect()
    device = device_memory()
    baseline = device()[0] if device else common.current_rss_bytes()
    # What starting the framework's runtime adds (JAX's CPU client: about
    # 50 MB), before any state: reported beside the growth, not taken out.
    _start_runtime()
    started = device()[0] if device else common.current_rss_bytes()
    step, sync = builder(kind)
    for _ in range(10):
        step()
    sync()
    peak = device()[1] if device else common.peak_rss_bytes()
    n = common.N_TENSORS * common.SIZE
    # parameters, gradients, two Adam moments, the averages
    needed = n * 4 * (4 + averages)
    common.emit({"bench": "memory", "backend": BACKEND, "name": name,
                 "memory": "device" if device else "host",
                 "growth_bytes": peak - baseline, "needed_bytes": needed,
                 "runtime_bytes": started - baseline,
                 "ratio": (peak - baseline) / needed})


def device_memory():
    """On a GPU, a function giving (bytes in use, peak bytes in use) of the
    accelerator's allocator (the state lives there, not in the process's
    resident memory); None on a CPU."""
    if BACKEND == "torch":
        import torch

        if not torch.cuda.is_available():
            return None
        torch.cuda.reset_peak_memory_stats()
        return lambda: (torch.cuda.memory_allocated(),
                        torch.cuda.max_memory_allocated())
    if BACKEND == "jax":
        import jax

        device = jax.devices()[0]
        if device.platform != "gpu":
            return None

        def stats():
            s = device.memory_stats()
            return s["bytes_in_use"], s["peak_bytes_in_use"]
        return stats
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        return None
    tf.config.experimental.reset_memory_stats("GPU:0")

    def stats():
        s = tf.config.experimental.get_memory_info("GPU:0")
        return s["current"], s["peak"]
    return stats


def _start_runtime():
    """One tiny computation: the backend's runtime (devices, thread pools,
    a client) starts, with no state of the benchmark's yet."""
    if BACKEND == "torch":
        import torch

        (torch.zeros(1) + 1).sum().item()
    elif BACKEND == "jax":
        import jax.numpy as jnp

        (jnp.zeros(1) + 1).block_until_ready()
    else:
        import tensorflow as tf

        (tf.zeros(1) + 1).numpy()


def _import_backend():
    import keras  # noqa: F401

    import keras_ema_opt  # noqa: F401

    if BACKEND == "torch":
        import torch  # noqa: F401
        import torch_ema  # noqa: F401
    elif BACKEND == "jax":
        import jax  # noqa: F401
        import optax  # noqa: F401
    else:
        import tensorflow  # noqa: F401
        import tf_keras  # noqa: F401


def main(argv=None):
    parser = argparse.ArgumentParser(description=common.summary(__doc__))
    parser.add_argument("--names", default=None,
                        help="comma-separated configurations (default all)")
    parser.add_argument("--memory", default=None,
                        help="measure the peak memory of one configuration")
    parser.add_argument("--list", action="store_true",
                        help="print the configurations of this backend")
    args = parser.parse_args(argv)
    if args.list:
        print(" ".join(configurations()))
    elif args.memory:
        memory(args.memory)
    else:
        run(args.names.split(",") if args.names else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
