"""JAX on a CPU: Keras' Adam with the averages folded in, as one C++ kernel.

XLA's CPU code makes one loop per output of the Adam + average update (the
moments, the weight, each average), and each later loop reads back what an
earlier one wrote: 13 floats an element where 9 must move with one
average, so at best 0.69 of the memory bandwidth (docs/performance.md).
``cpu_kernels.cc`` makes one pass instead. It is built on first use with
the system's C++ compiler against jaxlib's XLA FFI headers (as
``torch.utils.cpp_extension.load`` builds an extension), cached per
source, jaxlib, compiler and CPU, and registered with XLA as an FFI
target. Without a compiler, or where the build fails, JAX's own step runs
(the same rule, to the bit: tested), and :func:`status` says why.

Environment:

- ``KERAS_EMA_OPT_CPU_KERNELS=0``: do not build or use the kernel.
- ``KERAS_EMA_OPT_CACHE``: where built kernels are kept (by default
  ``$XDG_CACHE_HOME/keras_ema_opt`` or ``~/.cache/keras_ema_opt``).
- ``CXX``: the C++ compiler (by default ``c++``, ``g++`` or ``clang++``).
"""

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

_TARGET = "keras_ema_opt_adam_average"
_SOURCE = pathlib.Path(__file__).with_name("cpu_kernels.cc")
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd",
          "-fno-math-errno", "-ffp-contract=off", "-march=native", "-w")
MAX_AVERAGES = 2

_log = logging.getLogger("keras_ema_opt")
_lock = threading.Lock()
_state = {"ready": None, "reason": "not built yet", "library": None}


def status():
    """``(ready, reason)``: whether the kernel serves this process, and why
    not where it does not (the build's error, no compiler, turned off)."""
    _ready()
    return bool(_state["ready"]), _state["reason"]


def _ready():
    if _state["ready"] is not None:
        return _state["ready"]
    with _lock:
        if _state["ready"] is None:
            try:
                _state["reason"] = _load()
                _state["ready"] = _state["reason"] is None
            except Exception as error:  # a failed build serves nothing
                _state["ready"] = False
                _state["reason"] = f"{type(error).__name__}: {error}"
            if not _state["ready"]:
                _log.info("keras_ema_opt: JAX's own Adam step runs on the "
                          "CPU (the fused kernel is unavailable: %s)",
                          _state["reason"])
    return _state["ready"]


def _load():
    """Build (or find) the kernel and register it; the reason it cannot
    serve, or None."""
    if os.environ.get("KERAS_EMA_OPT_CPU_KERNELS", "1") == "0":
        return "KERAS_EMA_OPT_CPU_KERNELS=0"
    if platform.system() != "Linux":
        return f"built on Linux only, not {platform.system()}"
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler (set CXX)"
    include = jax.ffi.include_dir()
    library = _build(compiler, include)
    try:
        _state["library"] = ctypes.cdll.LoadLibrary(str(library))
    except OSError:  # a damaged file in the cache: build it again, once
        library.unlink(missing_ok=True)
        library = _build(compiler, include)
        _state["library"] = ctypes.cdll.LoadLibrary(str(library))
    jax.ffi.register_ffi_target(
        _TARGET, jax.ffi.pycapsule(_state["library"].KeoAdamAverage),
        platform="cpu")
    return None


def _compiler():
    """The compiler's command (``CXX`` may hold a launcher: ``ccache g++``),
    or None."""
    given = shlex.split(os.environ.get("CXX", ""))
    if given:
        found = shutil.which(given[0])
        return [found, *given[1:]] if found else None
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def _build(compiler, include):
    """The kernel's shared library: from the cache, or compiled into a
    temporary file and renamed into it (no partial file is ever loaded;
    processes building at once each rename a whole one)."""
    version = subprocess.run([*compiler, "--version"], capture_output=True,
                             text=True, check=True, timeout=60).stdout
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), jax.__version__.encode(),
                 _jaxlib_version().encode(), version.encode(),
                 " ".join(_FLAGS).encode(), _cpu_signature().encode()):
        key.update(part)
        key.update(b"\0")
    cache = _cache_dir()
    target = cache / f"adam_average-{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(cache)
    fd, temp = tempfile.mkstemp(dir=cache, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [*compiler, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", temp],
            capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(compiler)} exited "
                               f"{done.returncode}: "
                               f"{done.stderr.strip()[-2000:]}")
        os.replace(temp, target)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return target


def _remove_abandoned(cache, age=3600):
    """Temporary files of builds killed an hour ago or more."""
    now = time.time()
    for path in cache.glob(".build-*"):
        try:
            if now - path.stat().st_mtime > age:
                path.unlink()
        except OSError:  # another process took it meanwhile
            pass


def _jaxlib_version():
    import jaxlib

    return getattr(jaxlib, "__version__", "")


def _cpu_signature():
    """What ``-march=native`` compiled for: the CPU's model and flags."""
    fields = ("model name", "flags", "Features", "CPU implementer",
              "CPU architecture", "CPU variant", "CPU part")
    lines = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name = line.split(":")[0].strip()
                if name in fields:
                    lines.setdefault(name, line.strip())
    except OSError:
        pass
    return "\n".join([platform.machine(), platform.processor(),
                      *sorted(lines.values())])


def _cache_dir():
    given = os.environ.get("KERAS_EMA_OPT_CACHE")
    if given:
        return pathlib.Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "keras_ema_opt"


def serves(values):
    """Whether the kernel can update these arrays: float32 on a CPU, in a
    process with one JAX device (a sharded array would be gathered)."""
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    if any(v.dtype != jnp.float32 for v in values):
        return False
    return _ready()


def adam_average(scalars, tensors, averages):
    """One Adam step with ``averages`` averages per tensor.

    Args:
        scalars: float32 ``[alpha, 1 - beta_1, 1 - beta_2, epsilon, u_1,
            ..., u_k]``, ``u_j`` the weight of the new value in average
            ``j`` (1 copies, 0 keeps).
        tensors: per variable ``(g, m, v, w, a_1, ..., a_k)``, float32
            arrays of one size.
        averages: ``k``, 0 to 2.

    Returns:
        Per variable ``(m, v, w, a_1, ..., a_k)`` after the step, each in
        its input's buffer (aliased).
    """
    return _adam_average(averages, scalars, [tuple(t) for t in tensors])


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _adam_average(averages, scalars, tensors):
    per_in, per_out = 4 + averages, 3 + averages
    operands = [scalars]
    shapes, aliases = [], {}
    for i, group in enumerate(tensors):
        operands.extend(group)
        for k, value in enumerate(group[1:]):
            aliases[1 + i * per_in + 1 + k] = len(shapes)
            shapes.append(jax.ShapeDtypeStruct(value.shape, value.dtype))
    # Under `jax.vmap` (an ensemble of optimizers), one call per member.
    outputs = jax.ffi.ffi_call(_TARGET, shapes, input_output_aliases=aliases,
                               vmap_method="sequential")(
        *operands, averages=np.int64(averages))
    return [tuple(outputs[i * per_out:(i + 1) * per_out])
            for i in range(len(tensors))]


@_adam_average.defjvp
def _adam_average_jvp(averages, primals, tangents):
    """Derivatives through the step (``jax.grad`` of a loss after it): those
    of the same rule written in ``jax.numpy``."""
    outputs = _adam_average(averages, *primals)
    _, derivatives = jax.jvp(functools.partial(_rule, averages), primals,
                             tangents)
    return outputs, derivatives


def _rule(averages, scalars, tensors):
    """The kernel's rule in ``jax.numpy`` (see ``cpu_kernels.cc``)."""
    alpha, c1, c2, eps = (scalars[i] for i in range(4))
    updated = []
    for g, m, v, w, *avgs in tensors:
        m = m + (g - m) * c1
        v = v + (g * g - v) * c2
        w = w - (m * alpha) / (jnp.sqrt(v) + eps)
        new = []
        for j, a in enumerate(avgs):
            u = scalars[4 + j]
            near = u < 0.5
            mixed = jnp.where(near, a, w) + jnp.where(near, u, u - 1) * (
                w - a)
            new.append(jnp.where(u == 1, w, jnp.where(u == 0, a, mixed)))
        updated.append((m, v, w, *new))
    return updated
